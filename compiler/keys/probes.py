"""Example calls made from a real call: what a graph is traced from, and the range's corners.

The trace example (`trace_example`): a graph is never traced from a dynamic
size of 1. AOTInductor generates its code with the example's sizes as hints,
and for a dynamic dimension whose example size is 1 it may leave that
dimension out of an index: seen with torch 2.13 and 2.14 on CPU, a UNet
traced at batch 1 read every batch element's GroupNorm and LayerNorm
statistics from element 0's, so batch 2 latents came out 0.5-1.0 off, with
no guard to say so. Traced at 2, the same graph computes every size of its
range, 1 included. So each role (batch, sequence, frames...) whose dynamic
sizes are all 1 in the call is traced at 2, its tensors repeated along that
dimension (the values stay the caller's); a size of 1 that cannot move (its
range ends at 1, or it sits beside larger sizes of its role: a broadcast) is
pinned: the graph gets a guard that it serves 1 there and nothing else.

Corner probes (`corner_targets`, `reshape_call`): tracing can split a range
into regions (on CPU, convolutions guard on "batch > 1"; diffusers guards on
"batch < 64"). After the first compile we check, by the graph's guards alone,
whether it also serves the corners of the declared range; a corner it does
not serve is compiled now, while the user is already waiting, instead of in
the middle of a later run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from .guards import size_ref
from .shapes import BATCH, SEQUENCE, SPATIAL, LeafBounds, ShapeRange
from .signature import FlatCall

Place = Tuple[int, int]  # (tensor input, dim)


@dataclass(frozen=True)
class TraceExample:
    """The call a graph is traced from, and where it differs from the real call."""

    call: FlatCall
    widened: Tuple[Place, ...] = ()  # dynamic sizes of 1 traced at 2
    pinned: Tuple[Place, ...] = ()  # dynamic sizes of 1 left at 1: the graph serves 1 there only

    def pin_guards(self) -> List[str]:
        return [f"{size_ref(leaf, dim)} == 1" for leaf, dim in self.pinned]

    def describe(self, paths: Sequence[str]) -> str:
        return ", ".join(f"{paths[leaf]}.shape[{dim}]" for leaf, dim in self.widened + self.pinned)


def trace_example(call: FlatCall, bounds: LeafBounds) -> TraceExample:
    """`call` with every role whose dynamic sizes are all 1 moved to 2 (see the module docstring)."""
    roles = [t.dims for t in call.signature.tensors]
    shapes = call.shapes
    sizes: Dict[str, set] = {}
    for leaf, dims in enumerate(bounds):
        for dim in dims:
            sizes.setdefault(roles[leaf][dim], set()).add(shapes[leaf][dim])
    movable = {role for role, seen in sizes.items() if seen == {1}}
    widened: List[Place] = []
    pinned: List[Place] = []
    tensors: List[torch.Tensor] = []
    for leaf, (tensor, dims) in enumerate(zip(call.tensors, bounds)):
        for dim, (_low, high) in sorted(dims.items()):
            if tensor.shape[dim] != 1:
                continue
            if roles[leaf][dim] in movable and high >= 2:
                tensor = torch.cat([tensor, tensor], dim)
                widened.append((leaf, dim))
            else:
                pinned.append((leaf, dim))
        tensors.append(tensor)
    if not widened:
        return TraceExample(call, (), tuple(pinned))
    args, kwargs = call.rebuild(tensors)
    return TraceExample(FlatCall(args, kwargs, same_roles(roles)), tuple(widened), tuple(pinned))


def pinned_example(call: FlatCall, bounds: LeafBounds) -> TraceExample:
    """`call` as it is, every dynamic size of 1 pinned (when tracing at 2 is not possible)."""
    shapes = call.shapes
    return TraceExample(call, (), tuple((leaf, dim) for leaf, dims in enumerate(bounds)
                                        for dim in sorted(dims) if shapes[leaf][dim] == 1))

MULTIPLE = 8  # probe latents at multiples of 8 (images at multiples of 64)


def _round_down(value: int, multiple: int) -> int:
    return max(multiple, value - value % multiple)


def _round_up(value: int, multiple: int) -> int:
    return value + (-value) % multiple


def corner_targets(shape_range: ShapeRange) -> Iterator[Tuple[int, int, int]]:
    """(batch, height, width) triples at the corners of the range."""
    b_lo, b_hi = shape_range.batch
    s_lo, s_hi = shape_range.spatial
    lo, hi = _round_up(s_lo, MULTIPLE), _round_down(s_hi, MULTIPLE)
    batches = sorted({b_lo, min(max(2, b_lo), b_hi), b_hi})
    sides = sorted({lo, hi}) if lo <= hi else [s_lo]
    for batch, height, width in itertools.product(batches, sides, sides):
        yield batch, height, width


def _spatial_reference(call: FlatCall) -> Tuple[int, int] | None:
    """(height, width) of the first tensor with two spatial dims (what corner and cropped calls scale by)."""
    for shape, tensor in zip(call.shapes, call.signature.tensors):
        spatial = [d for d, role in enumerate(tensor.dims) if role == SPATIAL]
        if len(spatial) >= 2:
            return shape[spatial[-2]], shape[spatial[-1]]
    return None


def reshape_call(call: FlatCall, batch: int, height: int, width: int) -> FlatCall | None:
    """The call with its dynamic sizes moved to (batch, height, width); None if it cannot be."""
    roles = [t.dims for t in call.signature.tensors]
    reference = _spatial_reference(call)
    tensors: List[torch.Tensor] = []
    for tensor, dims in zip(call.tensors, roles):
        spatial = [d for d, role in enumerate(dims) if role == SPATIAL]
        shape = list(tensor.shape)
        for d, role in enumerate(dims):
            if role == BATCH:
                shape[d] = batch
        if len(spatial) >= 2 and reference:
            for d, target, ref in ((spatial[-2], height, reference[0]), (spatial[-1], width, reference[1])):
                scaled = target * shape[d]
                if scaled % ref:
                    return None
                shape[d] = scaled // ref
        tensors.append(torch.zeros(shape, dtype=tensor.dtype, device=tensor.device))
    args, kwargs = call.rebuild(tensors)
    return FlatCall(args, kwargs, same_roles(roles))


def cropped_call(call: FlatCall, height: int, width: int) -> FlatCall | None:
    """The call's own tensors cut to (height, width) latent pixels at their top left, every spatial input in
    proportion (the values are the caller's, not zeros); None where a size cannot be cut exactly."""
    reference = _spatial_reference(call)
    if reference is None:
        return None
    roles = [t.dims for t in call.signature.tensors]
    tensors: List[torch.Tensor] = []
    for tensor, dims in zip(call.tensors, roles):
        spatial = [d for d, role in enumerate(dims) if role == SPATIAL]
        if len(spatial) >= 2:
            for d, target, ref in ((spatial[-2], height, reference[0]), (spatial[-1], width, reference[1])):
                scaled = target * tensor.shape[d]
                if scaled % ref or scaled // ref > tensor.shape[d] or scaled == 0:
                    return None
                tensor = tensor.narrow(d, 0, scaled // ref)
        tensors.append(tensor)
    args, kwargs = call.rebuild(tensors)
    return FlatCall(args, kwargs, same_roles(roles))


def smallest_served(call: FlatCall, serves: Callable[[FlatCall], bool]) -> FlatCall:
    """The call cut to the smallest latent sides (multiples of MULTIPLE) that `serves` accepts, height first, or
    the call itself.

    Why: a check of how a graph computes at a size of 1 of another role (batch, text length) runs the graph and
    the model once each, and nothing in that question depends on the image's size. At a range corner it was the
    corner's size: a first call at latent 8x8 made the real-depth SD1.5 UNet's corner graph at batch 1, latent
    256x256 run the model there on the CPU, its first attention over 65536 positions (the first call had not
    ended after 10 minutes). The call itself is still compared with the model by the first-use check (verify.py).
    """
    reference = _spatial_reference(call)
    if reference is None:
        return call
    height, width = reference
    best = call
    for size in range(MULTIPLE, height, MULTIPLE):
        candidate = cropped_call(call, size, width)
        if candidate is not None and serves(candidate):
            best, height = candidate, size
            break
    for size in range(MULTIPLE, width, MULTIPLE):
        candidate = cropped_call(call, height, size)
        if candidate is not None and serves(candidate):
            return candidate
    return best


def narrowed_to_one(call: FlatCall, bounds: LeafBounds) -> List[Tuple[str, FlatCall, List[Tuple[int, int]]]]:
    """(role, the call with every dim of that role cut to 1, those dims) for each dynamic role whose range
    reaches 1 and whose size in the call is not 1: the sizes of 1 a graph traced from `call` would accept."""
    roles = [t.dims for t in call.signature.tensors]
    places: Dict[str, List[Tuple[int, int]]] = {}
    for leaf, dims in enumerate(bounds):
        for dim, (low, _high) in dims.items():
            if low <= 1 and call.shapes[leaf][dim] > 1:
                places.setdefault(str(roles[leaf][dim]), []).append((leaf, dim))
    out = []
    for role, where in places.items():
        tensors = list(call.tensors)
        for leaf, dim in where:
            tensors[leaf] = tensors[leaf].narrow(dim, 0, 1)
        args, kwargs = call.rebuild(tensors)
        out.append((role, FlatCall(args, kwargs, same_roles(roles)), where))
    return out


def cloned(call: FlatCall) -> FlatCall:
    """The same call on copies of its tensors (a run that may update inputs in place leaves `call` alone)."""
    args, kwargs = call.rebuild([tensor.clone() for tensor in call.tensors])
    return FlatCall(args, kwargs, same_roles([t.dims for t in call.signature.tensors]))


def same_roles(roles: Sequence[Tuple]):
    """A role policy giving a call made from another the other's roles, tensor by tensor."""
    lookup = iter(roles)

    def policy(path, tensor):
        dims = next(lookup)
        return {d: role for d, role in enumerate(dims) if isinstance(role, str)}

    return policy


def with_sequence(call: FlatCall, length: int) -> FlatCall:
    roles = [t.dims for t in call.signature.tensors]
    tensors = []
    for tensor, dims in zip(call.tensors, roles):
        shape = [length if role == SEQUENCE else size for size, role in zip(tensor.shape, dims)]
        tensors.append(torch.zeros(shape, dtype=tensor.dtype, device=tensor.device))
    args, kwargs = call.rebuild(tensors)
    return FlatCall(args, kwargs, same_roles(roles))
