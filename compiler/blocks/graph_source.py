"""Where one block structure's graph comes from: the registry, the graph store, another process's build, or a
compile here (waited for, or in the background while the blocks run eager).

Split from the block server (server.py), which serves the calls of a structure's instances: this side finds,
loads or builds the graph and hands it to the server (`BlockServer.adopt`); it owns what a build in flight
needs -- the claim on a shared graphs folder (build_claims.py), the other process's build being waited for,
the background build -- and nothing the per-call path reads but whether one of those is there. The steps a
whole model's graph source takes too (claiming, compiling, taking a background build in, landing) are
serving/supply.py's `GraphSource`; this side keeps what is a block structure's own: the store's range check,
the aot backend, the export with its sizes-of-1 check, and the server it hands the graph to.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Protocol

from ..builds import claims as build_claims
from ..backends.base import BuildLabel, CompiledGraph
from ..keys.graph_keys import FamilyKey, GraphKey
from ..serving.supply import RECHECK_S, Found, GraphSource
from ..store.registry import LOAD, PROGRESS, REFUSED
from ..keys.signature import FlatCall
from ..store.graph_store import GraphRefused
from .export import BlockBuild, package_block

log = logging.getLogger("keepfast")

BUILDING = "its graph is building in the background"


class Server(Protocol):
    """What a block graph source reads and sets of its block server (server.py's BlockServer)."""

    engine: Any  # the BlockEngine: registry, options, family, exporter, compile_failures, builds, ...
    lead: Any  # the instance traced and checked (its `module`)
    group: Any  # the BlockGroup: class_name, parameter_count()
    instances: List[Any]
    family: Optional[FamilyKey]
    label: str
    lock: threading.Lock
    ready: bool
    reason: Optional[str]
    origin: str
    compile_s: float
    notes: List[str]

    def check_unit_sizes(self, candidate: CompiledGraph, units: Dict[str, Any], call: FlatCall) -> Optional[str]: ...

    def adopt(self, graph: CompiledGraph, call: FlatCall) -> Optional[str]: ...

    def settle(self, reason: Optional[str]) -> bool: ...


class BlockGraphSource(GraphSource):
    """Finds, loads or builds the graph of one block structure (`server.source`; a new one per prepare)."""

    MISSING = "no stored graph serves this block"

    def __init__(self, server: Server):
        self.server = server
        self.claim: Optional[build_claims.Claim] = None  # held while this process builds the graph for the store
        self.elsewhere = None  # (call, bounds, key, when to look again) while another process builds it
        self.pending: Optional[BlockBuild] = None  # the graph building in the background

    @property
    def label(self) -> str:
        return self.server.label

    @property
    def registry(self):
        return self.server.engine.registry

    @property
    def options(self):
        return self.server.engine.options

    @property
    def failures(self) -> Dict[str, str]:  # the engine's: a new source per prepare does not retry them
        return self.server.engine.compile_failures

    def stop(self) -> None:
        """Cancel the background build and let go of the claim (the server prepares anew)."""
        if self.pending is not None:
            self.pending.cancel()
        self.release_claim()

    def obtain(self, call: FlatCall, bounds, key: GraphKey, progress) -> Found:
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
            refused = self.compiling_off(why) or self.failed_before(family)
            if refused:
                return None, refused
            backend, unavailable = self.backend_named(options.backend)
            if backend is None:
                return None, unavailable
            if not backend.persistent or options.backend != "aot":
                return None, f"block graphs are built with the aot backend, not {options.backend}"
            refused = engine.family.why_not_compiled(server.lead.module)
            if refused:
                self.failures[family.id] = f"not compiled: {refused}"
                return None, f"not compiled: {refused}"
            # background: another process's build is not waited for; its instances run eager meanwhile
            claimed = self.claim_build(family, progress, options.background and not engine.ahead_of_time,
                                       lambda: self.load(family, call, key))
            if claimed.graph is not None:
                return claimed.graph, None
            if claimed.elsewhere is not None:
                self.elsewhere = (call, bounds, key, time.monotonic() + RECHECK_S)
                return None, claimed.elsewhere
            self.claim = claimed.claim
            if (options.background and not engine.ahead_of_time) or engine.together:
                building = self._build_in_background(call, bounds, key)
                if building is not None:
                    return None, building
            return self._compile(call, bounds, key, progress)

    def _compile(self, call: FlatCall, bounds, key: GraphKey, progress) -> Found:
        server = self.server
        engine = server.engine
        family = key.family
        started = time.perf_counter()
        result, reason = self.compile_here(lambda: engine.exporter(
            server.lead.module, call, bounds, key, progress,
            check_unit_sizes=lambda candidate, units: server.check_unit_sizes(candidate, units, call),
            forward=engine.family.block_forward, tracing=engine.family.tracing))
        if result is None:  # whatever export or AOTInductor raised: this block runs eager
            self.failures[family.id] = reason
            return None, reason
        graph, notes = result
        server.compile_s = time.perf_counter() - started
        server.notes.extend(notes)
        self.landed(graph, family, "first call for this block structure and input structure", server.compile_s,
                    detail={"block": server.group.class_name, "instances": len(server.instances),
                            "shapes": [list(s) for s in call.shapes], "parameters": server.group.parameter_count(),
                            **getattr(graph, "build_usage", {})})
        server.origin = "compiled"
        return graph, None

    def load(self, family: FamilyKey, call: FlatCall, key: GraphKey) -> Found:
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

    # -- claims on a shared graphs folder (GraphSource.claim_build) ---------------
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
            reason = why if graph is None else server.adopt(graph, call)
        except Exception as error:  # noqa: BLE001 - the block stays eager with the reason
            reason = f"preparing its graph failed: {type(error).__name__}: {error}"
        finally:
            engine.ahead_of_time = ahead
            if self.pending is None:
                self.release_claim()
        return server.settle(reason)

    # -- background builds (docs/background.md) -----------------------------
    def _build_in_background(self, call: FlatCall, bounds, key: GraphKey) -> Optional[str]:
        """Trace the block now, build its package in a child process: the reason its instances run eager
        meanwhile, or None where it must be built in this process (`BuildInProcess`, logged)."""
        server = self.server
        engine = server.engine
        family = key.family
        pending, failure = self.start_building(family, lambda: BlockBuild(
            server.lead.module, call, bounds, key,
            BuildLabel(owner=engine.label, what=f"block {server.group.class_name}", family=family.id,
                       owner_id=f"{engine.label}@{id(engine):x}"),
            forward=engine.family.block_forward, tracing=engine.family.tracing,
            beside=len(engine.servers) if engine.together else 1))
        if pending is None:  # built in this process (None), or why the trace failed: this block runs eager
            return failure
        self.pending = pending
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
        family, call = server.family, pending.traced.call
        taking_in = time.perf_counter()
        result, why = self.take_in(family, "a block graph", lambda: package_block(
            pending.traced, pending.package(),
            check_unit_sizes=lambda candidate, units: server.check_unit_sizes(candidate, units, call)))
        if result is None:
            server.reason = why
            self.release_claim()
            return False
        graph, notes = result
        server.compile_s = pending.seconds
        server.notes.extend(notes)
        graph.build_usage = pending.usage(round(time.perf_counter() - taking_in, 2))
        try:
            where = "beside the other block structures" if pending.together else "in the background"
            self.landed(graph, family, f"first call for this block structure and input structure (built {where})",
                        server.compile_s, detail={"block": server.group.class_name, "instances": len(server.instances),
                                                  "shapes": [list(s) for s in call.shapes],
                                                  "background": not pending.together,
                                                  "parameters": server.group.parameter_count(), **graph.build_usage})
            server.origin = "compiled"
            return server.settle(server.adopt(graph, call))
        finally:  # written (or not): others sharing the store may look now
            self.release_claim()

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
