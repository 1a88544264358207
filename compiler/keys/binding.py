"""The one call binder: the same inputs give the same input structure, however passed.

A pipeline may pass `timestep_cond=None` or leave it out, pass the sample by
position or by name, or give an int timestep; ComfyUI passes its diffusion
model `transformer_options` beside the tensors. Binding every call to the
forward's parameter names, dropping inputs left at their defaults (and
`None`s), turning scalar timesteps into tensors and setting side inputs apart
makes a graph saved from a synthetic call (before any image was generated)
match the calls a pipeline or a sampler makes later.

The binder belongs to the compiled forward (it is made once, from the
function the calls are made to) and is not an option: a later call to
`compile_module` or `load_pipe` cannot replace it, so it cannot change the
key of graphs already saved -- the OneDiff "input structure key changed" bug.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

_EMPTY = inspect.Parameter.empty

SidePolicy = Callable[[Dict[str, Any]], Optional[str]]
"""Given the side inputs of a call, None when a graph may serve it, else why it must run eagerly."""


class CallDoesNotBind(TypeError):
    """The call does not fit the forward's parameters; the message says how."""


@dataclass(frozen=True)
class BoundCall:
    """A call in canonical form: keyword inputs sorted by name, plus the side inputs set apart."""

    inputs: Dict[str, Any]
    side: Dict[str, Any] = field(default_factory=dict)

    @property
    def args(self) -> Tuple[tuple, Dict[str, Any]]:
        return (), self.inputs


def _is_default(value: Any, default: Any, named: bool) -> bool:
    """Whether passing `value` is the same as leaving the input out."""
    if value is None and (default is None or not named):
        return True  # an optional input left empty (or a None passed through **kwargs)
    if default is _EMPTY:
        return False
    if value is default:
        return True
    if isinstance(value, (bool, int, str)) and isinstance(default, (bool, int, str)):
        return type(value) is type(default) and value == default
    return False


def _contiguous(tree: Any) -> Any:
    """Packages are traced with contiguous inputs and do not check strides."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_contiguous() else t.contiguous(), tree)


class CallBinder:
    """Binds calls made to `function` (whose first parameter, the module, is left out).

    `side_inputs` name parameters that never reach a graph (ComfyUI's
    `transformer_options`); `side_policy` decides whether what they carry
    lets a graph serve the call. `scalar_tensors` name inputs a caller may
    give as a Python number that the model turns into a tensor anyway.
    """

    def __init__(self, function: Callable, *, side_inputs: Sequence[str] = (),
                 side_policy: Optional[SidePolicy] = None,
                 scalar_tensors: Sequence[str] = ("timestep", "timesteps")):
        self.function = function
        self.side_inputs = tuple(side_inputs)
        self.side_policy = side_policy
        self.scalar_tensors = tuple(scalar_tensors)
        parameters = list(inspect.signature(function).parameters.values())[1:]
        self._signature = inspect.Signature(parameters)
        self._parameters = {p.name: p for p in parameters}

    def bind(self, args: tuple, kwargs: dict) -> BoundCall:
        """The call in canonical form; CallDoesNotBind when it does not fit the forward."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise CallDoesNotBind(str(error)) from None
        merged: Dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self._parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                merged.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    raise CallDoesNotBind(f"{len(value)} extra positional inputs a graph cannot name")
            else:
                merged[name] = value
        side = {name: merged.pop(name) for name in self.side_inputs if name in merged}
        inputs: Dict[str, Any] = {}
        for name in sorted(merged):
            value = merged[name]
            parameter = self._parameters.get(name)
            if _is_default(value, parameter.default if parameter is not None else _EMPTY, parameter is not None):
                continue
            if name in self.scalar_tensors and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(value)
            inputs[name] = value
        return BoundCall(_contiguous(inputs), side)

    def eager_reason(self, call: BoundCall) -> Optional[str]:
        """Why the side inputs keep this call from a graph, or None."""
        if self.side_policy is None or not call.side:
            return None
        return self.side_policy(call.side)
