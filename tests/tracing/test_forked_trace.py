"""Background builds trace in a forked copy of the process (compiler/tracing/forked_trace.py): the call that
starts a build does not wait for torch.export.

A tiny diffusers SD UNet with background builds. torch.export is counted in this process: a trace in the fork
counts in the fork's memory only, so this process's count stays 0 while the graph still lands and equals eager.
A trace that fails in the fork leaves the inputs eager with its reason (and forks go on); a fork that dies,
hangs past its timeout or outlives its parent is handled: the reason says so, nothing is left running or on
disk, and a fork that misbehaved makes later traces run in the caller.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from compiler.builds import status as build_status
from compiler.backends import aot_export
from compiler.tracing import forked_trace
from compiler.builds import launch, package_builds
from compiler.backends.base import CompileFailed
from tests.support.background import (HERE, background_unet, build_folders, gone, served_difference,
                                      stop_parent_mid_build)


@pytest.fixture
def exports(monkeypatch):
    """torch.export.export calls in this process (a fork's calls count in the fork's copy of the list)."""
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    monkeypatch.setattr(forked_trace, "_disabled", None)  # whatever an earlier test did, forks are on here
    return calls


def _failing_trace(monkeypatch, failure):
    """aot_export.trace replaced by `failure()` (the fork inherits the replacement)."""
    monkeypatch.setattr(aot_export, "trace", lambda *args, **kwargs: failure())


def test_the_trace_runs_in_a_forked_process_and_its_graph_lands(exports):
    unet, twin, registry, forward = background_unet(seed=11)
    assert served_difference(unet, twin, 1, 16) == 0.0 and forward.last.eager
    assert "building in the background" in forward.last.reason
    assert exports == [], "the first call traced in the caller's process"
    (view,) = [v for v in package_builds.snapshot()[0] if v.label.owner_id.startswith(forward.label)]
    assert view.state in (package_builds.TRACING, package_builds.WAITING, package_builds.BUILDING)
    assert forward.wait_for_builds(timeout=600) == 1
    (compiled,) = registry.compiles
    assert "built in the background" in compiled.reason
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (1, 12, 5)):
        assert served_difference(unet, twin, batch, side, length) < 1e-4
        assert not forward.last.eager, forward.last.reason
    assert exports == [] and len(registry.compiles) == 1 and registry.mismatches == []
    assert forked_trace.unavailable([]) is None and build_folders() == []


def test_a_trace_that_fails_in_the_fork_leaves_the_inputs_eager_with_its_reason(exports, monkeypatch):
    def failure():
        raise CompileFailed("torch.export failed: a test-only trace failure")

    _failing_trace(monkeypatch, failure)
    unet, twin, registry, forward = background_unet(seed=12)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=120) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "compile failed: torch.export failed: a test-only trace failure" in forward.last.reason
    assert registry.compiles == [] and forward.builds_pending == 0 and build_folders() == []
    assert forked_trace.unavailable([]) is None  # the model's failure, not the fork's: forks go on


def test_a_trace_process_that_dies_says_so_and_later_traces_run_in_the_caller(exports, monkeypatch):
    _failing_trace(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGKILL))
    unet, twin, registry, forward = background_unet(seed=13)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=120) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "the trace process was killed by signal 9" in forward.last.reason, forward.last.reason
    assert "killed by signal 9" in (forked_trace.unavailable([]) or "")
    assert registry.compiles == [] and build_folders() == []


def test_a_trace_past_its_timeout_is_stopped(exports, monkeypatch):
    monkeypatch.setenv(forked_trace.TIMEOUT_ENV, "1")
    _failing_trace(monkeypatch, lambda: time.sleep(600))
    unet, twin, registry, forward = background_unet(seed=14)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=60) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "ran longer than 1 s" in forward.last.reason, forward.last.reason
    assert package_builds.live_builds() == 0 and build_folders() == []


def test_cancelling_mid_trace_leaves_no_process_and_no_files(exports, monkeypatch):
    _failing_trace(monkeypatch, lambda: time.sleep(600))
    unet, twin, registry, forward = background_unet(seed=15)
    assert served_difference(unet, twin, 1, 8) == 0.0
    (build,) = [b for b in package_builds._live if b.label.owner_id.startswith(forward.label)]
    pid = build.tracer.pid
    assert package_builds.tracing_builds() == 1 and not gone(pid)
    # The page and Graph Stats show the trace as the build's first stage.
    (entry,) = build_status.progress()
    assert entry.building == ("UNet2DConditionModel (tracing)",) and "graph 1 of 1" in entry.text(), entry.text()
    assert forward.cancel_builds() == 1
    deadline = time.monotonic() + 30
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid) and package_builds.live_builds() == 0 and build_folders() == []
    assert forked_trace.unavailable([]) is None  # a cancellation is no fault of the fork's


def test_with_forks_off_the_caller_traces(exports, monkeypatch):
    monkeypatch.setenv(forked_trace.ENV, "0")
    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "600")
    unet, twin, registry, forward = background_unet(seed=16)
    assert served_difference(unet, twin, 1, 8) == 0.0 and "building in the background" in forward.last.reason
    assert len(exports) >= 1 and package_builds.tracing_builds() == 0
    assert forward.cancel_builds() == 1 and build_folders() == []


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_parent_stopped_mid_trace_leaves_no_process_and_no_files(tmp_path, how):
    """The trace process ends with its parent (its parent-death signal) and removes what the parent left."""
    stopped = stop_parent_mid_build(tmp_path, how, {"KEEPFAST_TEST_STOP_IN_TRACE": "1"})
    assert stopped.ran
    assert gone(stopped.pid), "the trace process outlived its parent"
    assert not stopped.run.exists() and not list(stopped.temp.rglob("build-*")), sorted(stopped.temp.rglob("*"))


def test_a_parent_gone_before_its_trace_process_started_leaves_no_process_and_no_files(tmp_path):
    """The trace process holds a copy of its parent's run lock from the fork: it lets go of it even when the parent
    is gone before the child's first step (a busy CI machine), else the parent's folder is never swept."""
    stopped = stop_parent_mid_build(tmp_path, signal.SIGKILL, {"KEEPFAST_TEST_STOP_IN_TRACE": "1",
                                                               "KEEPFAST_TEST_TRACE_START_DELAY_S": "3"})
    assert stopped.ran
    assert gone(stopped.pid), "the trace process outlived its parent"
    assert not stopped.run.exists() and not list(stopped.temp.rglob("build-*")), sorted(stopped.temp.rglob("*"))
