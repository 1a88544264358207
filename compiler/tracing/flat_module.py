"""An exportable view of a module call: flat tensors in, flat tensors out.

Compilers trace a function of tensors. This wrapper takes the tensors of one
call as a list, puts the call's constants back, calls the model and returns
its output leaves, so every backend compiles the same thing and the output
structure (e.g. a diffusers `UNet2DConditionOutput`) is rebuilt around the
graph's result by the caller.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .module_snapshot import MODULE_PREFIX, snapshot_of  # noqa: F401 - the pack imports MODULE_PREFIX from here
from ..keys.signature import FlatCall

ForwardFn = Callable[..., Any]  # forward_fn(module, *args, **kwargs)


class CallTemplate:
    """A FlatCall's layout and constants, without holding its tensors."""

    def __init__(self, call: FlatCall):
        self.treespec = call.treespec
        self.tensor_positions = list(call.tensor_positions)
        self.leaves = [None if i in set(call.tensor_positions) else leaf for i, leaf in enumerate(call.leaves)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, dict]:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.treespec)


class _Seen:
    out_spec: Optional[pytree.TreeSpec] = None


class FlatForward(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, forward_fn: ForwardFn, call: FlatCall):
        super().__init__()
        self.m = module
        self._forward_fn = forward_fn
        self._template = CallTemplate(call)
        # torch.export restores a module's attributes (dicts included) after
        # tracing; a plain object's attribute survives, so the spec lives there.
        self._seen = _Seen()

    @property
    def out_spec(self) -> Optional[pytree.TreeSpec]:
        return self._seen.out_spec

    def forward(self, flat: List[torch.Tensor]):
        args, kwargs = self._template.rebuild(flat)
        output = self._forward_fn(self.m, *args, **kwargs)
        leaves, spec = pytree.tree_flatten(output)
        self._seen.out_spec = spec
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"the model returned a {type(leaf).__name__}; graphs return tensors only")
        return tuple(leaves)


def module_tensors(module: torch.nn.Module) -> dict:
    """Parameters and buffers (persistent or not) under the names a graph binds (module_snapshot.py: walked again
    only where the module changed since the last call)."""
    return snapshot_of(module).tensors()


def dump_out_spec(spec: pytree.TreeSpec) -> Optional[str]:
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # a custom output type without a serialised name
        return None


def load_out_spec(text: Optional[str]) -> Optional[pytree.TreeSpec]:
    if not text:
        return None
    return pytree.treespec_loads(text)
