"""Block graphs: a transformer's repeated blocks compiled once per block structure, served N times.

See `engine.py` for how an adapter uses it; `diffusers_families.py` for the
diffusers families; the ComfyUI adapter brings its own `BlockFamily`s.
"""

from __future__ import annotations

from typing import Optional

import torch

from .engine import BlockEngine, BlockOptions
from .family import BlockFamily
from .finder import BlockGroup, find_blocks
from .server import BlockInstance, BlockServer
from .tokens import Dims, Geometry


def compile_blocks(model: torch.nn.Module, options: Optional[BlockOptions] = None, registry=None,
                   family: Optional[BlockFamily] = None) -> Optional[BlockEngine]:
    """Serve `model` block by block (installed in place); None when no family knows the model.

    An engine already installed on the model gets the new options (its graphs
    are prepared again on the next call).
    """
    existing = model.__dict__.get("forward")
    if isinstance(existing, BlockEngine):
        if options is not None:
            existing.options = options
        return existing
    if family is None:
        from .diffusers_families import diffusers_family

        family = diffusers_family(model)
        if family is None:
            return None
    engine = BlockEngine(model, family, options, registry)
    engine.install()
    return engine


def uncompile_blocks(model: torch.nn.Module) -> None:
    existing = model.__dict__.get("forward")
    if isinstance(existing, BlockEngine):
        existing.uninstall()


__all__ = ["BlockEngine", "BlockFamily", "BlockGroup", "BlockInstance", "BlockOptions", "BlockServer", "Dims",
           "Geometry", "compile_blocks", "find_blocks", "uncompile_blocks"]
