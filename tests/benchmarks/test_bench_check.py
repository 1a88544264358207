"""The device check (`bench --device cuda --check`): its plan, its files and the worker options it uses, on a CPU.

No GPU here: the plan and the report are pure functions of the check's tables and of results; the worker's new
options run on a two-level SD1.5-shaped UNet, eager, on the CPU. Nothing about timings is asserted.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

from benchmarks import check
from benchmarks import models as M
from benchmarks import transformer_configs as C
from benchmarks.joblog import JobLog

ASKED = {  # the issue: every model, each of these variants; the UNets' loaded graphs also with CUDA graph replays
    "sd15": {"eager", "torch_compile", "ours_aot_cold", "ours_aot_load", "ours_aot_load_cg"},
    "sdxl": {"eager", "torch_compile", "ours_aot_cold", "ours_aot_load", "ours_aot_load_cg"},
    "vae": {"eager", "torch_compile", "ours_aot_cold", "ours_aot_load"},
    "flux": {"eager", "torch_compile", "torch_compile_blocks", "ours_blocks", "ours_blocks_load"},
    "wan": {"eager", "torch_compile", "torch_compile_blocks", "ours_blocks", "ours_blocks_load"},
}


def test_the_check_plans_exactly_the_configurations_asked_for():
    jobs = check.plan()
    assert {(j.model, j.variant) for j in jobs} == {(m, v) for m, vs in ASKED.items() for v in vs}
    assert len(jobs) == len({(j.model, j.variant) for j in jobs})  # each once
    assert {j.model: j.dtype for j in jobs} == {"sd15": "fp16", "sdxl": "fp16", "vae": "bf16", "flux": "bf16",
                                                "wan": "bf16"}
    assert {j.lane for j in jobs} == set(range(check.LANES))
    for model in ASKED:
        lanes = {j.lane for j in jobs if j.model == model}
        assert len(lanes) == 1, model  # the loaded run reads what the cold one saved, in the same lane
        order = [j.variant for j in jobs if j.model == model]
        blocks = model in M.TRANSFORMERS
        cold, load = ("ours_blocks", "ours_blocks_load") if blocks else ("ours_aot_cold", "ours_aot_load")
        assert order.index(cold) < order.index(load) and order[0] == "eager"
        assert order.index(load) < order.index("torch_compile")  # ours first: torch.compile's first call is known
    for job in jobs:
        assert 0 < job.estimate_s <= job.timeout_s <= check.BUDGET_S - check.REPORT_S
        if job.variant == "torch_compile":
            assert job.sweep_s == 0 and "recompile" in job.sweep_why  # skipped, with the reason
        elif job.variant == "torch_compile_blocks":
            assert job.sweep_s > 0 and job.sweep_why
        else:
            assert job.sweep_s is None and not job.sweep_why  # ours and eager: the whole sweep
    one_lane = check.plan(lanes=1)
    assert {j.lane for j in one_lane} == {0} and len(one_lane) == len(jobs)


def test_the_check_can_be_narrowed_to_models_and_variants():
    jobs = check.plan(models=["flux", "sd15"], variants=["eager", "ours_blocks", "ours_blocks_load"])
    assert [(j.model, j.variant) for j in sorted(jobs, key=lambda j: (j.model, j.variant))] == [
        ("flux", "eager"), ("flux", "ours_blocks"), ("flux", "ours_blocks_load"), ("sd15", "eager")]


def test_the_check_profile_is_the_full_configs_on_gpu_sizes_with_flux_cut_to_three_blocks():
    flux = M.transformer_spec("flux", "check", "cuda")
    assert (flux.config["num_layers"], flux.config["num_single_layers"]) == (1, 2)
    assert {k: flux.config[k] for k in ("num_attention_heads", "attention_head_dim", "joint_attention_dim")} == \
        {k: C.FLUX[k] for k in ("num_attention_heads", "attention_head_dim", "joint_attention_dim")}  # full width
    assert flux.describe()["changed_from_real_config"] == {"num_layers": 1, "num_single_layers": 2}
    wan = M.transformer_spec("wan", "check", "cuda")
    assert wan.config == C.WAN and not wan.changes  # Wan 2.1 1.3B as it is
    for name in M.MODELS:
        full, checked = M.spec(name, "full", "cuda"), M.spec(name, "check", "cuda")
        assert checked.config == full.config and checked.sweep() == full.sweep()
        assert checked.steady_shapes == full.steady_shapes[:1]
    assert M.transformer_spec("wan", "check", "cuda").sweep() == M.transformer_spec("wan", "full", "cuda").sweep()


def test_a_job_starts_only_with_enough_of_the_budget_left_and_never_runs_past_it():
    job = next(j for j in check.plan() if (j.model, j.variant) == ("sd15", "ours_aot_cold"))
    limit, why = check.admit(job, 1000.0)
    assert limit == job.timeout_s and why is None
    limit, why = check.admit(job, job.estimate_s)  # less than its time limit left: the limit is what is left
    assert limit == job.estimate_s and why is None
    limit, why = check.admit(job, job.estimate_s / 2 - 1)
    assert limit is None and "budget" in why and f"{job.estimate_s:.0f} s" in why
    small = next(j for j in check.plan() if (j.model, j.variant) == ("vae", "eager"))
    assert check.admit(small, check.MIN_JOB_S - 1)[0] is None and check.admit(small, check.MIN_JOB_S)[0] is not None


def test_what_each_job_process_is_given(tmp_path):
    jobs = {(j.model, j.variant): j for j in check.plan()}
    job = jobs[("sdxl", "torch_compile")].worker_job(tmp_path, "cuda", 150.0)
    assert job["profile"] == "check" and job["device"] == "cuda" and job["dtype"] == "fp16"
    assert job["compare"] and job["checkpoints"] and job["build_on_device"] and not job["steady_static"]
    assert job["steady_lock"] == str(tmp_path / "steady.lock") and job["dump_after_s"] < 150.0
    assert job["sweep_s"] == 0 and job["sweep_why"]
    load = jobs[("sdxl", "ours_aot_load")].worker_job(tmp_path, "cuda", 150.0)
    assert load["graphs_dir"] == jobs[("sdxl", "ours_aot_cold")].worker_job(tmp_path, "cuda", 150.0)["graphs_dir"]
    assert "sweep_s" not in load
    assert check.core_share(3, 16) == {"TORCHINDUCTOR_COMPILE_THREADS": "5", "KEEPFAST_BUILD_PROCESSES": "5"}
    assert check.core_share(1, 16) == {}


def test_the_cli_runs_the_check_with_its_options(monkeypatch, tmp_path):
    from compiler.cli import build_parser

    seen = {}
    monkeypatch.setattr(check, "run_check", lambda out, **kwargs: seen.update(kwargs, out=out) or 0)
    args = build_parser().parse_args(["bench", "--out", str(tmp_path), "--device", "cuda", "--check",
                                      "--budget", "300", "--lanes", "2", "--models", "sd15,flux"])
    assert args.run(args) == 0
    assert seen["budget_s"] == 300 and seen["lanes"] == 2 and seen["models"] == ["sd15", "flux"]
    assert seen["device"] == "cuda" and seen["out"] == tmp_path
    defaults = build_parser().parse_args(["bench", "--out", "o", "--device", "cuda", "--check"])
    seen.clear()
    defaults.run(defaults)
    assert seen["budget_s"] == check.BUDGET_S and seen["lanes"] == check.LANES
    assert seen["rehearse"] is False and seen["job_timeout"] is None
    rehearsal = build_parser().parse_args(["bench", "--out", "o", "--device", "cuda", "--check", "--device", "cpu",
                                           "--rehearse"])  # what `bash .ci/gpu_check.sh --device cpu --rehearse` gives
    seen.clear()
    rehearsal.run(rehearsal)
    assert seen["device"] == "cpu" and seen["rehearse"] is True
    longer = build_parser().parse_args(["bench", "--out", "o", "--check", "--job-timeout", "900"])
    seen.clear()
    longer.run(longer)
    assert seen["job_timeout"] == 900


def test_the_check_refuses_a_cpu(tmp_path, capsys):
    assert check.run_check(tmp_path / "out", device="cpu") == 2
    assert "--device cuda" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert check.run_check(tmp_path / "out", device="cuda", rehearse=True) == 2  # a rehearsal is a CPU's
    assert "--device cpu" in capsys.readouterr().err and not (tmp_path / "out").exists()
    import torch

    if not torch.cuda.is_available():  # what `bash .ci/gpu_check.sh` says on a machine without a GPU: one line
        assert check.run_check(tmp_path / "out", device="cuda") == 2
        assert "CUDA is not available" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_a_rehearsal_runs_the_same_jobs_with_the_quick_models_and_says_so(tmp_path):
    """--rehearse --device cpu: the check's jobs, lanes, limits and sweep windows, with the quick profile's models;
    bench.md and bench.json say it is a CPU rehearsal."""
    real, rehearsal = check.plan(), check.plan(profile=check.REHEARSAL_PROFILE)
    assert [(j.model, j.variant, j.lane, j.timeout_s, j.sweep_s) for j in rehearsal] == \
        [(j.model, j.variant, j.lane, j.timeout_s, j.sweep_s) for j in real]
    assert {j.profile for j in real} == {check.PROFILE} and {j.profile for j in rehearsal} == {"rehearsal"}
    assert rehearsal[0].worker_job(tmp_path, "cpu", 60.0)["profile"] == "rehearsal"
    for name in check.MODELS:  # the quick models and sizes, with the check's one steady shape (as bench.md shows)
        quick, rehearsed = M.any_spec(name, "quick", "cpu"), M.any_spec(name, "rehearsal", "cpu")
        assert rehearsed.config == quick.config and rehearsed.sweep() == quick.sweep()
        assert rehearsed.steady_shapes == quick.steady_shapes[:1] and len(quick.steady_shapes) > 1
    assert {j.timeout_s for j in check.plan(profile=check.REHEARSAL_PROFILE, job_timeout=900)} == {900.0}
    jobs = check.plan(models=["vae"], profile=check.REHEARSAL_PROFILE)
    check.write(tmp_path, {("vae", "eager"): _ran("vae", "eager")}, jobs, {"device": "cpu"}, 100.0, 1, final=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["check"]["rehearsal"] is True
    assert data["models"]["vae"]["spec"]["config"]["block_out_channels"] == list(M.QUICK_CHANGES["vae"]["block_out_channels"])
    assert "a CPU rehearsal (`--rehearse`" in (tmp_path / "bench.md").read_text()
    check.write(tmp_path, {}, check.plan(models=["vae"]), {"device": "cuda"}, 100.0, 1, final=False)
    assert json.loads((tmp_path / "bench.json").read_text())["check"]["rehearsal"] is False


# -- the files the check writes ---------------------------------------------------------------------------------

def _ran(model, variant, first=1.0, compiled=0.010, eager=0.012, mb=2300.0, diff=2e-3, **extra):
    shape = [2, 64, 64]
    return {"model": model, "variant": variant, "first_call_s": first,
            "first_call_compiles": 0 if variant == "eager" else 1,
            "process_to_first_result_s": first + 8, "process_wall_s": first + 20, "parameters": 859_000_000,
            "sweep": [{"shape": shape, "s": 0.1, "compiles": 0}], "sweep_compiles": 0, "sweep_wall_s": 1.0,
            "steady": {"2x64x64": {"shape": shape, "eager": [eager], "compiled": [compiled], "eager_median_s": eager,
                                   "compiled_median_s": compiled, "eager_min_s": eager, "compiled_min_s": compiled}},
            "cuda_max_memory_allocated_mb": mb, "vs_eager": {"max_abs": diff, "max_rel": diff / 4, "rows": []},
            "peak_rss_mb": 3000.0, "check": {"lane": 0, "timeout_s": 90.0}, **extra}


def test_the_check_writes_at_most_eight_files_and_each_result_has_memory_and_difference(tmp_path):
    out = tmp_path / "out"
    jobs = check.plan(models=["sd15", "flux"])
    log = JobLog(out / check.LOG_NAME)
    log.say("KeepFast device check: test")
    log.write("sd15-eager", "a job's line\n")
    results = {
        ("sd15", "eager"): _ran("sd15", "eager", diff=0.0),
        ("sd15", "ours_aot_cold"): _ran("sd15", "ours_aot_cold", first=120.0, graphs_saved=1,
                                        verified={"checks": 15, "mismatches": 0}),
        ("sd15", "ours_aot_load"): _ran("sd15", "ours_aot_load", first=2.0, compiled=0.008,
                                        verified={"checks": 15, "mismatches": 0},
                                        cuda_call={"shape": [4, 96, 96], "held_mb": 1700.0, "peak_mb": 2100.0}),
        ("sd15", "torch_compile"): _ran("sd15", "torch_compile", first=54.0, sweep_cut={
            "done": 0, "of": 15, "why": "not run in the check"}),
        ("flux", "eager"): _ran("flux", "eager"),
        ("flux", "ours_blocks"): {"model": "flux", "variant": "ours_blocks", "first_call_s": 40.0, "partial": True,
                                  "cuda_max_memory_allocated_mb": 9000.0,
                                  "error": "timed out after 180 s: [  179.0 s] sweep (1, 64, 64, 1)"},
        ("flux", "ours_blocks_load"): {"model": "flux", "variant": "ours_blocks_load",
                                       "skipped": "needs ours_blocks, which failed"},
    }
    for key in ("sweep", "sweep_compiles", "sweep_wall_s"):  # a sweep not run has none of its figures
        results[("sd15", "torch_compile")].pop(key)
    meta = {"device": "cuda", "dtype": "per model", "profile": "check", "torch": "2.11", "gpu": "H100"}
    paths = check.write(out, results, jobs, meta, check.BUDGET_S, check.LANES, final=True)
    written = sorted(p.name for p in out.iterdir())
    assert len(written) <= 8 and set(written) <= set(check.FILES)
    assert {"bench.json", "bench.md", check.LOG_NAME} <= set(written)
    assert sorted(p.name for p in paths.values()) == sorted(set(written) - {check.LOG_NAME})
    data = json.loads((out / "bench.json").read_text())
    rows = {(r["model"], r["variant"]): r for r in data["check"]["rows"]}
    assert set(rows) == {(j.model, j.variant) for j in jobs}
    for key, result in results.items():
        row = rows[key]
        if "skipped" in result:
            assert row["status"] == "skipped" and row["why"] == result["skipped"]
            continue
        assert row["cuda_max_memory_allocated_mb"] == result["cuda_max_memory_allocated_mb"]
        if "vs_eager" in result:
            assert row["max_abs_diff_vs_eager"] == result["vs_eager"]["max_abs"]
    assert rows[("flux", "ours_blocks")]["status"] == "timed out" and rows[("flux", "ours_blocks")]["partial"]
    assert rows[("flux", "torch_compile")]["status"] == "not reached"
    assert rows[("sd15", "torch_compile")]["sweep_why"] == "not run in the check"
    assert rows[("sd15", "ours_aot_load")]["steady_vs_eager"] == pytest.approx(1.5)
    text = (out / "bench.md").read_text()
    assert "## Device check (`--check`)" in text
    assert "| sd15 | ours_aot_load | fp16 | ok | 2.00 |" in text
    assert rows[("sd15", "ours_aot_load")]["cuda_call"]["peak_mb"] == 2100.0
    assert "| 2300 (call 2100, held 1700) |" in text and "| 2300 |" in text  # with and without a call's figure
    assert "| flux | ours_blocks_load | bf16 | skipped: needs ours_blocks, which failed |" in text
    assert "not run: not run in the check" in text
    log_text = (out / check.LOG_NAME).read_text()
    assert "runner | KeepFast device check: test" in log_text and "sd15-eager | a job's line" in log_text


def test_the_progress_writes_leave_no_chart_until_the_end(tmp_path):
    jobs = check.plan(models=["sd15"])
    results = {("sd15", "eager"): _ran("sd15", "eager")}
    meta = {"device": "cuda", "profile": "check"}
    paths = check.write(tmp_path, results, jobs, meta, check.BUDGET_S, 1, final=False)
    assert sorted(paths) == ["json", "md"] and not (tmp_path / "bench.png").exists()
    assert json.loads((tmp_path / "bench.json").read_text())["check"]["rows"][0]["status"] == "ok"


# -- what the check asks of a job process, on the CPU --------------------------------------------------------------

def test_the_worker_options_of_the_check(tmp_path):
    """A two-level UNet, eager (with steady pairs): no sweep with its reason, the difference from eager, the figures
    checkpointed, the steady pairs under the lock."""
    from benchmarks import worker

    job = {"model": "sd15", "variant": "eager", "profile": "quick", "device": "cpu", "dtype": "fp32", "reps": 1,
           "build_on_device": True, "compare": True, "sweep_s": 0, "sweep_why": "not in this test",
           "steady_lock": str(tmp_path / "steady.lock"), "steady_everywhere": True}
    checkpoints = []
    result = worker.run_job(job, lambda figures: checkpoints.append(dict(figures)))
    assert "sweep" not in result and "sweep_compiles" not in result
    assert result["sweep_cut"] == {"done": 0, "of": 15, "why": "not in this test"}
    assert [row["shape"] for row in result["vs_eager"]["rows"]] == [list(M.spec("sd15", "quick").base_shape)]
    assert result["vs_eager"]["max_abs"] is not None and result["vs_eager"]["max_abs"] < 1e-4
    assert checkpoints and checkpoints[0]["first_call_s"] == result["first_call_s"]
    assert "steady" in checkpoints[-1] and (tmp_path / "steady.lock").exists()


def test_a_window_cuts_the_sweep_and_says_how_far_it_got():
    from benchmarks import worker

    job = {"model": "vae", "variant": "eager", "profile": "quick", "device": "cpu", "dtype": "fp32", "reps": 1,
           "sweep_s": 1e-9}
    result = worker.run_job(job)
    cut = result["sweep_cut"]
    assert cut["done"] == 1 and cut["of"] == 15 and len(result["sweep"]) == 1  # one shape, then the window was over
    assert result["sweep_compiles"] == 0 and "vs_eager" not in result  # no comparison unless asked


def test_a_job_stopped_during_its_sweep_counts_the_shapes_it_ran_out_of_the_whole_sweep():
    """The figures a job checkpointed before it was stopped (a CPU rehearsal: '0 (1 of 1)' for a VAE stopped after one
    sweep shape): the row counts the shapes run out of the sweep's 15."""
    from benchmarks import worker

    class Stopped(Exception):
        pass

    saved = []

    def checkpoint(result):
        saved.append(json.loads(json.dumps(result, default=str)))
        if result.get("sweep"):
            raise Stopped  # as if killed at its limit right after the first sweep shape

    job = {"model": "vae", "variant": "eager", "profile": "rehearsal", "device": "cpu", "dtype": "fp32", "reps": 1}
    with pytest.raises(Stopped):
        worker.run_job(job, checkpoint)
    partial = {**saved[-1], "error": "timed out after 20 s", "partial": True}
    row = check._row(next(j for j in check.plan(models=["vae"]) if j.variant == "eager"), partial)
    assert (row["status"], row["sweep_shapes"], row["sweep_of"]) == ("timed out", 1, 15)
    assert row["first_call_s"] == partial["first_call_s"]


