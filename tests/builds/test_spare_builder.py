"""A build process started ahead of its build (spares.prestart, a "spare") is started only for a build
that is coming: a compile starts one as it begins to trace, and a launched build starts the next one's only where
another build waits for a slot or is being traced. A spare started after the last build of a process imported
torch for nothing (about 5 s of a core) and was killed at exit: once in every process that compiled."""

from __future__ import annotations

import subprocess
import sys

import pytest

from compiler.builds import launch, package_builds, spares
from compiler.backends.base import UNLABELLED

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


def _launched(folder, monkeypatch, calls):
    monkeypatch.setattr(spares, "prestart", lambda kind: calls.append((folder.name, kind)))
    monkeypatch.setattr(spares, "_take_spare",
                        lambda _folder, _kind: subprocess.Popen([sys.executable, "-c", "pass"]))
    build = package_builds.PackageBuild(folder, UNLABELLED)
    build._launch()
    build.process.wait()
    return build


def test_a_launched_build_starts_no_spare_when_no_other_build_is_coming(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(package_builds, "_live", set())
    monkeypatch.setattr(package_builds, "_queue", [])
    _launched(tmp_path, monkeypatch, calls)
    assert calls == []


def test_a_launched_build_starts_the_next_one_s_process_while_another_is_traced(tmp_path, monkeypatch):
    calls = []
    tracing = package_builds.PackageBuild(tmp_path / "traced", UNLABELLED)
    tracing.tracer = object()  # a trace process at work: its build comes next
    assert tracing._tracing()
    monkeypatch.setattr(package_builds, "_live", {tracing})
    monkeypatch.setattr(package_builds, "_queue", [])
    (tmp_path / "launched").mkdir()
    _launched(tmp_path / "launched", monkeypatch, calls)
    assert calls == [("launched", "cpu")]  # of the launched build's kind (its folder has no GPU job)


def test_a_spare_imports_what_its_build_reads_and_compiles_with_before_the_build_comes():
    """On this 2-core CPU torch.export.load of a small program took 1.05-1.16 s in a process that had imported
    torch only, 0.02 s after these imports: a spare makes them while its caller traces."""
    code = ("import sys, importlib.util; spec = importlib.util.spec_from_file_location('c', sys.argv[1]); "
            "run = importlib.util.module_from_spec(spec); spec.loader.exec_module(run); run.child_module(); "
            "import importlib, torch; m = importlib.import_module(run.PACKAGE + '.build_process.spare'); "
            "failed = m._warm_imports(sys.argv[2]); "
            "print(','.join(failed) or '-', all(n in sys.modules for n in m.BUILD_IMPORTS))")
    for kind in ("cpu", "gpu"):
        done = subprocess.run([sys.executable, "-c", code, str(launch.REAL_CHILD), kind],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        failed, imported = done.stdout.split()
        assert imported == "True"  # every module a build needs on any machine
        if kind == "cpu":
            assert failed == "-"  # a CPU build's modules are in every torch
        else:  # a GPU build's: Triton where torch has it; a CPU-only torch may lack it, and the build says why
            assert set(failed.split(",")) <= {"-", "triton", "torch._inductor.codegen.triton",
                                              "torch._inductor.codegen.cpp_wrapper_gpu",
                                              "torch._inductor.runtime.triton_heuristics"}, failed
