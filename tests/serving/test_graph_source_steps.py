"""The steps both graph sources share (compiler/serving/supply.py's GraphSource), on a source of fakes.

A whole model's graph source (GraphSupply) and a block structure's (BlockGraphSource) take the same steps on a
miss: what rules a compile out, the claim on a shared store (another process's build waited for or run eager
beside), a compile in this process, a background build started and taken in, and the landing. Each step's
texts, events and failure memory here; the sources' own flows are covered end to end by tests/blocks/test_blocks.py,
test_build_claims.py, test_build_book.py, test_background_builds.py and test_fault_boundary.py. No compile
here (fast).
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from compiler.backends.base import BuildInProcess, CompileDeferred, CompileFailed
from compiler.builds import claims as build_claims
from compiler.serving.supply import GraphSource, failure_text
from compiler.store.registry import COMPILE

FAMILY = SimpleNamespace(id="family-1", signature="signature-1")


class _Registry:
    def __init__(self):
        self.graphs, self.signatures, self.events = [], {}, []

    def add(self, graph):
        self.graphs.append(graph)

    def note_signature(self, signature_id, signature):
        self.signatures[signature_id] = signature

    def record(self, kind, family, reason, **fields):
        self.events.append((kind, family, reason, fields))


class _Store:
    def __init__(self, root):
        self.root = root

    def claim_path(self, family):
        return self.root / family.id / ".building-test.lock"


class _Source(GraphSource):
    MISSING = "no stored graph serves this test"

    def __init__(self, store=None, compile_on_miss=True, autosave=True):
        self.label = "model"
        self.registry = _Registry()
        self.options = SimpleNamespace(store=store, autosave=autosave, compile_on_miss=compile_on_miss)
        self.failures = {}
        self.told = []  # what the hooks were told

    def held_elsewhere(self, family, reason):
        self.told.append(("elsewhere", reason))

    def on_wait(self, family, taken):
        self.told.append(("wait", taken.reason()))


def _raiser(error):
    def raise_it():
        raise error
    return raise_it


def test_what_rules_a_compile_out():
    source = _Source(compile_on_miss=False)
    assert source.compiling_off(None) == "no stored graph serves this test; compiling is off"
    assert source.compiling_off("stored graph refused") == "stored graph refused; compiling is off"
    assert _Source().compiling_off("anything") is None
    assert source.failed_before(FAMILY) is None
    source.failures[FAMILY.id] = "compile failed: boom"
    assert source.failed_before(FAMILY) == "compile failed: boom (not retried)"
    backend, why = source.backend_named("no-such-backend")
    assert backend is None and "unknown backend 'no-such-backend'" in why


def test_nothing_is_claimed_where_the_graph_is_not_written(tmp_path):
    assert _Source(store=None).claim_build(FAMILY, None, True, _raiser(AssertionError)) == (None, None, None)
    unsaved = _Source(store=_Store(tmp_path), autosave=False)
    assert unsaved.claim_build(FAMILY, None, False, _raiser(AssertionError)) == (None, None, None)
    assert not list(tmp_path.rglob("*"))


def test_a_background_claim_never_waits_and_names_the_other_builder(tmp_path):
    source = _Source(store=_Store(tmp_path))
    held = build_claims.try_claim(source.options.store.claim_path(FAMILY))  # another claimant holds it
    try:
        claimed = source.claim_build(FAMILY, None, True, _raiser(AssertionError))
        assert claimed.claim is None and claimed.graph is None
        assert "its graph is being built by" in claimed.elsewhere and "shares the graphs folder" in claimed.elsewhere
        assert source.told == [("elsewhere", claimed.elsewhere)]
    finally:
        build_claims.release(held)
    claimed = source.claim_build(FAMILY, None, True, _raiser(AssertionError))  # free now: claimed here
    try:
        assert isinstance(claimed.claim, build_claims.Claim) and claimed.elsewhere is None
        assert source.told[-1] == ("elsewhere", None)
    finally:
        build_claims.release(claimed.claim)


def test_a_blocking_claim_waits_and_loads_the_other_build(tmp_path):
    source = _Source(store=_Store(tmp_path))
    held = build_claims.try_claim(source.options.store.claim_path(FAMILY))
    threading.Timer(0.3, build_claims.release, args=(held,)).start()  # the other build writes its graph, lets go
    shown = []
    claimed = source.claim_build(FAMILY, lambda text, fraction: shown.append((text, fraction)), False,
                                 lambda: ("the other process's graph", None))
    assert claimed == (None, "the other process's graph", None)  # its claim was let go at once
    assert [kind for kind, _ in source.told] == ["wait"]
    assert len(shown) == 1 and shown[0][0].startswith("waiting for ") and shown[0][1] == 0.0
    assert shown[0][0].endswith(", which builds this graph")
    again = build_claims.try_claim(source.options.store.claim_path(FAMILY))
    assert isinstance(again, build_claims.Claim)
    build_claims.release(again)


def test_a_blocking_claim_that_times_out_builds_here_unclaimed(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(build_claims, "wait_seconds", lambda: 0.2)
    source = _Source(store=_Store(tmp_path))
    held = build_claims.try_claim(source.options.store.claim_path(FAMILY))
    try:
        with caplog.at_level("WARNING", logger="keepfast"):
            claimed = source.claim_build(FAMILY, None, False, lambda: (None, "not there"))
    finally:
        build_claims.release(held)
    assert claimed == (None, None, None)
    assert "; building it here too" in caplog.text


def test_a_compile_here_gives_its_failure_as_the_reason():
    source = _Source()
    assert source.compile_here(lambda: "graph") == ("graph", None)
    assert source.compile_here(_raiser(CompileFailed("no kernel"))) == (None, "compile failed: no kernel")
    assert source.compile_here(_raiser(KeyError("x"))) == (None, "compile failed: KeyError: 'x'")
    # a block's export cannot be deferred: a failure like any other
    assert source.compile_here(_raiser(CompileDeferred("no room"))) == (None, "compile failed: no room")
    source.DEFERS = True  # a whole model's: not compiled now, a later call tries again
    with pytest.raises(CompileDeferred):
        source.compile_here(_raiser(CompileDeferred("no room")))
    assert source.failures == {}  # the caller says whether a failed compile is not retried


def test_a_background_build_starts_builds_here_or_fails_as_a_compile():
    source = _Source()
    assert source.start_building(FAMILY, lambda: "pending") == ("pending", None)
    assert source.start_building(FAMILY, _raiser(BuildInProcess("only here"))) == (None, None)
    assert source.failures == {}
    pending, why = source.start_building(FAMILY, _raiser(RuntimeError("trace broke")))
    assert pending is None and why == "compile failed: RuntimeError: trace broke"
    assert source.failures == {FAMILY.id: why}


def test_taking_a_build_in_records_its_failure():
    source = _Source()
    assert source.take_in(FAMILY, "a graph", lambda: "graph") == ("graph", None)
    # the build's CompileFailed is its reason (the stage wrapping it is not a bug of the pack)
    assert source.take_in(FAMILY, "a graph", _raiser(CompileFailed("link failed"))) == (
        None, "compile failed: link failed")
    _, why = source.take_in(FAMILY, "a graph", _raiser(ValueError("bad")))
    assert why.startswith("compile failed: Failure: taking in a graph built in the background failed unexpectedly")
    assert source.failures == {FAMILY.id: why}


def test_a_landed_graph_joins_the_registry_with_its_compile_event():
    source = _Source()
    graph = SimpleNamespace(key=SimpleNamespace(id="graph-1"))
    source.landed(graph, FAMILY, "first call", 1.5, {"shapes": [[1, 4]]}, signature={"tensors": []})
    assert source.registry.graphs == [graph]
    assert source.registry.signatures == {"signature-1": {"tensors": []}}
    assert source.registry.events == [(COMPILE, FAMILY, "model: first call",
                                       {"seconds": 1.5, "graph_id": "graph-1", "detail": {"shapes": [[1, 4]]}})]


def test_failure_text_names_unexpected_types():
    assert failure_text(CompileFailed("a")) == "compile failed: a"
    assert failure_text(OSError("b")) == "compile failed: OSError: b"
    assert failure_text(OSError("b"), expected=(OSError,)) == "compile failed: b"
