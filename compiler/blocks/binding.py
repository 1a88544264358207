"""Serving every instance of a block structure from one graph: weights passed (or bound) per call.

One AOTInductor runner per graph, so N instances cost one graph in memory and
one compile. A graph built since format 4 takes an instance's weights as
inputs after the call's tensors (backends/weight_inputs.py): nothing is bound
and the runtime keeps nothing of them. A graph saved before that holds its
weights as constants: before an instance's call its own weights are handed to
the runner by pointer (`load_constants(..., user_managed=True)`: no copy; as
views that do not own the memory, backends/borrowed_weights.py), and torch's
runtime keeps a small handle of every tensor so bound.

What a call costs on top of the graph itself (measured on this 2-core CPU,
torch 2.13, a Flux double block with 32 weight tensors): walking the module
for its tensors as the whole-model path does each time the module changes,
about 130 us; handing 32 pointers to the runner, 25-40 us. So the tensors of
each instance are collected once and re-checked cheaply on each call (same
tensor objects at the same addresses); a replaced tensor (ComfyUI's LoRA
patching swaps parameters, `module.to()` moves them) is noticed and
re-collected, and an in-place update (fused LoRA) is seen through the
pointers as it is.

A family may bind tensors of its own beside the module's (`call_tensors`,
quantised.py): a LoRA delta per quantised Linear, computed for the call and
released after it (`release`), so a patched GGUF model holds one block's
deltas at a time, as ComfyUI-GGUF's own per-call patching does.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..backends.aot import AotGraph
from ..backends.aot_loading import index_of
from ..backends.borrowed_weights import BorrowedWeights, bind, borrowed_views
from ..tracing.weight_inputs import with_weights
from ..backends.base import CompiledGraph, WeightsElsewhere, call_device, weights_elsewhere
from ..tracing.flat_module import MODULE_PREFIX
from .export import empty_to_none
from .quantised import CallTensors, subclass_parts

_BOUND = "block"  # a runner's bound token of a block instance (the graph's own run() binds a module snapshot's token)
_SERIALS = itertools.count(1)  # never reused, unlike id(): a new model must never look bound


class InstanceWeights:
    """One block instance's tensors under the names a graph binds, re-checked per call."""

    def __init__(self, module: torch.nn.Module,
                 extra: Optional[Callable[[torch.nn.Module, Optional[torch.device]], Optional[CallTensors]]] = None):
        self.module = module
        self.serial = next(_SERIALS)
        self._entries: List[Tuple[Dict[str, Any], str, torch.Tensor, Any]] = []
        self.tensors: Dict[str, torch.Tensor] = {}
        self.version = 0
        self.extra = extra
        self.transient: List[str] = []  # names bound for the current call only
        self._own: Dict[str, torch.Tensor] = {}
        self.collect()

    def collect(self) -> None:
        entries, tensors = [], {}
        for prefix, sub in self.module.named_modules(remove_duplicate=False):
            for store in (sub._parameters, sub._buffers):
                for name, tensor in store.items():
                    if tensor is None:
                        continue
                    full = MODULE_PREFIX + (f"{prefix}.{name}" if prefix else name)
                    inner = subclass_parts(tensor)
                    if inner is None:
                        entries.append((store, name, tensor, tensor.data_ptr()))
                        tensors[full] = tensor
                        continue
                    # a tensor subclass weight (ComfyUI's QuantizedTensor: fp8 bytes and a scale): torch.export
                    # lifts its parts as `<module>.parametrizations.<name>.original<i>`, in flattening order
                    entries.append((store, name, tensor, _pointer(tensor)))
                    owner = MODULE_PREFIX + (f"{prefix}." if prefix else "")
                    for i, part in enumerate(inner):
                        tensors[f"{owner}parametrizations.{name}.original{i}"] = part
                    tensors[full] = tensor
        self._entries = entries
        self.tensors = tensors
        self._own = dict(tensors)  # what a per-call tensor of the same name replaces for one call
        self.version += 1

    def fresh(self) -> bool:
        """True when every tensor is the one collected, at the same address."""
        for store, name, tensor, pointer in self._entries:
            if store.get(name) is not tensor or _pointer(tensor) != pointer:
                return False
        return True

    def check(self, device: Optional[torch.device] = None) -> None:
        """Re-collect what changed, then add the family's tensors for a call on `device`."""
        if not self.fresh():
            self.collect()
        if self.extra is None:
            return
        found = self.extra(self.module, device)
        if not found:
            return
        tensors, transient = found
        changed = False
        for name, tensor in tensors.items():
            if self.tensors.get(name) is not tensor:
                self.tensors[name] = tensor
                changed = True
        if transient:
            self.transient = list(tensors)
        if changed:
            self.version += 1

    def release(self) -> None:
        """Drop the tensors bound for one call only (the next call binds its own)."""
        if self.transient:
            for name in self.transient:
                if name in self._own:
                    self.tensors[name] = self._own[name]
                else:
                    self.tensors.pop(name, None)
            self.transient = []
            self.version += 1

    def device_and_dtype(self) -> Tuple[Optional[torch.device], Optional[torch.dtype]]:
        for tensor in self.tensors.values():
            if tensor.is_floating_point():
                return tensor.device, tensor.dtype
        return None, None