def test_the_job_log_takes_each_line_as_it_comes_and_stops_a_job_at_its_limit(tmp_path):
    log = JobLog(tmp_path / "check.log")
    code = log.run("quick-job", [sys.executable, "-c", "print('done'); raise SystemExit(3)"], cwd=str(tmp_path),
                   env={}, timeout=60)
    assert code == 3 and log.tail("quick-job") == "done"
    script = "import time; print('[ 0.1 s] started', flush=True); print('stacks'); time.sleep(60); print('never')"
    assert log.run("slow-job", [sys.executable, "-c", script], cwd=str(tmp_path), env={}, timeout=2) is None
    assert log.last_step("slow-job") == "[ 0.1 s] started" and log.last_step("quick-job") is None
    text = (tmp_path / "check.log").read_text()
    assert "quick-job | done" in text and "slow-job | [ 0.1 s] started" in text and "never" not in text


def test_a_job_stopped_at_its_limit_is_reported_by_its_last_step_not_a_line_of_its_stacks(tmp_path, monkeypatch):
    """A job killed at its limit printed Python's stacks 10 s before it (worker.py): its row says where it was (the
    last progress line), and the error keeps the stacks' last lines."""
    from benchmarks import joblog, runner

    step = "[     9.3 s] ours_aot_cold vae: built in 9.3 s; first call at (1, 32, 32)"

    def fake_run(self, source, command, cwd, env, timeout, **limits):
        self.write(source, step)
        self.write(source, "Timeout (0:02:50)!\n" + "\n".join(f'  File "x.py", line {i} in f' for i in range(30)))
        return None  # stopped at its limit

    monkeypatch.setattr(joblog.JobLog, "run", fake_run)
    log = JobLog(tmp_path / check.LOG_NAME)
    result = runner.run_job({"model": "vae", "variant": "ours_aot_cold"}, tmp_path, {}, 180.0, log=log)
    assert result["error"].splitlines()[0] == ("timed out after 180 s, its last step: [ 9.3 s] ours_aot_cold vae: "
                                               "built in 9.3 s; first call at (1, 32, 32)")
    assert 'File "x.py", line 29 in f' in result["error"] and "partial" not in result
    job = next(j for j in check.plan(models=["vae"]) if j.variant == "ours_aot_cold")
    row = check._row(job, result)
    assert row["status"] == "timed out" and row["why"] == result["error"].splitlines()[0]


