"""Background builds trace in a forked copy of the process (compiler/backends/forked_trace.py): the call that
starts a build does not wait for torch.export.

A tiny diffusers SD UNet with background builds. torch.export is counted in this process: a trace in the fork
counts in the fork's memory only, so this process's count stays 0 while the graph still lands and equals eager.
A trace that fails in the fork leaves the inputs eager with its reason (and forks go on); a fork that dies,
hangs past its timeout or outlives its parent is handled: the reason says so, nothing is left running or on
disk, and a fork that misbehaved makes later traces run in the caller.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from compiler import CompileOptions, ShapeRange, build_status
from compiler.backends import aot, forked_trace, package_builds
from compiler.backends.base import CompileFailed
from compiler.diffusers_api import compile_module
from compiler.extraction import run_folder
from compiler.registry import GraphRegistry
from compiler.testing.tiny_models import prompt_embeds, tiny_unet

SUPPORT = Path(__file__).parent / "support"
RANGE = ShapeRange(batch=(1, 2), spatial=(8, 16), sequence=(1, 77))


def _call(batch: int, side: int, length: int = 77):
    latent = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(side + batch))
    return (latent, torch.tensor(500.0), prompt_embeds(batch, length)), {"return_dict": False}


def _served(unet, twin, batch, side, length=77):
    args, kwargs = _call(batch, side, length)
    with torch.no_grad():
        got, want = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
    return float((got - want).abs().max())


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _build_folders():
    return sorted(p.name for p in run_folder().glob("build-*"))


@pytest.fixture
def exports(monkeypatch):
    """torch.export.export calls in this process (a fork's calls count in the fork's copy of the list)."""
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    monkeypatch.setattr(forked_trace, "_disabled", None)  # whatever an earlier test did, forks are on here
    return calls


def _background(seed: int):
    unet = tiny_unet(seed=seed)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    return unet, twin, registry, compile_module(unet, CompileOptions(shape_range=RANGE, background=True), registry)


def _failing_trace(monkeypatch, failure):
    """aot.trace replaced by `failure()` (the fork inherits the replacement)."""
    monkeypatch.setattr(aot, "trace", lambda *args, **kwargs: failure())


def test_the_trace_runs_in_a_forked_process_and_its_graph_lands(exports):
    unet, twin, registry, forward = _background(seed=11)
    assert _served(unet, twin, 1, 16) == 0.0 and forward.last.eager
    assert "building in the background" in forward.last.reason
    assert exports == [], "the first call traced in the caller's process"
    (view,) = [v for v in package_builds.snapshot()[0] if v.label.owner_id.startswith(forward.label)]
    assert view.state in (package_builds.TRACING, package_builds.WAITING, package_builds.BUILDING)
    assert forward.wait_for_builds(timeout=600) == 1
    (compiled,) = registry.compiles
    assert "built in the background" in compiled.reason
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (1, 12, 5)):
        assert _served(unet, twin, batch, side, length) < 1e-4
        assert not forward.last.eager, forward.last.reason
    assert exports == [] and len(registry.compiles) == 1 and registry.mismatches == []
    assert forked_trace.unavailable([]) is None and _build_folders() == []


def test_a_trace_that_fails_in_the_fork_leaves_the_inputs_eager_with_its_reason(exports, monkeypatch):
    def failure():
        raise CompileFailed("torch.export failed: a test-only trace failure")

    _failing_trace(monkeypatch, failure)
    unet, twin, registry, forward = _background(seed=12)
    assert _served(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=120) == 0
    assert _served(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "compile failed: torch.export failed: a test-only trace failure" in forward.last.reason
    assert registry.compiles == [] and forward.builds_pending == 0 and _build_folders() == []
    assert forked_trace.unavailable([]) is None  # the model's failure, not the fork's: forks go on


def test_a_trace_process_that_dies_says_so_and_later_traces_run_in_the_caller(exports, monkeypatch):
    _failing_trace(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGKILL))
    unet, twin, registry, forward = _background(seed=13)
    assert _served(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=120) == 0
    assert _served(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "the trace process was killed by signal 9" in forward.last.reason, forward.last.reason
    assert "killed by signal 9" in (forked_trace.unavailable([]) or "")
    assert registry.compiles == [] and _build_folders() == []


def test_a_trace_past_its_timeout_is_stopped(exports, monkeypatch):
    monkeypatch.setenv(forked_trace.TIMEOUT_ENV, "1")
    _failing_trace(monkeypatch, lambda: time.sleep(600))
    unet, twin, registry, forward = _background(seed=14)
    assert _served(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=60) == 0
    assert _served(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "ran longer than 1 s" in forward.last.reason, forward.last.reason
    assert package_builds.live_builds() == 0 and _build_folders() == []


def test_cancelling_mid_trace_leaves_no_process_and_no_files(exports, monkeypatch):
    _failing_trace(monkeypatch, lambda: time.sleep(600))
    unet, twin, registry, forward = _background(seed=15)
    assert _served(unet, twin, 1, 8) == 0.0
    (build,) = [b for b in package_builds._live if b.label.owner_id.startswith(forward.label)]
    pid = build.tracer.pid
    assert package_builds.tracing_builds() == 1 and not _gone(pid)
    # The page and Graph Stats show the trace as the build's first stage.
    (entry,) = build_status.progress()
    assert entry.building == ("UNet2DConditionModel (tracing)",) and "graph 1 of 1" in entry.text(), entry.text()
    assert forward.cancel_builds() == 1
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid) and package_builds.live_builds() == 0 and _build_folders() == []
    assert forked_trace.unavailable([]) is None  # a cancellation is no fault of the fork's


def test_with_forks_off_the_caller_traces(exports, monkeypatch):
    monkeypatch.setenv(forked_trace.ENV, "0")
    monkeypatch.setattr(package_builds, "CHILD", SUPPORT / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "600")
    unet, twin, registry, forward = _background(seed=16)
    assert _served(unet, twin, 1, 8) == 0.0 and "building in the background" in forward.last.reason
    assert len(exports) >= 1 and package_builds.tracing_builds() == 0
    assert forward.cancel_builds() == 1 and _build_folders() == []


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_parent_stopped_mid_trace_leaves_no_process_and_no_files(tmp_path, how):
    """The trace process ends with its parent (its parent-death signal) and removes what the parent left."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "KEEPFAST_TEST_STOP_IN_TRACE": "1"}
    parent = subprocess.Popen([sys.executable, str(SUPPORT / "background_parent.py")], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        tracer_pid, run = parent.stdout.readline().split()
        assert not _gone(int(tracer_pid))
    finally:
        parent.send_signal(how)
        parent.wait(60)
    deadline = time.monotonic() + 30
    while (not _gone(int(tracer_pid)) or Path(run).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(int(tracer_pid)), "the trace process outlived its parent"
    assert not Path(run).exists() and not list(temp.rglob("build-*")), sorted(temp.rglob("*"))
