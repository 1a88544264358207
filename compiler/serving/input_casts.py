"""A call whose floating inputs come in another dtype than a graph of its model takes: served by that graph.

Why: graphs are keyed by each input's dtype, and a real pipeline does not always pass the dtypes an example
call (Save Graph, `save_pipe` before the first image) was made with. A bfloat16 SDXL pipeline driven with
precomputed float32 pooled embeddings passes `text_embeds` in float32 beside bfloat16 latents; the UNet casts
them itself, but the call's key differed from the saved graph's, so it compiled the UNet again (191 s), after
every restart too.

A graph of the same model, dtype, device and input structure whose inputs differ from the call's only in the
dtypes of floating inputs (`cast_plan`) serves the call with those inputs cast to its dtypes (`CastGraph`,
registered under the call's own key, never saved). The first-use check compares each new shape with the
model's own output on the call as it came, so a cast the model does not make itself (a float32 input it
computes in float32) is caught: the graph gives way for those shapes and the call compiles its own graph.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..backends.base import CompiledGraph
from ..machine.environment import dtype_from_name
from ..keys.graph_keys import FamilyKey, GraphKey
from ..keys.probes import same_roles
from ..keys.signature import FlatCall

Casts = Tuple[Tuple[int, str], ...]  # (tensor input index, the dtype the graph takes it in)


def _floating(name: str) -> bool:
    try:
        return dtype_from_name(name).is_floating_point
    except ValueError:
        return False


def cast_plan(call_signature: dict, graph_signature: dict) -> Optional[Casts]:
    """The casts that make a call of `call_signature` one of `graph_signature` (both `Signature.to_json()`), or
    None when they differ in anything but the dtypes of floating inputs (or not at all)."""
    if (call_signature.get("tree") != graph_signature.get("tree")
            or call_signature.get("constants") != graph_signature.get("constants")):
        return None
    mine, theirs = call_signature.get("tensors") or [], graph_signature.get("tensors") or []
    if len(mine) != len(theirs):
        return None
    casts = []
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a.get("path") != b.get("path") or list(a.get("dims", [])) != list(b.get("dims", [])):
            return None
        if a.get("dtype") != b.get("dtype"):
            if not (_floating(str(a.get("dtype"))) and _floating(str(b.get("dtype")))):
                return None
            casts.append((index, str(b["dtype"])))
    return tuple(casts) or None


def same_but_signature(a: FamilyKey, b: FamilyKey) -> bool:
    """Two families that differ at most in their input structure (the one field a cast can bridge)."""
    return (a.architecture, a.structure, a.dtype, a.device, a.backend, a.torch_version) == \
        (b.architecture, b.structure, b.dtype, b.device, b.backend, b.torch_version)


def cast_call(call: FlatCall, casts: Casts) -> FlatCall:
    """`call` with the named tensor inputs cast (the rest as they are)."""
    wanted = dict(casts)
    tensors = [tensor.to(dtype_from_name(wanted[index])) if index in wanted else tensor
               for index, tensor in enumerate(call.tensors)]
    args, kwargs = call.rebuild(tensors)
    return FlatCall(args, kwargs, same_roles([t.dims for t in call.signature.tensors]))


def describe(casts: Casts, paths: Sequence[str]) -> str:
    return ", ".join(f"{paths[index]} to {dtype}" for index, dtype in casts)


class CastGraph(CompiledGraph):
    """`inner` serving calls of another family whose floating inputs it takes in other dtypes (cast first)."""

    def __init__(self, inner: CompiledGraph, family: FamilyKey, casts: Casts):
        self.inner, self.casts = inner, casts
        digest = hashlib.sha256(json.dumps([inner.key.id, list(casts)]).encode()).hexdigest()[:8]
        self.key = GraphKey(family, inner.key.shape_range, f"cast-{digest}")
        self.origin = inner.origin

    def why_not(self, call: FlatCall) -> Optional[str]:
        return self.inner.why_not(cast_call(call, self.casts))

    def guard_failure(self, module: torch.nn.Module, call: FlatCall) -> Optional[str]:
        return self.inner.guard_failure(module, cast_call(call, self.casts))

    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        return self.inner.run(module, cast_call(call, self.casts), replay=replay)

    def describe_casts(self, paths: Sequence[str]) -> str:
        return f"graph {self.inner.key.id} with {describe(self.casts, paths)}"


def best(candidates: List[Tuple[Any, Casts]]) -> Optional[Tuple[Any, Casts]]:
    """The candidate needing the fewest casts."""
    return min(candidates, key=lambda item: len(item[1]), default=None)