def test_each_configuration_runs_in_a_process_of_its_own_and_the_run_writes_at_most_eight_files(tmp_path,
                                                                                               monkeypatch):
    """check.execute end to end with the job processes stood in for: one worker process per (model, variant), each
    with its own job file, result file and Inductor cache; what it leaves in --out is at most the check's files."""
    import torch

    from benchmarks import joblog

    started = []

    def fake_run(self, source, command, cwd, env, timeout, **limits):
        assert command[:3] == [sys.executable, "-m", "benchmarks.worker"]
        job = json.loads(Path(command[3]).read_text())
        started.append((source, job["model"], job["variant"], env["TORCHINDUCTOR_CACHE_DIR"], command[4]))
        self.write(source, f"ran {job['model']}/{job['variant']}")
        Path(command[4]).write_text(json.dumps(_ran(job["model"], job["variant"])))
        return 0

    monkeypatch.setattr(joblog.JobLog, "run", fake_run)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "a stand-in GPU")
    out = tmp_path / "out"
    jobs = check.plan(models=["sd15", "wan"])
    assert check.execute(out, "cuda", jobs, budget_s=check.BUDGET_S, lanes=2) == 0
    assert sorted((model, variant) for _, model, variant, _, _ in started) == \
        sorted((j.model, j.variant) for j in jobs)  # every configuration once, each its own process
    assert len({cache for *_, cache, _ in started}) == len(jobs)  # each with an Inductor cache of its own
    assert len({result for *_, result in started}) == len(jobs)
    written = sorted(p.name for p in out.iterdir())
    assert len(written) <= 8 and set(written) <= set(check.FILES), written
    rows = json.loads((out / "bench.json").read_text())["check"]["rows"]
    assert {r["status"] for r in rows} == {"ok"} and len(rows) == len(jobs)
    assert "sd15-ours_aot_load | ran sd15/ours_aot_load" in (out / check.LOG_NAME).read_text()


