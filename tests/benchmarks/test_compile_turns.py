"""The device check's compiles take turns (benchmarks/compile_turns.py): on the H200 our SD1.5 cold
compile ran beside the other lane's torch.compile of Flux while torch.compile's SD1.5 ran alone, so the two
figures of the cold-compile ratio came from different loads. A compile now holds a lock the run's jobs share, its
wait is not charged to its time limit or its time to a first result, and it has every core."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from compiler.store import file_lock
from benchmarks import check, compile_turns
from benchmarks.joblog import JobLog

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


def test_a_turn_waits_for_another_compile_and_says_how_long(tmp_path):
    lock, waits = tmp_path / "compile.lock", tmp_path / "job.waits.json"
    turns = compile_turns.CompileTurns(lock, waits)
    seen_while_waiting = []
    holding = threading.Event()

    def other_compile():
        with file_lock.held(lock):
            holding.set()
            time.sleep(0.3)
            seen_while_waiting.append(compile_turns.waited_seconds(waits))  # the job's wait, read as it waits
            time.sleep(0.4)

    other = threading.Thread(target=other_compile)
    other.start()
    holding.wait(10)
    with turns.turn():
        inside = time.time()
    other.join()
    assert 0.5 <= turns.waited_s < 5.0 and turns.turns == 1, turns.waited_s
    assert seen_while_waiting and seen_while_waiting[0] >= 0.2, seen_while_waiting  # counted while it went on
    assert abs(compile_turns.waited_seconds(waits) - turns.waited_s) < 1e-6  # ended: the total, nothing running
    assert inside > 0
    with turns.turn():  # nobody else compiling: no wait
        pass
    assert turns.turns == 2 and turns.waited_s < 5.0
    assert compile_turns.waited_seconds(tmp_path / "none.json") == 0.0
    free = compile_turns.CompileTurns(None, None)  # a run of one job: nothing to take turns with
    with free.turn():
        pass
    assert free.waited_s == 0.0 and free.turns == 0


def test_the_job_log_does_not_charge_a_job_for_its_waits_but_the_budget_still_bounds_it(tmp_path):
    waits = tmp_path / "job.waits.json"
    # the job "waits" 2 s for its turn, then works 1 s: 3 s of wall time, 1 s of its own
    script = (f"import json, time\nstart = time.time()\n"
              f"open({str(waits)!r}, 'w').write(json.dumps({{'waited_s': 0.0, 'waiting_since': start}}))\n"
              f"time.sleep(2.0)\n"
              f"open({str(waits)!r}, 'w').write(json.dumps({{'waited_s': time.time() - start, 'waiting_since': None}}))\n"
              f"time.sleep(1.0)\nprint('done', flush=True)\n")
    log = JobLog(tmp_path / "check.log")
    waited = lambda: compile_turns.waited_seconds(waits)  # noqa: E731
    assert log.run("waiting-job", [sys.executable, "-c", script], cwd=str(tmp_path), env={}, timeout=2.0,
                   waited=waited) == 0
    assert log.tail("waiting-job") == "done"
    waits.unlink()
    assert log.run("charged-job", [sys.executable, "-c", script], cwd=str(tmp_path), env={}, timeout=2.0) is None
    waits.unlink()
    assert log.run("over-budget", [sys.executable, "-c", script], cwd=str(tmp_path), env={}, timeout=2.0,
                   waited=waited, hard_timeout=1.5) is None


def test_compiling_jobs_get_the_lock_and_every_core_the_others_their_lane_s_share(tmp_path, monkeypatch):
    import torch

    from benchmarks import joblog

    given = {}

    def fake_run(self, source, command, cwd, env, timeout, waited=None, hard_timeout=None):
        job = json.loads(Path(command[3]).read_text())
        given[(job["model"], job["variant"])] = (job, env, waited, hard_timeout)
        from tests.benchmarks.test_bench_check import _ran

        Path(command[4]).write_text(json.dumps(_ran(job["model"], job["variant"])))
        return 0

    monkeypatch.setattr(joblog.JobLog, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a stand-in GPU")
    jobs = check.plan(models=["sd15", "flux"], lanes=2)
    assert check.execute(tmp_path / "out", "cuda", jobs, budget_s=check.BUDGET_S, lanes=2) == 0
    for (model, variant), (job, env, waited, hard) in given.items():
        assert job["compile_lock"].endswith("compile.lock") and callable(waited) and 0 < hard <= check.BUDGET_S
        if variant in compile_turns.COMPILING:
            assert "TORCHINDUCTOR_COMPILE_THREADS" not in env and "KEEPFAST_BUILD_PROCESSES" not in env, variant
        else:
            assert env["TORCHINDUCTOR_COMPILE_THREADS"] == check.core_share(2)["TORCHINDUCTOR_COMPILE_THREADS"]
    assert {v for _, v in given} >= {"ours_aot_cold", "torch_compile", "ours_blocks", "torch_compile_blocks"}
    text = (tmp_path / "out" / "bench.md").read_text()
    assert "compiles took turns, one at a time with every core" in text


def test_a_compiling_job_waits_for_its_turn_and_its_times_leave_the_wait_out(tmp_path):
    """The worker itself (the quick VAE, torch.compile on this CPU): while another job holds the run's compile lock
    its first call waits, and the runner's time to a first result leaves that wait out."""
    from benchmarks.runner import job_env, run_job

    lock = tmp_path / "compile.lock"
    job = {"model": "vae", "variant": "torch_compile", "profile": "quick", "device": "cpu", "dtype": "fp32",
           "reps": 1, "graphs_dir": str(tmp_path / "graphs"), "sweep_s": 0, "sweep_why": "not in this test",
           "steady_static": False, "first_use_cost": False, "compile_lock": str(lock)}
    held = threading.Event()
    release = threading.Event()

    def other_compile():
        with file_lock.held(lock):
            held.set()
            release.wait(60)

    other = threading.Thread(target=other_compile)
    other.start()
    held.wait(10)
    waits = compile_turns.waits_path(tmp_path / "vae-torch_compile.result.json")

    def end_other_compile():  # 3 s after the job began to wait for its turn (however long its start took)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if json.loads(waits.read_text()).get("waiting_since"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        time.sleep(3.0)
        release.set()

    threading.Thread(target=end_other_compile, daemon=True).start()
    log = JobLog(tmp_path / "check.log")
    env = {**job_env(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    result = run_job(job, tmp_path, env, 600.0, log=log, hard_timeout=900.0)
    other.join()
    assert "error" not in result, result.get("error")
    assert result["first_call_turn_wait_s"] >= 2.9, result["first_call_turn_wait_s"]
    assert result["compile_turn_wait_s"] == result["first_call_turn_wait_s"]  # no sweep, no other turn
    assert result["first_call_profile"]["compile_cpu_s"] > 0  # the compile's profile began after the wait


def test_the_time_to_a_first_result_leaves_the_wait_for_the_turn_out(tmp_path, monkeypatch):
    from benchmarks import joblog, runner

    def fake_run(self, source, command, cwd, env, timeout, waited=None, hard_timeout=None):
        Path(command[4]).write_text(json.dumps({"model": "sd15", "variant": "torch_compile",
                                                "first_result_at": time.time() + 50.0,
                                                "first_call_turn_wait_s": 40.0}))
        return 0

    monkeypatch.setattr(joblog.JobLog, "run", fake_run)
    result = runner.run_job({"model": "sd15", "variant": "torch_compile"}, tmp_path, {}, 60.0,
                            log=JobLog(tmp_path / "check.log"))
    assert 9.0 < result["process_to_first_result_s"] < 11.0, result  # 50 s after its start, 40 of them waiting


def test_a_job_stopped_while_it_waited_for_its_turn_says_so(tmp_path, monkeypatch):
    from benchmarks import joblog, runner

    def fake_run(self, source, command, cwd, env, timeout, waited=None, hard_timeout=None):
        waits = compile_turns.waits_path(command[4])
        waits.write_text(json.dumps({"waited_s": 0.0, "waiting_since": time.time() - 120.0}))
        self.write(source, "[     3.0 s] ours_blocks flux: built in 3.0 s; first call at (1, 64, 64, 1)")
        return None  # stopped: the check's budget ran out while it waited

    monkeypatch.setattr(joblog.JobLog, "run", fake_run)
    result = runner.run_job({"model": "flux", "variant": "ours_blocks"}, tmp_path, {}, 180.0,
                            log=JobLog(tmp_path / "check.log"), hard_timeout=150.0)
    first = result["error"].splitlines()[0]
    assert first.startswith("timed out after 180 s of its own time, 12") and "waiting for its turn" in first, first
