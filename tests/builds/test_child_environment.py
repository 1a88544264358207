"""What build and trace processes start with: a priority lowered by KEEPFAST_BUILD_NICE (default 10; 0: the
caller's), and Triton's kernel cache kept across builds (a build's own Inductor cache is fresh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "compiler" / "build_process" / "child_priority.py"
# As a build process does it: the module loaded by its path, with nothing of the pack imported.
LOWERED = (f"import importlib.util, os, sys; spec = importlib.util.spec_from_file_location('p', {str(MODULE)!r}); "
           "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.lower(); "
           "print(os.nice(0), 'compiler' in sys.modules)")


@pytest.mark.parametrize("setting, step", [(None, 10), ("0", 0), ("3", 3), ("19", 19), ("25", 10), ("x", 10)])
def test_a_child_lowers_its_priority_by_the_setting(setting, step):
    env = {k: v for k, v in os.environ.items() if k != "KEEPFAST_BUILD_NICE"}
    if setting is not None:
        env["KEEPFAST_BUILD_NICE"] = setting
    here = os.nice(0)
    out = subprocess.run([sys.executable, "-c", LOWERED], env=env, capture_output=True, text=True, check=True)
    niceness, imported_the_pack = out.stdout.split()
    assert int(niceness) == min(19, here + step)
    assert imported_the_pack == "False"


def test_builds_share_a_kept_triton_kernel_cache_unless_the_user_chose_one(monkeypatch, tmp_path):
    from compiler.builds import kept_folders, launch

    monkeypatch.setenv("KEEPFAST_ISA_CACHE", str(tmp_path / "isa"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    env = launch._child_options({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build" / "cache")})["env"]
    kept = Path(env["TRITON_CACHE_DIR"])
    assert kept == kept_folders.kernel_cache() and kept.parent == tmp_path / "triton-kernels"
    assert not kept.is_relative_to(tmp_path / "build")  # outlives the build's folder
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert launch._child_options({})["env"]["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_lower_takes_the_job_s_step_over_the_setting():
    program = LOWERED.replace("m.lower()", "m.lower(0)")
    env = {**os.environ, "KEEPFAST_BUILD_NICE": "7"}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout.split()[0]) == os.nice(0)  # a build the caller waits for keeps the caller's priority


@pytest.mark.parametrize("how, expected", [("now", 0), ("waited", 0), ("background", 10)])
def test_a_build_the_caller_waits_for_runs_at_its_priority(how, expected, monkeypatch):
    """On the H200 the device check's other lane compiled at full priority beside our lowered SD1.5 build."""
    import json

    import torch

    from compiler.builds import package_builds

    monkeypatch.delenv("KEEPFAST_BUILD_NICE", raising=False)
    monkeypatch.setattr(package_builds, "_pump", lambda: None)  # queued builds stay queued: only the job is read
    program = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    build = package_builds.start(program, {}, now=False, waited=how == "waited") if how != "now" else None
    if build is None:
        monkeypatch.setattr(package_builds.PackageBuild, "_launch", lambda self: None)
        build = package_builds.start(program, {}, now=True)
    try:
        assert json.loads((build.folder / "job.json").read_text())["nice"] == expected
    finally:
        build.cancel()
