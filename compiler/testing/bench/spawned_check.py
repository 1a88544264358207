"""The spawned trace of a background build, checked on a GPU (docs/gpu.md, "Not in the check").

`python -m compiler bench --check` compiles with background builds off, so it never reaches the path a GPU
process takes for a background build: the trace in a spawned process (compiler/backends/spawned_trace.py). This
runs that path on one model at a time, the way a ComfyUI session meets it, and writes what a reader needs to
trust it:

- where each build's trace ran (`trace_process`: "spawned" on a GPU) and why not in a trace process if not;
- the first call's time beside eager's (no torch.export in the caller), and the calls made while the build runs;
- the GPU memory of every process of the build as `nvidia-smi` shows it (the trace process should hold the CUDA
  context only: its weights are fake), and the caller's `torch.cuda.max_memory_allocated` before and after;
- once the build landed: every call served by a graph, compiles counted, and outputs against an eager twin.

    python -m compiler.testing.bench.spawned_check --device cuda --out DIR [--models sd15,flux] [--budget S]

Writes DIR/spawned.json after each model (a run stopped at a limit keeps what was done) and prints one line per
step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

MODELS = ("sd15", "flux")
CALLS_WHILE_BUILDING = 3  # model calls made right after the first, while the build runs (a sampler's steps)


def _say(started: float, text: str) -> None:
    print(f"[{time.perf_counter() - started:7.1f} s] {text}", flush=True)


class _Poller:
    """A daemon thread calling `poll()` every `interval` s between `with` entry and exit."""

    def __init__(self, interval: float):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set() and self.poll():
            self._stop.wait(self.interval)

    def poll(self) -> bool:
        """One look; False stops the polling."""
        raise NotImplementedError


class GpuMemory(_Poller):
    """Polls `nvidia-smi` for each process's GPU memory while a build runs (the peak per pid, in MiB)."""

    def __init__(self, interval: float = 0.25):
        super().__init__(interval)
        self.peaks: Dict[int, int] = {}
        self.available = True

    def poll(self) -> bool:
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                 timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            self.available = False
            return False
        for line in out.splitlines():
            try:
                pid, used = (int(part.strip()) for part in line.split(","))
            except ValueError:
                continue
            self.peaks[pid] = max(self.peaks.get(pid, 0), used)
        return True


class BuildWatch(_Poller):
    """Records every background build of this process as it goes: label, where its trace ran, its processes, the
    states it went through (package_builds keeps a build only until it is taken in)."""

    def __init__(self, interval: float = 0.1):
        super().__init__(interval)
        self.builds: Dict[int, Dict[str, Any]] = {}

    def poll(self) -> bool:
        from ...backends import package_builds

        with package_builds._lock:
            live = list(package_builds._live)
        for build in live:
            entry = self.builds.setdefault(id(build), {"label": str(build.label.owner_id), "states": {},
                                                       "trace_pids": [], "build_pids": []})
            entry["trace_process"] = build.trace_process
            entry["trace_note"] = build.trace_note
            tracer = getattr(build, "tracer", None)
            if tracer is not None and tracer.pid not in entry["trace_pids"]:
                entry["trace_pids"].append(tracer.pid)
            process = getattr(build, "process", None)
            if process is not None and process.pid not in entry["build_pids"]:
                entry["build_pids"].append(process.pid)
            view = build.view()
            entry["states"][view.state] = round(view.running_s, 2)
        return True

    def rows(self) -> List[Dict[str, Any]]:
        return list(self.builds.values())


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, args, kwargs, device: str) -> float:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        fn(*args, **kwargs)
    _sync(device)
    return time.perf_counter() - started


