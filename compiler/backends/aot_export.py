"""The aot backend's export step: a call traced with torch.export over the declared shape range (`trace`), with
the shape guards the pack checks before each call; and the check of a graph at a size of 1 it was not traced at.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..build_process.stack_traces import without_stack_traces
from ..keys import alignment
from ..keys.guards import GuardSet, GuardSyntaxError, readable
from ..keys.probes import cloned, pinned_example, smallest_served, trace_example
from ..keys.shapes import SPATIAL, leaf_bounds
from ..keys.signature import FlatCall
from ..serving.verify import compare
from ..tracing.export_guards import exported_shapes, guard_texts
from ..tracing.flat_module import FlatForward, dump_out_spec
from ..tracing.subclass_weights import unwrap_subclass_weights
from .base import CompiledGraph, CompileFailed

log = logging.getLogger("keepfast")


@contextlib.contextmanager
def _export_settings():
    """Keep size-1 dims and equal-sized dims symbolic while tracing.

    Size-oblivious tracing assumes a size is never 1 without recording a guard, so one graph serves 1 and
    up (a range of 1 to 2 is traced up to 3, `_traced_high`). As a safety net `AotBackend.compile` runs a
    graph whose guards accept a size of 1 once at 1 and gives 1 a graph of its own where they differ.
    Tracing honestly (backed_size_oblivious=False) would
    split every SD UNet's range at batch 1 and at sequence 1, a graph more for each.
    """
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False), without_stack_traces():
        yield


def _guards_from(ep: "torch.export.ExportedProgram", call: FlatCall) -> List[str]:
    """The exported program's sizes, ranges and guards as text the pack checks before each call.

    CompileFailed when one cannot be checked, or when the guards reject the
    very call the graph was traced from: the graph is refused now, with the
    reason, instead of a call failing on it later.
    """
    guards = guard_texts(exported_shapes(ep))
    try:
        failed = GuardSet(guards).first_failure(call.shapes)
    except GuardSyntaxError as error:
        raise CompileFailed(f"torch.export recorded a shape guard the pack cannot check ({error})") from None
    if failed is not None:
        raise CompileFailed("the graph's guard " + readable(failed, call.tensor_paths)
                            + " does not hold for the call it was traced from; the pack cannot check it")
    return guards


def _traced_high(low: int, high: int) -> int:
    """The upper bound a dynamic size is traced with: 3 where the range is 1 to 2.

    Size-oblivious tracing assumes a size is not 1, so a range of 1 to 2 is 2
    only to Inductor, which then builds the graph for 2 alone: its outputs
    had 2 rows for a call with 1 (a Conv2d traced over batch 1 to 2). The
    graph's own guards still bound it, and the declared range bounds the calls.
    """
    return 3 if low < 2 and high == 2 else high


def export_program(module, forward_fn, call: FlatCall, shape_range) -> tuple:
    """(exported program, its FlatForward): the call traced over the declared range.

    The one place the aot backend traces; the guard tests export through it too.
    """
    from torch.export import Dim

    flat = FlatForward(module, forward_fn, call)
    roles = [t.dims for t in call.signature.tensors]
    bounds = leaf_bounds(call.shapes, roles, shape_range)
    dynamic = [{d: Dim.AUTO(min=lo, max=_traced_high(lo, hi)) for d, (lo, hi) in b.items()} for b in bounds]
    for leaf, dims in enumerate(roles):  # the first tensor with spatial sizes: traced on the model's multiple
        spatial = [d for d, role in enumerate(dims) if role == SPATIAL]
        if spatial:
            aligned = alignment.spatial_multiples(module, call.shapes[leaf], spatial, bounds[leaf],
                                                   shape_range.spatial_multiple)
            for d, (multiple, k_low, k_high) in aligned.items():
                dynamic[leaf][d] = multiple * Dim(f"spatial{d}_over_{multiple}", min=k_low, max=k_high)
            break
    try:
        with _export_settings(), torch.no_grad():
            ep = unwrap_subclass_weights(
                torch.export.export(flat, (list(call.tensors),), dynamic_shapes=(dynamic,), strict=False))
    except Exception as error:  # export failures are many and varied
        raise CompileFailed(f"torch.export failed: {type(error).__name__}: {_first_line(error)}") from error
    return ep, flat


class Traced(NamedTuple):
    ep: Any  # torch.export.ExportedProgram
    flat: FlatForward
    guards: List[str]
    widened: str  # the sizes of 1 of the call that were traced at 2 ("" if none)
    seconds: float = 0.0  # the trace's wall time (torch.export, with any retry)


def trace(module, forward_fn, call: FlatCall, shape_range, widen: bool = True) -> Traced:
    """`call` traced with no dynamic size of 1 (unless `widen` is False).

    The example is `probes.trace_example(call)`: each size of 1 that can move
    is traced at 2, and the graph must still serve `call` itself by its
    guards. Where it does not, or the widened call does not export, or
    `widen` is False, the call is traced as it is with its sizes of 1 pinned
    (the graph then serves 1 there only, which is what it computes right).
    """
    started = time.perf_counter()
    bounds = leaf_bounds(call.shapes, [t.dims for t in call.signature.tensors], shape_range)
    example = trace_example(call, bounds) if widen else pinned_example(call, bounds)
    if example.widened:
        try:
            ep, flat = export_program(module, forward_fn, example.call, shape_range)
            guards = _guards_from(ep, example.call) + example.pin_guards()
            failed = GuardSet(guards).first_failure(call.shapes)
            if failed is None:
                return Traced(ep, flat, guards, example.describe(call.tensor_paths), time.perf_counter() - started)
            why = "its guard " + readable(failed, call.tensor_paths) + " rejects the call"
        except CompileFailed as error:
            why = str(error)
        log.info("traced at 2 where %s is 1, the graph does not serve the call (%s); tracing it as it is, "
                 "serving 1 there only", example.describe(call.tensor_paths), why)
        example = pinned_example(call, bounds)
    ep, flat = export_program(module, forward_fn, example.call, shape_range)
    return Traced(ep, flat, _guards_from(ep, example.call) + example.pin_guards(), "", time.perf_counter() - started)


def trace_for_build(module, forward_fn, call: FlatCall, shape_range) -> Tuple[Any, dict]:
    """`trace` as a background build's trace process runs it: (program, the JSON-able rest of what it found)."""
    result = trace(module, forward_fn, call, shape_range)
    if result.flat.out_spec is None:
        raise CompileFailed("the model's output structure was not seen while tracing")
    return result.ep, {"guards": result.guards, "widened": result.widened,
                       "out_spec": dump_out_spec(result.flat.out_spec), "export_s": result.seconds}


