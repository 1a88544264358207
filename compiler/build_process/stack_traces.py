"""Tracing without recording each node's Python stack, where torch can skip it.

Why: torch records the Python stack of every node it traces (`node.stack_trace`), read by torch's own debug
output and never by the pack. torch 2.13 and later can skip it (torch.fx.config.do_not_emit_stack_traces); earlier
torch records it whatever is set. On a 2-core CPU with torch 2.13, the real-depth SD1.5 UNet (2000 nodes):
- torch.export: 1.5 s of its 12.8 s went to capturing and symbolising those stacks;
- AOTInductor's own trace of the exported program in a build process (aot_export_module, before lowering):
  21.4 s without them against 27.4-29.5 s with them.

Standalone (no imports from the pack): the build process loads it by its path (build_process.child._sibling).
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Within the block, traces record no Python stacks (torch 2.13 and later; a no-op before); put back after."""
    import torch.fx.config as fx_config

    if not hasattr(fx_config, "do_not_emit_stack_traces"):
        yield
        return
    before = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = before
