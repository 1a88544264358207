"""Probe calls: example inputs at the corners of a declared range.

Tracing can split a range into regions (on CPU, convolutions guard on
"batch > 1"; diffusers guards on "batch < 64"). After the first compile we
check, by the graph's guards alone, whether it also serves the corners of the
declared range; a corner it does not serve is compiled now, while the user is
already waiting, instead of in the middle of a later run.
"""

from __future__ import annotations

import itertools
from typing import Iterator, List, Sequence, Tuple

import torch

from .shapes import BATCH, SEQUENCE, SPATIAL, ShapeRange
from .signature import FlatCall

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


def reshape_call(call: FlatCall, batch: int, height: int, width: int) -> FlatCall | None:
    """The call with its dynamic sizes moved to (batch, height, width); None if it cannot be."""
    roles = [t.dims for t in call.signature.tensors]
    reference = None
    for shape, dims in zip(call.shapes, roles):
        spatial = [d for d, role in enumerate(dims) if role == SPATIAL]
        if len(spatial) >= 2:
            reference = (shape[spatial[-2]], shape[spatial[-1]])
            break
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
    return FlatCall(args, kwargs, _same_roles(roles))


def _same_roles(roles: Sequence[Tuple]):
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
    return FlatCall(args, kwargs, _same_roles(roles))
