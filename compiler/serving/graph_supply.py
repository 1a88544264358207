"""Where one wrapper's graphs come from: the registry, the graph library, another process's build, or a compile.

Split from the wrapper (compiled_forward.py), which serves calls: this side has a graph for a call's family or
says why not, once per family and shapes until the registry changes (`settled`). In order: a graph in memory;
one in the library (or one that takes the call with its inputs cast); a background build the process already
has (forward_builds.py); a build another process claimed in the shared store (build_claims.py, waited for when
blocking); else a compile here -- in the background (the call runs eager meanwhile) or waited for, with the
declared range's corners compiled now rather than in a later run. The steps a block structure's graph source
takes too (claiming, compiling, taking a background build in, landing) are supply.py's `GraphSource`; this
side keeps what is a whole model's own: its keys, the library, cast inputs, the range and its corners.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Dict, Optional, Set, Tuple

from ..keys import alignment
from ..builds import claims as build_claims
from ..backends import BackendUnavailable, CompiledGraph, CompileFailed, serving_backend
from ..backends.base import BuildInProcess, CompileDeferred, GuardsUnknown, Progress, range_failure
from .boundary import Failure, stage
from ..builds.forward_builds import ForwardBuilds
from ..keys.graph_keys import FamilyKey, GraphKey
from ..store.library import GraphLibrary
from ..keys.probes import corner_targets, reshape_call
from .quiet import third_party_quiet
from ..store.registry import PROGRESS
from ..keys.shapes import leaf_bounds
from ..keys.signature import FlatCall
from ..store.graph_store import GraphRefused, StoreError
from .supply import RECHECK_S, Found, GraphSource, Wrapper

log = logging.getLogger("keepfast")


class GraphSupply(GraphSource):
    """Gets graphs for one wrapper (`forward.supply`); reads the wrapper's module, options and registry live,
    as callers may replace its options."""

    MISSING = "no stored graph serves this input"
    EXPECTED = (CompileFailed, BackendUnavailable)
    IN_PROCESS = (BackendUnavailable, BuildInProcess)
    DEFERS = True  # not compiled now (no room): not settled, a later call tries again

    def __init__(self, forward: Wrapper):
        self.forward = forward
        self.settled: Dict[tuple, Tuple[int, str]] = {}  # (family id, shapes) -> (registry generation, why not)
        self.failures: Dict[str, str] = {}  # family id -> why its compile failed; not retried in this process
        self.declared: Dict[str, set] = {}  # family id -> input shapes a warmup asked graphs for
        # family id -> (when to look again, why): another process builds its graph for the shared store
        self.elsewhere: Dict[str, Tuple[float, str]] = {}
        self.no_cast: Set[str] = set()  # family ids whose calls a graph with cast inputs served wrong (input_casts.py)
        self.blocking = 0  # inside warmup: builds are waited for
        self.builds = ForwardBuilds(self, forward)

    @property
    def label(self) -> str:
        return self.forward.label

    @property
    def registry(self):
        return self.forward.registry

    @property
    def options(self):
        return self.forward.options

    @property
    def library(self) -> GraphLibrary:
        return GraphLibrary(self.forward.options.store, self.forward.registry)

    def obtain(self, family: FamilyKey, call: FlatCall, why: Optional[str] = None,
               progress: Optional[Progress] = None) -> Found:
        """Load or compile a graph that serves `call`; (None, reason) if there is none.

        For a module whose samples are independent the graph is had for the call's first sample: it serves
        the call one sample at a time, or whole where its guards accept the batch.
        """
        forward = self.forward
        samples = forward.sample_calls(call)
        call = samples[0] if samples else call
        settled_key = (family.id, tuple(call.shapes))
        settled = self.settled.get(settled_key)
        if settled and settled[0] == forward.registry.generation:
            return None, settled[1]
        with forward.registry.family_lock(family):
            with stage("checking the graphs' shape guards"):
                graph, why = forward.registry.find(family, call)
            if graph is not None:
                return graph, None
            elsewhere = self.elsewhere.get(family.id)
            if elsewhere is not None and not self.blocking and time.monotonic() < elsewhere[0]:
                return None, f"not compiled now: {elsewhere[1]}"
            with stage("loading a stored graph"):
                graph, reason = self.load(family, call)
            if graph is None and family.id not in self.no_cast:
                with stage("looking for a graph that takes this call with its inputs cast"):
                    graph = self.library.cast_sibling(family, call, forward.label)
                if graph is not None:
                    note = (f"served by {graph.describe_casts(call.tensor_paths)}, as the model casts them itself "
                            "(the first call of each size is compared with the model's own output)")
                    log.info("%s: %s", forward.label, note)
                    forward.registry.record(PROGRESS, family, f"{forward.label}: {note}", detail={"fraction": 1.0})
            if graph is None:
                try:
                    graph, reason = self._compile_for(family, call, reason or why, progress)
                except CompileDeferred as deferred:  # not settled: a later call may find room for it
                    return None, f"not compiled now: {deferred}"
        if graph is None:
            self.settled[settled_key] = (forward.registry.generation, reason)
        return graph, reason

    def load(self, family: FamilyKey, call: FlatCall) -> Found:
        library = self.library
        stored, why = library.lookup(family, call)
        if stored is None:
            return None, why
        try:
            return library.load(stored, family, self.forward.label), None
        except GraphRefused as error:
            return None, str(error)

    def _compile_for(self, family, call, why, progress) -> Found:
        """(graph, None) or (None, why not); a backend's CompileDeferred passes through."""
        options = self.forward.options
        off = self.compiling_off(why)
        if off:
            return None, off
        bounds = leaf_bounds(call.shapes, [t.dims for t in call.signature.tensors], options.shape_range)
        outside = range_failure(call.shapes, bounds, call.tensor_paths)
        if outside:
            return None, f"{outside} (declared range: {options.shape_range.describe()})"
        backend, unavailable = self.backend_named(family.backend)
        if backend is None:
            return None, unavailable
        if family.backend != options.backend:  # the aot backend's packages crash this machine's loader
            _, instead = serving_backend(options.backend, family.device)
            why = "; ".join(part for part in (why, instead) if part)
        failed = self.failed_before(family)
        if failed:
            return None, failed
        existing = self.forward.registry.family_graphs(family)
        if len(existing) >= self.graph_limit(backend, family):
            return None, (f"{len(existing)} graphs already built for this input structure and none serves "
                          f"it ({why}); not compiling more")
        if existing:
            reason = f"no graph serves this input ({why})"
        elif why:
            reason = why
        else:
            reason = "first call for this model, dtype and input structure"
        graph, why = self.builds.from_the_book(family, call, wait=self.blocking > 0 or not options.background)
        if graph is not None or why is not None:
            return graph, why
        # Background builds do not wait for another process's: CompileDeferred, the call runs eager with the
        # holder named, and the store is looked at again from the call RECHECK_S later on.
        background = options.background and not self.blocking
        claimed = self.claim_build(family, progress, background, lambda: self.load(family, call))
        if claimed.elsewhere is not None:
            raise CompileDeferred(claimed.elsewhere)
        if claimed.graph is not None:
            return claimed.graph, None
        if background:
            failure = self.builds.start(backend, family, call, reason, claimed.claim)  # CompileDeferred: started
            if failure is not None:
                build_claims.release(claimed.claim)
                return None, failure
        try:  # waited for, or built in this process where the backend cannot build off it
            graph, error = self.compile(backend, family, call, reason, None if background else progress)
            if graph is None:
                self.failures[family.id] = error
                return None, error
            if options.cover_range and not backend.static_shapes and not background:
                self._cover(backend, family, call, progress)
            return graph, None
        finally:
            build_claims.release(claimed.claim)

    # -- claims on a shared graphs folder (GraphSource.claim_build) ---------------
    def held_elsewhere(self, family: FamilyKey, reason: Optional[str]) -> None:
        if reason is None:
            self.elsewhere.pop(family.id, None)
            return
        if family.id not in self.elsewhere:
            log.info("%s: %s", self.label, reason)
        self.elsewhere[family.id] = (time.monotonic() + RECHECK_S, reason)

    def on_wait(self, family: FamilyKey, taken: build_claims.Taken) -> None:
        self.registry.record(PROGRESS, family, f"{self.label}: waiting: {taken.reason()}", detail={"fraction": 0.0})

    def graph_limit(self, backend, family: FamilyKey) -> int:
        """Graphs one family may hold: the backend's bound, or as many shapes as warmups declared.

        A static-shape backend (oneflow) needs a graph per shape: a user who
        warms up 5 resolutions x 3 batch sizes asked for 15 graphs, and every one
        of those sizes must be served afterwards.
        """
        return max(backend.max_graphs_per_family, len(self.declared.get(family.id, ())))

    def compile(self, backend, family, call, reason, progress) -> Found:
        """(graph, None) or (None, why it failed); CompileDeferred (try again later) is raised.

        Any exception out of the backend is a failed compile, with its type and
        message as the reason: a bug in export or AOTInductor costs speed only.
        """
        forward = self.forward
        key = GraphKey(family, forward.options.shape_range)
        label = forward.label

        def report(stage: str, fraction: float) -> None:
            forward.registry.record(PROGRESS, family, f"{label}: {stage}", detail={"fraction": fraction})
            if progress:
                progress(stage, fraction)

        def build() -> CompiledGraph:
            with third_party_quiet():  # the notices torch prints while it compiles are not the user's business
                return backend.compile(forward.module, forward.forward_fn, call, key, report)

        log.info("%s: compiling (%s)", label, reason)
        started = time.perf_counter()
        graph, error = self.compile_here(build)
        if graph is None:
            return None, error
        self.landed(graph, family, reason, time.perf_counter() - started,
                    detail={"shapes": [list(s) for s in call.shapes], **getattr(graph, "build_usage", {})},
                    signature=call.signature.to_json())
        report("compiled", 1.0)
        self.keep(graph, call)
        return graph, None

    def _cover(self, backend, family, call, progress) -> None:
        """Compile now for the range corners no graph serves, not in a later run.

        Whether a graph serves a corner is read from its guards, never by running
        it there (see CompiledGraph.guard_failure).
        """
        forward = self.forward
        shape_range = forward.options.shape_range
        if forward.options.samples_independent:  # batches are served by the graphs of one sample
            shape_range = replace(shape_range, batch=(shape_range.batch[0], shape_range.batch[0]))
        lone_height, lone_width = alignment.one_multiple_sides(forward.module, shape_range.spatial[0],
                                                               shape_range.spatial_multiple)
        deferred = set()
        for batch, height, width in corner_targets(shape_range):
            if height == lone_height or width == lone_width:
                deferred.add((height, width))
                continue
            probe = reshape_call(call, batch, height, width)
            if probe is None:
                continue
            try:
                with stage("checking the range corners' guards"):
                    why = self._guard_failure(family, probe)
            except GuardsUnknown as unknown:
                log.info("%s: range corners are compiled when first used: %s", forward.label, unknown)
                return
            except Failure as failure:  # the corners then compile when first used
                log.warning("%s: %s", forward.label, failure)
                return
            if why is None:
                continue
            if len(forward.registry.family_graphs(family)) >= self.graph_limit(backend, family):
                return
            reason = f"range corner batch {batch}, latent {height}x{width} is not served ({why})"
            try:
                self.compile(backend, family, probe, reason, progress)
            except CompileDeferred:  # no room now: the corner compiles when first used
                return
        if deferred:
            log.info("%s: range corners at latent %s compile when first used: a side of exactly one multiple of "
                     "the model's downsampling (its lowest level 1 wide) needs a graph of its own", forward.label,
                     ", ".join(f"{h}x{w}" for h, w in sorted(deferred)))

    def _guard_failure(self, family: FamilyKey, call: FlatCall) -> Optional[str]:
        """None if a graph of the family serves the call, else why the first one does not."""
        why = None
        for graph in self.forward.registry.family_graphs(family):
            failure = graph.guard_failure(self.forward.module, call)
            if failure is None:
                return None
            why = why or failure
        return why or "no graph of this family"

    def keep(self, graph: CompiledGraph, call: Optional[FlatCall]) -> None:
        """A graph compiled here or taken in is written into the store where autosave is on."""
        if self.options.autosave and self.options.store is not None and graph.persistent:
            self.save_graph(graph, call)

    def save_graph(self, graph: CompiledGraph, call: Optional[FlatCall] = None) -> Optional[str]:
        """Write a graph into the store; returns the error message if it could not be."""
        signature = call.signature.to_json() if call is not None else {}
        try:
            self.library.save(graph, signature, self.forward.label)
        except StoreError as error:
            return str(error)
        return None
