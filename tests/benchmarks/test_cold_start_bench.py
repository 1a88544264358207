"""The benchmark's fresh-machine restart: its report keys and its "no compiler" machine (no benchmark runs here)."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks import models as M
from benchmarks import report
from benchmarks.fresh_machine import COMPILER_NAMES, FreshMachine


def _job(variant, first, process=None, **extra):
    job = {"model": "sd15", "variant": variant, "first_call_s": first, "first_call_compiles": 0, **extra}
    if process is not None:
        job["process_to_first_result_s"] = process
    return job


def test_fresh_machine_restart_is_summarised_against_the_cold_compile_and_eager():
    jobs = [_job("eager", 0.5, process=6.0), _job("torch_compile", 40.0, process=48.0),
            _job("ours_aot_cold", 90.0), _job("ours_aot_load", 1.5, process=8.0, first_call_loads=2),
            _job("ours_aot_fresh", 2.0, process=7.5, first_call_loads=2, compiler_calls=["/x/g++ --version"],
                 tmpdir_left_after_exit=[])]
    summary = report.summarise(jobs, {"profile": "quick"}, {"sd15": M.spec("sd15", "quick").describe()})
    assert summary["restart_fresh_machine_s"] == 2.0
    assert summary["restart_fresh_vs_cold_compile_ratio"] == pytest.approx(0.05)  # 2 s / 40 s
    assert summary["restart_fresh_process_over_eager_s"] == pytest.approx(1.5)  # 7.5 s - 6 s
    assert summary["restart_fresh_compiler_calls"] == 1
    targets = summary["targets"]
    assert targets["restart_fresh_vs_cold_compile_ratio"]["met"] is True
    assert targets["restart_fresh_process_over_eager_s"]["met"] is True
    assert targets["restart_fresh_compiler_calls"]["met"] is False
    assert "fresh machine" in report.markdown(summary)


def test_a_summary_without_the_fresh_variant_says_it_was_not_measured():
    summary = report.summarise([_job("torch_compile", 40.0)], {"profile": "quick"})
    assert summary["restart_fresh_machine_s"] is None
    assert summary["targets"]["restart_fresh_vs_cold_compile_ratio"]["met"] is None


def test_the_fresh_machine_records_every_compiler_call_and_starts_empty(tmp_path):
    machine = FreshMachine(tmp_path / "m").setup()
    (machine.tmpdir / "left").write_text("x")
    machine.setup()  # a second run starts from nothing again
    env = machine.env(os.environ)
    for name in COMPILER_NAMES + ("$CC", "$CXX"):
        done = subprocess.run(["sh", "-c", f"{name} -c x.c"], env=env, capture_output=True)
        assert done.returncode != 0
    assert len(machine.compiler_calls()) == len(COMPILER_NAMES) + 2
    assert machine.tmpdir_entries() == [] and machine.cache_entries() == []
    assert env["TMPDIR"] == str(machine.tmpdir) and env["TORCHINDUCTOR_CACHE_DIR"] == str(machine.inductor_cache)
