"""A GPU program's build process runs no vector-ISA probe (job_folder.GPU_HOST_ISA).

On the H200 (2026-11-28, torch 2.11+cu130) a build process that was not a spare spent 55-62 s before its build
began (`startup_s`), a spare 0.55 s: Inductor's ISA probe in torch 2.11 starts a Python importing torch for each
ISA and variant it checks (10 on this CPU, 16.3 s with the test programs already built), and a CUDA package's host
code needs no ISA. Here, on a CPU: the job says no ISA, the real build process then probes none (its kept probe
folder stays empty) and its package names none and computes as eager; a spare knows the kind of program it is
for (a GPU one does not probe) and is handed only a build of that kind.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch

from compiler.machine import machine_fit
from compiler.backends import aot_build
from compiler.build_process import isa_probe
from compiler.builds import job_folder, kept_folders, launch, package_builds, spares

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


def test_a_build_without_a_host_isa_probes_none_and_its_package_still_computes(tmp_path, monkeypatch):
    # A CPU spare waiting in this process, as an earlier test's builds leave one (CI, 2026-12-02: one took this
    # build, its probe already run, and the package named AVX512): a job that says no ISA must not be handed to it.
    spares.prestart("cpu")
    kept = tmp_path / "isa"
    monkeypatch.setenv(kept_folders.ISA_CACHE_ENV, str(kept))
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(3, 8)
    program = torch.export.export(module, (x,))
    assert isa_probe.skips_isa_probe({**aot_build.PACKAGE_CONFIG, **job_folder.GPU_HOST_ISA})
    assert not isa_probe.skips_isa_probe(dict(aot_build.PACKAGE_CONFIG))
    build = package_builds.start(program, {**aot_build.PACKAGE_CONFIG, **job_folder.GPU_HOST_ISA}, now=True)
    data = build.result(timeout=600)
    assert build.usage["phase_s"]["kernels"] >= 1, build.usage  # the kernels Inductor generated, for the bench
    assert not kept.exists() or not any(kept.rglob("*")), sorted(kept.rglob("*"))  # no probe ran, nothing kept
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        isas = {json.loads(archive.read(name)).get("AOTI_CPU_ISA")
                for name in archive.namelist() if name.endswith("_metadata.json")}
    assert isas == {"INVALID_VEC_ISA"}, isas
    # A GPU package naming no ISA asks nothing of the CPU: another machine's CPU can run its host code.
    needs = machine_fit.needs_of_package({"AOTI_CPU_ISA": "INVALID_VEC_ISA", "AOTI_DEVICE_KEY": "cuda"},
                                         machine_fit.NO_MARCH, built_here=True)
    assert needs["cpu_features"] == [] and needs["march"] == "none"
    path = tmp_path / "graph.pt2"
    path.write_bytes(data)
    compiled = torch._inductor.aoti_load_package(str(path))
    compiled.load_constants(module.state_dict(), check_full_update=True, user_managed=True)
    with torch.no_grad():
        assert torch.equal(compiled(x), module(x))


def _spare_probed(kind: str, kept) -> bool:
    """Run a spare of `kind` with no job (its stdin closed at once): whether it left the probe's files in `kept`."""
    done = subprocess.run([sys.executable, str(launch.REAL_CHILD), "--spare", str(kept), kind],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return kept.exists() and any(kept.rglob("*"))


def test_a_spare_for_a_gpu_program_runs_no_probe_and_one_for_a_cpu_program_does(tmp_path):
    assert not _spare_probed("gpu", tmp_path / "gpu")
    assert _spare_probed("cpu", tmp_path / "cpu")


class _Pipe:
    def __init__(self):
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        pass


class _Spare:
    """A spare build process that is running and reads its job from `stdin`."""

    def __init__(self):
        self.stdin = _Pipe()

    def poll(self):
        return None


def test_a_spare_is_handed_a_build_of_its_own_kind_only(tmp_path, monkeypatch):
    killed = []
    monkeypatch.setattr(spares, "_kill", killed.append)
    gpu_spare = _Spare()
    monkeypatch.setattr(spares, "_spares", [(gpu_spare, launch.CHILD, os.getpid(), "gpu")])
    assert spares._take_spare(tmp_path, "cpu") is None  # a CPU build: the GPU spare is stopped
    assert killed == [gpu_spare] and spares._spares == [] and gpu_spare.stdin.written == b""
    monkeypatch.setattr(spares, "_spares", [(gpu_spare, launch.CHILD, os.getpid(), "gpu")])
    assert spares._take_spare(tmp_path, "gpu") is gpu_spare
    assert gpu_spare.stdin.written == f"{tmp_path}\n".encode() and killed == [gpu_spare]
    assert spares._spares == []


def test_a_build_s_kind_is_read_from_its_job_s_settings(tmp_path):
    assert spares.host_kind("cuda:1") == "gpu" and spares.host_kind("cpu") == "cpu"
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"device": "cuda", "configs": {**aot_build.PACKAGE_CONFIG, **job_folder.GPU_HOST_ISA}}))
    assert spares.job_kind(tmp_path) == "gpu"
    # The settings decide, as they decide in the build process: a CPU program whose job says no ISA is a "gpu" build.
    job.write_text(json.dumps({"device": "cpu", "configs": {**aot_build.PACKAGE_CONFIG, **job_folder.GPU_HOST_ISA}}))
    assert spares.job_kind(tmp_path) == "gpu"
    job.write_text(json.dumps({"device": "cpu", "configs": dict(aot_build.PACKAGE_CONFIG)}))
    assert spares.job_kind(tmp_path) == "cpu"
    assert spares.job_kind(tmp_path / "missing") == "cpu"


def test_parts_started_together_each_find_a_spare_of_their_kind(tmp_path, monkeypatch):
    """A GPU program cut into parts starts them at once; on the H200 the SD1.5 UNet's second part found no spare
    and started in 9.6 s. Two spares, two parts: each is handed one; a third build starts its own process."""
    killed = []
    monkeypatch.setattr(spares, "_kill", killed.append)
    first, second = _Spare(), _Spare()
    monkeypatch.setattr(spares, "_spares", [(first, launch.CHILD, os.getpid(), "gpu"),
                                                    (second, launch.CHILD, os.getpid(), "gpu")])
    assert spares._take_spare(tmp_path / "a", "gpu") is first
    assert spares._take_spare(tmp_path / "b", "gpu") is second
    assert spares._take_spare(tmp_path / "c", "gpu") is None and killed == []
    assert first.stdin.written == f"{tmp_path / 'a'}\n".encode()
    assert second.stdin.written == f"{tmp_path / 'b'}\n".encode()


def test_prestart_keeps_as_many_spares_as_asked_and_stops_those_of_another_kind(monkeypatch):
    started, killed = [], []

    class _Started(_Spare):
        def __init__(self, argv, **_):
            super().__init__()
            started.append(argv[-1])

    monkeypatch.setattr(spares.subprocess, "Popen", _Started)
    monkeypatch.setattr(spares, "_kill", killed.append)
    old = _Spare()
    monkeypatch.setattr(spares, "_spares", [(old, launch.CHILD, os.getpid(), "cpu")])
    spares.prestart("cuda:0", count=2)
    assert started == ["gpu", "gpu"] and killed == [old]
    spares.prestart("cuda", count=2)  # both still ready: none started
    assert started == ["gpu", "gpu"] and [spare[3] for spare in spares._spares] == ["gpu", "gpu"]
    spares.prestart("cuda", count=3)
    assert started == ["gpu", "gpu", "gpu"]
