"""The staged load probe (compiler/testing/bench/load_stages.py) on the CPU: its C-stack printer shows the C stack
of a process that dies with SIGSEGV, beside Python's, and each step of a package's load runs and says so."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from compiler.testing.bench import load_stages

CRASH = "import faulthandler, ctypes; faulthandler.enable(); ctypes.string_at(0)"


def test_the_preloaded_printer_shows_the_c_stack_of_a_segfault_after_python_s(tmp_path):
    library = load_stages.c_stack_preload(tmp_path)
    assert library is not None and library.is_file()
    env = {**os.environ, "LD_PRELOAD": str(library)}
    crashed = subprocess.run([sys.executable, "-c", CRASH], env=env, capture_output=True, text=True, timeout=60)
    assert crashed.returncode == -11, crashed.stderr[-2000:]
    python_stack, _, c_stack = crashed.stderr.partition("--- C stack (keepfast c_stack_preload) ---")
    assert "Fatal Python error: Segmentation fault" in python_stack  # faulthandler first, then the handler it replaced
    assert "--- end of C stack ---" in c_stack and "_ctypes" in c_stack, c_stack[-2000:]
    plain = subprocess.run([sys.executable, "-c", CRASH], capture_output=True, text=True, timeout=60)
    assert plain.returncode == -11 and "C stack" not in plain.stderr


def test_each_step_of_a_package_s_load_runs_and_is_printed(tmp_path, capfd):
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        ep = torch.export.export(module, (x,))
    package = tmp_path / "probe.pt2"
    torch._inductor.aoti_compile_and_package(ep, package_path=str(package))
    for stage, last in (("stage_dlopen", "dlopen returned"), ("stage_runner", "ran"), ("stage_package", "ran")):
        steps = load_stages.run_stage(stage, package, tmp_path, "cpu", [x])
        assert steps[-1] == last, (stage, steps)
        assert f"STEP {last}" in capfd.readouterr().out
    facts = load_stages.machine_facts(load_stages.model_library(package, tmp_path / "facts"))
    assert "NEEDED" in facts["so_dynamic"] and facts["torch"].startswith(torch.__version__)
