"""How much of a whole-model call of ours is the pack's own work around its graph's run.

Why: on an H200 (torch 2.11+cu130) our SD1.5 graph measured 0.96x torch.compile's step time. A step of the UNet launches
hundreds of kernels, and the pack's work before the runner (finding the graph, checking the module's weights,
binding) comes before the first of them. On this 2-core CPU that work took 3.2 ms of each real-depth SD1.5 call,
2.1 ms now; what it takes
on a GPU machine's host is what this measures: the call's wall time (synchronised at its end, as the steady state
times it) against the time inside `AotGraph.run` (its kernels waited for there, on a GPU), over a few calls at one
shape.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, Optional

REPS = 10


def measure(timed: Callable[[Any, Any], float], compiled_fn: Callable, shape, reps: int = REPS) -> Optional[Dict[str, Any]]:
    """Per call at `shape`: the whole call's median ms, the median ms inside the graph's run, and what is left (the
    pack's work around the run); None where no whole-model graph ran (eager, blocks, torch.compile)."""
    import torch

    from compiler.backends import aot

    inside: list = []
    real = aot.AotGraph.run
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()

    def run(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            if gpu:  # the run's kernels finished inside it: what is left of the call is the pack's own work
                torch.cuda.synchronize()
            inside.append(time.perf_counter() - started)

    aot.AotGraph.run = run  # this process's graphs, for the calls below only
    whole, runs = [], []
    try:
        for _ in range(reps):
            inside.clear()
            whole.append(timed(compiled_fn, shape))
            if not inside:
                return None
            runs.append(sum(inside))
    finally:
        aot.AotGraph.run = real
    outside = [w - r for w, r in zip(whole, runs)]
    return {"shape": list(shape), "calls": reps, "whole_ms": round(statistics.median(whole) * 1000, 3),
            "graph_run_ms": round(statistics.median(runs) * 1000, 3),
            "outside_ms": round(statistics.median(outside) * 1000, 3)}
