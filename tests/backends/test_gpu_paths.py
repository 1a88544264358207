"""CUDA paths, checked on a CPU with torch.cuda mocked (no GPU here, nothing compiled).

- keys: a CUDA graph's device kind names its GPU generation (`cuda-sm90`), so graphs for two generations are
  keyed apart and one for sm80 is never looked up on sm90; CPU keys stay as they were;
- loading: a graph's package is loaded for the device index its call is on (a module on cuda:1 gets a runner
  loaded for 1), once per index;
- building: the job written for a program on a GPU asks for no CPU-level probe, and its needs are read without
  Inductor's ISA probe.
"""

from __future__ import annotations

import io
import json
import sys
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree

from compiler.machine import environment, machine_fit
from compiler.backends import aot, aot_build, aot_loading
from compiler.builds import job_folder, package_builds, slots
from compiler.backends.base import PackageInfo
from compiler.backends.base import WeightsElsewhere
from compiler.blocks.binding import InstanceWeights, SharedRunner
from compiler.tracing.flat_module import dump_out_spec, module_tensors
from compiler.keys.graph_keys import FamilyKey, GraphKey
from compiler.store.manifest import Manifest
from compiler.keys.shapes import ShapeRange
from compiler.keys.signature import FlatCall
from compiler.store.graph_store import GraphRefused, GraphStore

