"""Canonical calls: the same inputs give the same input structure, however passed.

A pipeline may pass `timestep_cond=None` or leave it out, pass the sample by
position or by name, or give an int timestep. Binding every call to the
forward's parameter names and dropping arguments left at their defaults
makes a graph saved from a synthetic call (before any image was generated)
match the calls a pipeline makes later.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Tuple

import torch

_EMPTY = inspect.Parameter.empty


def _is_default(value: Any, default: Any) -> bool:
    if default is _EMPTY:
        return False
    if value is default:
        return True
    if isinstance(value, (bool, int, str)) and isinstance(default, (bool, int, str)):
        return type(value) is type(default) and value == default
    return False


def canonical_binder(forward_fn: Callable, tensor_args: Tuple[str, ...] = ("timestep", "timesteps")):
    """A normaliser that binds calls to `forward_fn(module, ...)`'s parameters."""
    signature = inspect.signature(forward_fn)
    parameters = list(signature.parameters.values())[1:]  # drop `self`
    accepts_var_kw = any(p.kind is p.VAR_KEYWORD for p in parameters)
    by_name = {p.name: p for p in parameters}

    def normalise(args: tuple, kwargs: dict) -> Tuple[tuple, Dict[str, Any]]:
        bound: Dict[str, Any] = {}
        positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(args) > len(positional):
            return args, kwargs  # *args forwards: leave the call as it is
        for param, value in zip(positional, args):
            bound[param.name] = value
        for name, value in kwargs.items():
            if name in bound:
                raise TypeError(f"got multiple values for argument {name!r}")
            if name not in by_name and not accepts_var_kw:
                raise TypeError(f"unexpected keyword argument {name!r}")
            bound[name] = value
        out = {}
        for name, value in bound.items():
            param = by_name.get(name)
            if param is not None and _is_default(value, param.default):
                continue
            if name in tensor_args and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(value)
            out[name] = value
        return (), dict(sorted(out.items()))

    return normalise
