"""The input structure of a call: which inputs are present, of what kind.

A call's args and kwargs are flattened with torch's pytree. Tensors become
graph inputs; plain scalars (None, bools, ints, strings) become constants of
the graph. The resulting `Signature` -- tree layout, each tensor's rank, dtype
and static sizes, each constant's value -- is the "input structure" part of a
graph key. A call with ControlNet residuals has another signature than one
without: it gets a graph of its own and the first keeps serving.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..machine.environment import dtype_name
from .shapes import default_roles

RolePolicy = Callable[[str, torch.Tensor], Dict[int, str]]

_CONSTANT_TYPES = (type(None), bool, int, str)


class UnsupportedCall(Exception):
    """The call has an input a graph cannot take; the reason says which."""


@dataclass(frozen=True)
class TensorInput:
    path: str
    dtype: str
    dims: Tuple[Any, ...]  # an int for a static size, a role name for a dynamic one

    def to_json(self) -> dict:
        return {"path": self.path, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class Signature:
    tree: str
    tensors: Tuple[TensorInput, ...]
    constants: Tuple[Tuple[str, Any], ...]

    def to_json(self) -> dict:
        return {
            "tree": self.tree,
            "tensors": [t.to_json() for t in self.tensors],
            "constants": [[path, value] for path, value in self.constants],
        }

    @property
    def id(self) -> str:
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        parts = [f"{t.path}{list(t.dims)}" for t in self.tensors]
        parts += [f"{path}={value!r}" for path, value in self.constants]
        return ", ".join(parts)


class FlatCall:
    """One call, flattened: its tensors in order and how to rebuild the call."""

    def __init__(self, args: tuple, kwargs: dict, role_policy: Optional[RolePolicy] = None):
        policy = role_policy or (lambda path, tensor: default_roles(tensor.dim()))
        with_paths, self.treespec = pytree.tree_flatten_with_path((args, kwargs))
        self.leaves: List[Any] = [leaf for _, leaf in with_paths]
        self.paths: List[str] = [_path_name(path) for path, _ in with_paths]
        self.tensor_positions: List[int] = []
        tensors, constants = [], []
        for position, (path, leaf) in enumerate(zip(self.paths, self.leaves)):
            if isinstance(leaf, torch.Tensor):
                self.tensor_positions.append(position)
                roles = policy(path, leaf)
                dims = tuple(roles.get(d, int(size)) for d, size in enumerate(leaf.shape))
                tensors.append(TensorInput(path, dtype_name(leaf.dtype), dims))
            elif isinstance(leaf, _CONSTANT_TYPES):
                constants.append((path, leaf))
            elif isinstance(leaf, float):
                raise UnsupportedCall(
                    f"input {path} is a Python float ({leaf}); a graph would bake it in, "
                    "pass it as a tensor"
                )
            else:
                raise UnsupportedCall(
                    f"input {path} is a {type(leaf).__name__}, which a compiled graph cannot take"
                )
        self.signature = Signature(str(self.treespec), tuple(tensors), tuple(constants))

    @property
    def tensors(self) -> List[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_positions]

    @property
    def tensor_paths(self) -> List[str]:
        return [self.paths[i] for i in self.tensor_positions]

    @property
    def shapes(self) -> List[Tuple[int, ...]]:
        return [tuple(t.shape) for t in self.tensors]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Tuple[tuple, dict]:
        leaves = list(self.leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.treespec)
        return args, kwargs


def _path_name(path: tuple) -> str:
    """(0 args|1 kwargs, ...) -> 'sample' / 'args[0]' / 'added_cond_kwargs.text_embeds'."""
    text = pytree.keystr(path[1:]) if len(path) > 1 else ""
    if path and getattr(path[0], "idx", None) == 0:
        text = "args" + text
    text = text.replace("['", ".").replace("']", "")
    return text.lstrip(".") or "input"
