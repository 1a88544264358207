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
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, List, Optional, Tuple

import torch

from ..builds import cores as build_cores
from ..backends import DEFAULT_BACKEND, CompiledGraph, serving_backend
from ..backends.base import CannotServe, GraphMismatch, Progress, call_device
from ..backends.cuda_graphs import asked_for as cuda_graphs_asked_for
from ..keys.binding import CallBinder, CallDoesNotBind
from .boundary import Failure, contain, stage
from ..tracing.flat_module import ForwardFn
from .graph_supply import GraphSupply
from .input_casts import CastGraph
from ..keys.graph_keys import FamilyKey
from ..store.library import GraphLibrary
from ..tracing.module_snapshot import one_check_per_call, snapshot_of
from ..store.registry import FALLBACK, MISMATCH, NOTE, GraphRegistry, default_registry
from .replay_notes import ReplayNotes
from .samples import CannotJoin, join_samples, samples_of
from ..keys.shapes import DEFAULT_RANGE, ShapeRange
from ..keys.signature import FlatCall, RolePolicy, UnsupportedCall
from ..store.graph_store import GraphStore
from ..keys.structure import architecture_name, module_device, module_dtype, structure_hash
from .verify import Snapshot, judge, retired_reason, snapshot

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
    # Replay CUDA graphs of the shapes calls repeat (backends/cuda_graphs.py: the aot backend's graphs on a GPU).
    cuda_graphs: bool = field(default_factory=cuda_graphs_asked_for)

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
        self.supply = GraphSupply(self)  # where graphs come from: the registry, the library, a build
        self.last: Optional[Served] = None
        self.eager_calls = 0
        self.graph_calls = 0
        self._replay_notes = ReplayNotes()

    @property
    def library(self) -> GraphLibrary:
        return self.supply.library

    @property
    def last_status(self) -> str:
        """The last call's outcome in words (for logs and messages; `last` is the typed result)."""
        return self.last.describe() if self.last is not None else "not run yet"

    # -- keys: the one path from a call to a key ------------------------------
    def structure(self) -> str:
        shapes = snapshot_of(self.module).shapes  # the module walked again only where it changed
        if self._structure is None or self._structure[0] != shapes:
            self._structure = (shapes, structure_hash(self.module))
        return self._structure[1]

    def expected_family(self, signature: str, dtype: Optional[torch.dtype] = None) -> FamilyKey:
        """The family a graph needs to serve calls of `signature` to this module (in `dtype`, default its own)."""
        device = self.options.device or module_device(self.module)
        backend, _ = serving_backend(self.options.backend, str(device))
        return FamilyKey.here(architecture_name(self.module), self.structure(), signature,
                              dtype or module_dtype(self.module), device, backend)

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
        with one_check_per_call():  # the module's tensors checked once for the key and the binding
            return self._serve(args, kwargs, eager, eager_reason)

    def _serve(self, args: tuple, kwargs: dict, eager: Optional[Callable[..., Any]],
               eager_reason: Optional[str]) -> Served:
        eager = eager or self.eager
        run_eager = lambda: eager(*args, **kwargs)  # noqa: E731
        family: Optional[FamilyKey] = None
        build_cores.share()
        if self.supply.builds.building:
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
                    if served is None and self.sample_calls(call):
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
                    self.supply.no_cast.add(family.id)
                    why = f"{graph.describe_casts(call.tensor_paths)} disagreed with the model; its own graph is due"
                    continue
                raise _Retired(retired_reason(graph.key.id, call.tensor_paths, call.shapes, verdict))
            copies = snapshot(args, kwargs) if self.options.verify and verdict is None else None
            try:
                with stage(f"running graph {graph.key.id}"):
                    started = time.perf_counter()
                    output = graph.run(self.module, call, replay=self.options.cuda_graphs)
                    self._timed("graph", started)
            except GraphMismatch as mismatch:  # the graph now knows; try the next one
                why = str(mismatch)
                continue
            except CannotServe as cannot:  # expected by the backend: eager, with its reason
                return None, f"graph {graph.key.id} cannot serve this call: {cannot}", None
            if self.options.cuda_graphs:  # a graph that runs without replays says why, once
                self._replay_notes.after_run(graph, call_device(call.tensors).type, self.label,
                                             lambda text: self.registry.record(NOTE, family, text))
            return Served(output, graph.key.id, graph.origin), None, copies
        return None, why, None

    def _run_each_sample(self, family: FamilyKey, call: FlatCall, args: tuple,
                         kwargs: dict) -> Tuple[Optional[Served], Optional[str], Optional[Snapshot]]:
        """A batch no graph serves whole, served one sample at a time by the graph that serves one (samples.py).

        The first-use check is keyed by the batch's shapes (each new batch size is compared with eager once);
        a graph retired for one sample's shapes is retired for batches of them too.
        """
        samples = self.sample_calls(call)
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

    # -- getting a graph (graph_supply.py; background builds: forward_builds.py) --
    def sample_calls(self, call: FlatCall) -> Optional[List[FlatCall]]:
        """The call as one call per sample where this module takes that (samples_independent), else None."""
        return samples_of(call) if self.options.samples_independent else None

    def obtain(self, family: FamilyKey, call: FlatCall, why: Optional[str] = None,
               progress: Optional[Progress] = None) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """Load or compile a graph that serves `call`; (None, reason) if there is none (GraphSupply.obtain)."""
        return self.supply.obtain(family, call, why, progress)

    def save_graph(self, graph: CompiledGraph, call: Optional[FlatCall] = None) -> Optional[str]:
        """Write a graph into the store; returns the error message if it could not be."""
        return self.supply.save_graph(graph, call)

    def land_builds(self) -> int:
        """Take in the finished background builds of this wrapper's families; returns how many landed."""
        return self.supply.builds.land()

    def wait_for_builds(self, timeout: Optional[float] = None) -> int:
        """Wait for this wrapper's background builds (or `timeout` s), then land them."""
        return self.supply.builds.wait(timeout)

    def cancel_builds(self) -> int:
        """Stop every background build of this wrapper's families (stopping the workflow); returns how many."""
        return self.supply.builds.cancel()

    @property
    def builds_pending(self) -> int:
        return self.supply.builds.pending

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
                building = self.supply.builds.building
                if self.registry.find(family, call)[0] is not None or family.id in building:
                    continue
                before = len(building)
                self.obtain(family, call, "a state the declared range meets, built ahead")
                started += len(self.supply.builds.building) - before
            except Exception as error:  # noqa: BLE001 - ahead of time only: the call itself tries again
                log.info("%s: not built ahead: %s", self.label, error)
        return started

    def warmup(self, calls: Iterable[Tuple[tuple, dict]], progress: Optional[Progress] = None) -> List[Served]:
        """Make sure a graph serves each example call; one result per call (output None).

        Never raises for a graph that cannot be had: the result says why.
        """
        self.supply.blocking += 1
        try:
            self.wait_for_builds()  # a build already started for these inputs lands first
            return self._warmup(calls, progress)
        finally:
            self.supply.blocking -= 1

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
                self.supply.declared.setdefault(self.family_for(call).id, set()).add(tuple(map(tuple, call.shapes)))
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
            samples = self.sample_calls(call)
            with stage(f"running graph {graph.key.id}"):
                graph.run(self.module, samples[0] if samples else call)  # backends that build on first run
        return Served(None, graph.key.id, graph.origin)
