"""The call-time dispatcher that stands in for a module's forward.

Each call: bind it to canonical inputs (the forward's own binder), build its
family key (one place: `expected_family`), take a graph from the registry,
else from the graph library, else compile one (once per family and region,
with progress and a stated reason), and run it with the module's own weights.
The first time a graph serves a set of input shapes, the call also runs
eagerly and the two are compared (`verify.py`, option `verify`): a graph that
disagrees is retired for those shapes and eager's output is returned.

`serve()` is the boundary (`boundary.py`, shared with the block server): whatever goes wrong inside --
binding, keys, guard checks, loading, export, AOTInductor, weight binding, a
graph's run -- the call runs eagerly and the result says why (recorded in the
event log once per change of reason). A bug in the pack can cost speed, never
an image. Only the eager function's own exceptions reach the caller.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from . import build_claims, build_cores
from .build_book import Building, book_key
from .backends import DEFAULT_BACKEND, BackendUnavailable, CompiledGraph, CompileFailed, get_backend
from .backends.base import (BuildInProcess, BuildLabel, CannotServe, CompileDeferred, GraphMismatch, GuardsUnknown,
                            PendingGraph, Progress, range_failure)
from .binding import CallBinder, CallDoesNotBind
from .boundary import Failure, contain, expected_failure, stage
from .flat_module import ForwardFn
from .input_casts import CastGraph
from .keys import FamilyKey, GraphKey
from .library import GraphLibrary
from .probes import corner_targets, reshape_call
from .quiet import third_party_quiet
from .registry import COMPILE, FALLBACK, MISMATCH, PROGRESS, GraphRegistry, default_registry
from .samples import CannotJoin, join_samples, samples_of
from .shapes import DEFAULT_RANGE, ShapeRange, leaf_bounds
from .signature import FlatCall, RolePolicy, UnsupportedCall
from .store import GraphRefused, GraphStore, StoreError
from .structure import architecture_name, module_device, module_dtype, structure_hash
from .verify import Snapshot, judge, retired_reason, snapshot

log = logging.getLogger("keepfast")

RECHECK_S = 1.0  # while another process builds a graph: how often calls look in the store again


@dataclass
class CompileOptions:
    backend: str = DEFAULT_BACKEND
    shape_range: ShapeRange = DEFAULT_RANGE
    compile_on_miss: bool = True
    store: Optional[GraphStore] = None
    autosave: bool = False
    cover_range: bool = True
    role_policy: Optional[RolePolicy] = None
    label: str = ""
    # What the calls are counted as in the event log ("unet", "vae", ...); empty: not counted.
    counter: str = ""
    # The device calls run on when it is not the module's current one (ComfyUI offloads models between runs).
    device: Optional[str] = None
    # The first-use check: a graph's first call with new input shapes is compared with eager (verify.py).
    verify: bool = True
    # The module computes each batch sample alone (a VAE): graphs are built from one sample, and a batch no
    # graph serves whole is served one sample at a time (samples.py).
    samples_independent: bool = False
    # Graphs build in a child process while calls run eager; each serves from the call after it lands
    # (docs/background.md).
    # Warmup and Save Graph still wait for theirs.
    background: bool = False

    def with_(self, **changes) -> "CompileOptions":
        return replace(self, **changes)


@dataclass(frozen=True)
class Served:
    """How one call was served: by which graph, or eagerly and why."""

    output: Any
    graph_id: Optional[str] = None
    origin: Optional[str] = None  # "compiled" or "loaded" when a graph served the call
    reason: Optional[str] = None  # why it ran eagerly

    @property
    def eager(self) -> bool:
        return self.graph_id is None

    def describe(self) -> str:
        return f"eager: {self.reason}" if self.eager else f"{self.origin} graph"


class _Retired(Exception):
    """The graph that serves these inputs disagreed with eager for them: they run eager, unchecked."""


class CompiledForward:
    """Callable with a module's forward signature; see the module docstring."""

    is_keepfast_dispatcher = True

    def __init__(
        self,
        module: torch.nn.Module,
        options: Optional[CompileOptions] = None,
        registry: Optional[GraphRegistry] = None,
        forward_fn: Optional[ForwardFn] = None,
        binder: Optional[CallBinder] = None,
    ):
        self.module = module
        self.options = options or CompileOptions()
        self.registry = registry or default_registry()
        self.forward_fn: ForwardFn = forward_fn or type(module).forward
        # The binder is the forward's, made once: no later option can change how calls are keyed.
        self.binder = binder or CallBinder(self.forward_fn)
        self.label = self.options.label or architecture_name(module)
        self._structure: Optional[Tuple[tuple, str]] = None
        self._settled: Dict[tuple, Tuple[int, str]] = {}
        self._compile_failed: Dict[str, str] = {}  # family id -> why; not retried in this process
        self._declared: Dict[str, set] = {}  # family id -> input shapes a warmup asked graphs for
        # family id -> the registry's book key of its graph's background build (build_book.py: the build is
        # the process's, kept while any module of its structure lives, and taken in by whoever calls first)
        self._building: Dict[str, str] = {}
        # family id -> (when to look again, why): another process builds its graph for the shared store
        self._elsewhere: Dict[str, Tuple[float, str]] = {}
        self._no_cast: set = set()  # family ids whose calls a graph with cast inputs served wrong (input_casts.py)
        self._blocking = 0  # inside warmup: builds are waited for
        self.last: Optional[Served] = None
        self.eager_calls = 0
        self.graph_calls = 0

    @property
    def library(self) -> GraphLibrary:
        return GraphLibrary(self.options.store, self.registry)

    @property
    def last_status(self) -> str:
        """The last call's outcome in words (for logs and messages; `last` is the typed result)."""
        return self.last.describe() if self.last is not None else "not run yet"

    # -- keys: the one path from a call to a key ------------------------------
    def structure(self) -> str:
        shapes = tuple((name, tuple(p.shape)) for name, p in self.module.named_parameters())
        if self._structure is None or self._structure[0] != shapes:
            self._structure = (shapes, structure_hash(self.module))
        return self._structure[1]

    def expected_family(self, signature: str, dtype: Optional[torch.dtype] = None) -> FamilyKey:
        """The family a graph needs to serve calls of `signature` to this module (in `dtype`, default its own)."""
        device = self.options.device or module_device(self.module)
        return FamilyKey.here(architecture_name(self.module), self.structure(), signature,
                              dtype or module_dtype(self.module), device, self.options.backend)

    def family_for(self, call: FlatCall) -> FamilyKey:
        return self.expected_family(call.signature.id)

    def graphs(self) -> List[CompiledGraph]:
        """The graphs in memory for this module's structure (any input structure, dtype or backend)."""
        structure = self.structure()
        return [graph for graph in self.registry.graphs() if graph.key.family.structure == structure]

    def flatten(self, args: tuple, kwargs: dict) -> FlatCall:
        """The call, bound and flattened: what keys and graphs see."""
        bound = self.binder.bind(args, kwargs)
        return FlatCall(*bound.args, self.options.role_policy)

    # -- calling ------------------------------------------------------------
    def eager(self, *args, **kwargs) -> Any:
        return self.forward_fn(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs) -> Any:
        return self.serve(args, kwargs).output

    def serve(self, args: tuple, kwargs: dict, eager: Optional[Callable[..., Any]] = None,
              eager_reason: Optional[str] = None) -> Served:
        """Serve one call from a graph, or run it eagerly and say why.

        `eager(*args, **kwargs)` is what runs when no graph can (default: the
        module's forward; ComfyUI's nodes pass the wrapper chain), and what the
        first-use check compares a graph with, on copies of the arguments.
        `eager_reason`: the caller already knows the call must run eagerly
        (a partly loaded model, an option a graph cannot take).
        """
        eager = eager or self.eager
        run_eager = lambda: eager(*args, **kwargs)  # noqa: E731
        family: Optional[FamilyKey] = None
        build_cores.share()
        if self._building:
            self.land_builds()
        if eager_reason is not None:
            return self._eager(None, eager_reason, run_eager)
        try:
            with stage("binding the call"):
                bound = self.binder.bind(args, kwargs)
                side_reason = self.binder.eager_reason(bound)
                call = FlatCall(*bound.args, self.options.role_policy) if side_reason is None else None
            if call is None:
                return self._eager(None, side_reason, run_eager)
            with stage("building the graph key"):
                family = self.family_for(call)
            served, why, copies = self._run_existing(family, call, args, kwargs)
            if served is None:
                graph, why = self.obtain(family, call, why)
                if graph is not None:
                    served, why, copies = self._run_existing(family, call, args, kwargs)
                    if served is None and self._samples(call):
                        served, why, copies = self._run_each_sample(family, call, args, kwargs)
        except _Retired as retired:
            return self._eager(family, str(retired), run_eager)
        except UnsupportedCall as error:
            return self._eager(family, str(error), run_eager)
        except CallDoesNotBind as error:
            return self._eager(family, f"the call does not fit {self.label}'s forward ({error})", run_eager)
        except Exception as error:  # noqa: BLE001 - the boundary: never an exception of ours out of a call
            failure = contain(self.label, error, "serving the call")
            return self._eager(family, str(failure), run_eager)
        if served is None:
            return self._eager(family, why or "no graph", run_eager)
        if copies is not None:
            served = self._checked(family, call, served, copies, eager)
            if served.eager:
                return served
        self.graph_calls += 1
        self._count("graph")
        self.last = served
        return served

    def _checked(self, family: FamilyKey, call: FlatCall, served: Served, copies: Snapshot,
                 eager: Callable[..., Any]) -> Served:
        """The first-use check (verify.py): eager on the copies taken before the graph ran, compared.

        A graph that disagrees gives way to eager's output (and eager's state of
        inputs the model updates in place), and the difference is recorded.
        """
        reference = eager(*copies.args, **copies.kwargs)  # the model's own errors reach the caller
        disagreement = judge(self.registry.verdicts, served.graph_id, tuple(call.shapes), served.output, reference)
        if disagreement is None:
            return served
        reason = retired_reason(served.graph_id, call.tensor_paths, call.shapes, disagreement)
        try:
            copies.restore()
        except Exception as error:  # noqa: BLE001 - the output is eager's either way
            reason += f" (its in-place updates of the inputs could not be undone: {error})"
        self.registry.record(MISMATCH, family, f"{self.label}: {reason}", graph_id=served.graph_id,
                             detail={"shapes": [list(shape) for shape in call.shapes],
                                     "relative": disagreement.relative, "max_abs": disagreement.max_abs,
                                     "nonfinite": disagreement.nonfinite})
        log.error("%s: %s", self.label, reason)
        self.eager_calls += 1
        self._count("eager")
        self.last = Served(reference, reason=reason)
        return self.last

    def _run_existing(self, family: FamilyKey, call: FlatCall, args: tuple,
                      kwargs: dict) -> Tuple[Optional[Served], Optional[str], Optional[Snapshot]]:
        """Run the call on the first graph of the family that serves it: (served, why not, copies).

        `copies`: the inputs as they were before the graph ran, when the
        first-use check is due for this graph and these shapes (else None).
        """
        why = None
        shapes = tuple(call.shapes)
        for _ in range(len(self.registry.family_graphs(family)) + 1):
            with stage("checking the graphs' shape guards"):
                graph, reason = self.registry.find(family, call)
            if graph is None:
                return None, why or reason, None
            verdict = self.registry.verdicts.get(graph.key.id, shapes)
            if verdict is not None and not verdict.ok:
                if isinstance(graph, CastGraph):  # the model does not cast these inputs as the graph does
                    self.registry.remove(graph.key.id)
                    self._no_cast.add(family.id)
                    why = f"{graph.describe_casts(call.tensor_paths)} disagreed with the model; its own graph is due"
                    continue
                raise _Retired(retired_reason(graph.key.id, call.tensor_paths, call.shapes, verdict))
            copies = snapshot(args, kwargs) if self.options.verify and verdict is None else None
            try:
                with stage(f"running graph {graph.key.id}"):
                    started = time.perf_counter()
                    output = graph.run(self.module, call)
                    self._timed("graph", started)
            except GraphMismatch as mismatch:  # the graph now knows; try the next one
                why = str(mismatch)
                continue
            except CannotServe as cannot:  # expected by the backend: eager, with its reason
                return None, f"graph {graph.key.id} cannot serve this call: {cannot}", None
            return Served(output, graph.key.id, graph.origin), None, copies
        return None, why, None

    def _samples(self, call: FlatCall) -> Optional[List[FlatCall]]:
        """The call as one call per sample where this module takes that (samples_independent), else None."""
        return samples_of(call) if self.options.samples_independent else None

    def _run_each_sample(self, family: FamilyKey, call: FlatCall, args: tuple,
                         kwargs: dict) -> Tuple[Optional[Served], Optional[str], Optional[Snapshot]]:
        """A batch no graph serves whole, served one sample at a time by the graph that serves one (samples.py).

        The first-use check is keyed by the batch's shapes (each new batch size is compared with eager once);
        a graph retired for one sample's shapes is retired for batches of them too.
        """
        samples = self._samples(call)
        with stage("checking the graphs' shape guards"):
            graph, reason = self.registry.find(family, samples[0])
        if graph is None:
            return None, reason, None
        verdicts = self.registry.verdicts
        for probe in (samples[0], call):
            verdict = verdicts.get(graph.key.id, tuple(probe.shapes))
            if verdict is not None and not verdict.ok:
                raise _Retired(retired_reason(graph.key.id, probe.tensor_paths, probe.shapes, verdict))
        due = self.options.verify and verdicts.get(graph.key.id, tuple(call.shapes)) is None
        copies = snapshot(args, kwargs) if due else None
        try:
            with stage(f"running graph {graph.key.id} one sample at a time"):
                started = time.perf_counter()
                output = join_samples([graph.run(self.module, sample) for sample in samples])
                self._timed("graph", started)
        except GraphMismatch as mismatch:
            return None, str(mismatch), None
        except CannotServe as cannot:
            return None, f"graph {graph.key.id} cannot serve this call one sample at a time: {cannot}", None
        except CannotJoin as error:
            return None, f"the samples' outputs of graph {graph.key.id} do not join into a batch: {error}", None
        return Served(output, graph.key.id, graph.origin), None, copies

    def _eager(self, family: Optional[FamilyKey], reason: str, run_eager: Callable[[], Any]) -> Served:
        self.eager_calls += 1
        self._count("eager")
        if self.last is None or self.last.reason != reason:  # recorded once per change of reason
            self.registry.record(FALLBACK, family or "-", f"{self.label}: {reason}; running eager")
            log.info("%s runs eager: %s", self.label, reason)
        started = time.perf_counter()
        served = Served(run_eager(), reason=reason)
        self._timed("eager", started)
        self.last = served
        return served

    def _count(self, outcome: str) -> None:
        if self.options.counter:
            self.registry.log.count(f"{self.options.counter}.{outcome}")

    def _timed(self, outcome: str, started: float) -> None:
        if self.options.counter:
            self.registry.log.add_time(f"{self.options.counter}.{outcome}", time.perf_counter() - started)

    # -- getting a graph ------------------------------------------------------
    def obtain(self, family: FamilyKey, call: FlatCall, why: Optional[str] = None,
               progress: Optional[Progress] = None) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """Load or compile a graph that serves `call`; (None, reason) if there is none.

        For a module whose samples are independent the graph is had for the call's first sample: it serves
        the call one sample at a time, or whole where its guards accept the batch.
        """
        samples = self._samples(call)
        call = samples[0] if samples else call
        settled_key = (family.id, tuple(call.shapes))
        settled = self._settled.get(settled_key)
        if settled and settled[0] == self.registry.generation:
            return None, settled[1]
        with self.registry.family_lock(family):
            with stage("checking the graphs' shape guards"):
                graph, why = self.registry.find(family, call)
            if graph is not None:
                return graph, None
            elsewhere = self._elsewhere.get(family.id)
            if elsewhere is not None and not self._blocking and time.monotonic() < elsewhere[0]:
                return None, f"not compiled now: {elsewhere[1]}"
            with stage("loading a stored graph"):
                graph, reason = self._load(family, call)
            if graph is None and family.id not in self._no_cast:
                with stage("looking for a graph that takes this call with its inputs cast"):
                    graph = self.library.cast_sibling(family, call, self.label)
                if graph is not None:
                    note = (f"served by {graph.describe_casts(call.tensor_paths)}, as the model casts them itself "
                            "(the first call of each size is compared with the model's own output)")
                    log.info("%s: %s", self.label, note)
                    self.registry.record(PROGRESS, family, f"{self.label}: {note}", detail={"fraction": 1.0})
            if graph is None:
                try:
                    graph, reason = self._compile_for(family, call, reason or why, progress)
                except CompileDeferred as deferred:  # not settled: a later call may find room for it
                    return None, f"not compiled now: {deferred}"
        if graph is None:
            self._settled[settled_key] = (self.registry.generation, reason)
        return graph, reason

    def _load(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        library = self.library
        stored, why = library.lookup(family, call)
        if stored is None:
            return None, why
        try:
            return library.load(stored, family, self.label), None
        except GraphRefused as error:
            return None, str(error)

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
        graph, why = self._from_the_book(family, call, wait=self._blocking > 0 or not options.background)
        if graph is not None or why is not None:
            return graph, why
        claim, graph = self._claim(family, call, progress)
        if graph is not None:
            return graph, None
        if options.background and not self._blocking:
            return self._build_in_background(backend, family, call, reason, claim)
        try:
            graph, error = self._compile(backend, family, call, reason, progress)
            if graph is None:
                self._compile_failed[family.id] = error
                return None, error
            if options.cover_range and not backend.static_shapes:
                self._cover(backend, family, call, progress)
            return graph, None
        finally:
            build_claims.release(claim)

    # -- claims on a shared graphs folder (build_claims.py) --------------------
    def _claim(self, family: FamilyKey, call: FlatCall,
               progress: Optional[Progress]) -> Tuple[Optional[build_claims.Claim], Optional[CompiledGraph]]:
        """Claim the family's build in the store this graph will be written to: (claim or None, None), or
        (None, graph) when another process's build of it was waited for and is now in the store.

        Background builds do not wait: CompileDeferred, and the call runs eager with the holder named; the
        store is looked at again from the call RECHECK_S later on. Nothing is claimed when the graph will
        not be written (no store, or autosave off): nobody else could load it."""
        store = self.options.store
        if store is None or not self.options.autosave:
            return None, None
        path = store.claim_path(family)
        if self.options.background and not self._blocking:
            result = build_claims.try_claim(path)
            if isinstance(result, build_claims.Taken):
                reason = result.reason()
                if family.id not in self._elsewhere:
                    log.info("%s: %s", self.label, reason)
                self._elsewhere[family.id] = (time.monotonic() + RECHECK_S, reason)
                raise CompileDeferred(reason)
            self._elsewhere.pop(family.id, None)
            return result, None

        def waiting(taken: build_claims.Taken) -> None:
            log.info("%s: waiting: %s", self.label, taken.reason())
            self.registry.record(PROGRESS, family, f"{self.label}: waiting: {taken.reason()}",
                                 detail={"fraction": 0.0})
            if progress:
                progress(f"waiting for {taken.holder.describe()}, which builds this graph", 0.0)

        waited = []
        result = build_claims.claim_or_wait(path, on_wait=lambda taken: (waited.append(taken), waiting(taken)))
        if waited:
            graph, _ = self._load(family, call)
            if graph is not None:
                build_claims.release(result)
                return None, graph
        if isinstance(result, build_claims.Taken):
            log.warning("%s: still %s after %.0f s; building it here too", self.label,
                        result.reason(), build_claims.wait_seconds())
            return None, None
        return result, None

    # -- background builds ---------------------------------------------------
    def _build_in_background(self, backend, family: FamilyKey, call: FlatCall, reason: str,
                             claim: Optional[build_claims.Claim] = None):
        """Start the family's build in a child process and run this call eager (CompileDeferred: not settled,
        a later call finds the graph once it lands). A backend that cannot build off the caller's process
        compiles now, as without the option."""
        key = GraphKey(family, self.options.shape_range)
        log.info("%s: building in the background (%s)", self.label, reason)
        try:
            with third_party_quiet():
                pending = backend.start_compile(self.module, self.forward_fn, call, key, BuildLabel(
                    owner=self.label, what=self.label, family=family.id, owner_id=self._owner_id))
        except (BackendUnavailable, BuildInProcess) as why:
            log.info("%s: building in this process: %s", self.label, why)
            try:
                graph, error = self._compile(backend, family, call, reason, None)
            finally:
                build_claims.release(claim)
            if graph is None:
                self._compile_failed[family.id] = error
            return graph, error
        except Exception as error:  # noqa: BLE001 - tracing failed: as a failed compile
            build_claims.release(claim)
            failure = f"compile failed: {error}" if isinstance(error, CompileFailed) else \
                f"compile failed: {type(error).__name__}: {error}"
            self._compile_failed[family.id] = failure
            return None, failure
        key = self._book_key(family)
        self.registry.builds.add(key, Building(pending, family, call, reason, claim, self._owner_id), self.module)
        self._building[family.id] = key
        self.registry.record(PROGRESS, family, f"{self.label}: building in the background ({reason})",
                             detail={"fraction": 0.0, "background": True})
        raise CompileDeferred("its graph is building in the background; this call runs eager")

    @property
    def _owner_id(self) -> str:
        return f"{self.label}@{id(self):x}"

    def _book_key(self, family: FamilyKey) -> str:
        return book_key(family, self.options.shape_range)

    def _from_the_book(self, family: FamilyKey, call: FlatCall,
                       wait: bool) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """A background build of this family's graph that the process already has (started by this wrapper or by
        another one of a module of this structure: build_book.py): its graph once taken in (at once when it has
        finished; waited for when `wait`), CompileDeferred (the call runs eager) while it builds, or (None, its
        failure); (None, None) when there is none."""
        key = self._book_key(family)
        book = self.registry.builds
        failure = book.failure(key)
        if failure is not None:
            return None, failure + " (not retried)"
        building = book.adopt(key, self.module)
        if building is None:
            return None, None
        if family.id not in self._building:
            self._building[family.id] = key
            if building.started_by != self._owner_id:
                log.info("%s: adopting the background build of its graph started earlier (%.0f s so far)",
                         self.label, building.pending.seconds)
                self.registry.record(PROGRESS, family, f"{self.label}: adopted the background build of its graph, "
                                     f"started earlier for this model ({building.pending.seconds:.0f} s so far)",
                                     detail={"fraction": 0.0, "background": True, "adopted": True})
        if wait or building.pending.done():
            self.wait_for_builds()
            graph, _ = self.registry.find(family, call)
            if graph is not None:
                return graph, None
            failure = self._compile_failed.get(family.id)
            return (None, failure) if failure else (None, None)  # it landed and does not serve this call
        raise CompileDeferred(f"its graph is building in the background ({building.pending.seconds:.0f} s so far)")

    def land_builds(self) -> int:
        """Take in the background builds of this wrapper's families that finished (whoever started them): their
        graphs serve calls from now on (the first-use check applies to each). A failed build leaves its inputs
        eager with the reason, here and for every other wrapper. Returns how many landed."""
        landed = 0
        book = self.registry.builds
        for family_id, key in list(self._building.items()):
            if book.get(key) is None:  # taken in by another wrapper, or cancelled
                del self._building[family_id]
                failure = book.failure(key)
                if failure is not None:
                    self._compile_failed[family_id] = failure
                continue
            building = book.take(key)
            if building is None:  # still building
                continue
            del self._building[family_id]
            family = building.family
            try:
                try:
                    with stage("taking in a graph built in the background"), third_party_quiet():
                        graph = building.pending.finish(self.module)
                except Exception as error:  # noqa: BLE001 - the boundary: a failed build costs speed only
                    error = expected_failure(error)
                    why = f"compile failed: {error}" if isinstance(error, CompileFailed) else \
                        f"compile failed: {type(error).__name__}: {error}"
                    self._compile_failed[family_id] = why
                    book.fail(key, why)
                    log.warning("%s: the background build failed: %s", self.label, why)
                    continue
                self.registry.add(graph)
                self.registry.note_signature(family.signature, building.call.signature.to_json())
                whose = "" if building.started_by == self._owner_id else ", started earlier for this model"
                self.registry.record(COMPILE, family, f"{self.label}: {building.reason} (built in the background"
                                     f"{whose})", seconds=building.pending.seconds, graph_id=graph.key.id,
                                     detail={"shapes": [list(s) for s in building.call.shapes], "background": True,
                                             "adopted": bool(whose), **building.pending.usage,
                                             **getattr(graph, "build_usage", {})})
                if self.options.autosave and self.options.store is not None and graph.persistent:
                    self.save_graph(graph, building.call)
            finally:  # written (or failed): others sharing the store may look now
                build_claims.release(building.claim)
            landed += 1
        return landed

    def wait_for_builds(self, timeout: Optional[float] = None) -> int:
        """Wait until every background build of this wrapper's families has finished (or `timeout` s passed),
        then land them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        book = self.registry.builds

        def running() -> bool:
            return any((b := book.get(key)) is not None and not b.pending.done() for key in self._building.values())

        while running():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return self.land_builds()

    def cancel_builds(self) -> int:
        """Stop every background build of this wrapper's families (stopping the workflow); returns how many."""
        keys, self._building = list(self._building.values()), {}
        return sum(self.registry.builds.cancel(key) for key in keys)

    @property
    def builds_pending(self) -> int:
        book = self.registry.builds
        return sum(1 for key in self._building.values() if book.get(key) is not None)

    def _graph_limit(self, backend, family: FamilyKey) -> int:
        """Graphs one family may hold: the backend's bound, or as many shapes as warmups declared.

        A static-shape backend (oneflow) needs a graph per shape: a user who
        warms up 5 resolutions x 3 batch sizes asked for 15 graphs, and every one
        of those sizes must be served afterwards.
        """
        return max(backend.max_graphs_per_family, len(self._declared.get(family.id, ())))

    def _compile(self, backend, family, call, reason, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """(graph, None) or (None, why it failed); CompileDeferred (try again later) is raised.

        Any exception out of the backend is a failed compile, with its type and
        message as the reason: a bug in export or AOTInductor costs speed only.
        """
        key = GraphKey(family, self.options.shape_range)
        label = self.label

        def report(stage: str, fraction: float) -> None:
            self.registry.record(PROGRESS, family, f"{label}: {stage}", detail={"fraction": fraction})
            if progress:
                progress(stage, fraction)

        log.info("%s: compiling (%s)", label, reason)
        started = time.perf_counter()
        try:
            with third_party_quiet():  # the notices torch prints while it compiles are not the user's business
                graph = backend.compile(self.module, self.forward_fn, call, key, report)
        except CompileDeferred as error:
            log.warning("%s: not compiled now: %s", label, error)
            raise
        except (CompileFailed, BackendUnavailable) as error:
            log.warning("%s: compile failed: %s", label, error)
            return None, f"compile failed: {error}"
        except Exception as error:  # noqa: BLE001 - the boundary: anything the compiler raises
            log.warning("%s: compile failed unexpectedly: %s: %s", label, type(error).__name__, error)
            log.debug("%s: traceback of the failed compile", label, exc_info=True)
            return None, f"compile failed: {type(error).__name__}: {error}"
        seconds = time.perf_counter() - started
        self.registry.add(graph)
        self.registry.note_signature(family.signature, call.signature.to_json())
        self.registry.record(COMPILE, family, f"{label}: {reason}", seconds=seconds, graph_id=graph.key.id,
                             detail={"shapes": [list(s) for s in call.shapes], **getattr(graph, "build_usage", {})})
        report("compiled", 1.0)
        if self.options.autosave and self.options.store is not None and graph.persistent:
            self.save_graph(graph, call)
        return graph, None

    def _cover(self, backend, family, call, progress) -> None:
        """Compile now for the range corners no graph serves, not in a later run.

        Whether a graph serves a corner is read from its guards, never by running
        it there (see CompiledGraph.guard_failure).
        """
        shape_range = self.options.shape_range
        if self.options.samples_independent:  # batches are served by the graphs of one sample
            shape_range = replace(shape_range, batch=(shape_range.batch[0], shape_range.batch[0]))
        for batch, height, width in corner_targets(shape_range):
            probe = reshape_call(call, batch, height, width)
            if probe is None:
                continue
            try:
                with stage("checking the range corners' guards"):
                    why = self._guard_failure(family, probe)
            except GuardsUnknown as unknown:
                log.info("%s: range corners are compiled when first used: %s", self.label, unknown)
                return
            except Failure as failure:  # the corners then compile when first used
                log.warning("%s: %s", self.label, failure)
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
        signature = call.signature.to_json() if call is not None else {}
        try:
            self.library.save(graph, signature, self.label)
        except StoreError as error:
            return str(error)
        return None

    # -- ahead of time --------------------------------------------------------
    def start_builds(self, calls: Iterable[Tuple[tuple, dict]]) -> int:
        """Start the background builds of graphs these example calls need (none is waited for, none runs);
        returns how many started. Without background builds, a no-op: warmup() is the waiting kind."""
        if not self.options.background:
            return 0
        started = 0
        for args, kwargs in calls:
            try:
                call = self.flatten(args, kwargs)
                family = self.family_for(call)
                if self.registry.find(family, call)[0] is not None or family.id in self._building:
                    continue
                before = len(self._building)
                self.obtain(family, call, "a state the declared range meets, built ahead")
                started += len(self._building) - before
            except Exception as error:  # noqa: BLE001 - ahead of time only: the call itself tries again
                log.info("%s: not built ahead: %s", self.label, error)
        return started

    def warmup(self, calls: Iterable[Tuple[tuple, dict]], progress: Optional[Progress] = None) -> List[Served]:
        """Make sure a graph serves each example call; one result per call (output None).

        Never raises for a graph that cannot be had: the result says why.
        """
        self._blocking += 1
        try:
            self.wait_for_builds()  # a build already started for these inputs lands first
            return self._warmup(calls, progress)
        finally:
            self._blocking -= 1

    def _warmup(self, calls, progress) -> List[Served]:
        results = []
        flat: List[Tuple[Optional[FlatCall], Optional[str]]] = []
        for args, kwargs in calls:
            try:
                with stage("binding the call"):
                    flat.append((self.flatten(args, kwargs), None))
            except (UnsupportedCall, CallDoesNotBind, Failure) as error:
                flat.append((None, str(error)))
        for call, _ in flat:
            if call is not None:
                self._declared.setdefault(self.family_for(call).id, set()).add(tuple(map(tuple, call.shapes)))
        for call, problem in flat:
            if call is None:
                results.append(Served(None, reason=problem))
                continue
            try:
                results.append(self._ready(call, progress))
            except Exception as error:  # noqa: BLE001 - the boundary, as in serve()
                failure = contain(self.label, error, "warming up")
                results.append(Served(None, reason=str(failure)))
        return results

    def _ready(self, call: FlatCall, progress: Optional[Progress]) -> Served:
        family = self.family_for(call)
        with stage("checking the graphs' shape guards"):
            graph, why = self.registry.find(family, call)
        if graph is None:
            graph, why = self.obtain(family, call, why, progress)
        if graph is None:
            return Served(None, reason=why or "no graph")
        if not getattr(graph, "ready", True):
            samples = self._samples(call)
            with stage(f"running graph {graph.key.id}"):
                graph.run(self.module, samples[0] if samples else call)  # backends that build on first run
        return Served(None, graph.key.id, graph.origin)