def _first_tensor(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return _first_tensor(value[0])
    return getattr(value, "sample", None)


def _difference(fn, twin, args, kwargs) -> Dict[str, float]:
    import torch

    with torch.no_grad():
        got, want = _first_tensor(fn(*args, **kwargs)), _first_tensor(twin(*args, **kwargs))
    diff = float((got.float() - want.float()).abs().max())
    scale = float(want.float().abs().max()) or 1.0
    return {"max_abs_diff": diff, "relative": diff / scale, "finite": bool(torch.isfinite(got).all())}


def _wait(owner, seconds: float) -> int:
    """Wait (at most `seconds`) until no build of this process traces, waits or runs, then land them all."""
    from ...backends import package_builds

    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and (package_builds.tracing_builds() or package_builds.waiting_builds()
                                              or package_builds.live_builds()):
        time.sleep(0.2)
    return owner.wait_for_builds()


def check_model(name: str, device: str, dtype_flag: str, profile: str, budget_s: float, started: float,
                work: Path, row: Dict[str, Any], save) -> None:
    """One model's background build from the first call to the graphs serving, its figures into `row` (`save()`
    after each step: a run stopped at a limit keeps them)."""
    import torch

    from ...registry import GraphRegistry
    from ...store import GraphStore
    from .models import any_spec, dtype_from_flag

    deadline = time.perf_counter() + budget_s
    dtype = dtype_from_flag(dtype_flag)
    spec = any_spec(name, profile, device)
    row.update(model=name, device=device, dtype=dtype_flag, profile=profile, kind=spec.kind, status="running")
    module = spec.build(seed=0, device=device).to(device=device, dtype=dtype)
    twin = copy.deepcopy(module)
    shapes = [spec.base_shape] + [s for s in spec.sweep()[:: max(1, len(spec.sweep()) // 3)]][:2]
    if spec.kind == "transformer":
        calls = {shape: spec.inputs(shape, device, dtype, model=module) for shape in shapes}
    else:
        calls = {shape: spec.inputs(shape, device, dtype) for shape in shapes}
    base_args, base_kwargs = calls[spec.base_shape]
    row["eager_first_call_s"] = round(_timed(twin, base_args, base_kwargs, device), 3)
    row["eager_call_s"] = round(_timed(twin, base_args, base_kwargs, device), 4)
    _say(started, f"{name}: eager first call {row['eager_first_call_s']} s, then {row['eager_call_s']} s")
    save()

    registry = GraphRegistry()
    store = GraphStore(str(work / name))
    if spec.kind == "transformer":
        from ...blocks import BlockOptions, compile_blocks

        owner = compile_blocks(module, BlockOptions(shape_range=spec.shape_range(), label=name, store=store,
                                                    autosave=True, background=True), registry)
    else:
        from ...compiled_forward import CompileOptions
        from ...diffusers_api import compile_module

        owner = compile_module(module, CompileOptions(shape_range=spec.shape_range(), label=name, store=store,
                                                      autosave=True, background=True), registry)
    exports: List[int] = []
    export = torch.export.export
    torch.export.export = lambda *a, **k: exports.append(1) or export(*a, **k)  # counts traces in this process
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        row["caller_memory_before_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
    try:
        with GpuMemory() as memory, BuildWatch() as watch:
            row["first_call_s"] = round(_timed(module, base_args, base_kwargs, device), 3)
            row["torch_export_in_caller_at_first_call"] = len(exports)
            _say(started, f"{name}: first call with a background build {row['first_call_s']} s "
                          f"(torch.export in this process: {len(exports)})")
            save()
            row["calls_while_building_s"] = [round(_timed(module, base_args, base_kwargs, device), 4)
                                             for _ in range(CALLS_WHILE_BUILDING)]
            pending = owner.builds_pending
            row["builds_pending_after_first_calls"] = pending
            waited = time.perf_counter()
            left = max(10.0, deadline - time.perf_counter() - 30)
            _say(started, f"{name}: {pending} build(s) pending; waiting up to {left:.0f} s")
            save()
            row["builds_landed"] = _wait(owner, left)
            row["builds_wait_s"] = round(time.perf_counter() - waited, 2)
            row["builds_pending_after_wait"] = owner.builds_pending
            time.sleep(0.3)
        row["builds"] = watch.rows()
        own = os.getpid()
        row["gpu_memory_peak_mib_by_pid"] = {str(pid): mib for pid, mib in memory.peaks.items()}
        row["gpu_memory_caller_peak_mib"] = memory.peaks.get(own)
        trace_pids = {pid for b in row["builds"] for pid in b["trace_pids"]}
        build_pids = {pid for b in row["builds"] for pid in b["build_pids"]}
        row["gpu_memory_trace_processes_peak_mib"] = max([memory.peaks.get(p, 0) for p in trace_pids] or [None],
                                                         key=lambda v: v or 0)
        row["gpu_memory_build_processes_peak_mib"] = max([memory.peaks.get(p, 0) for p in build_pids] or [None],
                                                         key=lambda v: v or 0)
        row["nvidia_smi"] = memory.available
        if device.startswith("cuda"):
            row["caller_max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        _say(started, f"{name}: builds {[(b['label'], b['trace_process'], b['states']) for b in row['builds']]}")
        _say(started, f"{name}: waited {row['builds_wait_s']} s, pending {row['builds_pending_after_wait']} (landed {row['builds_landed']}); "
                      f"GPU MiB trace processes {row['gpu_memory_trace_processes_peak_mib']}, builds "
                      f"{row['gpu_memory_build_processes_peak_mib']}, caller {row['gpu_memory_caller_peak_mib']}")
        save()
        served_before = getattr(owner, "graph_calls", None)
        row["after"] = []
        for shape, (args, kwargs) in calls.items():
            before = len(registry.compiles)
            seconds = _timed(module, args, kwargs, device)
            entry = {"shape": list(shape), "call_s": round(seconds, 4),
                     "compiles_during_call": len(registry.compiles) - before, **_difference(module, twin, args,
                                                                                           kwargs)}
            row["after"].append(entry)
            _say(started, f"{name}: after the build, shape {shape}: {entry}")
            save()
        if served_before is not None:
            row["graph_calls_after_build"] = owner.graph_calls - served_before
            row["eager_calls_total"] = owner.eager_calls
        row["steady_eager_vs_ours_s"] = [round(_timed(twin, base_args, base_kwargs, device), 4),
                                         round(_timed(module, base_args, base_kwargs, device), 4)]
        row["compiles"] = [{"reason": e.reason, "seconds": round(e.seconds, 2), "family": e.family,
                            "detail": {k: v for k, v in (e.detail or {}).items() if isinstance(v, (str, int, float,
                                                                                                   bool, type(None)))}}
                           for e in registry.compiles]
        row["loads"] = len(registry.loads)
        row["torch_export_in_caller_total"] = len(exports)
        row["saved_files"] = sorted(str(p.relative_to(work)) for p in (work / name).rglob("*") if p.is_file())[:20]
        last = getattr(owner, "last", None)
        row["last_status"] = last.describe() if last is not None else None
    finally:
        torch.export.export = export
        owner.cancel_builds()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiler.testing.bench.spawned_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="fp16 (SD1.5 on a GPU), bf16 (Flux); default per model")
    parser.add_argument("--models", default="sd15,flux")
    parser.add_argument("--profile", default=None, help="check (GPU, default) or quick (a CPU rehearsal)")
    parser.add_argument("--budget", type=float, default=240.0, help="seconds for all models together")
    options = parser.parse_args(argv)
    started = time.perf_counter()
    import torch

    if options.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {options.device}: CUDA is not available to this torch ({torch.__version__})")
        return 2
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = options.profile or ("check" if options.device.startswith("cuda") else "quick")
    result: Dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": options.device,
                              "gpu": torch.cuda.get_device_name() if options.device.startswith("cuda") else None,
                              "trace_process_env": os.environ.get("KEEPFAST_TRACE_PROCESS"), "models": {}}
    names = [n for n in options.models.split(",") if n]
    end = started + options.budget
    with tempfile.TemporaryDirectory(prefix="keepfast-spawned-check-") as folder:
        for index, name in enumerate(names):
            share = (end - time.perf_counter()) / (len(names) - index)
            if share < 30:
                result["models"][name] = {"status": "skipped", "why": f"{share:.0f} s of the budget left"}
                continue
            dtype = options.dtype or ("bf16" if name == "flux" else "fp16") if options.device.startswith("cuda") \
                else (options.dtype or "fp32")
            row: Dict[str, Any] = {}
            result["models"][name] = row

            def save() -> None:
                (out / "spawned.json").write_text(json.dumps(result, indent=1, default=str))

            try:
                check_model(name, options.device, dtype, profile, share, started, Path(folder), row, save)
                row["status"] = "ok"
            except Exception as error:  # noqa: BLE001 - the report says what failed; the next model still runs
                import traceback

                row.update(status="failed", error=f"{type(error).__name__}: {error}"[:2000],
                           stack=traceback.format_exc()[-4000:])
                _say(started, f"{name}: FAILED {row['error'][:300]}")
            save()
            if options.device.startswith("cuda"):
                torch.cuda.empty_cache()
    _say(started, f"wrote {out / 'spawned.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
