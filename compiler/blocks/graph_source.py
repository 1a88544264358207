"""Where one block structure's graph comes from: the registry, the graph store, another process's build, or a
compile here (waited for, or in the background while the blocks run eager).

Split from the block server (server.py), which serves the calls of a structure's instances: this side finds,
loads or builds the graph and hands it to the server (`BlockServer.adopt`); it owns what a build in flight
needs -- the claim on a shared graphs folder (build_claims.py), the other process's build being waited for,
the background build -- and nothing the per-call path reads but whether one of those is there.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional, Tuple

from ..builds import claims as build_claims
from ..backends import BackendUnavailable, get_backend
from ..backends.base import BuildInProcess, BuildLabel, CompiledGraph, CompileFailed
from ..serving.boundary import expected_failure, stage
from ..keys.graph_keys import FamilyKey, GraphKey
from ..serving.quiet import third_party_quiet
from ..store.registry import COMPILE, LOAD, PROGRESS, REFUSED
from ..keys.signature import FlatCall
from ..store.graph_store import GraphRefused
from .export import BlockBuild, package_block

if TYPE_CHECKING:
    from .server import BlockServer

log = logging.getLogger("keepfast")

BUILDING = "its graph is building in the background"
RECHECK_S = 1.0  # while another process builds a block graph: how often its calls look in the store again


def _failure_text(error: BaseException) -> str:
    return str(error) if isinstance(error, CompileFailed) else f"{type(error).__name__}: {error}"


class BlockGraphSource:
    """Finds, loads or builds the graph of one block structure (`server.source`; a new one per prepare)."""

    def __init__(self, server: "BlockServer"):
        self.server = server
        self.claim: Optional[build_claims.Claim] = None  # held while this process builds the graph for the store
        self.elsewhere = None  # (call, bounds, key, when to look again) while another process builds it
        self.pending: Optional[BlockBuild] = None  # the graph building in the background

    def stop(self) -> None:
        """Cancel the background build and let go of the claim (the server prepares anew)."""
        if self.pending is not None:
            self.pending.cancel()
        self.release_claim()

    def obtain(self, call: FlatCall, bounds, key: GraphKey, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """(graph, None), or (None, why the blocks run eager: a failure, or a build in flight here or elsewhere)."""
        server = self.server
        engine = server.engine
        registry = engine.registry
        options = engine.options
        family = key.family
        with registry.family_lock(family):
            for graph in registry.family_graphs(family):
                # a graph built for a narrower range would leave part of this one eager
                if graph.key.shape_range.covers(key.shape_range) and graph.why_not(call) is None:
                    registry.count_hit()
                    server.origin = graph.origin
                    return graph, None
            graph, why = self.load(family, call, key)
            if graph is not None:
                return graph, None
            if not options.compile_on_miss:
                return None, (why or "no stored graph serves this block") + "; compiling is off"
            known = engine.compile_failures.get(family.id)
            if known:
                return None, known + " (not retried)"
            try:
                backend = get_backend(options.backend)
            except BackendUnavailable as error:
                return None, str(error)
            if not backend.persistent or options.backend != "aot":
                return None, f"block graphs are built with the aot backend, not {options.backend}"
            refused = engine.family.why_not_compiled(server.lead.module)
            if refused:
                engine.compile_failures[family.id] = f"not compiled: {refused}"
                return None, f"not compiled: {refused}"
            graph, elsewhere = self._claim(family, call, key, progress)
            if graph is not None:
                return graph, None
            if elsewhere is not None:
                self.elsewhere = (call, bounds, key, time.monotonic() + RECHECK_S)
                return None, elsewhere
            if (options.background and not engine.ahead_of_time) or engine.together:
                building = self._build_in_background(call, bounds, key)
                if building is not None:
                    return None, building
            return self._compile(call, bounds, key, progress)

    def _compile(self, call: FlatCall, bounds, key: GraphKey, progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        server = self.server
        engine = server.engine
        family = key.family
        started = time.perf_counter()
        try:
            graph, notes = engine.exporter(
                server.lead.module, call, bounds, key, progress,
                check_unit_sizes=lambda candidate, units: server.check_unit_sizes(candidate, units, call),
                forward=engine.family.block_forward, tracing=engine.family.tracing)
        except Exception as error:  # whatever export or AOTInductor raises: this block runs eager
            reason = f"compile failed: {_failure_text(error)}"
            engine.compile_failures[family.id] = reason
            log.warning("%s: %s", server.label, reason)
            return None, reason
        server.compile_s = time.perf_counter() - started
        server.notes.extend(notes)
        engine.registry.add(graph)
        engine.registry.record(COMPILE, family, f"{server.label}: first call for this block structure and input "
                               "structure", seconds=server.compile_s, graph_id=graph.key.id,
                               detail={"block": server.group.class_name, "instances": len(server.instances),
                                       "shapes": [list(s) for s in call.shapes],
                                       "parameters": server.group.parameter_count(),
                                       **getattr(graph, "build_usage", {})})
        server.origin = "compiled"
        return graph, None

    def load(self, family: FamilyKey, call: FlatCall, key: GraphKey) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        server = self.server
        store = server.engine.options.store
        if store is None:
            return None, None
        registry = server.engine.registry
        try:
            stored, notes = store.lookup(family, call)
        except OSError as error:
            return None, f"graphs folder {store.root} cannot be read: {error}"
        for note in notes:
            registry.record(REFUSED, family, f"{server.label}: {note}")
        if stored is None:
            return None, notes[0] if notes else None
        have = stored.manifest.key.shape_range
        if not have.covers(key.shape_range) and server.engine.options.compile_on_miss:
            why = (f"stored graph {stored.name} was built for {have.describe()}, narrower than "
                   f"{key.shape_range.describe()}")
            registry.record(REFUSED, family, f"{server.label}: {why}; compiling for the declared range")
            return None, why
        started = time.perf_counter()
        try:
            graph = store.load(stored, family)
        except GraphRefused as error:
            registry.record(REFUSED, family, f"{server.label}: {error}", graph_id=stored.manifest.graph_id)
            return None, str(error)
        registry.add(graph)
        registry.record(LOAD, family, f"{server.label}: loaded {stored.name} from {store.root}",
                        seconds=time.perf_counter() - started, graph_id=graph.key.id)
        server.origin = "loaded"
        return graph, None

    # -- claims on a shared graphs folder (compiler/builds/claims.py) --------
    def _claim(self, family: FamilyKey, call: FlatCall, key: GraphKey,
               progress) -> Tuple[Optional[CompiledGraph], Optional[str]]:
        """Claim the structure's build in the store its graph will be written to (`self.claim`): (None, None)
        to build here; (graph, None) when another process's build was waited for and is now in the store;
        (None, why) in background mode while another process holds the claim (its instances run eager).
        Nothing is claimed when the graph will not be written (no store, or autosave off)."""
        server = self.server
        options = server.engine.options
        if options.store is None or not options.autosave:
            return None, None
        path = options.store.claim_path(family)
        if options.background and not server.engine.ahead_of_time:
            result = build_claims.try_claim(path)
            if isinstance(result, build_claims.Taken):
                log.info("%s: %s", server.label, result.reason())
                return None, result.reason()
            self.claim = result
            return None, None
        waited = []

        def waiting(taken: build_claims.Taken) -> None:
            waited.append(taken)
            log.info("%s: waiting: %s", server.label, taken.reason())
            progress(f"waiting for {taken.holder.describe()}, which builds this graph", 0.0)

        result = build_claims.claim_or_wait(path, on_wait=waiting)
        if waited:
            graph, _ = self.load(family, call, key)
            if graph is not None:
                build_claims.release(result)
                return graph, None
        if isinstance(result, build_claims.Taken):
            log.warning("%s: still %s after %.0f s; building it here too", server.label, result.reason(),
                        build_claims.wait_seconds())
            return None, None
        self.claim = result
        return None, None

    def release_claim(self) -> None:
        claim, self.claim = self.claim, None
        build_claims.release(claim)

    def look_again(self, wait: bool = False) -> bool:
        """While another process builds this structure's graph: look in the store again (at most once per
        RECHECK_S unless `wait`), loading the graph once it is there, or claiming and building it here
        when the other build ended without one. True when the block now serves from a graph."""
        server = self.server
        elsewhere = self.elsewhere
        if elsewhere is None:
            return server.ready
        call, bounds, key, due = elsewhere
        if not wait and time.monotonic() < due:
            return False
        self.elsewhere = None
        engine = server.engine
        ahead = engine.ahead_of_time
        engine.ahead_of_time = ahead or wait  # waiting: block on the claim, build here if needed
        try:
            graph, why = self.obtain(call, bounds, key, lambda *_: None)
            server.reason = why if graph is None else server.adopt(graph, call)
        except Exception as error:  # noqa: BLE001 - the block stays eager with the reason
            server.reason = f"preparing its graph failed: {type(error).__name__}: {error}"
        finally:
            engine.ahead_of_time = ahead
            if self.pending is None:
                self.release_claim()
        if server.reason is not None:
            server.graph = None
            server.record_fallback(server.reason)
        return server.reason is None

    # -- background builds (docs/background.md) -----------------------------
    def _build_in_background(self, call: FlatCall, bounds, key: GraphKey) -> Optional[str]:
        """Trace the block now, build its package in a child process: the reason its instances run eager
        meanwhile, or None where it must be built in this process (`BuildInProcess`, logged)."""
        server = self.server
        engine = server.engine
        family = key.family
        try:
            with third_party_quiet():
                self.pending = BlockBuild(server.lead.module, call, bounds, key,
                                          BuildLabel(owner=engine.label, what=f"block {server.group.class_name}",
                                                     family=family.id, owner_id=f"{engine.label}@{id(engine):x}"),
                                          forward=engine.family.block_forward, tracing=engine.family.tracing,
                                          beside=len(engine.servers) if engine.together else 1)
        except BuildInProcess as why:
            log.info("%s: building in this process: %s", server.label, why)
            return None
        except Exception as error:  # whatever export raises: this block runs eager
            reason = f"compile failed: {_failure_text(error)}"
            engine.compile_failures[family.id] = reason
            return reason
        engine.builds.append(self.pending.build.cancel)
        where = "beside the other block structures" if engine.together else "in the background"
        engine.registry.record(PROGRESS, family, f"{server.label}: building {where}",
                               detail={"fraction": 0.0, "background": not engine.together,
                                       "block": server.group.class_name})
        return BUILDING

    def land(self) -> bool:
        """Take in the background build if it finished: True when the block now serves from its graph.

        The graph is checked as a build in this process is (sizes of 1 against eager), recorded as a compile
        "built in the background", and its first call at new shapes gets the first-use check. A failed build
        leaves the block eager with the reason."""
        server = self.server
        pending = self.pending
        if pending is None or not pending.done():
            return False
        self.pending = None
        engine, family, call = server.engine, server.family, pending.traced.call
        taking_in = time.perf_counter()
        try:
            with stage("taking in a block graph built in the background"), third_party_quiet():
                graph, notes = package_block(pending.traced, pending.package(), check_unit_sizes=lambda candidate,
                                             units: server.check_unit_sizes(candidate, units, call))
        except Exception as error:  # noqa: BLE001 - a failed build costs speed only
            server.reason = engine.compile_failures[family.id] = \
                f"compile failed: {_failure_text(expected_failure(error))}"
            log.warning("%s: the background build failed: %s", server.label, server.reason)
            self.release_claim()
            return False
        server.compile_s = pending.seconds
        server.notes.extend(notes)
        engine.registry.add(graph)
        graph.build_usage = pending.usage(round(time.perf_counter() - taking_in, 2))
        try:
            self._land_graph(graph, call, pending)
        finally:  # written (or not): others sharing the store may look now
            self.release_claim()
        return server.reason is None

    def _land_graph(self, graph: CompiledGraph, call: FlatCall, pending: BlockBuild) -> None:
        server = self.server
        engine, family = server.engine, server.family
        together = pending.together
        where = "beside the other block structures" if together else "in the background"
        engine.registry.record(COMPILE, family, f"{server.label}: first call for this block structure and input "
                               f"structure (built {where})", seconds=server.compile_s,
                               graph_id=graph.key.id,
                               detail={"block": server.group.class_name, "instances": len(server.instances),
                                       "shapes": [list(s) for s in call.shapes], "background": not together,
                                       "parameters": server.group.parameter_count(), **graph.build_usage})
        server.origin = "compiled"
        server.reason = server.adopt(graph, call)
        if server.reason is not None:
            server.graph = None
            server.record_fallback(server.reason)

    def wait(self) -> bool:
        """Wait for the background build (or another process's), then take it in (Save Graph and warmup
        wait for their graphs)."""
        server = self.server
        if self.elsewhere is not None:
            with server.lock:
                self.look_again(wait=True)
        if self.pending is None:
            return server.ready
        self.pending.wait()
        with server.lock:
            return self.land()

    def cancel(self) -> bool:
        """Stop the background build, if one runs; the block stays eager with that reason."""
        pending, self.pending = self.pending, None
        if pending is None:
            return False
        pending.cancel()
        self.release_claim()
        self.server.reason = "its background build was cancelled"
        return True