def size_one_disagreement(graph: CompiledGraph, module, flat: FlatForward, call: FlatCall) -> Optional[str]:
    """How a graph disagrees with the model at a call with a size of 1 it was not traced at (None: it agrees).

    Tracing is size-oblivious (`_export_settings`), so nothing in the graph's
    guards says whether it computes right at 1: run it there once, and the
    model, each on copies of the call's tensors cut to the smallest image the
    graph serves (`probes.smallest_served`: a range corner's own size made
    this one run of the model the first call's longest part), and compare.
    """
    small = smallest_served(call, lambda smaller: graph.why_not(smaller) is None)  # the question is not the size's
    with torch.no_grad():
        try:
            reference = flat(list(cloned(small).tensors))
            call = small
        except Exception:  # noqa: BLE001 - a model that takes no smaller image is asked at the call's own
            try:
                reference = flat(list(cloned(call).tensors))
            except Exception:  # noqa: BLE001 - the model itself does not take a 1 there: nothing to serve
                return None
        try:
            output = pytree.tree_leaves(graph.run(module, cloned(call)))
        except Exception as error:  # noqa: BLE001 - a graph that fails at 1 does not serve 1
            return f"the graph fails there ({type(error).__name__}: {_first_line(error)})"
    agreement = compare(output, list(reference))
    return None if agreement.ok else agreement.describe()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