def _pointer(tensor: torch.Tensor) -> Any:
    """Where a tensor's memory is; for a subclass, every part's (a part replaced on its own, the scale of an fp8
    weight, must be bound again: the runner's view of the old one does not keep it)."""
    inner = subclass_parts(tensor)
    if inner is None:
        return tensor.data_ptr()
    return tuple(part.data_ptr() for part in inner)


class SharedRunner:
    """Runs an aot graph for any instance of its structure.

    Uses the graph's loaded runner directly when it can (the aot backend's
    `AotGraph`); otherwise, or for other backends, `graph.run(module, call)`,
    which binds the module's weights itself, slower but correct.
    """

    def __init__(self, graph: CompiledGraph):
        self.graph = graph
        names = getattr(graph, "_names", None)
        spec = getattr(graph, "_out_spec", None)
        self.lock = getattr(graph, "_lock", None) or threading.Lock()
        self.direct = isinstance(graph, AotGraph) and names is not None and spec is not None
        self._names, self._spec = list(names or ()), spec
        self._inputs = list(getattr(graph, "weight_inputs", ()) or ()) if self.direct else []
        self._chosen: Dict[int, Tuple[int, BorrowedWeights]] = {}

    def _constants(self, weights: InstanceWeights) -> BorrowedWeights:
        cached = self._chosen.get(weights.serial)
        if cached is not None and cached[0] == weights.version:
            return cached[1]
        try:
            chosen = borrowed_views({name: weights.tensors[name] for name in self._names})
        except KeyError as missing:
            raise RuntimeError(f"the block has no tensor {missing.args[0][len(MODULE_PREFIX):]}") from None
        if not weights.transient:  # a per-call delta is never kept alive by the cache
            self._chosen[weights.serial] = (weights.version, chosen)
        return chosen

    def misplaced(self, weights: InstanceWeights, device: torch.device) -> Optional[str]:
        """Why `weights` cannot be bound for a call on `device` (`base.weights_elsewhere`), or None; every tensor of
        the block is checked where the graph's names are not known (another backend's graph)."""
        names = (self._inputs or self._names) if self.direct else list(weights.tensors)
        return weights_elsewhere({name: weights.tensors.get(name) for name in names}, device)

    def run(self, weights: InstanceWeights, tensors: Sequence[torch.Tensor], rebuild, checked: bool = False) -> Any:
        """Run with `weights` (passed as inputs, or bound for a graph that holds them as constants); `rebuild(tensors)`
        gives (args, kwargs) for the generic path. `checked`: the
        caller has just checked `weights` for this call (per-call tensors are made once a call)."""
        inputs = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        device = call_device(inputs)
        if not checked:
            weights.check(device)
        if not self.direct:
            from ..keys.signature import FlatCall

            args, kwargs = rebuild(inputs)
            return empty_to_none(self.graph.run(weights.module, FlatCall(args, kwargs)))
        if self._inputs:
            return self._run_with_weights(weights, inputs, device)
        with self.lock:
            # The runner of the device the call is on (a block on cuda:1 runs the package loaded there), and
            # whose tensors it holds: the graph keeps that per runner, for its own run() too.
            index = index_of(device)
            runner = self.graph.runner_on(index)
            bound = self.graph._bound
            token = (_BOUND, weights.serial, weights.version)
            if bound.get(index) != token:
                misplaced = self.misplaced(weights, device)
                if misplaced:
                    raise WeightsElsewhere(misplaced)
                bind(runner, self._constants(weights), check_full_update=False)
                bound[index] = token
            try:
                outputs = runner(inputs)
            finally:
                if weights.transient:  # released: the runner's pointers to them must not be used again
                    weights.release()
                    bound.pop(index, None)
        return self._unflatten(outputs)

    def _run_with_weights(self, weights: InstanceWeights, inputs: List[torch.Tensor], device: torch.device) -> Any:
        """A graph taking its weights as inputs: the instance's weights passed for this call, nothing bound."""
        try:
            misplaced = self.misplaced(weights, device)
            if misplaced:
                raise WeightsElsewhere(misplaced)
            try:
                flat = with_weights(inputs, weights.tensors, self._inputs)
            except KeyError as missing:
                raise RuntimeError(f"the block has no tensor {missing.args[0][len(MODULE_PREFIX):]}") from None
            with self.lock:  # the runner of the device the call is on (a block on cuda:1 runs the package loaded there)
                outputs = self.graph.runner_on(index_of(device))(flat)
        finally:
            weights.release()  # the call's own tensors (a per-call delta) are the caller's again
        return self._unflatten(outputs)

    def _unflatten(self, outputs: Any) -> Any:
        if isinstance(outputs, torch.Tensor):
            outputs = [outputs]
        return empty_to_none(pytree.tree_unflatten(list(outputs), self._spec))