def test_a_job_near_its_limit_prints_the_stacks_from_a_python_thread(capsys):
    """Not faulthandler's later dump, which read other threads' frames without the GIL and was followed by SIGSEGV
    in two jobs on an H100: the stacks come from a Python thread, the waiting thread's own frame in them."""
    from benchmarks import worker

    def _waiting_here():
        worker._print_stacks_later(0.05)
        time.sleep(0.5)

    _waiting_here()
    err = capsys.readouterr().err
    assert "Stacks after 0 s" in err and "in _waiting_here" in err, err


def test_a_row_whose_graphs_are_not_packages_says_why():
    """Where the package loader crashed (loader_check.py), ours is served by torch.compile: the row says so."""
    job = next(j for j in check.plan(models=["sd15"]) if j.variant == "ours_aot_cold")
    reason = "sd15: torch's AOTInductor package loader crashed (SIGSEGV) ...; compiled by torch.compile instead"
    row = check._row(job, {"first_call_s": 3.0, "events": [{"kind": "compile", "reason": reason}]})
    assert row["status"] == "ok" and row["why"] == "no AOTInductor package: " + reason
    assert "why" not in check._row(job, {"first_call_s": 3.0, "events": [{"kind": "compile", "reason": "first"}]})


def test_the_check_command_without_variants_runs_the_check_s_own_cuda_graph_variant(monkeypatch, tmp_path):
    """`--check` with no --variants must not be narrowed to the CPU bench's defaults, which leave out
    ours_aot_load_cg (the loaded UNets with CUDA graph replays)."""
    import argparse

    import benchmarks as bench

    asked = {}
    monkeypatch.setattr(check, "run_check", lambda out, **kw: asked.update(kw) or 0)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    bench.run_from_args(parser.parse_args(["--out", str(tmp_path), "--device", "cuda", "--check"]))
    jobs = check.plan(models=["sd15"], variants=asked["variants"])
    assert "ours_aot_load_cg" in {j.variant for j in jobs}
    bench.run_from_args(parser.parse_args(["--out", str(tmp_path), "--check", "--variants", "eager"]))
    assert asked["variants"] == ["eager"]


