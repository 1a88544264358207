"""`python -m compiler bench --device cuda --check --out DIR`: the device check of one GPU in about 7 minutes.

What one GPU machine is asked, in one command, within a budget fit for a machine
that kills a command after 10 minutes (one H100, 16 cores, no network, at most 8 files back):
the real SD1.5 and SDXL UNets in fp16 and the SD VAE decoder (bf16, as
ComfyUI decodes on GPUs that have it), compiled whole; Flux at full width cut
to 1 double and 2 single blocks and Wan 2.1 1.3B, in bf16, by blocks. Each
(model, variant) in its own process: eager, torch.compile as TorchCompileModel
calls it, compile_repeated_blocks (transformers), ours cold and ours loaded in
a fresh process; first call, steady state alternating with eager in one
process, compiles over the sweep, peak GPU memory and the largest difference
from eager.

Everything in sequence takes about 20 minutes on such a machine (estimates
below), so the jobs run in LANES lanes at once, one model's jobs in one lane
(its loaded run after its cold one), each lane's jobs by priority (ours before
torch.compile, whose first call there is expected near a minute: 53.7 s for
the SD1.5 UNet in the H100 figures the plan started from).
Compiles take turns (compile_turns.py): the first call of a variant that
compiles, and a sweep that recompiles, hold a lock that every job of the run
shares, so no two compiles overlap and each has every core for its compilers
(its wait for the turn is not charged to its time limit, nor to its time to a
first result); the other jobs get their lane's share of the cores. The timed
steady-state pairs of two jobs never overlap either (another lock); a compile
may still run meanwhile, which eager and compiled calls of a pair, alternating,
share alike, and each pair records how busy the machine was. A job starts only with enough of the budget
left for it (else it is skipped with the reason), its time limit is what is
left at most, and whole-model torch.compile runs no sweep (a recompile costs
about a first compile: the reason is in the report).

Written into DIR, progressively (a run killed at its limit leaves the results
so far): bench.json and bench.md after every job, check.log line by line (every
job's output with its name), bench.png at the end.

`--rehearse --device cpu` runs all of that on a CPU with the quick profile's
small models (REHEARSAL_PROFILE): the same jobs, processes, limits, budget and
files, so that a GPU run does not meet an import, path or report mistake;
its figures are a small CPU's, never a GPU's, and its report says so.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from compiler.settings import BUILD_PROCESSES, CONV_LAYOUT, get as setting_text
from . import models as M
from . import report
from .compile_turns import COMPILING
from .joblog import JobLog

PROFILE = "check"
REHEARSAL_PROFILE = "rehearsal"  # --rehearse: the check's jobs on a CPU, with the quick profile's small models
BUDGET_S = 420.0  # the whole check on one H100: about 7 minutes (the machine's limit is 10 per command)
REPORT_S = 20.0  # kept back from the budget for the report and chart at the end
MIN_JOB_S = 30.0  # no job starts with less than this left (nor with less than half its estimate)
LANES = 3
REPS = 5
LOG_NAME = "check.log"
FILES = ("bench.json", "bench.md", "bench.png", LOG_NAME)  # all the check writes into --out
MODELS = ("sd15", "sdxl", "vae", "flux", "wan")
# ComfyUI runs SD UNets in fp16 and, on GPUs with bf16 (an H100), the VAE in bf16 (fp16 overflows SD VAEs).
DTYPES = {"sd15": "fp16", "sdxl": "fp16", "vae": "bf16", "flux": "bf16", "wan": "bf16"}
WHOLE = ("eager", "torch_compile", "ours_aot_cold", "ours_aot_load")
UNET = WHOLE + ("ours_aot_load_cg",)  # CUDA graph replays measured on and off where a sampler repeats a step
BLOCKS = ("eager", "torch_compile", "torch_compile_blocks", "ours_blocks", "ours_blocks_load")
# Within a lane, in this order: what is not yet known of a GPU first.
PRIORITY = ("eager", "ours_aot_cold", "ours_blocks", "ours_aot_load", "ours_blocks_load", "ours_aot_load_cg",
            "torch_compile_blocks",
            "torch_compile")

# (estimated seconds from process start to exit on one H100, time limit) per (model, variant). Anchored on the
# H100 figures the plan started from (SD1.5 eager first call 4.1 s, torch.compile's 53.7 s, torch.export of it
# over 30 s; Flux blocks' compile_repeated_blocks 16.5 s and 6 recompiles over the sweep: not measured by this
# repository's sessions, which had no GPU) and on the CPU runs' ratios. The jobs that ran on the H200 (second
# session, 3 lanes of 5 cores: docs/benchmarks.md) now say what their processes took there: SD1.5 eager 30 s,
# Flux eager 20 s, ours_blocks 145 s (its structures built one after the other), ours_blocks_load 21 s,
# torch_compile_blocks 81 s with its sweep, whole-model torch_compile 47 s.
ESTIMATES: Dict[Tuple[str, str], Tuple[float, float]] = {
    ("sd15", "eager"): (30, 90), ("sd15", "torch_compile"): (75, 150),
    ("sd15", "ours_aot_cold"): (200, 330), ("sd15", "ours_aot_load"): (35, 120), ("sd15", "ours_aot_load_cg"): (35, 120),
    ("sdxl", "eager"): (35, 90), ("sdxl", "torch_compile"): (110, 200),
    ("sdxl", "ours_aot_cold"): (240, 330), ("sdxl", "ours_aot_load"): (45, 150), ("sdxl", "ours_aot_load_cg"): (45, 150),
    ("vae", "eager"): (20, 90), ("vae", "torch_compile"): (50, 120),
    ("vae", "ours_aot_cold"): (90, 180), ("vae", "ours_aot_load"): (30, 120),
    ("flux", "eager"): (20, 90), ("flux", "torch_compile"): (50, 120), ("flux", "torch_compile_blocks"): (80, 120),
    ("flux", "ours_blocks"): (140, 180), ("flux", "ours_blocks_load"): (25, 120),
    ("wan", "eager"): (25, 90), ("wan", "torch_compile"): (90, 180), ("wan", "torch_compile_blocks"): (45, 120),
    ("wan", "ours_blocks"): (70, 180), ("wan", "ours_blocks_load"): (30, 120),
}
# The sweep's window per variant (None: the whole sweep), and why it is shorter.
SWEEPS: Dict[str, Tuple[Optional[float], str]] = {
    "torch_compile": (0.0, "not run in the check: a recompile of the whole model costs about its first compile "
                           "(the SD1.5 UNet: about 54 s expected on an H100) and the CPU runs counted 2-5 over this sweep"),
    "torch_compile_blocks": (45.0, "no shape started after 45 s of sweep (about 6 recompiles over it are expected "
                                   "on a GPU)"),
}


@dataclass(frozen=True)
class CheckJob:
    """One configuration of the check: where and when it runs, how long it may take, how much sweep it does."""

    model: str
    variant: str
    dtype: str
    lane: int
    estimate_s: float
    timeout_s: float
    sweep_s: Optional[float] = None
    sweep_why: str = ""
    profile: str = PROFILE

    def worker_job(self, work: Path, device: str, timeout_s: float) -> Dict[str, Any]:
        """What worker.py is given: the check profile and the check's options (worker.py's docstring)."""
        job: Dict[str, Any] = {
            "model": self.model, "variant": self.variant, "profile": self.profile, "device": device, "dtype": self.dtype,
            "reps": REPS, "graphs_dir": str(work / f"{self.model}-graphs"), "cache_fresh": True,
            "build_on_device": True, "compare": True, "checkpoints": True, "steady_lock": str(work / "steady.lock"),
            "compile_lock": str(work / "compile.lock"),
            "steady_static": False, "first_use_cost": False, "dump_after_s": max(5.0, timeout_s - 10.0),
        }
        if self.sweep_s is not None:
            job.update(sweep_s=self.sweep_s, sweep_why=self.sweep_why)
        return job


def variants_of(model: str) -> Tuple[str, ...]:
    return BLOCKS if model in M.TRANSFORMERS else UNET if model in ("sd15", "sdxl") else WHOLE


def plan(models: Sequence[str] = MODELS, variants: Optional[Sequence[str]] = None,
         lanes: int = LANES, profile: str = PROFILE, job_timeout: Optional[float] = None) -> List[CheckJob]:
    """The check's jobs, lane by lane and in the order each lane runs them.

    A model's jobs share a lane (its loaded run reads the graphs its cold run saved); models go to the lane with
    the least estimated time so far, the longest first; within a lane, jobs run by PRIORITY, then by model.
    `variants` narrows the check's own (None: all of them); `profile` is the models' (REHEARSAL_PROFILE: --rehearse);
    `job_timeout` replaces every job's own time limit (a rehearsal on a small CPU needs longer ones).
    """
    lanes = max(1, lanes)
    chosen = {m: [v for v in variants_of(m) if variants is None or v in variants] for m in MODELS if m in models}
    totals = {m: sum(ESTIMATES[(m, v)][0] for v in vs) for m, vs in chosen.items()}
    load = [0.0] * lanes
    lane_of: Dict[str, int] = {}
    for model in sorted(chosen, key=lambda m: (-totals[m], MODELS.index(m))):
        lane = min(range(lanes), key=lambda i: (load[i], i))
        lane_of[model] = lane
        load[lane] += totals[model]
    jobs = []
    for model, vs in chosen.items():
        for variant in vs:
            estimate, limit = ESTIMATES[(model, variant)]
            window, why = SWEEPS.get(variant, (None, ""))
            jobs.append(CheckJob(model, variant, DTYPES[model], lane_of[model], float(estimate),
                                 float(job_timeout or limit), window, why, profile))
    return sorted(jobs, key=lambda j: (j.lane, PRIORITY.index(j.variant), MODELS.index(j.model)))


def admit(job: CheckJob, left_s: float) -> Tuple[Optional[float], Optional[str]]:
    """(the time limit to run `job` with, None) with `left_s` seconds of the budget left, or (None, why not)."""
    needed = max(MIN_JOB_S, job.estimate_s / 2)
    if left_s < needed:
        return None, (f"not started: {max(0.0, left_s):.0f} s of the check's budget were left, it needs about "
                      f"{job.estimate_s:.0f} s (at least {needed:.0f})")
    return min(job.timeout_s, left_s), None


def core_share(lanes: int, cores: Optional[int] = None) -> Dict[str, str]:
    """Each job's share of the cores for its compilers when LANES jobs run at once: Inductor's compile workers
    and the pack's build processes."""
    if lanes <= 1:
        return {}
    share = str(max(1, (cores or os.cpu_count() or 1) // lanes))
    return {"TORCHINDUCTOR_COMPILE_THREADS": share, BUILD_PROCESSES.name: share}


# -- the summary of the check -----------------------------------------------------------------------------------

def _row(job: CheckJob, result: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    row: Dict[str, Any] = {"model": job.model, "variant": job.variant, "dtype": job.dtype, "lane": job.lane}
    if result is None:
        return {**row, "status": "not reached", "why": "the run ended before this job's turn"}
    if "skipped" in result:
        return {**row, "status": "skipped", "why": result["skipped"]}
    if "error" in result:
        row.update(status="timed out" if "timed out" in str(result["error"]) else "failed",
                   why=str(result["error"]).strip().splitlines()[0][:300], partial=bool(result.get("partial")))
    else:
        row["status"] = "ok"
        instead = next((e["reason"] for e in result.get("events") or [] if "package loader crashed" in e["reason"]),
                       None)
        if instead:  # ours ran, but not from packages: what it ran instead (loader_check.py) is the row's news
            row["why"] = "no AOTInductor package: " + instead[:240]
    steady = next(iter((result.get("steady") or {}).values()), None)
    cut = result.get("sweep_cut")
    row.update({
        "timeout_s": (result.get("check") or {}).get("timeout_s"),
        "process_wall_s": result.get("process_wall_s"),
        "first_call_s": result.get("first_call_s"),
        "first_call_compiles": result.get("first_call_compiles"),
        "process_to_first_result_s": result.get("process_to_first_result_s"),
        "sweep_compiles": result.get("sweep_compiles"),
        "sweep_shapes": len(result.get("sweep") or []) if "sweep" in result else 0,
        "sweep_of": (cut or {}).get("of") or result.get("sweep_of") or len(result.get("sweep") or []),
        "sweep_why": (cut or {}).get("why"),
        "steady_shape": steady["shape"] if steady else None,
        "steady_ms": steady["compiled_median_s"] * 1000 if steady else None,
        "steady_eager_ms": steady["eager_median_s"] * 1000 if steady else None,
        "steady_vs_eager": steady["eager_median_s"] / steady["compiled_median_s"] if steady else None,
        "cuda_max_memory_allocated_mb": result.get("cuda_max_memory_allocated_mb"),
        "cuda_call": result.get("cuda_call"),
        "channels_last": result.get("channels_last"),
        "call_overhead": result.get("call_overhead"),
        "weight_release": result.get("weight_release"),
        "max_abs_diff_vs_eager": (result.get("vs_eager") or {}).get("max_abs"),
        "max_rel_diff_vs_eager": (result.get("vs_eager") or {}).get("max_rel"),
        "verified": result.get("verified"),
        "graphs_saved": result.get("graphs_saved"),
    })
    return row


def _release_cell(cell: Dict[str, Any]) -> str:
    text = f"{cell['kept']} of {cell['replaced']} copies kept ({cell['rounds']} rounds of {cell['weights']} weights)"
    if cell.get("compiles"):
        text += f", {cell['compiles']} compiles"
    if "allocated_mb_before" in cell:
        text += f", {cell['allocated_mb_before']:.0f} MB allocated before, {cell['allocated_mb_after']:.0f} MB after"
    return text


def summarise(jobs: List[CheckJob], results: Dict[Tuple[str, str], Dict[str, Any]], budget_s: float,
              lanes: int) -> Dict[str, Any]:
    """bench.json's `check`: the plan and one row per job (its figures, or why it did not run)."""
    return {"budget_s": budget_s, "lanes": lanes, "core_share": core_share(lanes),
            "rehearsal": any(job.profile != PROFILE for job in jobs),
            "plan": [asdict(job) for job in jobs],
            "rows": [_row(job, results.get((job.model, job.variant))) for job in jobs]}


def _cell(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(check: Dict[str, Any]) -> List[str]:
    """bench.md's check table: every job, ran or not (with the reason)."""
    share = (check.get("core_share") or {}).get("TORCHINDUCTOR_COMPILE_THREADS", "all")
    title = "## Device check (`--check`)"
    if check.get("rehearsal"):
        title += ": a CPU rehearsal (`--rehearse`, the quick profile's small models), not GPU figures"
    lines = [title, "",
             f"Budget {check['budget_s']:.0f} s; {check['lanes']} lanes at once, each model's jobs in one lane "
             f"(Inductor compile threads and build processes per job that does not compile: {share}); compiles took "
             "turns, one at a time with every core (a job's wait for its turn is not in its times); timed "
             "steady-state pairs never overlap between jobs. Steady state: the first steady shape, "
             f"median of {REPS} alternating pairs in one process.", "",
             "| model | variant | dtype | status | first call, s | process start to first result, s | compiles "
             "in the first call | sweep compiles (shapes) | steady ms: compiled / eager | vs eager | peak GPU MB "
             "(one call's at the largest shape after the checks, MB held before it) "
             "| max abs diff vs eager (rel) | first-use checks (mismatches) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in check["rows"]:
        status = row["status"] + (f": {row['why']}" if row.get("why") else "")
        if row["status"] in ("skipped", "not reached"):
            lines.append(f"| {row['model']} | {row['variant']} | {row['dtype']} | {status} |" + " - |" * 9)
            continue
        sweep = (f"{_cell(row['sweep_compiles'])} ({row['sweep_shapes']} of {row['sweep_of']})"
                 if row["sweep_shapes"] else f"not run: {row['sweep_why']}" if row.get("sweep_why") else "-")
        if row["sweep_shapes"] and row.get("sweep_why"):
            sweep += f"; {row['sweep_why']}"
        steady = (f"{_cell(row['steady_ms'])} / {_cell(row['steady_eager_ms'])}" if row.get("steady_ms") is not None
                  else "-")
        rel = row.get("max_rel_diff_vs_eager")
        diff = "-" if row.get("max_abs_diff_vs_eager") is None else (
            f"{row['max_abs_diff_vs_eager']:.3g}" + (f" ({rel:.2g})" if rel is not None else ""))
        verified = row.get("verified") or {}
        checks = f"{verified['checks']} ({verified['mismatches']})" if verified else "-"
        lines.append(f"| {row['model']} | {row['variant']} | {row['dtype']} | {status} | {_cell(row['first_call_s'])} "
                     f"| {_cell(row['process_to_first_result_s'])} | {_cell(row['first_call_compiles'])} | {sweep} "
                     f"| {steady} | {_cell(row['steady_vs_eager'])} | {_peak_cell(row)} | {diff} | {checks} |")
    overheads = [row for row in check["rows"] if row.get("call_overhead")]
    if overheads:
        lines += ["", "The pack's own work around its graph's run in a call (call_overhead.py; medians of "
                  "synchronised calls at the steady shape):"]
        lines += [f"- {row['model']} {row['variant']} {row['call_overhead']['shape']}: "
                  f"{row['call_overhead']['outside_ms']:.2f} ms of a {row['call_overhead']['whole_ms']:.2f} ms call "
                  f"(its graph's run {row['call_overhead']['graph_run_ms']:.2f} ms)" for row in overheads]
    released = [row for row in check["rows"] if row.get("weight_release")]
    if released:
        lines += ["", "Weights replaced by copies and put back, a call after each (LoRA patching; weight_release.py): "
                  "copies still held after it, and the memory allocated before and after:"]
        lines += [f"- {row['model']} {row['variant']}: {_release_cell(row['weight_release'])}" for row in released]
    layouts = [(row["model"], key, cell) for row in check["rows"] for key, cell in (row.get("channels_last") or {}).items()]
    if layouts:
        lines += ["", "Eager with the weights and inputs channels-last (NHWC) against contiguous (NCHW), alternating "
                  "pairs (what NHWC convolutions could give a graph of the model; compiler/build_process/conv_layout.py):"]
        lines += [f"- {model} {key}: {cell['channels_last_s'] * 1000:.2f} ms against {cell['contiguous_s'] * 1000:.2f} ms "
                  f"({cell['channels_last_vs_contiguous']:.2f}x)" for model, key, cell in layouts]
    return lines + [""]


def _peak_cell(row: Dict[str, Any]) -> str:
    """The job's peak GPU memory, and where measured, one call's at the largest shape after every check
    (`worker._call_memory`): "peak (a call's peak, held before it)"."""
    cell = _cell(row.get("cuda_max_memory_allocated_mb"), 0)
    call = row.get("cuda_call")
    if call:
        cell += f" (call {call['peak_mb']:.0f}, held {call['held_mb']:.0f})"
    return cell


def write(out: Path, results: Dict[Tuple[str, str], Dict[str, Any]], jobs: List[CheckJob], meta: Dict[str, Any],
          budget_s: float, lanes: int, final: bool) -> Dict[str, Path]:
    """bench.json and bench.md from the results so far (and bench.png when `final`); the files written."""
    device = meta.get("device", "cuda")
    specs = {j.model: M.any_spec(j.model, j.profile, device).describe() for j in jobs}
    ran = [r for j in jobs for r in [results.get((j.model, j.variant))] if r is not None]
    summary = report.summarise(ran, meta, specs, {"run": False, "why": "not part of the device check"})
    summary["check"] = summarise(jobs, results, budget_s, lanes)
    why = "not drawn yet (the run goes on)"
    if final:
        try:
            return report.write_all(Path(out), summary)
        except Exception as error:  # noqa: BLE001 - a chart that cannot be drawn must not cost the figures
            why = f"not drawn: {type(error).__name__}: {error}"
            Path(out, "bench.png").unlink(missing_ok=True)
    return report.write_all(Path(out), summary, chart_too=False, no_chart=why)


# -- running it -------------------------------------------------------------------------------------------------

def run_check(out: Path, device: str = "cuda", models: Sequence[str] = MODELS, variants: Optional[Sequence[str]] = None,
              budget_s: float = BUDGET_S, lanes: int = LANES, keep: bool = False, rehearse: bool = False,
              job_timeout: Optional[float] = None) -> int:
    """Run the check (CheckJob.worker_job in its own process each, LANES at once) within `budget_s`; `rehearse`:
    on the CPU, with REHEARSAL_PROFILE's models; `job_timeout`: every job's time limit instead of its own."""
    cuda = str(device).startswith("cuda")
    if rehearse and cuda:
        print("--rehearse is a CPU rehearsal of the check: give --device cpu (or leave --rehearse out)", file=sys.stderr)
        return 2
    if not cuda and not rehearse:
        print("--check is the device check of one GPU: give --device cuda (a CPU runs it only as a rehearsal, with "
              "small models: --device cpu --rehearse)", file=sys.stderr)
        return 2
    import torch

    if cuda and not torch.cuda.is_available():
        print(f"--device {device}: CUDA is not available to this torch ({torch.__version__})", file=sys.stderr)
        return 2
    profile = REHEARSAL_PROFILE if rehearse else PROFILE
    return execute(Path(out), device, plan(models, variants, lanes, profile, job_timeout), budget_s, lanes, keep)


def execute(out: Path, device: str, jobs: List[CheckJob], budget_s: float, lanes: int, keep: bool = False) -> int:
    """Run `jobs` lane by lane, each lane's jobs one after the other, within `budget_s`; 1 if any failed."""
    from .runner import _line, job_env, machine_meta, missing_need, run_job

    started = time.time()
    deadline = started + budget_s - REPORT_S
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="keepfast-check-"))
    log = JobLog(out / LOG_NAME)
    rehearsal = any(job.profile != PROFILE for job in jobs)
    meta: Dict[str, Any] = {
        "profile": PROFILE, "quick": False, "device": device, "dtype": "per model: " + ", ".join(
            f"{m} {DTYPES[m]}" for m in dict.fromkeys(j.model for j in jobs)), "reps": REPS,
        "profile_text": "the device check: the real SD1.5 / SDXL UNets (fp16) and SD VAE decoder (bf16) whole, Flux "
                        "at full width with 1 double + 2 single blocks and Wan 2.1 1.3B (bf16) by blocks; random "
                        "weights",
        **machine_meta(device, started),
        # Our GPU graphs' convolution layout (compiler/build_process/conv_layout.py): asked for, or Inductor's choice
        "conv_layout": setting_text(CONV_LAYOUT) or "Inductor's choice (NCHW for a dynamic-size graph)",
    }
    if rehearsal:
        meta.update(profile=REHEARSAL_PROFILE, quick=True,
                    profile_text="a CPU rehearsal of the device check (--rehearse): its jobs, processes, limits and "
                                 "files with the quick profile's small models (two levels, narrow widths) and the "
                                 "check's one steady shape; a small CPU's figures, not a GPU's")
    log.say(f"KeepFast device check: {len(jobs)} jobs in {lanes} lanes, budget {budget_s:.0f} s; "
            f"{meta['gpu'] or 'no GPU: a CPU rehearsal'}; "
            f"torch {meta['torch']}; work folder {work}")
    for job in jobs:
        log.say(f"  lane {job.lane}: {job.model}/{job.variant} {job.dtype}, about {job.estimate_s:.0f} s, limit "
                f"{job.timeout_s:.0f} s" + (f", sweep: {job.sweep_why}" if job.sweep_why else ""))
    results: Dict[Tuple[str, str], Dict[str, Any]] = {}
    lock = threading.Lock()
    env = job_env(work)

    def record(job: CheckJob, result: Dict[str, Any]) -> None:
        with lock:
            results[(job.model, job.variant)] = result
            log.say(_line(result))
            write(out, results, jobs, meta, budget_s, lanes, final=False)

    def lane(index: int) -> None:
        for job in [j for j in jobs if j.lane == index]:
            with lock:
                done = {v: r for (m, v), r in results.items() if m == job.model}
            why = missing_need(job.variant, done)
            limit, skip = (None, why) if why else admit(job, deadline - time.time())
            if skip:
                record(job, {"model": job.model, "variant": job.variant, "skipped": skip})
                continue
            cache = work / f"{job.model}-cache-{job.variant}"
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
            log.say(f"lane {index}: {job.model}/{job.variant} starts, limit {limit:.0f} s")
            # a compile takes its turn (compile_turns.py) and has every core then; other jobs share them by lane
            share = {} if job.variant in COMPILING else core_share(lanes)
            try:
                result = run_job(job.worker_job(work, device, limit), work,
                                 {**env, **share, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, limit, log=log,
                                 hard_timeout=max(1.0, deadline - time.time()))
            except Exception as error:  # noqa: BLE001 - the lane goes on with its next job
                result = {"model": job.model, "variant": job.variant,
                          "error": f"the runner could not run it: {type(error).__name__}: {error}"}
            result["check"] = {"lane": index, "timeout_s": round(limit, 1), "estimate_s": job.estimate_s,
                               "started_s": round(time.time() - started - result.get("process_wall_s", 0.0), 1)}
            record(job, result)

    threads = [threading.Thread(target=lane, args=(i,), name=f"check-lane-{i}") for i in sorted({j.lane for j in jobs})]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    meta.update(loadavg_end=[round(x, 2) for x in os.getloadavg()], duration_s=round(time.time() - started, 1))
    with lock:
        paths = write(out, results, jobs, meta, budget_s, lanes, final=True)
    names = ", ".join(sorted(p.name for p in paths.values()))
    log.say(f"wrote {names} and {LOG_NAME} in {time.time() - started:.0f} s")
    if keep:
        log.say(f"kept the work folder {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any("error" in r for r in results.values()) else 0
