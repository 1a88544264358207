"""One block structure: its graph (found, loaded or compiled once) and the calls of all its instances.

`BlockServer.prepare` turns the two probe calls' block inputs into an input
structure with named dimensions, a family key and a graph (registry, then
graph store, then compile). `BlockServer.call` is the per-call path of every
instance: check the call against what was prepared (input structure, dtypes,
the graph's shape guards, cached per shape), bind the instance's weights and
run; anything else runs the instance's own forward with the reason recorded
once. Unexpected errors anywhere on that path are contained by the pack's one
boundary (`compiler.serving.boundary`), as for whole models. A graph that fails at
run time is not used again in this process. The first time the graph serves
a set of input shapes, the instance also runs eagerly and the two are
compared (`compiler.serving.verify`, as for whole models): a graph that disagrees is
retired for those shapes.

Beside it: the graph's source (graph_source.py: registry, store, another
process's build, a compile), the checks a graph passes before it serves
(graph_checks.py: sizes of 1 against eager, the range corners its guards
exclude) and the instances' stand-in forward (instance.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..builds import cores as build_cores
from ..backends.base import CompiledGraph
from ..keys.binding import CallBinder
from ..serving.boundary import Failure, contain, stage
from ..machine.environment import dtype_name
from ..keys.graph_keys import FamilyKey, GraphKey
from ..store.registry import FALLBACK, MISMATCH, REFUSED
from ..keys.signature import FlatCall, UnsupportedCall
from ..store.graph_store import StoreError
from ..serving.verify import Snapshot, judge, retired_reason, snapshot
from . import tokens as T
from ..backends.base import call_device
from .binding import InstanceWeights, SharedRunner
from .graph_checks import Shapes, corner_notes, unit_size_failure
from .graph_source import BlockGraphSource
from .finder import BlockGroup
from .instance import BlockInstance

log = logging.getLogger("keepfast")

_MISSING = object()
_SHAPE_CACHE_LIMIT = 256


def _same_constant(now: Any, then: Any) -> bool:
    """A non-tensor input the graph was traced with, unchanged (a tensor where one was is never the same)."""
    if now is then:
        return True
    if isinstance(now, torch.Tensor) or isinstance(then, torch.Tensor):
        return False
    return bool(now == then)


class BlockServer:
    """Every instance of one block structure, served from one graph."""

    def __init__(self, engine, group: BlockGroup, first_index: int):
        self.engine = engine
        self.group = group
        self.instances = [BlockInstance(self, first_index + i, path, module)
                          for i, (path, module) in enumerate(group.instances)]
        binder = CallBinder(type(group.modules[0]).forward, scalar_tensors=())  # the one binder, as for models
        family = engine.family
        self.normalise = lambda args, kwargs: binder.bind(*family.block_inputs(args, kwargs)).args
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        if getattr(self, "source", None) is not None:
            self.source.stop()
        self.source = BlockGraphSource(self)  # finds, loads or builds the graph (a build in flight is its)
        self.graph: Optional[CompiledGraph] = None
        self.runner: Optional[SharedRunner] = None
        self.family: Optional[FamilyKey] = None
        self.call_template: Optional[FlatCall] = None
        self.roles: T.RoleMap = {}
        self.reason: Optional[str] = "not prepared yet"
        self.origin = ""
        self.compile_s = 0.0
        self.notes: List[str] = []
        self.saved: Optional[str] = None
        self.saved_name: Optional[str] = None  # the store's name for it ('<folder>/<graph>'), for graph sets
        self._spec = None
        self._positions: List[int] = []
        self._constants: List[Tuple[int, Any]] = []
        self._dtypes: Tuple[torch.dtype, ...] = ()
        self._device = None
        self._dtype = None
        self.lead: Optional[BlockInstance] = None  # the instance traced and checked (`_lead`), once prepared
        self._shape_cache: Dict[tuple, Optional[str]] = {}
        self._recorded: Dict[str, int] = {}

    # -- describing ---------------------------------------------------------
    @property
    def label(self) -> str:
        return f"{self.engine.label} {self.group.class_name}"

    @property
    def ready(self) -> bool:
        return self.graph is not None and self.reason is None

    def status(self) -> str:
        if self.ready:
            return f"{self.origin} graph"
        return f"eager: {self.reason}"

    # -- preparing ----------------------------------------------------------
    def prepare(self, first: Optional[Tuple[tuple, dict]], second: Optional[Tuple[tuple, dict]],
                counts: Tuple[Dict[str, int], Dict[str, int]], progress: Callable[[str, float], None]) -> None:
        """Name the input dimensions from the two probes' calls, then find, load or compile the graph."""
        self.reset()
        try:
            self.reason = self._prepare(first, second, counts, progress)
        except Exception as error:  # nothing in preparing a block may break the model's call
            log.exception("%s: preparing the block graph failed", self.label)
            self.reason = f"preparing its graph failed: {type(error).__name__}: {error}"
        finally:
            if self.source.pending is None:  # built and written here, or not built here: others may look now
                self.source.release_claim()
        if self.reason is not None:
            self.graph = None
            if not (self.engine.together and self.source.pending is not None):  # waited for by the engine
                self.record_fallback(self.reason)

    def _prepare(self, first, second, counts, progress) -> Optional[str]:
        if first is None or second is None:
            return "the model's forward did not call this block in the example calls"
        try:
            a = FlatCall(*self.normalise(*first))
            b = FlatCall(*self.normalise(*second))
        except (UnsupportedCall, TypeError) as error:
            return f"its inputs cannot be a graph's inputs: {error}"
        if a.treespec != b.treespec or a.signature.constants != b.signature.constants:
            return "its input structure changes with the call's size (a Python value among its inputs differs)"
        try:
            roles = T.rows_roles(T.infer_roles(a.tensor_paths, a.shapes, b.shapes, *counts),
                                 self.engine.family.timestep_rows)
        except T.UnknownDimension as error:
            return f"an input size is not a batch or token count: {error}"
        call = FlatCall(*self.normalise(*first), role_policy=lambda path, tensor: roles.get(path, {}))
        self.roles = roles
        self.call_template = call
        device = call_device(call.tensors)
        lead = self._lead(device)
        if lead is None:
            return (f"every instance has weights outside {device}, where its calls run (ComfyUI loaded the model "
                    "partly: low-VRAM mode keeps some weights in CPU memory)")
        self.lead = lead
        _, dtype = lead.weights.device_and_dtype()
        self._device, self._dtype = device, dtype
        options = self.engine.options
        self.family = FamilyKey.here(self.group.class_name, self.group.structure, call.signature.id,
                                     dtype, device if device is not None else "cpu", options.backend)
        block_range = self.engine.block_range
        bounds = [{d: T.role_bounds(role, block_range) for d, role in roles.get(path, {}).items()}
                  for path in call.tensor_paths]
        for (lo, hi), size in ((bound, call.shapes[i][d]) for i, leaf in enumerate(bounds) for d, bound in leaf.items()):
            if not lo <= size <= hi:
                return f"the probe size {size} is outside its declared range {lo}-{hi}"
        graph, why = self.source.obtain(call, bounds, GraphKey(self.family, block_range), progress)
        if graph is None:
            return why
        return self.adopt(graph, call)

    def _lead(self, device: torch.device) -> Optional[BlockInstance]:
        """The first instance whose every tensor is on `device`: the one traced and checked against eager. A model
        ComfyUI loaded partly keeps some layers' weights in CPU memory; an instance traced with those would make a
        graph of copies to the device, or none."""
        for instance in self.instances:
            weights = InstanceWeights(instance.module, self.engine.family.call_tensors)
            if all(tensor.device == device for tensor in weights.tensors.values()):
                instance.weights = weights
                return instance
        return None

    def adopt(self, graph: CompiledGraph, call: FlatCall) -> Optional[str]:
        """Serve from `graph` (None), or why it cannot serve the call it was built from."""
        failure = graph.why_not(call)
        if failure is not None:
            return f"the graph does not serve the call it was built from: {failure}"
        self.graph = graph
        self.runner = SharedRunner(graph)
        self._spec = call.treespec
        self._positions = list(call.tensor_positions)
        self._constants = [(i, leaf) for i, leaf in enumerate(call.leaves) if i not in set(call.tensor_positions)]
        self._dtypes = tuple(t.dtype for t in call.tensors)
        self.notes.extend(corner_notes(graph, call, self.roles, self.engine.block_range))
        options = self.engine.options
        if self.origin == "compiled" and options.autosave and options.store is not None:
            problem = self.save(options.store)
            if problem:
                self.notes.append(problem)
        return None

    def check_unit_sizes(self, candidate: CompiledGraph, units: Dict[str, Tuple[int, int]],
                          call: FlatCall) -> Optional[str]:
        """None if the graph gives the block's eager result where the range's sizes of 1 are (graph_checks.py:
        the lead instance runs the probe call cut down to them, both ways)."""
        return unit_size_failure(candidate, units, call, self.lead, self.roles, self.engine.probe_counts[0],
                                 self.engine.family)

    def save(self, store) -> Optional[str]:
        """Write the graph into `store`; the problem, if it could not be."""
        if self.graph is None or self.call_template is None:
            return f"{self.label}: no graph to save ({self.reason})"
        if not self.graph.persistent:
            return f"{self.label}: the {self.graph.key.family.backend} backend's graphs cannot be saved"
        signature = self.call_template.signature.to_json()
        # What the graph library shows next to the graph: the blocks it serves, of which model.
        signature["block"] = {"class": self.group.class_name, "instances": len(self.instances),
                              "paths": [self.group.paths[0], self.group.paths[-1]],
                              "model": self.engine.architecture}
        try:
            stored = store.save(self.graph, signature)
        except StoreError as error:
            self.engine.registry.record(REFUSED, self.graph.key.family, f"{self.label}: {error}")
            return f"{self.label}: {error}"
        self.saved = str(stored.package_path)
        self.saved_name = stored.name
        return None

    def settle(self, reason: Optional[str]) -> bool:
        """Serve from the adopted graph (`reason` None), or run eager with `reason`, recorded once: whether the
        block now serves from a graph (its graph source settles a build it waited for or took in)."""
        self.reason = reason
        if reason is not None:
            self.graph = None
            self.record_fallback(reason)
        return reason is None

    # -- calling ------------------------------------------------------------
    def record_fallback(self, reason: str, instance: Optional[BlockInstance] = None) -> None:
        count = self._recorded.get(reason, 0)
        self._recorded[reason] = count + 1
        if count == 0:
            where = f" {instance.path}" if instance is not None else f" ({self.group.describe()})"
            self.engine.registry.record(FALLBACK, self.family or "-", f"{self.label}{where}: {reason}; running eager")
            log.info("%s%s runs eager: %s", self.label, where, reason)

    def _eager(self, instance: BlockInstance, reason: str, args, kwargs) -> Any:
        instance.eager_calls += 1
        self.engine.registry.log.count("blocks.eager")
        instance.last_status = "eager: " + reason
        self.record_fallback(reason, instance)
        return instance.eager(args, kwargs)

    def _weights_for(self, instance: BlockInstance,
                     device: torch.device) -> Tuple[Optional[InstanceWeights], Optional[str]]:
        """The instance's weights for a call on `device`, or why they cannot be bound there (checked again only
        when they change or the call moves)."""
        weights = instance.weights
        if weights is None:
            weights = instance.weights = InstanceWeights(instance.module, self.engine.family.call_tensors)
        weights.check(device)
        if instance.checked_version != (weights.version, device):
            _, dtype = weights.device_and_dtype()
            reason = None
            if self._device is not None and device.type != self._device.type:
                reason = f"the call runs on {device}, its graph on {self._device.type}"
            elif dtype is not None and self._dtype is not None and dtype != self._dtype:
                reason = f"its weights are {dtype_name(dtype)}, its graph is for {dtype_name(self._dtype)}"
            else:
                reason = self.runner.misplaced(weights, device)
            instance.weights_reason = reason
            instance.checked_version = (weights.version, device)
        return weights, instance.weights_reason

    def call(self, instance: BlockInstance, args: tuple, kwargs: dict) -> Any:
        engine = self.engine
        if engine.eager_now():
            return instance.eager(args, kwargs)
        if engine.capturing is not None:
            return engine.capture(self, instance, args, kwargs)
        if engine.scoped and not engine.serving_now():
            return instance.eager(args, kwargs)  # a caller that did not ask for graphs
        build_cores.share()
        started, graph_calls = time.perf_counter(), instance.graph_calls
        try:
            return self._serve(instance, args, kwargs)
        finally:
            outcome = "graph" if instance.graph_calls > graph_calls else "eager"
            engine.registry.log.add_time(f"blocks.{outcome}", time.perf_counter() - started)

    def _serve(self, instance: BlockInstance, args: tuple, kwargs: dict) -> Any:
        engine = self.engine
        source = self.source
        if not self.ready and source.pending is not None:
            with self.lock:
                source.land()
        elif not self.ready and source.elsewhere is not None and time.monotonic() >= source.elsewhere[3]:
            with self.lock:
                source.look_again()
        if not self.ready:
            return self._eager(instance, self.reason or "no graph", args, kwargs)
        try:
            output, reason, shapes, copies = self._from_graph(instance, args, kwargs)
        except Exception as error:  # noqa: BLE001 - the boundary: never an exception of ours out of a call
            return self._eager(instance, str(contain(self.label, error, "serving the block")), args, kwargs)
        if reason is not None:
            return self._eager(instance, reason, args, kwargs)
        if copies is not None:  # the first-use check: eager on the inputs as they were before the graph ran
            reference = instance.eager(copies.args, copies.kwargs)
            disagreement = judge(engine.registry.verdicts, self.graph.key.id, shapes, output, reference)
            if disagreement is not None:
                self._retire(instance, shapes, disagreement, copies)
                return reference
        instance.graph_calls += 1
        instance.last_status = f"{self.origin} graph"
        engine.registry.count_hit()
        engine.registry.log.count("blocks.graph")
        if self._recorded:
            self._recorded.clear()  # a reason that comes back is recorded again
        return output

    def _retire(self, instance: BlockInstance, shapes, disagreement, copies) -> None:
        """Record that the graph disagreed with eager at these shapes (the call returns eager's output, and its
        inputs get eager's in-place updates)."""
        reason = retired_reason(self.graph.key.id, self.call_template.tensor_paths, shapes[0], disagreement)
        try:
            copies.restore()
        except Exception as error:  # noqa: BLE001 - the output is eager's either way
            reason += f" (its in-place updates of the inputs could not be undone: {error})"
        self.engine.registry.record(MISMATCH, self.family, f"{self.label} {instance.path}: {reason}",
                                    graph_id=self.graph.key.id,
                                    detail={"shapes": [list(shape) for shape in shapes[0]],
                                            "relative": disagreement.relative, "max_abs": disagreement.max_abs,
                                            "nonfinite": disagreement.nonfinite})
        log.error("%s %s: %s", self.label, instance.path, reason)
        instance.eager_calls += 1
        self.engine.registry.log.count("blocks.eager")
        instance.last_status = "eager: " + reason
        self._recorded[reason] = 1  # the mismatch event says it; later calls do not repeat it as a fallback

    def _from_graph(self, instance: BlockInstance, args: tuple,
                    kwargs: dict) -> Tuple[Any, Optional[str], tuple, Optional[Snapshot]]:
        """(the graph's output, None, the call's shapes and dtypes, copies of (args, kwargs) taken before the
        graph ran when the first-use check is due), or (None, why this call runs eager, ...); unexpected
        errors name their stage."""
        engine = self.engine
        with stage("checking the block's call"):
            if engine.block_filter is not None:
                reason = engine.block_filter(instance, args, kwargs)
                if reason:
                    return None, reason, (), None
            try:
                c_args, c_kwargs = self.normalise(args, kwargs)
            except TypeError as error:
                return None, f"the call does not bind to the block's inputs: {error}", (), None
            leaves, spec = pytree.tree_flatten((c_args, c_kwargs))
            if spec != self._spec or any(not _same_constant(leaves[i], v) for i, v in self._constants):
                return None, self._structure_difference(c_args, c_kwargs), (), None
            tensors = [leaves[i] for i in self._positions]
            if not all(isinstance(t, torch.Tensor) for t in tensors):
                return None, "an input that was a tensor when prepared is not one now", (), None
        shapes = tuple(tuple(t.shape) for t in tensors)
        cache_key = (shapes, tuple(t.dtype for t in tensors))
        why = self._shape_cache.get(cache_key, _MISSING)
        if why is _MISSING:
            try:
                why = self._why_not(shapes, cache_key[1])
            except Exception as error:  # a guard this machine cannot evaluate: eager, never a failed call
                why = f"the graph's shape guards cannot be checked: {type(error).__name__}: {error}"
            if len(self._shape_cache) >= _SHAPE_CACHE_LIMIT:
                self._shape_cache.clear()
            self._shape_cache[cache_key] = why
        if why:
            return None, why, cache_key, None
        verdict = engine.registry.verdicts.get(self.graph.key.id, cache_key)
        if verdict is not None and not verdict.ok:
            return (None, retired_reason(self.graph.key.id, self.call_template.tensor_paths, shapes, verdict),
                    cache_key, None)
        with stage("binding the block's weights"):
            weights, reason = self._weights_for(instance, call_device(tensors))
        if reason:
            return None, reason, cache_key, None
        copies = snapshot(args, kwargs) if engine.options.verify and verdict is None else None
        running = f"running graph {self.graph.key.id}"
        try:
            with stage(running):
                return (self.runner.run(weights, tensors, self.call_template.rebuild, checked=True), None, cache_key,
                        copies)
        except Failure as failure:  # a graph that breaks at run time is not used again in this process
            self.reason = str(failure)
            raise

    def _why_not(self, shapes, dtypes) -> Optional[str]:
        template = self.call_template
        for path, want, have in zip(template.tensor_paths, self._dtypes, dtypes):
            if want != have:
                return f"{path} is {dtype_name(have)}, its graph takes {dtype_name(want)}"
        outside = T.outside_range(template.tensor_paths, shapes, self.roles, self.graph.key.shape_range)
        if outside is not None:
            role, why = outside
            advice = (self.engine.options.range_advice or {}).get(role)
            return f"{why} ({advice})" if advice else why
        return self.graph.why_not(Shapes(shapes, template.tensor_paths))

    def _structure_difference(self, args, kwargs) -> str:
        try:
            now = FlatCall(args, kwargs).signature
        except UnsupportedCall as error:
            return str(error)
        then = self.call_template.signature
        return (f"its input structure differs from the prepared one ({now.describe()} vs "
                f"{then.describe()}); not compiled for it")
