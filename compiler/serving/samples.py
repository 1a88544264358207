"""A batch served as its samples, for modules that compute each sample alone (VAEs).

Why: a graph traced for one image may not serve two. On CPU, torch's fake
convolution picks its kernel with a `batch > 1` guard, so a VAE traced at
batch 2 serves 2 and up and one traced at 1 serves 1 only: each side of that
guard cost a compile (21 + 24 s for Flux's VAE here). A VAE's decode and
encode work on each image alone (convolutions, group norms, attention within
one image), so the graph that serves one image serves any batch, one image
at a time, its outputs joined along the batch. Where a graph's guards accept
the whole batch, the batch runs in one call (`CompiledForward` tries that
first). A module opts in with `CompileOptions(samples_independent=True)`;
the first-use check compares the joined output with eager's on the batch.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.utils._pytree as pytree

from ..keys.probes import same_roles
from ..keys.shapes import BATCH
from ..keys.signature import FlatCall


class CannotJoin(ValueError):
    """The samples' outputs do not join into one batch (their structures or constants differ)."""


def samples_of(call: FlatCall) -> Optional[List[FlatCall]]:
    """`call` as one call per sample (every batch dimension cut to that sample), or None.

    None when there is nothing to split: a batch of 1, no batch dimension, or
    batch dimensions of different sizes (a broadcast the caller relies on).
    """
    roles = [t.dims for t in call.signature.tensors]
    places = [(leaf, dim) for leaf, dims in enumerate(roles) for dim, role in enumerate(dims) if role == BATCH]
    sizes = {call.shapes[leaf][dim] for leaf, dim in places}
    if len(sizes) != 1:
        return None
    (count,) = sizes
    if count < 2:
        return None
    samples = []
    for index in range(count):
        tensors = list(call.tensors)
        for leaf, dim in places:
            tensors[leaf] = tensors[leaf].narrow(dim, index, 1).contiguous()  # packages do not check strides
        args, kwargs = call.rebuild(tensors)
        samples.append(FlatCall(args, kwargs, same_roles(roles)))
    return samples


def join_samples(outputs: List[Any]) -> Any:
    """The outputs of one call per sample as the output of the batch: tensors joined along dim 0."""
    flat = [pytree.tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]):
        raise CannotJoin("the samples' outputs differ in structure")
    joined = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if any(not isinstance(leaf, torch.Tensor) or leaf.shape[1:] != first.shape[1:] for leaf in column):
                raise CannotJoin("the samples' output tensors differ in shape")
            joined.append(torch.cat(column))
        elif all(leaf is first or (not isinstance(leaf, torch.Tensor) and leaf == first) for leaf in column):
            joined.append(first)
        else:
            raise CannotJoin("a non-batch output differs between samples")
    return pytree.tree_unflatten(joined, spec)
