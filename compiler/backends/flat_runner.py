"""A loaded AOTInductor package called with one flat list of tensors, its call specs read once.

Why: torch's `AOTICompiledModel.__call__` asks the loader for the package's input and output specs and parses both
(`treespec_loads`, JSON) on every call, then flattens the arguments and unflattens the outputs. The pack calls every
package one way, `runner([tensor, ...])` (the program was exported taking one list, a part of one a tuple, a block
graph taking its weights two lists: the call's tensors, then the weights, weight_inputs.py), so the
specs are read here once and a call goes straight to the loader's `boxed_run`. On this 2-core CPU the real-depth
SD1.5 UNet in 2 parts spent about 0.2 ms of each call there (a cProfile of 40 calls); on a GPU that time comes
before the call's first kernel. A package whose input spec is anything else is called as torch calls it.
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch.utils import _pytree as pytree


def _takes_one_list(in_spec: pytree.TreeSpec) -> bool:
    """Whether a package's inputs flatten to one list of tensors in their order, with no keywords: one positional
    list or tuple (`((list,), {})`; the parts of a graph take a tuple), or a block graph's two lists (its call's
    tensors, then its weights: `((list, list), {})`)."""
    leaves = [0] * in_spec.num_leaves
    if in_spec in (pytree.tree_structure(((leaves,), {})), pytree.tree_structure(((tuple(leaves),), {}))):
        return True
    return any(in_spec == pytree.tree_structure(((leaves[:k], leaves[k:]), {})) for k in range(len(leaves) + 1))


class FlatRunner:
    """torch's loaded model (`AOTICompiledModel`), everything but its call passed through to it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.loader = model.loader
        in_spec, out_spec = self.loader.get_call_spec()
        self._flat = _takes_one_list(pytree.treespec_loads(in_spec))
        self._out_spec = pytree.treespec_loads(out_spec)

    def __call__(self, *args, **kwargs) -> Any:
        if self._flat and not kwargs and len(args) == 1 and isinstance(args[0], list) \
                and all(isinstance(t, torch.Tensor) for t in args[0]):
            outputs: List[torch.Tensor] = self.loader.boxed_run(list(args[0]))  # a list of its own: boxed_run takes it
            return pytree.tree_unflatten(outputs, self._out_spec)
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
