"""One block structure: its graph (found, loaded or compiled once) and the calls of all its instances.

`BlockServer.prepare` turns the two probe calls' block inputs into an input
structure with named dimensions, a family key and a graph (registry, then
graph store, then compile). `BlockServer.call` is the per-call path of every
instance: check the call against what was prepared (input structure, dtypes,
the graph's shape guards, cached per shape), bind the instance's weights and
run; anything else runs the instance's own forward with the reason recorded
once. Unexpected errors anywhere on that path are contained by the pack's one
boundary (`compiler.boundary`), as for whole models. A graph that fails at
run time is not used again in this process. The first time the graph serves
a set of input shapes, the instance also runs eagerly and the two are
compared (`compiler.verify`, as for whole models): a graph that disagrees is
retired for those shapes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .. import build_claims, build_cores
from ..backends import BackendUnavailable, get_backend
from ..backends.base import BuildInProcess, BuildLabel, CompiledGraph, CompileFailed
from ..binding import CallBinder
from ..boundary import Failure, contain, expected_failure, stage
from ..environment import dtype_name
from ..keys import FamilyKey, GraphKey
from ..quiet import third_party_quiet
from ..registry import COMPILE, FALLBACK, LOAD, MISMATCH, PROGRESS, REFUSED
from ..signature import FlatCall, UnsupportedCall
from ..store import GraphRefused, StoreError
from ..verify import Snapshot, compare, judge, retired_reason, snapshot
from . import tokens as T
from .binding import InstanceWeights, SharedRunner
from .export import BlockBuild, package_block
from .finder import BlockGroup

log = logging.getLogger("keepfast")

_MISSING = object()
_SHAPE_CACHE_LIMIT = 256


class _Shapes:
    """What a graph's `why_not` reads of a call: its tensor shapes and their names."""

    def __init__(self, shapes: Sequence[Tuple[int, ...]], paths: Sequence[str]):
        self.shapes = list(shapes)
        self.tensor_paths = list(paths)


def _same_constant(now: Any, then: Any) -> bool:
    """A non-tensor input the graph was traced with, unchanged (a tensor where one was is never the same)."""
    if now is then:
        return True
    if isinstance(now, torch.Tensor) or isinstance(then, torch.Tensor):
        return False
    return bool(now == then)


