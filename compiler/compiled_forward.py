"""The call-time dispatcher that stands in for a module's forward.

Each call: flatten it, build its family key, take a graph from the registry,
else from the graph store, else compile one (once per family and region, with
progress and a stated reason), and run it with the module's own weights.
Anything a graph cannot serve -- an unsupported input, a shape outside the
declared range, a refused or broken graph, a failed compile -- runs eagerly
with the reason recorded, so the caller always gets a correct result.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .backends import DEFAULT_BACKEND, BackendUnavailable, CompiledGraph, CompileFailed, get_backend
from .backends.base import CompileDeferred, GraphMismatch, GuardsUnknown, Progress, range_failure
from .environment import device_kind, dtype_name, torch_version
from .flat_module import ForwardFn
from .keys import FamilyKey, GraphKey
from .probes import corner_targets, reshape_call
from .registry import COMPILE, FALLBACK, LOAD, PROGRESS, REFUSED, GraphRegistry, default_registry
from .shapes import DEFAULT_RANGE, ShapeRange, leaf_bounds
from .signature import FlatCall, RolePolicy, UnsupportedCall
from .store import GraphRefused, GraphStore, StoreError
from .structure import architecture_name, module_device, module_dtype, structure_hash

log = logging.getLogger("keepfast")


@dataclass
class CompileOptions:
    backend: str = DEFAULT_BACKEND
    shape_range: ShapeRange = DEFAULT_RANGE
    compile_on_miss: bool = True
    store: Optional[GraphStore] = None
    autosave: bool = False
    cover_range: bool = True
    role_policy: Optional[RolePolicy] = None
    normalise: Optional[Callable[[tuple, dict], Tuple[tuple, dict]]] = None
    label: str = ""

    def with_(self, **changes) -> "CompileOptions":
        return replace(self, **changes)


class CompiledForward:
    """Callable with a module's forward signature; see the module docstring."""

    is_keepfast_dispatcher = True

    def __init__(
        self,
        module: torch.nn.Module,
        options: Optional[CompileOptions] = None,
        registry: Optional[GraphRegistry] = None,
        forward_fn: Optional[ForwardFn] = None,
    ):
        self.module = module
        self.options = options or CompileOptions()
        self.registry = registry or default_registry()
        self.forward_fn: ForwardFn = forward_fn or type(module).forward
        self.label = self.options.label or architecture_name(module)
        self._structure: Optional[Tuple[tuple, str]] = None
        self._settled: Dict[tuple, Tuple[int, str]] = {}
        self._compile_failed: Dict[str, str] = {}  # family id -> why; not retried in this process
        self._declared: Dict[str, set] = {}  # family id -> input shapes a warmup asked graphs for
        self.last_status: str = "not run yet"
        self.eager_calls = 0
        self.graph_calls = 0

    # -- keys ---------------------------------------------------------------
    def structure(self) -> str:
        shapes = tuple((name, tuple(p.shape)) for name, p in self.module.named_parameters())
        if self._structure is None or self._structure[0] != shapes:
            self._structure = (shapes, structure_hash(self.module))
        return self._structure[1]

    def family_for(self, call: FlatCall, backend: Optional[str] = None) -> FamilyKey:
        return FamilyKey(
            architecture=architecture_name(self.module),
            structure=self.structure(),
            signature=call.signature.id,
            dtype=dtype_name(module_dtype(self.module)),
            device=device_kind(module_device(self.module)),
            backend=backend or self.options.backend,
            torch_version=torch_version(),
        )

    def flatten(self, args: tuple, kwargs: dict) -> FlatCall:
        if self.options.normalise is not None:
            args, kwargs = self.options.normalise(args, kwargs)
        return FlatCall(args, kwargs, self.options.role_policy)

    # -- calling ------------------------------------------------------------
    def eager(self, *args, **kwargs) -> Any:
        return self.forward_fn(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs) -> Any:
        try:
            call = self.flatten(args, kwargs)
        except UnsupportedCall as error:
            return self._fallback(None, str(error), args, kwargs)
        family = self.family_for(call)
        served, output, why = self._run_existing(family, call)
        if not served:
            graph, why = self.obtain(family, call, why)
            if graph is not None:
                served, output, why = self._run_existing(family, call)
        if not served:
            return self._fallback(family, why or "no graph", args, kwargs)
        self.graph_calls += 1
        return output

    def _run_existing(self, family: FamilyKey, call: FlatCall) -> Tuple[bool, Any, Optional[str]]:
        """Run the call on the first graph of the family that serves it: (served, output, why not)."""
        why = None
        for _ in range(len(self.registry.family_graphs(family)) + 1):
            graph, reason = self.registry.find(family, call)
            if graph is None:
                return False, None, why or reason
            try:
                output = graph.run(self.module, call)
            except GraphMismatch as mismatch:  # the graph now knows; try the next one
                why = str(mismatch)
                continue
            except Exception as error:  # a graph that breaks at run time must not break the run
                return False, None, f"graph {graph.key.id} failed at run time: {error}"
            self.last_status = f"{graph.origin} graph"
            return True, output, None
        return False, None, why

    def _fallback(self, family: Optional[FamilyKey], reason: str, args, kwargs) -> Any:
        self.eager_calls += 1
        if self.last_status != "eager: " + reason:
            self.registry.record(FALLBACK, family or "-", f"{self.label}: {reason}; running eager")
            log.info("%s runs eager: %s", self.label, reason)
        self.last_status = "eager: " + reason
        return self.eager(*args, **kwargs)

    # -- getting a graph ------------------------------------------------------
    def obtain(self, family: FamilyKey, call: FlatCall, why: Optional[str] = None,
               progress: Optional[Progress] = None) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """Load or compile a graph that serves `call`; (None, reason) if there is none."""
        settled_key = (family.id, tuple(call.shapes))
        settled = self._settled.get(settled_key)
        if settled and settled[0] == self.registry.generation:
            return None, settled[1]
        with self.registry.family_lock(family):
            graph, why = self.registry.find(family, call)
            if graph is not None:
                return graph, None
            graph, reason = self._load(family, call)
            if graph is None:
                try:
                    graph, reason = self._compile_for(family, call, reason or why, progress)
                except CompileDeferred as deferred:  # not settled: a later call may find room for it
                    return None, f"not compiled now: {deferred}"
        if graph is None:
            self._settled[settled_key] = (self.registry.generation, reason)
        return graph, reason

    def _load(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        store = self.options.store
        if store is None:
            return None, None
        try:
            stored, notes = store.lookup(family, call)
        except OSError as error:
            return None, f"graphs folder {store.root} cannot be read: {error}"
        for note in notes:
            self.registry.record(REFUSED, family, note)
        if stored is None:
            return None, notes[0] if notes else None
        started = time.perf_counter()
        try:
            graph = store.load(stored, family)
        except GraphRefused as error:
            self.registry.record(REFUSED, family, str(error), graph_id=stored.manifest.graph_id)
            log.warning("%s", error)
            return None, str(error)
        self.registry.add(graph)
        self.registry.record(LOAD, family, f"{self.label}: loaded {stored.name} from {store.root}",
                             seconds=time.perf_counter() - started, graph_id=graph.key.id)
        return graph, None

    def _compile_for(self, family, call, why, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """(graph, None) or (None, why not); a backend's CompileDeferred passes through."""
        options = self.options
        if not options.compile_on_miss:
            return None, (why or "no stored graph serves this input") + "; compiling is off"
        bounds = leaf_bounds(call.shapes, [t.dims for t in call.signature.tensors], options.shape_range)
        outside = range_failure(call.shapes, bounds, call.tensor_paths)
        if outside:
            return None, f"{outside} (declared range: {options.shape_range.describe()})"
        try:
            backend = get_backend(options.backend)
        except BackendUnavailable as error:
            return None, str(error)
        if family.id in self._compile_failed:
            return None, self._compile_failed[family.id] + " (not retried)"
        existing = self.registry.family_graphs(family)
        if len(existing) >= self._graph_limit(backend, family):
            return None, (f"{len(existing)} graphs already built for this input structure and none serves "
                          f"it ({why}); not compiling more")
        if existing:
            reason = f"no graph serves this input ({why})"
        elif why:
            reason = why
        else:
            reason = "first call for this model, dtype and input structure"
        graph, error = self._compile(backend, family, call, reason, progress)
        if graph is None:
            self._compile_failed[family.id] = error
            return None, error
        if options.cover_range and not backend.static_shapes:
            self._cover(backend, family, call, progress)
        return graph, None

    def _graph_limit(self, backend, family: FamilyKey) -> int:
        """Graphs one family may hold: the backend's bound, or as many shapes as warmups declared.

        A static-shape backend (oneflow) needs a graph per shape: a user who
        warms up 5 resolutions x 3 batch sizes asked for 15 graphs, and every one
        of those sizes must be served afterwards.
        """
        return max(backend.max_graphs_per_family, len(self._declared.get(family.id, ())))

    def _compile(self, backend, family, call, reason, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """(graph, None) or (None, why it failed); CompileDeferred (try again later) is raised."""
        key = GraphKey(family, self.options.shape_range)
        label = self.label

        def report(stage: str, fraction: float) -> None:
            self.registry.record(PROGRESS, family, f"{label}: {stage}", detail={"fraction": fraction})
            if progress:
                progress(stage, fraction)

        log.info("%s: compiling (%s)", label, reason)
        started = time.perf_counter()
        try:
            graph = backend.compile(self.module, self.forward_fn, call, key, report)
        except CompileDeferred as error:
            log.warning("%s: not compiled now: %s", label, error)
            raise
        except (CompileFailed, BackendUnavailable) as error:
            log.warning("%s: compile failed: %s", label, error)
            return None, f"compile failed: {error}"
        seconds = time.perf_counter() - started
        self.registry.add(graph)
        self.registry.record(COMPILE, family, f"{label}: {reason}", seconds=seconds, graph_id=graph.key.id,
                             detail={"shapes": [list(s) for s in call.shapes]})
        report("compiled", 1.0)
        if self.options.autosave and self.options.store is not None and graph.persistent:
            self.save_graph(graph, call)
        return graph, None

    def _cover(self, backend, family, call, progress) -> None:
        """Compile now for the range corners no graph serves, not in a later run.

        Whether a graph serves a corner is read from its guards, never by running
        it there (see CompiledGraph.guard_failure).
        """
        for batch, height, width in corner_targets(self.options.shape_range):
            probe = reshape_call(call, batch, height, width)
            if probe is None:
                continue
            try:
                why = self._guard_failure(family, probe)
            except GuardsUnknown as unknown:
                log.info("%s: range corners are compiled when first used: %s", self.label, unknown)
                return
            if why is None:
                continue
            if len(self.registry.family_graphs(family)) >= self._graph_limit(backend, family):
                return
            reason = f"range corner batch {batch}, latent {height}x{width} is not served ({why})"
            try:
                self._compile(backend, family, probe, reason, progress)
            except CompileDeferred:  # no room now: the corner compiles when first used
                return

    def _guard_failure(self, family: FamilyKey, call: FlatCall) -> Optional[str]:
        """None if a graph of the family serves the call, else why the first one does not."""
        why = None
        for graph in self.registry.family_graphs(family):
            failure = graph.guard_failure(self.module, call)
            if failure is None:
                return None
            why = why or failure
        return why or "no graph of this family"

    def save_graph(self, graph: CompiledGraph, call: Optional[FlatCall] = None) -> Optional[str]:
        """Write a graph into the store; returns the error message if it could not be."""
        store = self.options.store
        if store is None:
            return "no graphs folder was given"
        signature = call.signature.to_json() if call is not None else {}
        try:
            store.save(graph, signature)
        except StoreError as error:
            self.registry.record(REFUSED, graph.key.family, f"{self.label}: {error}")
            log.warning("%s", error)
            return str(error)
        return None

    # -- ahead of time --------------------------------------------------------
    def warmup(self, calls: Iterable[Tuple[tuple, dict]], progress: Optional[Progress] = None) -> List[str]:
        """Make sure a graph serves each example call; returns what happened for each."""
        results = []
        calls = [self.flatten(args, kwargs) for args, kwargs in calls]
        for call in calls:
            self._declared.setdefault(self.family_for(call).id, set()).add(tuple(map(tuple, call.shapes)))
        for call in calls:
            family = self.family_for(call)
            graph, why = self.registry.find(family, call)
            if graph is None:
                graph, why = self.obtain(family, call, why, progress)
            if graph is not None and not getattr(graph, "ready", True):
                graph.run(self.module, call)  # backends that build on first run (torch.compile)
            results.append("ready" if graph is not None else f"eager: {why}")
        return results