CAPABILITIES = {0: (8, 0), 1: (9, 0)}  # cuda:0 an A100-like GPU, cuda:1 an H100-like one


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda says: two GPUs, cuda:0 of compute capability 8.0 and cuda:1 of 9.0, cuda:0 current."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(CAPABILITIES))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def capability(device=None):
        index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
        return CAPABILITIES[index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    environment._capability.cache_clear()
    yield
    environment._capability.cache_clear()


# -- C: keys by compute capability ---------------------------------------------------------------------------

def test_a_cuda_device_kind_names_its_gpu_generation(two_gpus):
    assert environment.device_kind(torch.device("cuda", 1)) == "cuda-sm90"
    assert environment.device_kind("cuda:0") == "cuda-sm80"
    assert environment.device_kind("cuda") == "cuda-sm80"  # no index: the current device
    assert environment.device_kind("cpu") == "cpu"
    assert environment.kind_type("cuda-sm90") == "cuda" and environment.kind_type("cpu") == "cpu"


def test_graphs_for_two_gpu_generations_have_two_keys_and_cpu_keys_are_unchanged(two_gpus):
    def family(device):
        return FamilyKey.here("UNet", "s" * 24, "sig", torch.float16, device, "aot")

    sm80, sm90 = family("cuda:0"), family("cuda:1")
    assert (sm80.device, sm90.device) == ("cuda-sm80", "cuda-sm90")
    assert sm80.id != sm90.id
    assert family("cuda:0").id == sm80.id  # the same GPU generation: the same key
    cpu = family("cpu")
    assert cpu == FamilyKey("UNet", "s" * 24, "sig", "float16", "cpu", "aot", torch.__version__)


def _empty_package() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w"):
        pass
    return buffer.getvalue()


def _stored(store: GraphStore, family: FamilyKey, needs: dict):
    data = _empty_package()
    from compiler.store.atomic import sha256_bytes

    key = GraphKey(family, ShapeRange(batch=(1, 2), spatial=(8, 16)))
    manifest = Manifest(key=key, package_file=f"{key.id}.pt2", package_sha256=sha256_bytes(data),
                        package_bytes=len(data), info=PackageInfo(out_spec=dump_out_spec(pytree.tree_flatten([1])[1]),
                                                                  needs=needs), signature={})
    return store.import_graph(manifest, data, origin="built here")


def _gpu_needs(capability: str) -> dict:
    return {"version": machine_fit.NEEDS_VERSION, "platform": sys.platform, "machine": machine_fit.machine(),
            "device": "cuda", "cpu_isa": "", "march": "none", "cpu_features": [], "compute_capability": capability}


def test_a_graph_for_another_gpu_generation_is_not_looked_up_and_a_hand_copied_one_is_refused(
        two_gpus, tmp_path, monkeypatch):
    loaders = []
    monkeypatch.setattr(aot_loading, "_new_loader", lambda *args: loaders.append(args))
    store = GraphStore(tmp_path / "graphs")
    sm80 = FamilyKey.here("UNet", "s" * 24, "sig", torch.float16, "cuda:0", "aot")
    sm90 = FamilyKey.here("UNet", "s" * 24, "sig", torch.float16, "cuda:1", "aot")
    _stored(store, sm80, _gpu_needs("80"))
    call = FlatCall((torch.zeros(1, 4, 8, 8),), {})
    found, notes = store.lookup(sm90, call)
    assert found is None
    assert any("device: graph has cuda-sm80, this run needs cuda-sm90" in note for note in notes), notes
    assert store.lookup(sm80, call)[0] is not None  # on an sm80 GPU it is the graph
    # Copied by hand under the sm90 key: looked up, and refused by what its package needs, before loading.
    copied = _stored(store, sm90, _gpu_needs("80"))
    assert store.lookup(sm90, call)[0].name == copied.name
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with pytest.raises(GraphRefused) as refused:
        store.load(copied, sm90)
    assert "its GPU code is for compute capability 8.0; this GPU is 9.0" in str(refused.value)
    assert loaders == []


def test_a_bundle_for_a_gpu_generation_this_machine_lacks_is_refused(two_gpus, monkeypatch):
    assert environment.kind_available("cuda-sm90") and environment.kind_available("cuda-sm80")
    assert not environment.kind_available("cuda-sm86")
    assert environment.kind_available("cuda")  # a key written before kinds named a generation
    assert environment.kind_available("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not environment.kind_available("cuda-sm90") and not environment.kind_available("cuda")


# -- D: packages loaded onto the module's own device ----------------------------------------------------------

class FakeLoader:
    """torch._C._aoti.AOTIModelPackageLoader, recording what it was made for and what ran on it."""

    made: list = []
    names: list = []

    def __init__(self, path, model, run_single_threaded, num_runners, device_index):
        self.device_index = device_index
        self.constants: dict = {}
        self.runs = 0
        FakeLoader.made.append(self)

    def get_constant_fqns(self):
        return list(FakeLoader.names)

    def load_constants(self, constants, *flags):
        self.constants = dict(constants)

    def get_call_spec(self):
        example = [torch.zeros(1)]
        return [pytree.treespec_dumps(pytree.tree_flatten(((example,), {}))[1]),
                pytree.treespec_dumps(pytree.tree_flatten(example)[1])]

    def boxed_run(self, inputs):
        self.runs += 1
        return [inputs[0] * 2]


class OnCuda1(torch.Tensor):
    """A CPU tensor that says it is on cuda:1 (all a graph reads of a call's device is `.device`)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


@pytest.fixture
def fake_loader(monkeypatch, two_gpus):
    FakeLoader.made = []
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", FakeLoader)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    environment._capability.cache_clear()
    return FakeLoader


def _gpu_graph(module: torch.nn.Module) -> aot.AotGraph:
    FakeLoader.names = sorted(module_tensors(module))
    family = FamilyKey.here("Linear", "s" * 24, "sig", torch.float32, "cuda:0", "aot")
    info = PackageInfo(out_spec=dump_out_spec(pytree.tree_flatten([torch.zeros(1)])[1]),
                       constant_names=list(FakeLoader.names), needs=_gpu_needs("90"))
    return aot.AotGraph(GraphKey(family, ShapeRange(batch=(1, 2))), _empty_package(), info, origin="loaded")


def _on_cuda1(module: torch.nn.Module) -> None:
    """The module's weights as if moved to cuda:1 (the same CPU memory, saying it is there)."""
    for name, tensor in list(module.named_parameters()):
        setattr(module, name, torch.nn.Parameter(tensor.detach().as_subclass(OnCuda1)))


def test_the_device_index_of_a_call():
    assert aot_loading.device_index([torch.zeros(1)]) == -1
    assert aot_loading.device_index([torch.zeros(1), SimpleNamespace(device=torch.device("cuda", 1))]) == 1
    assert aot_loading.device_index([]) == -1


def test_a_package_is_loaded_for_the_device_index_its_call_is_on_once_per_index(fake_loader):
    module = torch.nn.Linear(4, 4)
    graph = _gpu_graph(module)
    assert [loader.device_index for loader in fake_loader.made] == [0]  # loaded for the current GPU
    x = torch.ones(2, 4).as_subclass(OnCuda1)
    with pytest.raises(WeightsElsewhere, match="is on cpu, the call runs on cuda:1"):  # weights not moved there
        graph.run(module, FlatCall((x,), {}))
    _on_cuda1(module)
    out = graph.run(module, FlatCall((x,), {}))
    assert [loader.device_index for loader in fake_loader.made] == [0, 1]
    home, on_1 = fake_loader.made
    assert on_1.runs == 1 and home.runs == 0
    assert on_1.constants == module_tensors(module) and home.constants == {}
    assert torch.equal(out[0], torch.full((2, 4), 2.0))
    graph.run(module, FlatCall((x,), {}))
    assert len(fake_loader.made) == 2 and on_1.runs == 2  # kept for index 1, its weights bound already
    # a call from the CPU would get the runner the graph was first loaded for; with weights on cuda:1 it is refused
    with pytest.raises(WeightsElsewhere, match="is on cuda:1, the call runs on cpu"):
        graph.run(module, FlatCall((torch.ones(2, 4),), {}))
    assert len(fake_loader.made) == 2 and home.runs == 0 and home.constants == {}
    assert graph.runner_on(1).loader is on_1 and graph.runner_on(0).loader is home


def test_a_block_runs_the_package_loaded_for_its_own_device(fake_loader):
    module = torch.nn.Linear(4, 4)
    graph = _gpu_graph(module)
    runner = SharedRunner(graph)
    assert runner.direct
    x = torch.ones(2, 4).as_subclass(OnCuda1)
    # its weights still in CPU memory (a model ComfyUI loaded partly): never handed to the GPU's runner
    with pytest.raises(WeightsElsewhere, match="is on cpu, the call runs on cuda:1"):
        runner.run(InstanceWeights(module), [x], rebuild=None)
    assert all(loader.runs == 0 and loader.constants == {} for loader in fake_loader.made)
    _on_cuda1(module)  # now on the block's GPU
    weights = InstanceWeights(module)
    runner.run(weights, [x], rebuild=None)
    home, on_1 = fake_loader.made
    assert on_1.device_index == 1 and on_1.runs == 1 and home.runs == 0
    assert set(on_1.constants) == set(FakeLoader.names)
    graph.run(module, FlatCall((x,), {}))  # the graph's own run binds the module again on that runner
    assert len(fake_loader.made) == 2 and on_1.runs == 2


def test_a_loader_without_a_device_index_argument_is_made_with_that_device_current(monkeypatch):
    """An older torch's loader takes no device index: it loads onto the current device, so that is set around it."""
    made, current = [], []

    class OlderLoader:
        def __init__(self, path, model, run_single_threaded, num_runners, *rest):
            if rest:
                raise TypeError("no device index in this torch")
            made.append((path, model, list(current)))

    class Current:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            current.append(self.index)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", OlderLoader)
    monkeypatch.setattr(torch.cuda, "device", Current)
    aot_loading._new_loader("pkg", "model", 1)
    aot_loading._new_loader("pkg", "part_0", -1)  # the CPU: nothing made current
    assert made == [("pkg", "model", [1]), ("pkg", "part_0", [])]


def test_a_loader_with_a_device_index_argument_is_given_it_and_runs_single_threaded(monkeypatch):
    """Single-threaded: torch's multi-threaded container waits on the last call's CUDA event in every call, which
    a CUDA graph capture forbids (package_loader.new_loader)."""
    made = []
    monkeypatch.setattr(torch._C._aoti, "AOTIModelPackageLoader", lambda *args: made.append(args))
    monkeypatch.setattr(torch.cuda, "device", _must_not_run("setting the current device"))
    aot_loading._new_loader("pkg", "model", 1)
    assert made == [("pkg", "model", True, 1, 1)]


# -- E: no CPU probe in a CUDA graph's build ------------------------------------------------------------------

@pytest.fixture
def program():
    return torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


@pytest.fixture
def inductor_march_unset():
    from torch._inductor import config

    if not hasattr(config.cpp, "march"):
        pytest.fail("this torch's Inductor has no cpp.march: the GPU host build would be -march=native")
    with config.patch({"cpp.march": None}):  # the user's TORCHINDUCTOR_CPP_MARCH aside
        yield


def test_the_job_of_a_cpu_program_asks_for_the_cpu_level(program, tmp_path):
    job_folder._write_job(program, {"a": 1}, True, tmp_path)
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["probe"] == str(job_folder.MACHINE_FIT) and job["configs"] == {"a": 1}
    assert job["device"] == "cpu" and job["compile_threads"] is None  # no kernel compilers started early
    assert job_folder._read_probe(tmp_path) is None  # the child writes it
    assert job_folder.program_device(program) == "cpu"


def test_the_job_of_a_cuda_program_asks_for_no_probe(program, tmp_path, monkeypatch, inductor_march_unset):
    real = job_folder.weightless

    def on_cuda(ep):
        light, layout = real(ep)
        return light, {name: entry[:3] + ["cuda:0"] + entry[4:] for name, entry in layout.items()}

    monkeypatch.setattr(job_folder, "weightless", on_cuda)
    monkeypatch.setattr(machine_fit, "build_probe", _must_not_run("the CPU level probe"))
    monkeypatch.setattr(machine_fit, "_vec_isa", _must_not_run("Inductor's ISA probe"))
    job_folder._write_job(program, {"a": 1}, True, tmp_path)
    job = json.loads((tmp_path / "job.json").read_text())
    assert "probe" not in job
    assert job["device"] == "cuda"  # the child starts its kernel compilers first (warm_kernel_compilers)
    assert {entry[3] for entry in job["weights"].values()} == {"cuda:0"}
    # host code: no -march, and no vector ISA (so no ISA probe runs in the build process: GPU_HOST_ISA)
    assert job["configs"] == {"a": 1, "cpp.march": machine_fit.NO_MARCH, "cpp.vec_isa_ok": False}
    built_for = job_folder._read_probe(tmp_path)
    assert built_for == {"march": machine_fit.NO_MARCH, "vec_isa": None, "vec_flags": None}
    # The parent reads the package's needs as read_built does: from the ISA the package names, no probe.
    metadata = {"AOTI_DEVICE_KEY": "cuda", "AOTI_CPU_ISA": "AVX2", "AOTI_COMPUTE_CAPABILITY": "90"}
    needs = machine_fit.needs_of_package(metadata, built_for["march"], built_here=True, vec=None)
    assert needs["cpu_features"] == sorted(["avx2", "fma", "f16c"]) and needs["march"] == "none"
    assert needs["device"] == "cuda" and needs["compute_capability"] == "90"


def _on_cuda_layout(ep):
    """job_folder.weightless as for a program whose weights are on cuda:0 (its job then says a GPU program)."""
    light, layout = _REAL_WEIGHTLESS(ep)
    return light, {name: entry[:3] + ["cuda:0"] + entry[4:] for name, entry in layout.items()}


def _job(ep, folder):
    """The job job_folder._write_job writes for the build of `ep`."""
    folder.mkdir()
    job_folder._write_job(ep, {}, False, folder)
    return json.loads((folder / "job.json").read_text())


def _job_configs(ep, folder):
    """The Inductor settings job_folder._write_job gives the build of `ep`."""
    return _job(ep, folder)["configs"]


_REAL_WEIGHTLESS = job_folder.weightless


def test_a_gpu_program_convolves_channels_last_only_where_asked(program, tmp_path, monkeypatch, inductor_march_unset):
    """KEEPFAST_CONV_LAYOUT=channels_last (compiler/build_process/conv_layout.py): Inductor's force_layout_optimization
    for a GPU program with 2-D convolutions, nothing for one without or where not asked, nothing for a CPU program."""
    from compiler.build_process import conv_layout
    from torch._inductor import config

    assert hasattr(config, "force_layout_optimization")  # the setting this torch's Inductor reads
    conv = torch.export.export(torch.nn.Conv2d(3, 4, 3), (torch.randn(1, 3, 8, 8),))
    configs, on_cuda = _job_configs, _on_cuda_layout
    monkeypatch.delenv(conv_layout.ENV, raising=False)
    video = torch.export.export(torch.nn.Conv3d(3, 4, 3), (torch.randn(1, 3, 4, 8, 8),))  # a video VAE's
    assert conv_layout.has_2d_convolution(conv) and not conv_layout.has_2d_convolution(program)
    assert not conv_layout.has_2d_convolution(video)
    assert configs(conv, tmp_path / "cpu-asked-not") == {}
    monkeypatch.setenv(conv_layout.ENV, "channels_last")
    assert configs(conv, tmp_path / "cpu") == {}  # a CPU program: Inductor lays mkldnn convolutions out itself
    monkeypatch.setattr(job_folder, "weightless", on_cuda)
    assert configs(conv, tmp_path / "asked")["force_layout_optimization"] is True
    assert "force_layout_optimization" not in configs(program, tmp_path / "no-convolution")
    monkeypatch.setenv(conv_layout.ENV, "")
    assert "force_layout_optimization" not in configs(conv, tmp_path / "not-asked")


def test_parts_built_together_share_the_cores_between_their_kernel_compilers(program, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    monkeypatch.setattr(package_builds.os, "cpu_count", lambda: 16)
    assert slots.kernel_compile_threads(1) is None  # alone: Inductor's own choice, one per core
    assert slots.kernel_compile_threads(5) == 3
    assert slots.kernel_compile_threads(40) == 1
    job_folder._write_job(program, {}, False, tmp_path, beside=4)
    assert json.loads((tmp_path / "job.json").read_text())["compile_threads"] == 4
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")  # the user's (or the check's lane's) number, shared
    assert slots.kernel_compile_threads(4) == 2
    assert slots.kernel_compile_threads(1) is None
    # a trace process (a block engine's structures built side by side) writes its build's share too
    traced_folder = tmp_path / "traced"
    traced_folder.mkdir()
    job_folder.trace_job(lambda: (program, {"guards": []}), {}, False, traced_folder, beside=2)
    assert json.loads((traced_folder / "job.json").read_text())["compile_threads"] == 4


def test_a_gpu_program_is_cut_into_no_more_parts_than_leave_each_part_four_kernel_compilers(program, monkeypatch):
    """The H200's SD1.5 UNet was cut by the CPU rule (a part per core) and each part compiled its Triton kernels
    with one worker, one after another: each GPU part now keeps at least four, and a CPU program is cut as before."""
    for name in ("TORCHINDUCTOR_COMPILE_THREADS", "KEEPFAST_BUILD_PROCESSES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(package_builds.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(aot_build.os, "cpu_count", lambda: 16)
    assert slots.gpu_part_builders() == 4
    assert slots.kernel_compile_threads(slots.gpu_part_builders()) == 4
    assert aot_build._part_builders(program) == 16  # a CPU program: one part per core
    monkeypatch.setattr(job_folder, "program_device", lambda ep, layout=None: "cuda")
    assert aot_build._part_builders(program) == 4
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "5")  # the device check's share of one of three lanes
    monkeypatch.setenv("KEEPFAST_BUILD_PROCESSES", "5")
    assert aot_build._part_builders(program) == 1  # built whole, with the lane's five workers
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "64")
    assert aot_build._part_builders(program) == 5  # no more parts than builds that run at once
    for cores in range(1, 65):
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", str(cores))
        monkeypatch.delenv("KEEPFAST_BUILD_PROCESSES", raising=False)
        parts = slots.gpu_part_builders()
        assert parts == 1 or slots.kernel_compile_threads(parts) >= slots.KERNEL_WORKERS_PER_PART


def test_a_gpu_build_starts_inductor_s_kernel_compilers_before_it_reads_its_program(monkeypatch):
    """AOTInductor starts Triton's compile workers only at its first kernel, and compiles kernels one by one until
    they are up; torch.compile starts them first (maybe_warm_pool), and so does a GPU build process."""
    import torch._inductor.async_compile as async_compile
    from torch._inductor import config

    from compiler.build_process import child as build_child

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(config.compile_threads))
    with config.patch({"compile_threads": config.compile_threads}):
        assert build_child.warm_kernel_compilers(3) is True
        assert started == [3]
        assert build_child.warm_kernel_compilers(None) is True
        assert started == [3, 3]  # None: the number already chosen stays
    def cannot_start():
        raise OSError("no processes left")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", cannot_start)
    assert build_child.warm_kernel_compilers(2) is False  # the build goes on: kernels compile as before


def test_a_cuda_program_built_in_process_picks_no_cpu_level(monkeypatch, inductor_march_unset):
    monkeypatch.setattr(machine_fit, "build_march", _must_not_run("the CPU level probe"))
    march, configs = aot_build.package_configs(gpu=True)
    assert march == machine_fit.NO_MARCH and configs == {**aot_build.PACKAGE_CONFIG, "cpp.march": machine_fit.NO_MARCH}


def test_the_gpu_host_build_runs_no_probe_and_keeps_a_level_the_user_chose(monkeypatch):
    from torch._inductor import config

    monkeypatch.setattr(machine_fit, "_vec_isa", _must_not_run("Inductor's ISA probe"))
    monkeypatch.setattr(machine_fit, "host_cpu_features", _must_not_run("the CPU feature read"))
    monkeypatch.setattr(machine_fit, "_compiler_accepts", _must_not_run("the compiler's -march check"))
    if not hasattr(config.cpp, "march"):
        assert machine_fit.gpu_host_build() == (None, {})  # Inductor's own choice
        return
    with config.patch({"cpp.march": None}):
        assert machine_fit.gpu_host_build() == (machine_fit.NO_MARCH, {"cpp.march": machine_fit.NO_MARCH})
    with config.patch({"cpp.march": "x86-64-v2"}):
        assert machine_fit.gpu_host_build() == ("x86-64-v2", {})
    import torch._inductor.cpp_builder as cpp_builder

    with config.patch({"cpp.march": None}):  # an Inductor that would write `-march=`: its own choice is kept
        monkeypatch.setattr(cpp_builder, "_get_cpu_arch_cflags", lambda compiler: [f"march={config.cpp.march}"])
        assert machine_fit.gpu_host_build() == (None, {})


def test_a_cpu_package_built_here_still_reads_its_exact_isa_flags(monkeypatch):
    """The probe is left out for GPU packages only: a CPU package built for a named level reads its ISA's flags."""
    calls = []
    monkeypatch.setattr(machine_fit, "_vec_isa", lambda: calls.append(1) or None)
    machine_fit.needs_of_package({"AOTI_CPU_ISA": "AVX2"}, "x86-64-v3", built_here=True, vec=None)
    assert calls == [1]


def _must_not_run(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran for a CUDA program")
    return fail


def test_a_gpu_program_with_dynamic_sizes_makes_no_persistent_reduction_over_a_dynamic_size(tmp_path, monkeypatch):
    """compiler/build_process/gpu_reductions.py: a GPU program whose sizes are dynamic is built with Inductor's
    persistent-reduction decision made per kernel (none over a dynamic size: the H200's SD1.5 spent 332 of 422
    kernel build seconds on those, one kernel 80 s), in its build process and where it is built in this process;
    the whole program's `triton.persistent_reductions` off only where this torch has no such hook. Nothing for a
    static program, a CPU one, or where KEEPFAST_PERSISTENT_REDUCTIONS=1 asks for Inductor's default."""
    from compiler.build_process import gpu_reductions
    from torch._inductor import config

    assert hasattr(config.triton, "persistent_reductions")  # the setting this torch's Inductor reads
    assert gpu_reductions._default_choices_class() is not None  # torch 2.11 to 2.14 all have the hook
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)).eval()
    static = torch.export.export(module, (torch.randn(4, 8),))
    dynamic = torch.export.export(module, (torch.randn(4, 8),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},))
    monkeypatch.delenv(gpu_reductions.ENV, raising=False)
    assert gpu_reductions.has_dynamic_sizes(dynamic) and not gpu_reductions.has_dynamic_sizes(static)
    cpu = _job(dynamic, tmp_path / "cpu")  # a CPU program: no Triton
    assert "triton.persistent_reductions" not in cpu["configs"] and "heuristics" not in cpu
    monkeypatch.setattr(job_folder, "weightless", _on_cuda_layout)
    job = _job(dynamic, tmp_path / "gpu-dynamic")
    assert job["heuristics"] == {"fixed_size_persistent_reductions": True}
    assert "triton.persistent_reductions" not in job["configs"]
    job = _job(static, tmp_path / "gpu-static")
    assert job["heuristics"] == {"fixed_size_persistent_reductions": False}
    assert "triton.persistent_reductions" not in job["configs"]
    # the same where a program is built in this process (aot_build._build_here: it cannot travel to a child)
    assert job_folder.gpu_program_heuristics(dynamic) == {"fixed_size_persistent_reductions": True}
    assert "triton.persistent_reductions" not in job_folder.gpu_program_settings(dynamic)
    # a torch without the hook (or another's heuristics configured): the whole program's switch, as before
    monkeypatch.setattr(gpu_reductions, "_default_choices_class", lambda: None)
    job = _job(dynamic, tmp_path / "gpu-no-hook")
    assert job["configs"]["triton.persistent_reductions"] is False
    assert job["heuristics"] == {"fixed_size_persistent_reductions": False}
    assert job_folder.gpu_program_settings(dynamic)["triton.persistent_reductions"] is False
    monkeypatch.undo()
    monkeypatch.setattr(job_folder, "weightless", _on_cuda_layout)
    monkeypatch.setenv(gpu_reductions.ENV, "1")
    job = _job(dynamic, tmp_path / "gpu-asked-default")
    assert "triton.persistent_reductions" not in job["configs"]
    assert job["heuristics"] == {"fixed_size_persistent_reductions": False}
