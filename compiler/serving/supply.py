"""The steps every graph source takes, whole model or block structure.

A graph source has a graph for a family of calls, or says why not. It looks in memory (the registry), then in
the graphs folder; on a miss it rules a compile out or in (compiling off, a failure not retried, a backend this
machine lacks), claims the build in the store the graph will be written to (compiler/builds/claims.py: another
process's build is waited for, or the calls run eager while it builds), and compiles -- in this process, or in
the background in a child process, the build taken in once it has finished. A graph it gets lands: it joins the
registry with a compile event (and, for a whole model, the store).

Those steps are here, once (`GraphSource`). What differs stays with the two sources: how a whole model's graphs
are keyed, loaded, traced and compiled (`GraphSupply`, serving/graph_supply.py, with its background builds in
builds/forward_builds.py), and how one block structure's are (`BlockGraphSource`, blocks/graph_source.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple, TypeVar

from ..backends import BackendUnavailable, get_backend
from ..backends.base import BuildInProcess, CompileDeferred, CompiledGraph, CompileFailed, Progress
from ..builds import claims as build_claims
from ..keys.graph_keys import FamilyKey
from ..keys.signature import FlatCall
from ..store.registry import COMPILE, GraphRegistry
from .boundary import expected_failure, stage
from .quiet import third_party_quiet

log = logging.getLogger("keepfast")

RECHECK_S = 1.0  # while another process builds a graph: how often its calls look in the store again

T = TypeVar("T")
Found = Tuple[Optional[CompiledGraph], Optional[str]]  # (graph, None) or (None, why not)


def failure_text(error: BaseException, expected: Tuple[type, ...] = (CompileFailed,)) -> str:
    """Why a compile failed: an expected failure's message, anything else with its type."""
    if isinstance(error, expected):
        return f"compile failed: {error}"
    return f"compile failed: {type(error).__name__}: {error}"


class Claimed(NamedTuple):
    """The outcome of claiming a family's build in the shared store (`GraphSource.claim_build`)."""

    claim: Optional[build_claims.Claim] = None  # held while this process builds the graph for the store
    graph: Optional[CompiledGraph] = None  # another process's build, waited for and now loaded
    elsewhere: Optional[str] = None  # background: another process builds it (why the calls run eager meanwhile)


class Wrapper(Protocol):
    """What a whole model's graph source and its background builds read of their wrapper (CompiledForward's
    `supply`), live: callers may replace its options."""

    module: Any
    forward_fn: Callable[..., Any]
    options: Any
    registry: GraphRegistry
    label: str

    def sample_calls(self, call: FlatCall) -> Optional[List[FlatCall]]: ...


