"""A package is loaded in this process only once one loaded in another process of this machine
(compiler/backends/loader_check.py).

On an H100 (torch 2.11+cu130) torch's AOTInductor loader killed every process that loaded a
CUDA package, torch's own example included. This machine has no GPU: KEEPFAST_LOADER_CHECK=all applies the check
to CPU packages, and the crash is made by replacing torch's loader with one that sends SIGSEGV, in the child
processes only (tests/support/crashing_loader.py). What is checked: the test process survives every crash, the
model's outputs equal eager's, the reason names the crash, the machine's verdict is kept, and once a crash was
seen no graph is traced or built for nothing.
"""

from __future__ import annotations

import copy
import json
import zipfile

import pytest
import torch

from compiler import GraphRegistry, ShapeRange, load_pipe
from compiler.backends import loader_check, package_loader
from compiler.builds import launch, package_builds, spares
from compiler.serving.compiled_forward import CompileOptions
from compiler.diffusers_api import compile_module
from compiler.store.graph_store import GraphRefused, GraphStore
from compiler.demo.tiny_models import tiny_sd_pipeline
from tests.support import tiny_transformers
from tests.support.background import HERE
from tests.support.inputs import unet_inputs

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

RANGE = ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160))


@pytest.fixture
def checked(monkeypatch, tmp_path):
    """CPU packages checked as GPU ones are; this test's own verdicts; the check processes counted."""
    monkeypatch.setenv(loader_check.CHECK_ENV, "all")
    monkeypatch.setenv(loader_check.VERDICTS_ENV, str(tmp_path / "package-loader.json"))
    runs = []
    real = loader_check.subprocess.run

    def run(command, **kw):
        if isinstance(command, list) and len(command) > 1 and command[1] == str(loader_check.CHILD):
            runs.append(command)  # a check process (not the compilers torch.compile runs)
        return real(command, **kw)

    monkeypatch.setattr(loader_check.subprocess, "run", run)
    return runs


def _crashing_checks(monkeypatch):
    monkeypatch.setattr(loader_check, "CHILD", HERE / "crashing_loader_check_child.py")


def _verdict() -> loader_check.Verdict:
    return loader_check.known("cpu")


def _exports(monkeypatch) -> list:
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    return calls


def _unet_difference(unet, twin) -> float:
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        return float((unet(*args, **kwargs)[0] - twin(*args, **kwargs)[0]).abs().max())


# -- loading saved graphs --------------------------------------------------------------------------------------

