"""One exception boundary: whatever the pack raises while serving a call, the call runs eagerly.

Faults are injected at each stage -- export, guard extraction, AOTInductor,
loading a package, checking guards, binding weights, running a graph -- with
exception types the code does not expect. The call returns the eager output,
the reason (stage and exception) is recorded, and nothing escapes.
"""

from __future__ import annotations

import pytest
import torch

from compiler import CompiledForward, CompileOptions, GraphRegistry, GraphStore, ShapeRange
from compiler.backends import aot, aot_export, aot_loading
from compiler.keys.guards import GuardSet, GuardSyntaxError
from compiler.demo.tiny_models import tiny_unet
from tests.support.inputs import unet_inputs

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

ERRORS = [ValueError("injected"), KeyError("injected"), OSError("injected"), RuntimeError("injected"),
          GuardSyntaxError("injected")]


def _raiser(error: BaseException):
    def raise_it(*args, **kwargs):
        raise error
    return raise_it


class TinyConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, sample):
        return self.conv(sample) * 2


def _last_fallback(registry: GraphRegistry) -> str:
    assert registry.fallbacks, "no fallback was recorded"
    return registry.fallbacks[-1].reason


# -- compile stages: a tiny convolution, so nothing real is built ---------------------------------------

def _failing_build_process(monkeypatch, error: BaseException) -> None:
    """The build process (launch.CHILD) replaced by one that fails as AOTInductor would, with `error`."""
    import tempfile
    from pathlib import Path

    from compiler.builds import launch

    script = Path(tempfile.mkdtemp(prefix="kf-fault-")) / "child.py"
    script.write_text("import os, sys\n"
                      "with open(os.path.join(sys.argv[1], 'error.txt'), 'w') as f:\n"
                      f"    f.write({type(error).__name__ + ': injected'!r} + '\\n')\n"
                      "sys.exit(1)\n")
    monkeypatch.setattr(launch, "CHILD", script)


def _in_this_process(monkeypatch, error: BaseException) -> None:
    """A program that cannot travel to a build process is built here: AOTInductor raising here."""
    from compiler.builds import job_folder
    from compiler.backends.base import BuildInProcess

    monkeypatch.setattr(job_folder, "weightless", _raiser(BuildInProcess("a test keeps it here")))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", _raiser(error))


COMPILE_STAGES = {
    "export": ("torch.export.export", lambda mp, e: mp.setattr(torch.export, "export", _raiser(e))),
    "guard extraction": ("_guards_from", lambda mp, e: mp.setattr(aot_export, "_guards_from", _raiser(e))),
    "AOTInductor in its build process": ("the build process", _failing_build_process),
    "AOTInductor in this process": ("aoti_compile_and_package", _in_this_process),
}


@pytest.mark.parametrize("stage", list(COMPILE_STAGES))
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_compile_stage_that_raises_runs_eager_with_the_reason(monkeypatch, stage, error):
    _, inject = COMPILE_STAGES[stage]
    inject(monkeypatch, error)
    module = TinyConv().eval()
    registry = GraphRegistry()
    compiled = CompiledForward(module, CompileOptions(shape_range=ShapeRange(batch=(1, 2), spatial=(4, 8)),
                                                      label="conv"), registry)
    sample = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        served = compiled.serve((sample,), {})
        expected = module(sample)
    assert served.eager and torch.equal(served.output, expected)
    assert type(error).__name__ in served.reason and "injected" in served.reason
    assert "compile failed" in _last_fallback(registry)
    assert registry.compiles == []


# -- stages of a loaded graph: the session's saved tiny UNet graphs ------------------------------------

@pytest.fixture()
def loaded(saved_pipe, test_range):
    """A fresh UNet (other weights) served by the saved graphs in a fresh registry, after one good call."""
    registry = GraphRegistry()
    unet = tiny_unet(seed=3)
    compiled = CompiledForward(unet, CompileOptions(shape_range=test_range, store=GraphStore(saved_pipe.graphs),
                                                    compile_on_miss=False, label="unet"), registry)
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        first = compiled.serve(args, kwargs)
    assert not first.eager and first.origin == "loaded", first.reason
    return compiled, registry, args, kwargs


def _served_eagerly(compiled, args, kwargs):
    with torch.no_grad():
        served = compiled.serve(args, kwargs)
        expected = compiled.eager(*args, **kwargs)
    assert served.eager
    assert torch.equal(served.output[0], expected[0])
    return served


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_guard_check_that_raises_runs_eager_with_the_reason(loaded, monkeypatch, error):
    compiled, registry, args, kwargs = loaded
    monkeypatch.setattr(GuardSet, "first_failure", _raiser(error))
    served = _served_eagerly(compiled, args, kwargs)
    assert "shape guards failed unexpectedly" in served.reason and type(error).__name__ in served.reason
    assert _last_fallback(registry).startswith("unet: checking the graphs' shape guards failed unexpectedly")


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_binding_weights_that_raises_runs_eager_with_the_reason(loaded, monkeypatch, error):
    compiled, registry, args, kwargs = loaded
    monkeypatch.setattr(aot.AotGraph, "_bind", _raiser(error))
    served = _served_eagerly(compiled, args, kwargs)
    assert "running graph" in served.reason and type(error).__name__ in served.reason


class _BrokenRunner:
    """The loaded runner, except that running it raises."""

    def __init__(self, runner, error):
        self._runner, self._error = runner, error

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def __call__(self, *args, **kwargs):
        raise self._error


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_graph_run_that_raises_runs_eager_with_the_reason(loaded, error):
    compiled, registry, args, kwargs = loaded
    graph = registry.graphs()[0]
    graph._runners = {index: _BrokenRunner(runner, error) for index, runner in graph._runners.items()}
    served = _served_eagerly(compiled, args, kwargs)
    assert f"running graph {graph.key.id} failed unexpectedly: {type(error).__name__}" in served.reason


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_loading_a_package_that_raises_runs_eager_with_the_reason(saved_pipe, test_range, monkeypatch, error):
    monkeypatch.setattr(aot_loading, "_load_runner", _raiser(error))
    registry = GraphRegistry()
    compiled = CompiledForward(tiny_unet(seed=3), CompileOptions(
        shape_range=test_range, store=GraphStore(saved_pipe.graphs), compile_on_miss=False, label="unet"), registry)
    args, kwargs = unet_inputs(2, 16, 16)
    served = _served_eagerly(compiled, args, kwargs)
    assert "failed to load" in served.reason and type(error).__name__ in served.reason
    assert any("failed to load" in e.reason for e in registry.events if e.kind == "refused")


def test_the_eager_functions_own_error_reaches_the_caller():
    """Only the pack's faults are absorbed: a model that raises still raises."""
    compiled = CompiledForward(TinyConv(), CompileOptions(compile_on_miss=False), GraphRegistry())
    with pytest.raises(RuntimeError):
        compiled.serve((torch.randn(1, 3, 8, 8),), {})  # 3 channels: the model itself cannot run this