def _cut(tensor: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The leading part of `tensor` with `shape` (each size at most the tensor's)."""
    for dim, size in enumerate(shape):
        if tensor.shape[dim] != size:
            tensor = tensor.narrow(dim, 0, size)
    return tensor


class BlockInstance:
    """One block of the model; its `forward` is replaced by this object."""

    is_keepfast_dispatcher = True  # installed as the block's forward: traces want the block itself

    def __init__(self, server: "BlockServer", index: int, path: str, module: torch.nn.Module):
        self.server = server
        self.index = index
        self.path = path
        self.module = module
        self.original = module.__dict__.get("forward")  # an instance-level forward someone else set
        self.weights: Optional[InstanceWeights] = None
        self.checked_version = -1
        self.weights_reason: Optional[str] = None
        self.graph_calls = 0
        self.eager_calls = 0
        self.last_status = "not run yet"

    def __call__(self, *args, **kwargs) -> Any:
        return self.server.call(self, args, kwargs)

    def eager(self, args: tuple, kwargs: dict) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is self:
            if self.original is not None:
                self.module.forward = self.original
            else:
                del self.module.forward


BUILDING = "its graph is building in the background"
RECHECK_S = 1.0  # while another process builds a block graph: how often its calls look in the store again


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
        if getattr(self, "pending", None) is not None:
            self.pending.cancel()
        build_claims.release(getattr(self, "claim", None))
        self.claim: Optional[build_claims.Claim] = None  # held while this process builds the graph for the store
        self.elsewhere = None  # (call, bounds, key, when to look again) while another process builds it
        self.graph: Optional[CompiledGraph] = None
        self.runner: Optional[SharedRunner] = None
        self.family: Optional[FamilyKey] = None
        self.call_template: Optional[FlatCall] = None
        self.roles: T.RoleMap = {}
        self.reason: Optional[str] = "not prepared yet"
        self.pending = None  # export.BlockBuild: the graph building in the background
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
            if self.pending is None:  # built and written here, or not built here: others may look now
                self._release_claim()
        if self.reason is not None:
            self.graph = None
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
            roles = T.infer_roles(a.tensor_paths, a.shapes, b.shapes, *counts)
        except T.UnknownDimension as error:
            return f"an input size is not a batch or token count: {error}"
        call = FlatCall(*self.normalise(*first), role_policy=lambda path, tensor: roles.get(path, {}))
        self.roles = roles
        self.call_template = call
        module = self.group.modules[0]
        weights = InstanceWeights(module, self.engine.family.call_tensors)
        device, dtype = weights.device_and_dtype()
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
        graph, why = self._obtain(call, bounds, GraphKey(self.family, block_range), progress)
        if graph is None:
            return why
        return self._adopt(graph, call)

    def _adopt(self, graph: CompiledGraph, call: FlatCall) -> Optional[str]:
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
        self.notes.extend(self._corner_notes(graph, call))
        options = self.engine.options
        if self.origin == "compiled" and options.autosave and options.store is not None:
            problem = self.save(options.store)
            if problem:
                self.notes.append(problem)
        return None

    def _obtain(self, call: FlatCall, bounds, key: GraphKey, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        registry = self.engine.registry
        options = self.engine.options
        family = key.family
        with registry.family_lock(family):
            for graph in registry.family_graphs(family):
                # a graph built for a narrower range would leave part of this one eager
                if graph.key.shape_range.covers(key.shape_range) and graph.why_not(call) is None:
                    registry.count_hit()
                    self.origin = graph.origin
                    return graph, None
            graph, why = self._load(family, call, key)
            if graph is not None:
                return graph, None
            if not options.compile_on_miss:
                return None, (why or "no stored graph serves this block") + "; compiling is off"
            known = self.engine.compile_failures.get(family.id)
            if known:
                return None, known + " (not retried)"
            try:
                backend = get_backend(options.backend)
            except BackendUnavailable as error:
                return None, str(error)
            if not backend.persistent or options.backend != "aot":
                return None, f"block graphs are built with the aot backend, not {options.backend}"
            refused = self.engine.family.why_not_compiled(self.group.modules[0])
            if refused:
                self.engine.compile_failures[family.id] = f"not compiled: {refused}"
                return None, f"not compiled: {refused}"
            graph, elsewhere = self._claim(family, call, key, progress)
            if graph is not None:
                return graph, None
            if elsewhere is not None:
                self.elsewhere = (call, bounds, key, time.monotonic() + RECHECK_S)
                return None, elsewhere
            if options.background and not self.engine.ahead_of_time:
                building = self._build_in_background(call, bounds, key)
                if building is not None:
                    return None, building
            started = time.perf_counter()
            try:
                graph, notes = self.engine.exporter(
                    self.group.modules[0], call, bounds, key, progress,
                    check_unit_sizes=lambda candidate, units: self._check_unit_sizes(candidate, units, call),
                    forward=self.engine.family.block_forward, tracing=self.engine.family.tracing)
            except Exception as error:  # whatever export or AOTInductor raises: this block runs eager
                text = str(error) if isinstance(error, CompileFailed) else f"{type(error).__name__}: {error}"
                reason = f"compile failed: {text}"
                self.engine.compile_failures[family.id] = reason
                log.warning("%s: %s", self.label, reason)
                return None, reason
            self.compile_s = time.perf_counter() - started
            self.notes.extend(notes)
            registry.add(graph)
            registry.record(COMPILE, family, f"{self.label}: first call for this block structure and input structure",
                            seconds=self.compile_s, graph_id=graph.key.id,
                            detail={"block": self.group.class_name, "instances": len(self.instances),
                                    "shapes": [list(s) for s in call.shapes], "parameters": self.group.parameter_count()})
            self.origin = "compiled"
            return graph, None

    # -- claims on a shared graphs folder (compiler/build_claims.py) --------
    def _claim(self, family: FamilyKey, call: FlatCall, key: GraphKey,
               progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """Claim the structure's build in the store its graph will be written to (`self.claim`): (None, None)
        to build here; (graph, None) when another process's build was waited for and is now in the store;
        (None, why) in background mode while another process holds the claim (its instances run eager).
        Nothing is claimed when the graph will not be written (no store, or autosave off)."""
        options = self.engine.options
        if options.store is None or not options.autosave:
            return None, None
        path = options.store.claim_path(family)
        if options.background and not self.engine.ahead_of_time:
            result = build_claims.try_claim(path)
            if isinstance(result, build_claims.Taken):
                log.info("%s: %s", self.label, result.reason())
                return None, result.reason()
            self.claim = result
            return None, None
        waited = []

        def waiting(taken: build_claims.Taken) -> None:
            waited.append(taken)
            log.info("%s: waiting: %s", self.label, taken.reason())
            progress(f"waiting for {taken.holder.describe()}, which builds this graph", 0.0)

        result = build_claims.claim_or_wait(path, on_wait=waiting)
        if waited:
            graph, _ = self._load(family, call, key)
            if graph is not None:
                build_claims.release(result)
                return graph, None
        if isinstance(result, build_claims.Taken):
            log.warning("%s: still %s after %.0f s; building it here too", self.label, result.reason(),
                        build_claims.wait_seconds())
            return None, None
        self.claim = result
        return None, None

    def _release_claim(self) -> None:
        claim, self.claim = self.claim, None
        build_claims.release(claim)

    def look_again(self, wait: bool = False) -> bool:
        """While another process builds this structure's graph: look in the store again (at most once per
        RECHECK_S unless `wait`), loading the graph once it is there, or claiming and building it here
        when the other build ended without one. True when the block now serves from a graph."""
        elsewhere = self.elsewhere
        if elsewhere is None:
            return self.ready
        call, bounds, key, due = elsewhere
        if not wait and time.monotonic() < due:
            return False
        self.elsewhere = None
        engine = self.engine
        ahead = engine.ahead_of_time
        engine.ahead_of_time = ahead or wait  # waiting: block on the claim, build here if needed
        try:
            graph, why = self._obtain(call, bounds, key, lambda *_: None)
            self.reason = why if graph is None else self._adopt(graph, call)
        except Exception as error:  # noqa: BLE001 - the block stays eager with the reason
            self.reason = f"preparing its graph failed: {type(error).__name__}: {error}"
        finally:
            engine.ahead_of_time = ahead
            if self.pending is None:
                self._release_claim()
        if self.reason is not None:
            self.graph = None
            self.record_fallback(self.reason)
        return self.reason is None

    # -- background builds (docs/background.md) -----------------------------
    def _build_in_background(self, call: FlatCall, bounds, key: GraphKey) -> Optional[str]:
        """Trace the block now, build its package in a child process: the reason its instances run eager
        meanwhile, or None where it must be built in this process (`BuildInProcess`, logged)."""
        family = key.family
        try:
            with third_party_quiet():
                self.pending = BlockBuild(self.group.modules[0], call, bounds, key,
                                          BuildLabel(owner=self.engine.label, what=f"block {self.group.class_name}",
                                                     family=family.id, owner_id=f"{self.engine.label}@{id(self.engine):x}"),
                                          forward=self.engine.family.block_forward, tracing=self.engine.family.tracing)
        except BuildInProcess as why:
            log.info("%s: building in this process: %s", self.label, why)
            return None
        except Exception as error:  # whatever export raises: this block runs eager
            text = str(error) if isinstance(error, CompileFailed) else f"{type(error).__name__}: {error}"
            reason = f"compile failed: {text}"
            self.engine.compile_failures[family.id] = reason
            return reason
        self.engine.builds.append(self.pending.build.cancel)
        self.engine.registry.record(PROGRESS, family, f"{self.label}: building in the background",
                                    detail={"fraction": 0.0, "background": True, "block": self.group.class_name})
        return BUILDING

    def land(self) -> bool:
        """Take in the background build if it finished: True when the block now serves from its graph.

        The graph is checked as a build in this process is (sizes of 1 against eager), recorded as a compile
        "built in the background", and its first call at new shapes gets the first-use check. A failed build
        leaves the block eager with the reason."""
        pending = self.pending
        if pending is None or not pending.done():
            return False
        self.pending = None
        engine, family, call = self.engine, self.family, pending.traced.call
        try:
            with stage("taking in a block graph built in the background"), third_party_quiet():
                graph, notes = package_block(pending.traced, pending.package(), check_unit_sizes=lambda candidate,
                                             units: self._check_unit_sizes(candidate, units, call))
        except Exception as error:  # noqa: BLE001 - a failed build costs speed only
            error = expected_failure(error)
            text = str(error) if isinstance(error, CompileFailed) else f"{type(error).__name__}: {error}"
            self.reason = engine.compile_failures[family.id] = f"compile failed: {text}"
            log.warning("%s: the background build failed: %s", self.label, self.reason)
            self._release_claim()
            return False
        self.compile_s = pending.seconds
        self.notes.extend(notes)
        engine.registry.add(graph)
        try:
            self._land_graph(graph, call, pending)
        finally:  # written (or not): others sharing the store may look now
            self._release_claim()
        return self.reason is None

    def _land_graph(self, graph: CompiledGraph, call: FlatCall, pending) -> None:
        engine, family = self.engine, self.family
        engine.registry.record(COMPILE, family, f"{self.label}: first call for this block structure and input "
                               "structure (built in the background)", seconds=self.compile_s, graph_id=graph.key.id,
                               detail={"block": self.group.class_name, "instances": len(self.instances),
                                       "shapes": [list(s) for s in call.shapes], "background": True,
                                       "parameters": self.group.parameter_count(), **pending.build.usage})
        self.origin = "compiled"
        self.reason = self._adopt(graph, call)
        if self.reason is not None:
            self.graph = None
            self.record_fallback(self.reason)

    def wait(self) -> bool:
        """Wait for the background build (or another process's), then take it in (Save Graph and warmup
        wait for their graphs)."""
        if self.elsewhere is not None:
            with self.lock:
                self.look_again(wait=True)
        if self.pending is None:
            return self.ready
        self.pending.wait()
        with self.lock:
            return self.land()

    def cancel(self) -> bool:
        """Stop the background build, if one runs; the block stays eager with that reason."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        pending.cancel()
        self._release_claim()
        self.reason = "its background build was cancelled"
        return True

    def _load(self, family: FamilyKey, call: FlatCall, key: GraphKey) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        store = self.engine.options.store
        if store is None:
            return None, None
        registry = self.engine.registry
        try:
            stored, notes = store.lookup(family, call)
        except OSError as error:
            return None, f"graphs folder {store.root} cannot be read: {error}"
        for note in notes:
            registry.record(REFUSED, family, f"{self.label}: {note}")
        if stored is None:
            return None, notes[0] if notes else None
        have = stored.manifest.key.shape_range
        if not have.covers(key.shape_range) and self.engine.options.compile_on_miss:
            why = (f"stored graph {stored.name} was built for {have.describe()}, narrower than "
                   f"{key.shape_range.describe()}")
            registry.record(REFUSED, family, f"{self.label}: {why}; compiling for the declared range")
            return None, why
        started = time.perf_counter()
        try:
            graph = store.load(stored, family)
        except GraphRefused as error:
            registry.record(REFUSED, family, f"{self.label}: {error}", graph_id=stored.manifest.graph_id)
            return None, str(error)
        registry.add(graph)
        registry.record(LOAD, family, f"{self.label}: loaded {stored.name} from {store.root}",
                        seconds=time.perf_counter() - started, graph_id=graph.key.id)
        self.origin = "loaded"
        return graph, None

    def _check_unit_sizes(self, candidate: CompiledGraph, units: Dict[str, Tuple[int, int]],
                          call: FlatCall) -> Optional[str]:
        """None if the graph gives the block's eager result where the range's sizes of 1 are.

        The probe call's inputs are cut down to size 1 along those roles (all of
        them at once, then each alone) and run both ways; values do not matter,
        the same inputs go to both. Agreement is the first-use check's
        (`compiler.verify.compare`, the output dtype's tolerance).
        """
        instance = self.instances[0]
        paths = call.tensor_paths
        at_one = sorted({self.roles[paths[leaf]][dim].partition("+")[0] for leaf, dim in units.values()})
        probe = self.engine.probe_counts[0]
        variants = [at_one] + ([[role] for role in at_one] if len(at_one) > 1 else [])
        with torch.no_grad():
            for roles in variants:
                counts = dict(probe)
                counts.update({role: 1 for role in roles})
                counts = T.role_values({k: counts[k] for k in (T.BATCH, T.TOKENS, T.SEQUENCE)})
                shapes = T.shapes_at(call.shapes, paths, self.roles, counts)
                tensors = [_cut(t, shape) for t, shape in zip(call.tensors, shapes)]
                where = ", ".join(f"{role} 1" for role in roles)
                agreement = self._compare(candidate, instance, call, tensors)
                if agreement is None:
                    return f"the graph does not take {where}"
                if not agreement.ok:
                    return f"at {where} the graph differs from eager: {agreement.describe()}"
        return None

    def _compare(self, graph: CompiledGraph, instance: BlockInstance, call: FlatCall, tensors):
        args, kwargs = call.rebuild([t.contiguous() for t in tensors])
        flat = FlatCall(args, kwargs, role_policy=lambda path, tensor: self.roles.get(path, {}))
        if graph.why_not(flat) is not None:
            return None
        # bound as a served call binds (the family's per-call tensors included), not by the module's own tensors
        weights = InstanceWeights(instance.module, self.engine.family.call_tensors)
        output = SharedRunner(graph).run(weights, flat.tensors, call.rebuild)
        return compare(output, instance.eager(args, kwargs))

    def _corner_notes(self, graph: CompiledGraph, call: FlatCall) -> List[str]:
        """Range corners the graph's guards exclude (they will run eager), read without running it."""
        block_range = self.engine.block_range
        notes = []
        corners = {}
        for batch in block_range.batch:
            for tokens in block_range.tokens:
                for text in block_range.sequence:
                    corners[(batch, tokens, text)] = T.role_values({T.BATCH: batch, T.TOKENS: tokens, T.SEQUENCE: text})
        for (batch, tokens, text), counts in corners.items():
            shapes = T.shapes_at(call.shapes, call.tensor_paths, self.roles, counts)
            try:
                failure = graph.why_not(_Shapes(shapes, call.tensor_paths))
            except Exception as error:
                failure = f"its guards cannot be checked ({type(error).__name__}: {error})"
            if failure:
                notes.append(f"batch {batch}, {tokens} image tokens, {text} text tokens: {failure}")
        return notes

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

    def _weights_for(self, instance: BlockInstance) -> Tuple[Optional[InstanceWeights], Optional[str]]:
        weights = instance.weights
        if weights is None:
            weights = instance.weights = InstanceWeights(instance.module, self.engine.family.call_tensors)
        weights.check()
        if instance.checked_version != weights.version:
            device, dtype = weights.device_and_dtype()
            reason = None
            if device is not None and self._device is not None and device != self._device:
                reason = f"its weights are on {device}, its graph runs on {self._device} (offloaded?)"
            elif dtype is not None and self._dtype is not None and dtype != self._dtype:
                reason = f"its weights are {dtype_name(dtype)}, its graph is for {dtype_name(self._dtype)}"
            instance.weights_reason = reason
            instance.checked_version = weights.version
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
        if not self.ready and self.pending is not None:
            with self.lock:
                self.land()
        elif not self.ready and self.elsewhere is not None and time.monotonic() >= self.elsewhere[3]:
            with self.lock:
                self.look_again()
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
            weights, reason = self._weights_for(instance)
        if reason:
            return None, reason, cache_key, None
        copies = snapshot(args, kwargs) if engine.options.verify and verdict is None else None
        running = f"running graph {self.graph.key.id}"
        try:
            with stage(running):
                return self.runner.run(weights, tensors, self.call_template.rebuild), None, cache_key, copies
        except Failure as failure:  # a graph that breaks at run time is not used again in this process
            self.reason = str(failure)
            raise

    def _why_not(self, shapes, dtypes) -> Optional[str]:
        template = self.call_template
        for path, want, have in zip(template.tensor_paths, self._dtypes, dtypes):
            if want != have:
                return f"{path} is {dtype_name(have)}, its graph takes {dtype_name(want)}"
        return self.graph.why_not(_Shapes(shapes, template.tensor_paths))

    def _structure_difference(self, args, kwargs) -> str:
        try:
            now = FlatCall(args, kwargs).signature
        except UnsupportedCall as error:
            return str(error)
        then = self.call_template.signature
        return (f"its input structure differs from the prepared one ({now.describe()} vs "
                f"{then.describe()}); not compiled for it")
