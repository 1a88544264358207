"""Background builds (CompileOptions.background): the graph builds in a child process while calls run eager.

A tiny diffusers SD UNet: the first call returns eager's output while its graph is still building (the
build is slowed on purpose by 20 s, so a call that waited for it could not return with the build pending);
calls meanwhile start no second build; once the build lands, calls at other sizes and batches run on the
graph, equal eager, with the one compile recorded as built in the background. A build cancelled mid-way
leaves no child process and no files; a build that fails leaves the inputs eager with the reason; warmup
waits for its graphs.
"""

from __future__ import annotations

import copy
import gc
import json
import signal
import time

import pytest
import torch

from compiler import CompileOptions
from compiler.builds import status as build_status
from compiler.machine import machine_fit
from compiler.builds import launch, package_builds
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import (HERE, RANGE, background_unet, build_folders, gone, served_difference,
                                      stop_parent_mid_build, unet_call)


@pytest.fixture(scope="module")
def slowed():
    """A background-compiled tiny UNet whose first build is slowed by 20 s; its state after the first call."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
        monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "20")
        unet = tiny_unet(seed=1)
        twin = copy.deepcopy(unet)
        registry = GraphRegistry()
        forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=True), registry)
        probes = []  # Inductor's CPU probe (compiles test programs) runs in the build process, not here
        probe = machine_fit._vec_isa
        monkeypatch.setattr(machine_fit, "_vec_isa", lambda: probes.append(1) or probe())
        threads = torch.get_num_threads()
        difference = served_difference(unet, twin, 1, 16)
        state = dict(difference=difference, pending=forward.builds_pending, live=package_builds.live_builds(),
                     reason=forward.last.reason, eager=forward.last.eager, compiles=len(registry.compiles),
                     probes=len(probes), threads=threads)
        difference = served_difference(unet, twin, 2, 8, 20)  # while building: eager, no second build
        state.update(second_difference=difference, second_live=package_builds.live_builds(),
                     second_reason=forward.last.reason, threads_while_building=torch.get_num_threads())
        yield unet, twin, registry, forward, state
        forward.cancel_builds()


def test_the_first_call_returns_eager_s_output_while_its_graph_builds(slowed):
    _, _, _, _, state = slowed
    assert state["difference"] == 0.0 and state["eager"]
    assert state["pending"] == 1 and state["live"] == 1 and state["compiles"] == 0 and state["probes"] == 0
    assert "building in the background" in state["reason"], state["reason"]
    assert state["second_difference"] == 0.0 and state["second_live"] == 1
    assert "building in the background" in state["second_reason"]
    # The model's calls leave the running build its core (build_cores.py): one intra-op thread fewer.
    assert state["threads_while_building"] == max(1, state["threads"] - 1), state


def test_once_the_build_lands_every_size_runs_on_the_graph_and_equals_eager(slowed):
    unet, twin, registry, forward, state = slowed
    assert forward.wait_for_builds(timeout=600) == 1
    assert package_builds.live_builds() == 0 and forward.builds_pending == 0
    (compiled,) = registry.compiles
    assert "built in the background" in compiled.reason and compiled.detail["background"]
    # The build's memory is stated: the build process's peak and its largest compiler process's.
    assert compiled.detail["peak_rss_mb"] > 50 and compiled.detail["compiler_peak_rss_mb"] > 10, compiled.detail
    # Built for the CPU level the build process picked, stated as a build in this process states it.
    (graph,) = forward.graphs()
    built_here = machine_fit.build_probe()
    needs = graph.info.needs
    assert needs["march"] == (built_here["march"] or "native") and needs["cpu_isa"].upper() == built_here["vec_isa"].upper()
    assert set(machine_fit._features_of_gcc_flags(built_here["vec_flags"])) <= set(needs["cpu_features"])
    assert machine_fit.why_not_here(needs) is None
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (1, 12, 5), (2, 16, 77)):
        difference = served_difference(unet, twin, batch, side, length)
        assert difference < 1e-4, (batch, side, difference)
        assert not forward.last.eager, forward.last.reason
    assert len(registry.compiles) == 1 and registry.mismatches == []
    assert build_folders() == []
    assert torch.get_num_threads() == state["threads"]  # no build runs: the first call after took them back


def test_a_cancelled_build_leaves_no_process_and_no_files(monkeypatch):
    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "600")
    unet = tiny_unet(seed=2)
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=True), GraphRegistry())
    args, kwargs = unet_call(1, 8)
    with torch.no_grad():
        unet(*args, **kwargs)
    assert package_builds.live_builds() == 1 and len(build_folders()) == 1
    assert forward.cancel_builds() == 1
    assert package_builds.live_builds() == 0 and build_folders() == []


def test_dropping_the_model_cancels_its_build(monkeypatch):
    """ComfyUI unloading a model (or a workflow moving to another checkpoint) drops it: nothing would take its
    builds in, so they stop, with nothing left behind."""
    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "600")
    unet = tiny_unet(seed=5)
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=True), GraphRegistry())
    args, kwargs = unet_call(1, 8)
    with torch.no_grad():
        unet(*args, **kwargs)
    assert forward.builds_pending == 1 and package_builds.live_builds() == 1 and len(build_folders()) == 1
    del unet, forward
    gc.collect()
    assert package_builds.live_builds() == 0 and package_builds.waiting_builds() == 0 and build_folders() == []


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_parent_stopped_mid_build_leaves_no_process_and_no_files(tmp_path, how):
    """ComfyUI stopped as services and containers stop it (SIGTERM: Python runs no exit handler; SIGKILL):
    the build sees its parent gone, stops its compilers and removes its folder and the parent's run folder."""
    stopped = stop_parent_mid_build(tmp_path, how, {"KEEPFAST_TEST_BUILD_DELAY_S": "600"})
    assert stopped.run.is_relative_to(stopped.temp)
    assert gone(stopped.pid), "the build process outlived its parent"
    assert not stopped.run.exists() and not list(stopped.temp.rglob("build-*")), sorted(stopped.temp.rglob("*"))