class GraphSource:
    """The steps shared by the graph sources (see the module docstring).

    A subclass provides `label`, `registry`, `options` (read live: store, autosave, background, compile_on_miss)
    and `failures` (family id -> why its compile failed; not retried in this process), and says which failures
    are expected (`EXPECTED`: their message is the reason), which exceptions mean a build must run in this
    process (`IN_PROCESS`), and whether a backend's CompileDeferred passes through a compile (`DEFERS`).
    """

    MISSING = "no stored graph serves this call"  # the reason of a miss where the store gave none
    EXPECTED: Tuple[type, ...] = (CompileFailed,)
    IN_PROCESS: Tuple[type, ...] = (BuildInProcess,)
    DEFERS = False

    label: str
    registry: GraphRegistry
    options: Any
    failures: Dict[str, str]

    # -- what rules a compile out ------------------------------------------------
    def compiling_off(self, why: Optional[str]) -> Optional[str]:
        """The reason a miss stays one when compiling is off, else None."""
        if self.options.compile_on_miss:
            return None
        return (why or self.MISSING) + "; compiling is off"

    def failed_before(self, family: FamilyKey) -> Optional[str]:
        """Why the family's compile failed in this process (not retried), else None."""
        known = self.failures.get(family.id)
        return known + " (not retried)" if known else None

    @staticmethod
    def backend_named(name: str) -> Tuple[Any, Optional[str]]:
        """(the backend, None), or (None, why this machine cannot use it)."""
        try:
            return get_backend(name), None
        except BackendUnavailable as error:
            return None, str(error)

    # -- claims on a shared graphs folder (compiler/builds/claims.py) ------------
    def claim_build(self, family: FamilyKey, progress: Optional[Progress], background: bool,
                    reload: Callable[[], Found]) -> Claimed:
        """Claim the family's build in the store its graph will be written to.

        `background`: never waits -- another process's claim is `elsewhere` (`held_elsewhere` is told either
        way). Otherwise another process's build is waited for (`on_wait` is told) and its graph loaded with
        `reload`; still not there after build_claims.wait_seconds(), it is built here too, unclaimed. Nothing
        is claimed when the graph will not be written (no store, or autosave off): nobody else could load it.
        """
        store = self.options.store
        if store is None or not self.options.autosave:
            return Claimed()
        path = store.claim_path(family)
        if background:
            result = build_claims.try_claim(path)
            if isinstance(result, build_claims.Taken):
                reason = result.reason()
                self.held_elsewhere(family, reason)
                return Claimed(elsewhere=reason)
            self.held_elsewhere(family, None)
            return Claimed(claim=result)
        waited = []

        def waiting(taken: build_claims.Taken) -> None:
            waited.append(taken)
            log.info("%s: waiting: %s", self.label, taken.reason())
            self.on_wait(family, taken)
            if progress:
                progress(f"waiting for {taken.holder.describe()}, which builds this graph", 0.0)

        result = build_claims.claim_or_wait(path, on_wait=waiting)
        if waited:
            graph, _ = reload()
            if graph is not None:
                build_claims.release(result)
                return Claimed(graph=graph)
        if isinstance(result, build_claims.Taken):
            log.warning("%s: still %s after %.0f s; building it here too", self.label, result.reason(),
                        build_claims.wait_seconds())
            return Claimed()
        return Claimed(claim=result)

    def held_elsewhere(self, family: FamilyKey, reason: Optional[str]) -> None:
        """A background claim's outcome: `reason` names the other process building the graph, None: not held."""
        if reason is not None:
            log.info("%s: %s", self.label, reason)

    def on_wait(self, family: FamilyKey, taken: build_claims.Taken) -> None:
        """A blocking claim starts waiting for another process's build (logged, and shown as progress)."""

    # -- compiling -----------------------------------------------------------------
    def compile_here(self, compile: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
        """Run a compile in this process: (what it gives, None), or (None, why it failed), logged.

        Any exception out of the backend or export is a failed compile with its type and message as the
        reason: a bug there costs speed only. Where `DEFERS`, a backend's CompileDeferred passes through (not
        compiled now: a later call may find room).
        """
        try:
            return compile(), None
        except Exception as error:  # noqa: BLE001 - the boundary: anything the compiler raises
            if self.DEFERS and isinstance(error, CompileDeferred):
                log.warning("%s: not compiled now: %s", self.label, error)
                raise
            reason = failure_text(error, self.EXPECTED)
            if isinstance(error, self.EXPECTED):
                log.warning("%s: %s", self.label, reason)
            else:
                log.warning("%s: compile failed unexpectedly: %s: %s", self.label, type(error).__name__, error)
                log.debug("%s: traceback of the failed compile", self.label, exc_info=True)
            return None, reason

    def start_building(self, family: FamilyKey, start: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
        """Start a background build (traced now, built in a child process): (the build, None); (None, None)
        where it must be built in this process instead (`IN_PROCESS`, logged); (None, why) when tracing
        failed, recorded as a failed compile."""
        try:
            with third_party_quiet():
                return start(), None
        except self.IN_PROCESS as why:
            log.info("%s: building in this process: %s", self.label, why)
            return None, None
        except Exception as error:  # noqa: BLE001 - whatever the trace raises: as a failed compile
            failure = failure_text(error, self.EXPECTED)
            self.failures[family.id] = failure
            return None, failure

    def take_in(self, family: FamilyKey, what: str, finish: Callable[[], T]) -> Tuple[Optional[T], Optional[str]]:
        """Take in a finished background build: (what `finish` gives, None), or (None, why) for a failed build,
        recorded as a failed compile and logged: it costs speed only."""
        try:
            with stage(f"taking in {what} built in the background"), third_party_quiet():
                return finish(), None
        except Exception as error:  # noqa: BLE001 - the boundary: a failed build costs speed only
            why = failure_text(expected_failure(error), self.EXPECTED)
            self.failures[family.id] = why
            log.warning("%s: the background build failed: %s", self.label, why)
            return None, why

    # -- landing -------------------------------------------------------------------
    def landed(self, graph: CompiledGraph, family: FamilyKey, how: str, seconds: float, detail: dict,
               signature: Optional[dict] = None) -> None:
        """A graph compiled here or taken in joins the registry, with a compile event saying `how`."""
        self.registry.add(graph)
        if signature is not None:
            self.registry.note_signature(family.signature, signature)
        self.registry.record(COMPILE, family, f"{self.label}: {how}", seconds=seconds, graph_id=graph.key.id,
                             detail=detail)

    def keep(self, graph: CompiledGraph, call: Optional[FlatCall]) -> None:
        """Write a landed graph into the store where the source does (a block server writes its own, adopted)."""


__all__ = ["RECHECK_S", "Claimed", "Found", "GraphSource", "Wrapper", "failure_text"]
