"""Whether a graph keeps weights its model let go: each Parameter replaced by a copy, a call, again, then the
originals back (what ComfyUI's LoRA patching and unpatching do), with the memory held before and after.

Why: torch's AOTInductor runtime kept every weight bound to a package by pointer once it was let go (on an
H200, a partly loaded Flux peaked at 11396 MB for a 1311 MB model). The pack now binds views that do not own the memory (backends/borrowed_weights.py); this measures
it where the check runs: the replaced weights still alive after the calls (by their storages, on any device), and
on a GPU the memory allocated before and after.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Dict, List, Optional

ROUNDS = 3


def measure(module: Any, call: Callable[[], Any], rounds: int = ROUNDS,
            compiles: Optional[Callable[[], int]] = None) -> Dict[str, Any]:
    """`call()` after each of `rounds` replacements of every Parameter of `module` by a copy, then after the
    originals are put back; the copies' storages still alive after that, the compiles meanwhile (`compiles()`: a
    count; none expected, the weights keep their shapes), and on CUDA the MB allocated before the first
    replacement and after the last call (the same weights in place: equal when nothing was kept)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    named = [(sub, name) for sub in module.modules() for name, p in sub._parameters.items() if p is not None]
    originals = [sub._parameters[name] for sub, name in named]
    cuda = any(p.is_cuda for p in originals)

    def allocated() -> float:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() / 2 ** 20

    before = allocated() if cuda else None
    compiled = compiles() if compiles else 0
    replaced: List[Any] = []  # weak references to the copies' storages
    try:
        with torch.no_grad():
            for _ in range(rounds):
                for sub, name in named:
                    sub._parameters[name] = torch.nn.Parameter(sub._parameters[name].detach().clone(),
                                                               requires_grad=False)
                    replaced.append(StorageWeakRef(sub._parameters[name].untyped_storage()))  # nothing else held here
                call()
    finally:
        for (sub, name), original in zip(named, originals):
            sub._parameters[name] = original
    with torch.no_grad():
        call()  # the originals bound again: the last copies are let go here
    gc.collect()
    kept = sum(1 for ref in replaced if not ref.expired())
    result: Dict[str, Any] = {"rounds": rounds, "weights": len(named), "replaced": len(replaced), "kept": kept}
    if compiles:
        result["compiles"] = compiles() - compiled
    if cuda:
        result["allocated_mb_before"] = round(before, 1)
        result["allocated_mb_after"] = round(allocated(), 1)
    return result