def test_a_saved_graph_is_loaded_in_a_separate_process_first_then_here_at_once(saved_pipe, checked):
    pipe, twin = tiny_sd_pipeline(seed=0), tiny_sd_pipeline(seed=0)
    registry = GraphRegistry()
    load_pipe(pipe, saved_pipe.graphs, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    assert len(checked) == 1 and checked[0][1].endswith("package_loader.py"), checked  # one check, then trusted
    assert _verdict() == (True, "a package loaded in a separate process")
    assert len(registry.loads) >= 2 and len(registry.compiles) == 0  # UNet and VAE decoder, both loaded here
    assert _unet_difference(pipe.unet, twin.unet) < 1e-4
    assert len(registry.compiles) == 0


def test_a_saved_graph_whose_load_crashes_the_check_process_is_not_loaded_and_torch_compile_serves(
        saved_pipe, checked, monkeypatch):
    _crashing_checks(monkeypatch)
    exports = _exports(monkeypatch)
    pipe, twin = tiny_sd_pipeline(seed=0), tiny_sd_pipeline(seed=0)
    registry = GraphRegistry()
    load_pipe(pipe, saved_pipe.graphs, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    assert len(checked) == 1  # the first crash is the verdict: the second graph is not tried
    verdict = _verdict()
    assert verdict is not None and not verdict.loads
    assert "SIGSEGV" in verdict.reason and "loading a cpu graph in a separate process" in verdict.reason
    assert len(registry.loads) == 0
    # The model's first call: no package traced or built; torch.compile in this process (not saved), its output
    # compared with eager.
    assert _unet_difference(pipe.unet, twin.unet) < 1e-4
    assert exports == []
    first = registry.compiles[0].reason
    assert "crashed (SIGSEGV)" in first and "torch.compile in this process" in first, first
    assert {g.key.family.backend for g in registry.graphs()} == {"inductor"}


def test_a_crash_seen_once_stands_and_another_machine_key_is_asked_again(checked, monkeypatch, tmp_path):
    loader_check.record("cpu", False, "crashed once")
    loader_check.record("cpu", True, "loaded later")
    assert _verdict() == (False, "crashed once")
    monkeypatch.setattr(loader_check, "machine_key", lambda kind: f"{kind} | torch 9.9")
    assert _verdict() is None


def test_a_crash_recorded_before_the_pack_linked_libstdcxx_as_a_shared_library_does_not_stand(checked):
    """The GPU machines' crashes came from a libstdc++ linked statically into the package (cxx_linkage.py); a
    verdict recorded by a pack that did not check that is not this pack's, and is asked again."""
    key = loader_check.machine_key("cpu")
    assert key.endswith(loader_check.LINKAGE_MARK)
    older = key[: -len(" | " + loader_check.LINKAGE_MARK)]
    loader_check.verdicts_path().write_text(json.dumps({older: {"loads": False, "reason": "crashed (SIGSEGV)"}}))
    assert _verdict() is None


def test_an_unreadable_verdict_file_is_an_open_question(checked, tmp_path):
    path = loader_check.verdicts_path()
    path.write_text("{not json")
    assert _verdict() is None
    loader_check.record("cpu", True, "loaded")
    assert json.loads(path.read_text())[loader_check.machine_key("cpu")]["loads"] is True


def test_cpu_packages_are_loaded_here_unless_asked_and_gpu_ones_always_checked(monkeypatch):
    monkeypatch.delenv(loader_check.CHECK_ENV, raising=False)
    assert not loader_check.applies("cpu") and loader_check.applies("cuda")
    monkeypatch.setenv(loader_check.CHECK_ENV, "0")
    assert not loader_check.applies("cuda")


def test_the_models_of_a_package_in_parts_are_each_loaded(tmp_path):
    path = tmp_path / "parts.pt2"
    with zipfile.ZipFile(path, "w") as archive:
        for name in ("part_0", "part_1"):
            archive.writestr(f"graph/data/aotinductor/{name}/wrapper.so", b"")
        archive.writestr("graph/data/constants/x", b"")
    assert package_loader.model_names(str(path)) == ["part_0", "part_1"]


# -- building --------------------------------------------------------------------------------------------------

class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_build_whose_package_crashes_the_loader_runs_eager_with_the_reason_and_builds_no_more(
        checked, monkeypatch):
    monkeypatch.setattr(launch, "CHILD", HERE / "crashing_load_build_child.py")
    monkeypatch.setenv(spares.SPARE_ENV, "0")
    module = _Small()
    twin = copy.deepcopy(module)
    registry = GraphRegistry()
    compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 8))), registry)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(module(x), twin(x))  # eager: the build's process died, this one did not
    verdict = _verdict()
    assert verdict is not None and not verdict.loads
    assert "crashed (SIGSEGV) loading the cpu graph its build process had just built" in verdict.reason
    assert len(registry.compiles) == 0
    reasons = [e.reason for e in registry.fallbacks]
    assert any("SIGSEGV" in r for r in reasons), reasons
    # Another model: no package traced or built; torch.compile in this process instead, with the reason.
    starts = []
    monkeypatch.setattr(package_builds, "start", lambda *a, **k: starts.append(1))
    exports = _exports(monkeypatch)
    other = _Small()
    other_twin = copy.deepcopy(other)
    other_registry = GraphRegistry()
    compile_module(other, CompileOptions(shape_range=ShapeRange(batch=(1, 8))), other_registry)
    with torch.no_grad():
        assert float((other(x) - other_twin(x)).abs().max()) < 1e-5
    assert starts == [] and exports == []
    assert [verdict.reason in e.reason and "torch.compile" in e.reason for e in other_registry.compiles] == [True]
    assert len(checked) == 0  # what a build process loaded needed no check process


