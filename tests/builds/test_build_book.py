"""Background builds belong to the process, not to one wrapper of a model (compiler/builds/book.py).

ComfyUI drops a Speedup node's output whenever another workflow runs or something upstream changes, and makes a
new one for the next run of the pack's workflow. Here a wrapper (CompiledForward) of a tiny SD UNet starts a
background build and is dropped, as that output is; a new wrapper of the same module then adopts the build in
flight, or takes in the finished graph at its first call: one build in all, every later call from the graph and
equal to eager. A build whose every module is gone stops; a build that failed is not started again by the next
wrapper.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from compiler import CompiledForward, CompileOptions
from compiler.builds import launch, package_builds
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import HERE, RANGE, build_folders, unet_call

OPTIONS = CompileOptions(shape_range=RANGE, background=True, label="unet")


def _run(forward: CompiledForward, twin, batch: int, side: int, length: int = 77) -> float:
    args, kwargs = unet_call(batch, side, length)
    with torch.no_grad():
        return float((forward(*args, **kwargs)[0] - twin(*args, **kwargs)[0]).abs().max())


def _book_builds(registry: GraphRegistry):
    return [registry.builds.get(key) for key in registry.builds.pending()]


@pytest.fixture()
def slow_builds(monkeypatch):
    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "10")


def test_a_new_wrapper_adopts_the_build_in_flight_of_a_dropped_one(slow_builds):
    unet = tiny_unet(seed=11)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    progress = []
    registry.add_listener(lambda event: progress.append(event) if event.kind == "progress" else None)
    first = CompiledForward(unet, OPTIONS, registry)
    assert _run(first, twin, 1, 16) == 0.0 and first.last.eager
    assert first.builds_pending == 1 and package_builds.live_builds() == 1
    del first
    gc.collect()
    assert package_builds.live_builds() == 1, "dropping a wrapper stopped the build of a model still loaded"
    second = CompiledForward(unet, OPTIONS, registry)
    assert _run(second, twin, 2, 8, 20) == 0.0 and second.last.eager
    assert "building in the background" in second.last.reason, second.last.reason
    assert second.builds_pending == 1 and package_builds.live_builds() == 1  # adopted: no second build
    (adopted,) = [event for event in progress if event.detail.get("adopted")]  # what the page's badge shows
    assert "adopted the background build" in adopted.reason, adopted.reason
    assert second.wait_for_builds(timeout=600) == 1
    (compiled,) = registry.compiles
    assert compiled.detail["adopted"] and "started earlier for this model" in compiled.reason
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (2, 12, 5)):
        assert _run(second, twin, batch, side, length) < 1e-4
        assert not second.last.eager, second.last.reason
    assert len(registry.compiles) == 1 and build_folders() == []


def test_a_finished_build_nobody_took_in_serves_the_next_wrapper_s_first_call():
    unet = tiny_unet(seed=12)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    first = CompiledForward(unet, OPTIONS, registry)
    assert _run(first, twin, 1, 16) == 0.0 and first.last.eager
    (building,) = _book_builds(registry)
    del first
    gc.collect()
    assert building.pending.build.wait(timeout=600) and building.pending.done()
    second = CompiledForward(unet, OPTIONS, registry)
    assert _run(second, twin, 2, 8, 20) < 1e-4
    assert not second.last.eager, second.last.reason  # taken in at its first call, not one more eager image
    assert len(registry.compiles) == 1 and registry.builds.pending() == [] and build_folders() == []


def test_a_build_stops_when_every_module_that_could_use_it_is_gone(slow_builds, monkeypatch):
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", "600")
    registry = GraphRegistry()
    unet, other = tiny_unet(seed=13), tiny_unet(seed=14)  # two loaded checkpoints of one structure
    first = CompiledForward(unet, OPTIONS, registry)
    args, kwargs = unet_call(1, 8)
    with torch.no_grad():
        first(*args, **kwargs)
    second = CompiledForward(other, OPTIONS, registry)
    with torch.no_grad():
        second(*args, **kwargs)
    assert package_builds.live_builds() == 1 and second.builds_pending == 1  # adopted by the other module
    del first, unet
    gc.collect()
    assert package_builds.live_builds() == 1  # the other checkpoint can still use it
    del second, other
    gc.collect()
    assert package_builds.live_builds() == 0 and registry.builds.pending() == [] and build_folders() == []


def test_a_failed_build_is_not_started_again_by_the_next_wrapper(monkeypatch):
    import tempfile
    from pathlib import Path

    script = Path(tempfile.mkdtemp(prefix="kf-fail-")) / "child.py"
    script.write_text("import os, sys\nopen(os.path.join(sys.argv[1], 'error.txt'), 'w').write('RuntimeError: "
                      "a build that fails\\n')\nsys.exit(1)\n")
    monkeypatch.setattr(launch, "CHILD", script)
    unet = tiny_unet(seed=15)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    first = CompiledForward(unet, OPTIONS, registry)
    assert _run(first, twin, 1, 16) == 0.0
    (key,) = registry.builds.pending()
    assert first.wait_for_builds(timeout=120) == 0
    assert "a build that fails" in registry.builds.failure(key)
    del first
    gc.collect()
    second = CompiledForward(unet, OPTIONS, registry)
    assert _run(second, twin, 2, 8) == 0.0 and second.last.eager
    assert "a build that fails" in second.last.reason and "not retried" in second.last.reason, second.last.reason
    assert second.builds_pending == 0 and package_builds.live_builds() == 0 and build_folders() == []
