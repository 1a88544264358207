"""Run every benchmark configuration, each in its own process, then write the report.

Each (model, variant) runs in a fresh Python process (compile caches and
memory peaks do not leak between them) with its own empty Inductor cache
folder, so a cold compile is cold. Two exceptions, on purpose:
`torch_compile_warm` reuses `torch_compile`'s cache folder (torch.compile's
own restart), and `ours_aot_load` reads the graphs `ours_aot_cold` saved.
`ours_aot_fresh` reads them too, on a "fresh machine" (fresh_machine.py:
empty TMPDIR and Inductor cache, a C++ compiler that records calls and fails);
its result says what was called and what was left in TMPDIR after it exited.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from compiler.settings import TRUST_FILE
from . import compile_turns
from . import models as M
from . import report
from . import session as S
from . import weights as W
from .fresh_machine import FreshMachine
from .joblog import JobLog
from .models import DEFAULT_VARIANTS
from .worker import partial_path as worker_partial_path

REPO = Path(__file__).resolve().parents[1]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_job(job: Dict[str, Any], work: Path, env: Dict[str, str], timeout: float,
            log: Optional["JobLog"] = None, hard_timeout: Optional[float] = None) -> Dict[str, Any]:
    """Run one configuration in a fresh process; returns its result (or the error). Its output goes to its own
    log in `work`, or, given `log`, into that one log, line by line (check.py). A job killed at `timeout` that
    wrote its figures so far (worker.py's checkpoints) returns those, with the error. Given `log`, the time the
    job waited for its turns at compiling (compile_turns.py) does not count against `timeout`, and
    `hard_timeout` bounds its wall time whatever it waited."""
    tag = job_tag(job)
    job_path, result_path, log_path = work / f"{tag}.job.json", work / f"{tag}.result.json", work / f"{tag}.log"
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    partial = worker_partial_path(result_path)
    partial.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.worker", str(job_path), str(result_path)]
    spawned = time.time()
    step = None
    waited = lambda: 0.0  # noqa: E731 - its waits for a turn at compiling (compile_turns.py), with `log`
    if log is not None:
        waits = compile_turns.waits_path(result_path)
        waits.unlink(missing_ok=True)
        waited = lambda: compile_turns.waited_seconds(waits)  # noqa: E731
        code = log.run(tag, command, cwd=str(REPO), env=env, timeout=timeout, waited=waited,
                       hard_timeout=hard_timeout)
        tail = lambda: log.tail(tag)  # noqa: E731
        step = log.last_step(tag)
    else:
        with open(log_path, "w") as output:
            try:
                process = subprocess.run(command, cwd=str(REPO), env=env, stdout=output, stderr=subprocess.STDOUT,
                                         timeout=timeout)
                code = process.returncode
            except subprocess.TimeoutExpired:
                code = None
        tail = lambda: _tail(log_path, 15)  # noqa: E731
    wall = time.time() - spawned
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exited with {code}"
        turn_wait_s = waited() if code is None else 0.0
        if turn_wait_s >= 1.0:  # stopped by the budget while it waited for other jobs' compiles
            why += f" of its own time, {turn_wait_s:.0f} s more waiting for its turn to compile"
        if step:  # the error's first line (the report's row) says where it was, not a line of its stacks
            why += f", its last step: {' '.join(step.split())}"
        result = json.loads(partial.read_text()) if partial.exists() else {"variant": job["variant"],
                                                                           "model": job["model"]}
        result["error"] = f"{why}\nits last lines:\n{tail()}"
        if partial.exists():
            result["partial"] = True  # the figures it wrote before it ended
    if code is None and "error" not in result:
        result["error"] = f"timed out after {timeout:.0f} s"
    result["process_wall_s"] = wall
    if result.get("first_result_at"):  # less any wait for its turn at compiling: not the job's own time
        result["process_to_first_result_s"] = (result["first_result_at"] - spawned
                                               - float(result.get("first_call_turn_wait_s") or 0.0))
    for stamp, seconds in (("first_image_at", "first_image_s"), ("last_image_at", "session_s")):
        if result.get(stamp):  # session.py's figures count from the process's start
            result[seconds] = result[stamp] - spawned
    result["job"] = {k: v for k, v in job.items() if k not in ("graphs_dir",)}
    result["cache_dir_fresh"] = job.get("cache_fresh", True)
    return result


# A variant that reads what another one left (its graphs, its Inductor cache) runs after it, in the same run.
NEEDS = {"torch_compile_warm": "torch_compile", "ours_aot_load": "ours_aot_cold", "ours_aot_fresh": "ours_aot_cold",
         "ours_aot_load_cg": "ours_aot_cold",
         "ours_blocks_load": "ours_blocks"}


def missing_need(variant: str, done: Dict[str, Dict[str, Any]]) -> Optional[str]:
    """Why `variant` cannot run, given the results of its model's variants so far (`done`); None if it can."""
    needs = NEEDS.get(variant)
    if needs and (needs not in done or "error" in done[needs] or "skipped" in done[needs]):
        return f"needs {needs}, which {'failed' if needs in done and 'error' in done[needs] else 'was not run'}"
    return None


def machine_meta(device: str, started: float) -> Dict[str, Any]:
    """What the report says of the machine and the run: versions, CPU and GPU, load, start time, command."""
    import torch

    return {
        "torch": torch.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(), "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
        "threads": torch.get_num_threads(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "uptime_start": _uptime(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(started)),
        "command": " ".join(sys.argv),
    }


def job_env(work: Path) -> Dict[str, str]:
    """The environment of a job process: the run's own trust list, unbuffered output, this checkout importable."""
    return {**os.environ, TRUST_FILE.name: str(work / "trusted.json"), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p])}


