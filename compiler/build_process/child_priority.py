"""The priority of the pack's own processes (graph builds, traces): below the model's, so that an image in
progress keeps the cores it uses and a build takes what is left.

A build the caller waits for (its first call, or block structures built before the first call returns) runs at
the caller's priority instead: nothing of the caller's runs meanwhile, and a lowered build loses its cores to
whatever else the machine runs (on the H200, 2026-11-28, the device check's other lane compiled with
torch.compile at full priority while our SD1.5 build, lowered, waited 76.4 s for its Triton kernels).

KEEPFAST_BUILD_NICE says how far below, as `nice` counts (0 to 19; default 10; 0 runs them at the caller's
priority: a GPU machine whose CPU the model leaves idle can build at full priority). Standalone (the standard
library, and compiler/settings.py loaded by its path where this file is): a spawned trace process loads it by path.
"""

from __future__ import annotations

import os
from typing import Optional


def _settings():
    """compiler/settings.py: imported with the package, or loaded by its path where this file was loaded so (a
    spawned trace process: tracing/spawned_trace_child.py)."""
    if __package__:
        from .. import settings

        return settings
    import importlib.util
    import sys

    name = "keepfast_settings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "settings.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


NICE_ENV = _settings().BUILD_NICE.name
DEFAULT_NICENESS = _settings().DEFAULT_BUILD_NICE


def niceness() -> int:
    """How much the pack's processes lower their priority: KEEPFAST_BUILD_NICE where it is 0-19, else 10."""
    return _settings().build_nice()


def lower(step: Optional[int] = None) -> None:
    """Lower this process's priority by `step` (`niceness()` where None); where the system refuses, it runs at its
    current one."""
    step = niceness() if step is None else step
    if step <= 0:
        return
    try:
        os.nice(step)
    except (AttributeError, OSError):  # not POSIX, or not allowed
        pass
