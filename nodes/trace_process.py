"""ComfyUI's command-line settings in a spawned trace process (compiler/tracing/spawned_trace.py).

A background build's trace runs in a spawned process where a fork cannot (a GPU ComfyUI). Unpickling the
diffusion model there imports ComfyUI's classes, and with them comfy.model_management, which picks its device
from `comfy.cli_args.args` when it is imported. A fresh process would read ComfyUI's defaults, not the settings
this ComfyUI was started with (`--cpu`, `--directml`, ...): measured on a CPU-only machine, ComfyUI run with `--cpu`,
the child's import failed with "Found no NVIDIA driver". The settings travel by value and are set before the model
is unpickled.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict


def register() -> None:
    """Every spawned trace process of this ComfyUI gets its settings (idempotent)."""
    from ..compiler import prepare_trace_children

    prepare_trace_children(settings_now)


def settings_now() -> Callable[[], None]:
    """What a spawned trace process runs first: ComfyUI's settings as they are in this process now."""
    import comfy.cli_args

    return functools.partial(restore, dict(vars(comfy.cli_args.args)))


def restore(settings: Dict[str, object]) -> None:
    """In the spawned process, before anything imports comfy.model_management."""
    import comfy.cli_args

    vars(comfy.cli_args.args).update(settings)
