"""`inductor`: torch.compile with the dynamic dimensions marked from the first call.

In-process only (graphs on disk are `aot` packages). Three things keep it
from surprising a user:
- weights are passed as inputs through `torch.func.functional_call`, so one
  graph serves every module of the architecture and sees in-place weight
  changes (LoRA) without recompiling;
- size-1 batches are not specialised (`backed_size_oblivious`) and equal
  sizes are not assumed equal (no duck shaping), so batch 1 -> 2 and a square
  first image do not force a recompile;
- after its first compile a graph runs under the "fail_on_recompile" stance:
  an input that would silently recompile (or, past torch's recompile limit of
  8, silently run eager) is reported instead, with the guard that failed, and
  the dispatcher decides -- a counted compile of a new graph, or eager with
  the reason. Each graph gets its own code object, so one family's graphs
  never use up another's recompile budget.
- whether a graph serves a shape is answered from its guards (Dynamo's guard
  manager for the graph's code object) without running it, so covering the
  corners of a large declared range costs milliseconds, not a run at the
  largest size.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import sys
import threading
import types
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..machine import torch_support
from ..tracing.flat_module import FlatForward, module_tensors
from ..keys.graph_keys import GraphKey
from ..keys.shapes import leaf_bounds
from ..keys.signature import FlatCall
from .base import (
    Backend, CompileFailed, CompiledGraph, GraphMismatch, GuardsUnknown, LeafBounds, Progress, no_progress,
    range_failure,
)

_COUNTER = itertools.count()


def _skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of the module's structure with meta tensors in place of its weights.

    The graph is traced through this, with the real weights passed in. Were it
    traced through the real module, torch.compile would guard on the identity of
    that module's tensors and recompile for every other checkpoint.
    """
    clone = copy.copy(module)
    state = clone.__dict__
    state["_parameters"] = {
        name: None if p is None else torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for name, p in module._parameters.items()
    }
    state["_buffers"] = {
        name: None if b is None else torch.empty_like(b, device="meta") for name, b in module._buffers.items()
    }
    state["_modules"] = {name: None if m is None else _skeleton(m) for name, m in module._modules.items()}
    if getattr(state.get("forward"), "is_keepfast_dispatcher", False):
        del state["forward"]  # trace the module itself, not our dispatcher installed on it
    return clone


def _fresh_entry_point(name: str):
    def entry(flat, params, tensors):
        return torch.func.functional_call(flat, params, (tensors,))

    names = {"co_name": name}
    if sys.version_info >= (3, 11):  # code objects have a qualified name from Python 3.11 on
        names["co_qualname"] = name
    code = entry.__code__.replace(**names)
    return types.FunctionType(code, entry.__globals__, name, entry.__defaults__, entry.__closure__)


@contextlib.contextmanager
def _dynamic_settings():
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
        yield


class InductorGraph(CompiledGraph):
    def __init__(self, key: GraphKey, module: torch.nn.Module, forward_fn, call: FlatCall, bounds: LeafBounds):
        self.key = key
        self.origin = "compiled"
        self.bounds = bounds
        self.inductor_compiles = 0
        self._flat = FlatForward(_skeleton(module), forward_fn, call)
        self._rejected: Dict[Tuple, str] = {}
        self._lock = threading.Lock()
        self.ready = False

        def count_and_compile(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            self.inductor_compiles += 1
            return compile_fx(gm, example_inputs)

        entry = _fresh_entry_point(f"keepfast_graph_{next(_COUNTER)}")
        self._code = entry.__code__
        self._compiled = torch.compile(entry, backend=count_and_compile, fullgraph=True)

    def why_not(self, call: FlatCall) -> Optional[str]:
        reason = self._rejected.get(tuple(call.shapes))
        if reason:
            return reason
        return range_failure(call.shapes, self.bounds, call.tensor_paths)

    def _marked(self, call: FlatCall) -> List[torch.Tensor]:
        tensors = call.tensors
        for tensor, leaf in zip(tensors, self.bounds):
            for dim in leaf:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return tensors

    def guard_failure(self, module: torch.nn.Module, call: FlatCall) -> Optional[str]:
        why = self.why_not(call)
        if why:
            return why
        if not self.ready:
            raise GuardsUnknown("the graph has not been compiled yet")
        try:
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            managers = [entry.guard_manager for entry in _debug_get_cache_entry_list(self._code)]
        except (ImportError, AttributeError, RuntimeError) as error:
            raise GuardsUnknown(f"torch {torch.__version__} does not expose torch.compile's guards ({error})")
        if not managers:
            raise GuardsUnknown("torch.compile kept no guards for this graph")
        scope = {"flat": self._flat, "params": module_tensors(module), "tensors": self._marked(call)}
        with self._lock, _dynamic_settings():
            if any(manager.check(scope) for manager in managers):
                return None
            failed = managers[0].check_verbose(scope).verbose_code_parts
        reason = "torch.compile would recompile: " + (failed[0].split("  #")[0].strip() if failed else "a guard failed")
        self._rejected[tuple(call.shapes)] = reason
        return reason

    def run(self, module: torch.nn.Module, call: FlatCall, replay: bool = False) -> Any:
        tensors = self._marked(call)
        stance = "fail_on_recompile" if self.ready else "default"
        with self._lock, _dynamic_settings(), torch.compiler.set_stance(stance):
            try:
                outputs = self._compiled(self._flat, module_tensors(module), tensors)
            except Exception as error:
                if self.ready and "recompil" in str(error).lower():
                    reason = "torch.compile would recompile: " + _guard_text(error)
                    self._rejected[tuple(call.shapes)] = reason
                    raise GraphMismatch(reason) from None
                raise
        self.ready = True
        return pytree.tree_unflatten(list(outputs), self._flat.out_spec)


def _guard_text(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    guard_lines = [line for line in lines if "guard" in line.lower() or "size" in line.lower()]
    return (guard_lines or lines or ["unknown guard"])[-1][:300]


class InductorBackend(Backend):
    name = "inductor"
    persistent = False

    def unavailable_reason(self) -> Optional[str]:
        return torch_support.refusal()

    def compile(self, module, forward_fn, call: FlatCall, key: GraphKey,
                progress: Progress = no_progress) -> InductorGraph:
        roles = [t.dims for t in call.signature.tensors]
        bounds = leaf_bounds(call.shapes, roles, key.shape_range)
        graph = InductorGraph(key.with_variant(call.shapes), module, forward_fn, call, bounds)
        progress("compiling with torch.compile (inductor)", 0.1)
        try:
            graph.run(module, call)  # under the caller's grad mode, which torch.compile guards on
        except GraphMismatch:
            raise
        except Exception as error:
            raise CompileFailed(f"torch.compile failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}") from error
        return graph