def test_a_build_process_loads_its_package_before_this_process_does(checked, tmp_path):
    module = _Small()
    twin = copy.deepcopy(module)
    registry = GraphRegistry()
    store = GraphStore(tmp_path / "graphs")
    compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 8)), store=store, autosave=True),
                   registry)
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert float((module(x) - twin(x)).abs().max()) < 1e-5
    assert len(registry.compiles) == 1
    assert "load_check_s" in registry.compiles[0].detail["phase_s"], registry.compiles[0].detail
    assert _verdict() == (True, "a package loaded in its build process")
    assert checked == []  # the build process's load was the check
    # A new process (a new registry) loads the saved graph here at once: the machine's loader is known good.
    fresh, fresh_registry = copy.deepcopy(twin), GraphRegistry()
    compile_module(fresh, CompileOptions(shape_range=ShapeRange(batch=(1, 8)), store=store), fresh_registry)
    with torch.no_grad():
        assert float((fresh(x) - twin(x)).abs().max()) < 1e-5
    assert len(fresh_registry.loads) == 1 and len(fresh_registry.compiles) == 0 and checked == []


def test_blocks_run_eager_with_the_reason_where_the_loader_crashed(checked, monkeypatch):
    from compiler.blocks import BlockOptions, compile_blocks

    loader_check.record("cpu", False, "torch's AOTInductor package loader crashed (SIGSEGV) in a test")
    exports = _exports(monkeypatch)
    model = tiny_transformers.build("flux")
    twin = copy.deepcopy(model)
    registry = GraphRegistry()
    dims = tiny_transformers.sweep("flux")[0]
    engine = compile_blocks(model, BlockOptions(shape_range=tiny_transformers.RANGE), registry)
    assert torch.equal(tiny_transformers.call(model, dims), tiny_transformers.call(twin, dims))
    assert exports == [] and len(registry.compiles) == 0
    assert "crashed (SIGSEGV) in a test" in json.dumps(engine.report(), default=str)


def test_a_package_refused_here_raises_the_reason_not_a_crash(checked, monkeypatch, saved_pipe):
    _crashing_checks(monkeypatch)
    store = GraphStore(saved_pipe.graphs)
    with pytest.raises(GraphRefused, match="failed to load: CompileFailed: .*SIGSEGV"):
        store.load(store.graphs()[0])
    assert loader_check.refusal("cpu") is not None


def test_where_the_loader_crashed_a_whole_model_is_compiled_by_torch_compile_in_this_process(checked, monkeypatch,
                                                                                              tmp_path):
    loader_check.record("cpu", False, "torch's AOTInductor package loader crashed (SIGSEGV) in a test")
    exports = _exports(monkeypatch)
    module = _Small()
    twin = copy.deepcopy(module)
    registry = GraphRegistry()
    store = GraphStore(tmp_path / "graphs")
    forward = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 8)), store=store,
                                                    autosave=True), registry)
    with torch.no_grad():
        for batch in (3, 5, 3):
            x = torch.randn(batch, 16)
            assert float((module(x) - twin(x)).abs().max()) < 1e-5
    assert exports == []  # no package traced for a loader that crashes
    assert len(registry.compiles) >= 1
    assert all(e.graph_id and "crashed (SIGSEGV) in a test" in e.reason and "torch.compile in this process" in e.reason
               for e in registry.compiles), [e.reason for e in registry.compiles]
    assert forward.last_status == "compiled graph", forward.last_status
    assert {g.key.family.backend for g in forward.graphs()} == {"inductor"}
    assert not list((tmp_path / "graphs").rglob("*.pt2"))  # torch.compile's graphs are not saved
