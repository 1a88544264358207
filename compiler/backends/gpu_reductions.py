"""No persistent reductions in a GPU program whose sizes are dynamic: Inductor lists configurations for some of them
that take tens of seconds each to build, and a cold compile waited for them.

What the H200 showed (docs/gpu.md, "Sixth H200 session"): the SD1.5 UNet's cold compile spent 422 s of its Triton
compile workers' time on 487 kernel configurations, 332 s of it on the 111 configurations of 42 persistent
reductions, one kernel 80 s and another 74 s; torch.compile's static graph built its 85 persistent configurations in
22 s, its slowest kernel in 2.1 s. Each part of the graph waited for its slowest kernel (67 and 73 s). The median
configuration took 0.23 s in both.

Why (torch 2.11 to 2.14, read in torch/_inductor/runtime/triton_heuristics.py `_persistent_reduction_configs` and
codegen/triton.py `_get_persistent_RBLOCK`): a persistent reduction over a dynamic size gets R0_BLOCK, the whole
reduction in one block, from the size's upper bound, but its XBLOCK choices are budgeted against the size's hint
(the traced example): a hint of 64 under a bound of 1024 lets XBLOCK 32 through, 32 x 1024 elements in one program
where the budget is 4096. Reproduced on this CPU (a layer norm over a dimension traced at 64 and bounded at 1024,
built for sm_90): 0.15 s for XBLOCK 1, 0.33 s for 8, 3.65 s for 32. Upstream: pytorch/pytorch#193801 (open) budgets
against the emitted R0_BLOCK.

So GPU programs with any dynamic size are built with Inductor's `triton.persistent_reductions` off: their
reductions loop over blocks the ordinary reduction heuristics size. The graph computes the same; the setting is not
part of a graph's key. What it costs a step is measured by the device check (the steady ratios of the next GPU run
against the sixth session's). KEEPFAST_PERSISTENT_REDUCTIONS=1 keeps Inductor's default.
"""

from __future__ import annotations

import os
from typing import Any, Dict

ENV = "KEEPFAST_PERSISTENT_REDUCTIONS"


def has_dynamic_sizes(ep: Any) -> bool:
    """Whether any input of the exported program has a size that is a symbol (a graph for a range of sizes)."""
    for node in ep.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("val")
        shape = getattr(value, "shape", None)
        if shape is not None and any(not isinstance(size, int) for size in shape):
            return True
    return False


def gpu_settings(ep: Any) -> Dict[str, Any]:
    """Inductor settings for a GPU program: persistent reductions off where its sizes are dynamic, unless asked."""
    if os.environ.get(ENV, "").strip() == "1" or not has_dynamic_sizes(ep):
        return {}
    return {"triton.persistent_reductions": False}
