"""No persistent reductions over a dynamic size in a GPU program: Inductor lists configurations for them that take
tens of seconds each to build, and a cold compile waited for them. Reductions over a fixed size keep Inductor's
choice.

What an H200 showed (torch 2.11+cu130, bench --device cuda --check): the SD1.5 UNet's cold compile spent 422 s of its Triton
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
against the emitted R0_BLOCK. A reduction over a fixed size (a layer norm over a model's channels, an RMS norm over
a head) has its R0_BLOCK and its hint from the same number, so its configurations are budgeted right, and a
persistent kernel is what Inductor found fastest for it.

So the decision is made per kernel, through the hook Inductor gives for its heuristics (`InductorChoices`,
installed with `V.set_choices_handler` for the build's thread only): a reduction whose size has a symbol loops over
blocks the ordinary reduction heuristics size; any other keeps Inductor's decision. A torch without that hook, or a
build under heuristics of someone else's (`config.inductor_choices_class`), gets Inductor's
`triton.persistent_reductions` off for the whole program instead (every GPU build did so before 2026-11-28 23:00).
The graph computes the same either way; none of this is part of a graph's key. Inductor's own FX graph cache does
not see a handler set so: an entry one machine made for the same program under Inductor's default heuristics would
be taken as it is (kernels no slower to run, only to build). KEEPFAST_PERSISTENT_REDUCTIONS=1 keeps Inductor's
default.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

from ..settings import PERSISTENT_REDUCTIONS, persistent_reductions

ENV = PERSISTENT_REDUCTIONS.name


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


def _asked_default() -> bool:
    return persistent_reductions()


def _default_choices_class():
    """Inductor's own heuristics class where this torch lets a build replace its persistent-reduction decision per
    kernel and no other heuristics are configured; else None."""
    try:
        from torch._inductor import config
        from torch._inductor.choices import InductorChoices
        from torch._inductor.virtualized import V
    except ImportError:
        return None
    if getattr(config, "inductor_choices_class", None) is not None or not hasattr(V, "set_choices_handler"):
        return None
    if not callable(getattr(InductorChoices, "should_use_persistent_reduction", None)):
        return None
    return InductorChoices


def per_kernel(ep: Any) -> bool:
    """Whether a GPU build of `ep` decides persistent reductions per kernel (`fixed_size_persistent_reductions`)."""
    return has_dynamic_sizes(ep) and not _asked_default() and _default_choices_class() is not None


def gpu_settings(ep: Any) -> Dict[str, Any]:
    """Inductor settings for a GPU program: persistent reductions off for the whole program where its sizes are
    dynamic and the per-kernel decision is not available, unless asked for Inductor's default."""
    if _asked_default() or not has_dynamic_sizes(ep) or _default_choices_class() is not None:
        return {}
    return {"triton.persistent_reductions": False}


def is_fixed(numel: Any) -> bool:
    """Whether a kernel's reduction size is a number (no symbol in it)."""
    return not getattr(numel, "free_symbols", None)


def _choices():
    base = _default_choices_class()

    class FixedSizePersistentReductions(base):
        """Inductor's heuristics, except that a reduction over a size with a symbol is never persistent."""

        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs) -> bool:
            if not is_fixed(features.reduction_numel):
                return False
            return base.should_use_persistent_reduction(features, cooperative_reduction, *args, **kwargs)

    return FixedSizePersistentReductions()


@contextlib.contextmanager
def fixed_size_persistent_reductions(active: bool) -> Iterator[None]:
    """Within: this thread's Inductor makes no persistent reduction over a dynamic size (when `active`, from
    `per_kernel` of the program being built). Inductor's choices are thread-local; the build compiles in this
    thread, its kernels' code is written here before the compile workers build it."""
    if not active or _default_choices_class() is None:
        yield
        return
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_choices()):
        yield
