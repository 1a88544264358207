"""What a block graph is checked for before it serves, read from its guards or run against eager.

Split from the block server (server.py): `unit_size_failure` runs a candidate graph where the declared range
has sizes of 1 and compares it with the block's eager forward (export asks it before widening the graph's
guards to 1); `corner_notes` names the range corners the graph's guards exclude, without running it.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..backends.base import CompiledGraph
from ..keys.shapes import ShapeRange
from ..keys.signature import FlatCall
from ..serving.verify import compare
from . import tokens as T
from .binding import InstanceWeights, SharedRunner

_CORNER_WORDS = {T.FRAMES: "latent frames", T.AUDIO: "audio tokens"}  # the counts a range corner may add


class Shapes:
    """What a graph's `why_not` reads of a call: its tensor shapes and their names."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], paths: Sequence[str]):
        self.shapes = list(shapes)
        self.tensor_paths = list(paths)


def _cut(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The leading part of `tensor` with `shape` (each size at most the tensor's)."""
    for dim, size in enumerate(shape):
        if tensor.shape[dim] != size:
            tensor = tensor.narrow(dim, 0, size)
    return tensor


def unit_size_failure(candidate: CompiledGraph, units: Dict[str, Tuple[int, int]], call: FlatCall, instance: Any,
                      roles: T.RoleMap, probe: Dict[str, int], family: Any) -> Optional[str]:
    """None if the graph gives the block's eager result where the range's sizes of 1 are.

    The probe call's inputs are cut down to size 1 along those roles (all of
    them at once, then each alone) and run both ways on `instance` (the block
    server's lead); values do not matter, the same inputs go to both.
    Agreement is the first-use check's (`compiler.serving.verify.compare`, the
    output dtype's tolerance). `probe`: the first probe's counts; `family`:
    the block family (how a served call binds, what eager is given).
    """
    paths = call.tensor_paths
    at_one = sorted({roles[paths[leaf]][dim].partition("+")[0] for leaf, dim in units.values()})
    variants = [at_one] + ([[role] for role in at_one] if len(at_one) > 1 else [])
    with torch.no_grad():
        for at in variants:
            # a timestep's rows follow its tokens unless they are at one themselves
            counts = {k: v for k, v in T.counted(probe).items() if not k.startswith(T.ROWS)}
            counts.update({role: 1 for role in at})
            counts = T.role_values(counts)
            shapes = T.shapes_at(call.shapes, paths, roles, counts)
            tensors = [_cut(t, shape) for t, shape in zip(call.tensors, shapes)]
            where = ", ".join(f"{role} 1" for role in at)
            agreement = _compare(candidate, instance, call, tensors, roles, family)
            if agreement is None:
                return f"the graph does not take {where}"
            if not agreement.ok:
                return f"at {where} the graph differs from eager: {agreement.describe()}"
    return None


def _compare(graph: CompiledGraph, instance: Any, call: FlatCall, tensors, roles: T.RoleMap, family: Any):
    args, kwargs = call.rebuild([t.contiguous() for t in tensors])
    flat = FlatCall(args, kwargs, role_policy=lambda path, tensor: roles.get(path, {}))
    if graph.why_not(flat) is not None:
        return None
    # bound as a served call binds (the family's per-call tensors included), not by the module's own tensors
    weights = InstanceWeights(instance.module, family.call_tensors)
    output = SharedRunner(graph).run(weights, flat.tensors, call.rebuild)
    return compare(output, instance.eager(*family.reference_inputs(args, kwargs)))


def corner_notes(graph: CompiledGraph, call: FlatCall, roles: T.RoleMap, block_range: ShapeRange) -> List[str]:
    """Range corners the graph's guards exclude (they will run eager), read without running it."""
    notes = []
    used = {role for dims in roles.values() for role in dims.values()}
    # frames and audio tokens are corners only where an input has them (most families' calls have neither)
    extra = [role for role in (T.FRAMES, T.AUDIO) if role in used]
    for corner in itertools.product(*(block_range.bounds(role) for role in (T.BATCH, T.TOKENS, T.SEQUENCE)),
                                    *(block_range.bounds(role) for role in extra)):
        values = dict(zip((T.BATCH, T.TOKENS, T.SEQUENCE, *extra), corner))
        counts = T.role_values({T.FRAMES: 1, T.AUDIO: 0, **values})
        shapes = T.shapes_at(call.shapes, call.tensor_paths, roles, counts)
        try:
            failure = graph.why_not(Shapes(shapes, call.tensor_paths))
        except Exception as error:
            failure = f"its guards cannot be checked ({type(error).__name__}: {error})"
        if failure:
            where = "".join(f", {values[role]} {_CORNER_WORDS[role]}" for role in extra)
            notes.append(f"batch {values[T.BATCH]}, {values[T.TOKENS]} image tokens, {values[T.SEQUENCE]} text "
                         f"tokens{where}: {failure}")
    return notes