def test_a_block_engine_s_job_ends_without_asking_for_cuda_graph_replays():
    """The first GPU check's flux/ours_blocks job failed at its end with "'BlockOptions' object has no attribute
    'cuda_graphs'": blocks have no replays, and their result has no cuda_graph_replays."""
    from types import SimpleNamespace

    from compiler.blocks import BlockOptions
    from compiler.serving.compiled_forward import CompileOptions
    from compiler.store.registry import GraphRegistry
    from benchmarks.worker import cuda_graph_replays

    registry = GraphRegistry()
    assert cuda_graph_replays(SimpleNamespace(options=BlockOptions()), registry) is None
    assert cuda_graph_replays(SimpleNamespace(options=CompileOptions(cuda_graphs=False)), registry) is None
    assert cuda_graph_replays(SimpleNamespace(options=CompileOptions(cuda_graphs=True)), registry) == {}
    assert cuda_graph_replays(SimpleNamespace(options=CompileOptions(cuda_graphs=True)), None) is None


def test_a_build_process_reports_its_stacks_and_the_worker_prints_them_at_its_limit(monkeypatch, tmp_path, capsys):
    """The GPU check's SD1.5 build had not ended in 230 s and its stacks were nowhere: build processes write
    theirs where the worker reads them (build_process.stack_reports._report_stacks)."""
    import threading
    import time

    from compiler.build_process import stack_reports
    from benchmarks import worker

    monkeypatch.setenv(stack_reports.STACKS_ENV, str(tmp_path))
    monkeypatch.setattr(stack_reports, "STACKS_EVERY_S", 0.05)
    stop = threading.Event()
    building = threading.Thread(target=lambda: stop.wait(10), name="pretend-inductor")
    building.start()
    stack_reports._report_stacks("build-folder-x", time.perf_counter())
    deadline = time.monotonic() + 10
    while not list(tmp_path.glob("build-*.txt")) and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.print_build_stacks()  # while the pretend build still runs: each report replaces the last
    stop.set()
    building.join()
    printed = capsys.readouterr().err
    assert "(build-folder-x)" in printed and "Thread pretend-inductor:" in printed