def job_tag(job: Dict[str, Any]) -> str:
    """A job's name in file names and log lines: model-variant."""
    return f"{job['model']}-{job['variant']}".replace(":", "-")


def _line(result: Dict[str, Any]) -> str:
    head = f"  {result.get('model')}/{result.get('variant')}: "
    if "error" in result:
        return head + "FAILED: " + str(result["error"]).splitlines()[0][:200]
    if "skipped" in result:
        return head + "skipped: " + result["skipped"]
    parts = [f"first call {result.get('first_call_s', 0):.2f} s ({result.get('first_call_compiles', 0)} compiles)"]
    if "sweep_compiles" in result:
        parts.append(f"sweep {result['sweep_wall_s']:.1f} s, {result['sweep_compiles']} compiles")
    for key, cell in (result.get("steady") or {}).items():
        parts.append(f"{key}: eager {cell['eager_median_s']:.4f} s / compiled {cell['compiled_median_s']:.4f} s")
    parts.append(f"peak RSS {result.get('peak_rss_mb', 0):.0f} MB, process {result.get('process_wall_s', 0):.0f} s")
    return head + "; ".join(parts)


def run_bench(out: Path, *, quick: bool = False, device: str = "cpu", dtype: str = "fp32",
              models: Sequence[str] = M.ALL_MODELS, variants: Sequence[str] = DEFAULT_VARIANTS, reps: Optional[int] = None,
              comfy: bool = True, keep: bool = False, job_timeout: Optional[float] = None,
              comfy_modes: Sequence[str] = M.COMFY_MODES, comfy_attention: str = "default",
              sessions: bool = True, steady: bool = True, weights: Sequence[str] = (),
              weight_variants: Sequence[str] = W.VARIANTS,
              session_variants: Sequence[str] = S.SESSION_VARIANTS) -> int:
    profile = "quick" if quick else "full"
    reps = reps or (11 if quick else 5)  # quick calls take milliseconds: more pairs for the same time
    job_timeout = job_timeout or (1800.0 if quick else 7200.0)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="keepfast-bench-"))
    started = time.time()
    import torch  # only for the version and device checks; the work runs in subprocesses

    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {device}: CUDA is not available to this torch ({torch.__version__})", file=sys.stderr)
        return 2
    specs = {name: M.any_spec(name, profile, device) for name in models}
    profile_text = ("--quick: the real block types and conditioning sizes at two levels and narrow widths (see "
                    "each model's 'changed_from_real_config'), a smoke run, not the real models' numbers" if quick else
                    "the real diffusers configs (SD1.5 UNet, SDXL UNet, SD VAE decoder), random weights; transformers "
                    "at their real configs, on a CPU at real width with one block per block structure")
    if weights and not (steady or sessions or comfy):  # --weights-only: the profile text above is not about it
        profile_text = ("quantised weights only (--weights-only): the tiny Flux of comfy_quantised.py, "
                        + ("smaller sizes and fewer timed steps (--quick)" if quick else "256-512 pixel sizes"))
    meta: Dict[str, Any] = {
        "profile": profile, "quick": quick, "profile_text": profile_text, "device": device, "dtype": dtype,
        **machine_meta(device, started), "reps": reps,
    }
    print(f"KeepFast bench: profile {profile} ({profile_text}); device {device} {dtype}; torch {torch.__version__}; "
          f"load {meta['loadavg_start']}; work folder {work}", flush=True)
    base_env = job_env(work)
    jobs: List[Dict[str, Any]] = []
    for name in models:
        spec = specs[name]
        if not steady:
            break
        print(f"{spec.title} ({name}): sweep {len(spec.sweep())} shapes, steady {spec.steady_shapes}, "
              f"declared range batch {spec.range_batch} latent {spec.range_spatial}", flush=True)
        done: Dict[str, Dict[str, Any]] = {}
        for variant in variants:
            if variant not in M.variants_for(name):
                continue
            cache = work / f"{name}-cache-{'torch_compile' if variant in ('torch_compile', 'torch_compile_warm') else variant}"
            job = {"model": name, "variant": variant, "profile": profile, "device": device, "dtype": dtype,
                   "reps": reps, "graphs_dir": str(work / f"{name}-graphs"),
                   "cache_fresh": variant != "torch_compile_warm"}
            why = missing_need(variant, done)
            if why:
                result = {"model": name, "variant": variant, "skipped": why}
            elif variant == "ours_aot_fresh":
                machine = FreshMachine(work / f"{name}-fresh-machine").setup()
                result = run_job(job, work, machine.env(base_env), job_timeout)
                result["compiler_calls"] = machine.compiler_calls()
                result["tmpdir_left_after_exit"] = machine.tmpdir_entries()
                result["inductor_cache_files_after_exit"] = len(machine.cache_entries())
            else:
                if variant != "torch_compile_warm":
                    shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir(parents=True, exist_ok=True)
                env = {**base_env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
                result = run_job(job, work, env, job_timeout)
            done[variant] = result
            jobs.append(result)
            print(_line(result), flush=True)
            _save_partial(out, jobs, meta)
    for name in models if sessions else ():
        if name not in S.SESSION_MODELS:
            continue
        print(f"{specs[name].title} ({name}): sessions of {S.IMAGES} images x {S.STEPS} steps", flush=True)
        for job in S.session_jobs(name, specs[name].kind, session_variants):
            variant = job["session_variant"]
            job.update(profile=profile, device=device, dtype=dtype, graphs_dir=str(work / f"{name}-session-{variant}-graphs"))
            cache = work / f"{name}-session-cache-{variant}"  # the restart keeps its session's Inductor cache
            if not job["restart"]:
                shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True, exist_ok=True)
            result = run_job(job, work, {**base_env, "TORCHINDUCTOR_CACHE_DIR": str(cache)}, job_timeout)
            result.setdefault("kind", "session")
            jobs.append(result)
            print(S.line(result), flush=True)
            _save_partial(out, jobs, meta)
    weights_result = None
    if weights:
        weights_result = _run_weights(work, models, weights, quick, weight_variants, job_timeout)
    if comfy:
        from .comfy_e2e import run_comfy

        comfy_result = run_comfy(work, quick=quick, keep=keep, modes=comfy_modes, attention=comfy_attention)
    else:
        only = "--weights-only" if weights and not sessions else "--sessions-only"
        comfy_result = {"run": False, "why": "--no-comfy was given" if steady else f"{only} was given"}
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["uptime_end"] = _uptime()
    meta["duration_s"] = round(time.time() - started, 1)
    summary = report.summarise(jobs, meta, {n: s.describe() for n, s in specs.items()}, comfy_result, weights_result)
    paths = report.write_all(out, summary)
    (out / "partial.json").unlink(missing_ok=True)
    print()
    print(report.markdown(summary))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if summary.get("chart"):
        print("no chart: " + summary["chart"])
    if keep:
        print(f"kept the work folder {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    failed = [j for j in jobs if "error" in j] + [
        r for entry in ((weights_result or {}).get("results") or {}).values()
        for r in (entry.get("variants") or {}).values() if "error" in r]
    return 1 if failed else 0


def _run_weights(work: Path, models: Sequence[str], weights: Sequence[str], quick: bool,
                 variants: Sequence[str], timeout: float) -> Dict[str, Any]:
    """The quantised-weights part (weights.py); it is Flux's only, so without flux in --models it says so."""
    if W.MODEL not in models:
        why = f"--weights runs the {W.MODEL} model; --models {','.join(models)} leaves it out"
        print(f"quantised weights: skipped: {why}", flush=True)
        return {"model": W.MODEL, "results": {kind: {"skipped": why} for kind in weights}}
    print(f"Flux with quantised weights in ComfyUI ({', '.join(weights)}): variants "
          f"{', '.join(variants)}", flush=True)
    return W.run_weights(work / "weights", weights, quick=quick, variants=variants, timeout=timeout)


def _save_partial(out: Path, jobs: List[dict], meta: dict) -> None:
    """What has run so far, in case the run is stopped."""
    (out / "partial.json").write_text(json.dumps({**meta, "jobs": jobs}, indent=1, default=str))