def test_a_failed_build_leaves_the_inputs_eager_with_the_reason(monkeypatch):
    monkeypatch.setattr(launch, "CHILD", HERE / "failing_build_child.py")
    unet, twin, registry, forward = background_unet(seed=3)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=120) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "a test-only failure of the C++ compiler" in forward.last.reason
    assert "not retried" in forward.last.reason
    assert registry.compiles == [] and forward.builds_pending == 0 and build_folders() == []


def test_a_build_past_its_memory_limit_is_stopped_with_the_reason(monkeypatch):
    """A build's memory is bounded: past KEEPFAST_BUILD_MEMORY_MB (with its compilers) it stops, and the inputs
    stay eager with that reason (64 MB: less than the build process needs once torch is imported)."""
    monkeypatch.setenv("KEEPFAST_BUILD_MEMORY_MB", "64")
    unet, twin, registry, forward = background_unet(seed=7)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert forward.wait_for_builds(timeout=300) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    reason = forward.last.reason
    assert "more than its limit of 64 MB (KEEPFAST_BUILD_MEMORY_MB); stopped" in reason, reason
    assert registry.compiles == [] and package_builds.live_builds() == 0 and build_folders() == []


def test_warmup_waits_for_its_graph(monkeypatch):
    """Warmup (and Save Graph) stay blocking: their graphs exist when they return."""
    unet = tiny_unet(seed=4)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=True), registry)
    (served,) = forward.warmup([unet_call(1, 8)])
    assert not served.eager, served.reason
    assert len(registry.compiles) == 1 and forward.builds_pending == 0
    assert "built in the background" not in registry.compiles[0].reason


def test_a_flux_transformer_runs_eager_while_its_block_graphs_build_then_from_them(monkeypatch, tmp_path):
    """Block by block: one build per block structure (2 for Flux), queued one at a time here (2 cores); the
    model's output equals eager's before, while and after they land."""
    from compiler import compile_pipe
    from compiler.blocks.graph_source import BUILDING
    from compiler.diffusers_api import compiled_parts
    from tests.support import tiny_transformers as tt

    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "10")
    monkeypatch.setenv("KEEPFAST_BUILD_PROCESSES", "1")
    times = tmp_path / "build_times.json"
    monkeypatch.setenv("KEEPFAST_BUILD_TIMES_FILE", str(times))  # this machine has built nothing yet
    model = tt.build("flux", seed=0)
    pipe = tt.pipe_of(model)
    registry = GraphRegistry()
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry, background=True)
    engine = compiled_parts(pipe)["transformer"]
    with torch.no_grad():
        got, want = tt.call(model, tt.FIRST), tt.reference(engine, tt.FIRST)
    assert float((got - want).abs().max()) == 0.0
    assert engine.builds_pending == 2 and registry.compiles == []
    deadline = time.monotonic() + 120  # both structures are traced in forked processes at once, then queued
    while package_builds.tracing_builds() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert package_builds.live_builds() == 1 and package_builds.waiting_builds() == 1
    assert all(server.reason == BUILDING for server in engine.servers)
    # What the page and Graph Stats show: graph 1 of 2, no time left known (nothing was ever built here).
    (first,) = build_status.progress()
    assert (first.owner, first.done, first.total, first.left_s) == (engine.label, 0, 2, None), first
    assert len(first.building) == 1 and first.building[0].startswith("block ")
    assert "graph 1 of 2" in first.text() and "time left known after a first build here" in first.text()
    deadline = time.monotonic() + 600
    while not times.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    # The first build's time is this machine's measure: the second build's time left is estimated from it.
    (second,) = build_status.progress()
    assert (second.done, second.total) == (1, 2) and second.left_s is not None and second.left_s > 0, second
    assert "graph 2 of 2" in second.text() and "s left" in second.text()
    deadline = time.monotonic() + 600  # the second build starts when the first ends, with no call meanwhile
    while package_builds.live_builds() + package_builds.waiting_builds() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert package_builds.live_builds() == 0 and package_builds.waiting_builds() == 0
    (built,) = build_status.progress()
    assert built.finished and built.ready == 2 and "2 built, serving from the next call" in built.text()
    assert engine.wait_for_builds() == 2 and engine.builds_pending == 0
    assert len(registry.compiles) == 2 and all(e.detail["background"] for e in registry.compiles)
    assert build_status.progress() == [] and sum(len(v) for v in json.loads(times.read_text()).values()) == 2
    graph_calls = engine.graph_calls
    for dims in tt.sweep("flux")[:4]:
        with torch.no_grad():
            got, want = tt.call(model, dims), tt.reference(engine, dims)
        assert float((got - want).abs().max()) < 1e-4, dims
    assert engine.graph_calls - graph_calls == 4 * tt.BLOCKS["flux"]
    assert len(registry.compiles) == 2 and registry.mismatches == [] and build_folders() == []