def test_a_call_s_gpu_memory_is_measured_at_the_largest_shape_after_a_fresh_peak(monkeypatch):
    """The job's peak covers its first-use checks (inputs copied, eager beside the graph); the call's figure is
    one call at the largest shape run, with the peak reset just before it."""
    import torch

    from benchmarks import worker

    state = {"allocated": 1000 * 2**20, "peak": 9000 * 2**20}
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["allocated"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])

    def fn(x):
        calls.append(tuple(x.shape))
        state["peak"] = max(state["peak"], state["allocated"] + x.numel() * 2**20)

    inputs = {shape: ((torch.zeros(shape),), {}) for shape in [(1, 2, 2), (4, 3, 3), (2, 4, 4)]}
    shapes_run = [(1, 2, 2), (4, 3, 3), (2, 4, 4)]
    got = worker._call_memory(fn, inputs, max(shapes_run, key=math.prod))
    assert calls == [(4, 3, 3)]
    assert got == {"shape": [4, 3, 3], "held_mb": 1000.0, "peak_mb": 1036.0}


def test_eager_is_timed_channels_last_against_contiguous_and_the_module_is_left_contiguous(tmp_path):
    """The eager job of a UNet or VAE on a GPU times NHWC against NCHW (worker._channels_last_steady): the layout
    changes between timed calls, each call sees weights and inputs of one layout, the module ends contiguous; the
    check's bench.md says the ratio."""
    import torch

    from benchmarks import worker

    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(6, 6))
    shape = (1, 8, 8)
    inputs = {shape: ((torch.randn(1, 3, 8, 8),), {})}
    seen = []

    def timed(fn, at):
        (x,), _ = inputs[at]
        weight = fn[0].weight
        layout = "nhwc" if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() else "nchw"
        weight_layout = "nhwc" if weight.is_contiguous(memory_format=torch.channels_last) and \
            not weight.is_contiguous() else "nchw"
        seen.append((layout, weight_layout))
        return 0.010 if layout == "nchw" else 0.008

    got = worker._channels_last_steady(timed, module, inputs, [shape], reps=4)
    assert set(seen) == {("nchw", "nchw"), ("nhwc", "nhwc")} and len(seen) == 10  # a first untimed pair
    assert got == {"1x8x8": {"contiguous_s": 0.010, "channels_last_s": 0.008,
                             "channels_last_vs_contiguous": pytest.approx(1.25)}}
    assert module[0].weight.is_contiguous() and inputs[shape][0][0].is_contiguous()
    out = tmp_path / "out"
    results = {("sd15", "eager"): {**_ran("sd15", "eager", diff=0.0), "channels_last": got}}
    meta = {"device": "cuda", "dtype": "per model", "profile": "check", "torch": "2.11", "gpu": "H100"}
    check.write(out, results, check.plan(models=["sd15"]), meta, check.BUDGET_S, check.LANES, final=False)
    assert "- sd15 1x8x8: 8.00 ms against 10.00 ms (1.25x)" in (out / "bench.md").read_text()
