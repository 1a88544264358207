"""One benchmark configuration in its own process: `python -m benchmarks.worker JOB.json RESULT.json`.

Variants (what is timed; everything after the model is built):
- eager: the module as it is;
- torch_compile: `torch.compile(module)` -- default `dynamic=None`, backend
  "inductor", as ComfyUI's TorchCompileModel calls it -- with empty caches;
- torch_compile_warm: the same in a fresh process that reuses the first
  one's Inductor cache folder (torch.compile's own "restart");
- ours_inductor: `compile_module(..., backend="inductor")` over the declared range;
- ours_aot_cold: `compile_module(..., backend="aot")`, graphs saved as they compile;
- ours_aot_load: a fresh process serving the module from those saved graphs;
- ours_aot_load_cg: the same, replaying CUDA graphs of repeated shapes (backends/cuda_graphs.py);
- ours_aot_fresh: the same on a "fresh machine" (the parent gives it an empty
  TMPDIR and Inductor cache and no C++ compiler); only its first call is timed;
- ours_oneflow: `compile_module(..., backend="oneflow")`; OneFlow graphs are
  static, so after the first call the sweep's shapes are warmed up (timed,
  compiles counted) as a user declares them, and the sweep follows.
- torch_compile_blocks (transformers): diffusers' `compile_repeated_blocks()`,
  torch.compile of each repeated block (what KJNodes and diffusers do);
- ours_blocks / ours_blocks_load (transformers): `compiler.blocks` with the
  aot backend, graphs saved as they compile / a fresh process loading them.

Each compiled variant: the first call at the base shape (timed: a cold
compile, or a load), steady-state step times alternating eager and compiled
calls, and the sweep of 5 resolutions x 3 batch sizes counting compiles. Ours
run with the first-use check on (the default): each sweep shape's first call
also runs eagerly once, so the sweep is visited again (`first_use_check`):
what a first visit cost more than a checked one, how many checks ran, and the
largest output held while the eager call runs. The result is one JSON file;
nothing is printed that the parent needs.

What the device check (check.py) adds to a job, each off unless the job asks:
`build_on_device` (weights made on the GPU), `sweep_s` (the sweep starts no
shape after its first once that many seconds passed; 0: no sweep, with
`sweep_why`), `compare` (the
largest difference from eager over the shapes run: `vs_eager`),
`checkpoints` (the result so far written after each phase, so a job killed at
its time limit still tells its first call), `steady_lock` (a file locked while
steady-state pairs are timed, so two jobs never time at once on one GPU),
`compile_lock` (a file locked while the job compiles, so two jobs never compile at once:
compile_turns.py; its waits go to `turn_waits`, by default beside the result, for the runner),
`steady_static` False and `first_use_cost` False (phases left out), and
`dump_after_s` (Python's stacks into the log shortly before the time limit).
An eager job of a UNet or VAE on a GPU also times the model with its weights and
inputs channels-last against contiguous (`channels_last`; `"channels_last": false` leaves it out).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import os
import resource
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from compiler.build_process.build_profile import CompileProfile, machine_busy_seconds
from .compile_turns import COMPILING, SWEEP_COMPILES, CompileTurns, waited_seconds, waits_path
from . import call_overhead, phases, weight_release

_T0 = time.perf_counter()


def cuda_graph_replays(wrapper: Any, registry: Any) -> Optional[Dict[str, Any]]:
    """Per graph, its CUDA graph captures, replays and why replay is off, where the job asked for replays; None
    otherwise. Block engines have no such option (blocks are not replayed: BlockOptions has no cuda_graphs)."""
    if registry is None or not getattr(getattr(wrapper, "options", None), "cuda_graphs", False):
        return None
    return {graph.key.id: graph.replay_state() for graph in registry.graphs() if hasattr(graph, "replay_state")}


def _say(text: str) -> None:
    """Progress into the job's log (the parent keeps it in the work folder)."""
    print(f"[{time.perf_counter() - _T0:8.1f} s] {text}", file=sys.stderr, flush=True)


def _rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _LimitWatcher(logging.Handler):
    """Notices torch.compile giving up on a frame (recompile limit): later calls run eager, silently."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record):
        try:
            text = record.getMessage()
        except Exception:
            return
        if "recompile_limit" in text or "cache_size_limit" in text or "recompile limit" in text:
            self.messages.append(text.splitlines()[0][:300])


def run_job(job: Dict[str, Any], checkpoint: Callable[[Dict[str, Any]], None] = lambda result: None) -> Dict[str, Any]:
    """One configuration's figures; `checkpoint(result)` is called with the figures so far after each phase."""
    if job.get("kind") == "session":  # session.py: images from process start
        from .session import run_session

        return run_session(job)
    import torch

    from .models import any_spec, dtype_from_flag, parameter_count

    variant = job["variant"]
    device = job.get("device", "cpu")
    dtype = dtype_from_flag(job.get("dtype", "fp32"))
    model = any_spec(job["model"], job["profile"], device)
    reps = int(job.get("reps", 5))
    cuda = device.startswith("cuda")
    result: Dict[str, Any] = {
        "variant": variant, "model": model.name, "profile": job["profile"], "device": device,
        "dtype": job.get("dtype", "fp32"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()), "pid": os.getpid(),
    }

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Callable, shape) -> float:
        args, kwargs = inputs[shape]
        started = time.perf_counter()
        with torch.no_grad():
            fn(*args, **kwargs)
        sync()
        return time.perf_counter() - started

    started = time.perf_counter()
    module = model.build(seed=0, device=device if job.get("build_on_device") else None).to(device=device, dtype=dtype)
    result["build_s"] = time.perf_counter() - started
    result["parameters"] = parameter_count(module)
    result["rss_after_build_mb"] = _rss_mb()
    shapes = sorted(set(model.sweep()) | set(model.steady_shapes))
    if model.kind == "transformer":  # its pipeline's call, built from the model's config
        inputs = {shape: model.inputs(shape, device, dtype, model=module) for shape in shapes}
    else:
        inputs = {shape: model.inputs(shape, device, dtype) for shape in shapes}
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    watcher = _LimitWatcher()
    logging.getLogger("torch._dynamo").addHandler(watcher)
    eager_fn: Callable = module
    compiled_fn: Callable = module
    registry = None
    wrapper = None
    count: Callable[[], int] = lambda: 0

    if variant == "eager":
        pass
    elif variant in ("torch_compile", "torch_compile_warm"):
        from torch._dynamo.utils import counters

        compiled_fn = torch.compile(module)  # as ComfyUI's TorchCompileModel: dynamic=None, backend "inductor"
        count = lambda: int(counters["stats"]["unique_graphs"])
    elif variant == "torch_compile_blocks":
        from torch._dynamo.utils import counters

        model.compile_repeated_blocks(module)  # diffusers: torch.compile of every block in `_repeated_blocks`

        def eager_fn(*args, **kwargs):
            with torch.compiler.set_stance("force_eager"):
                return module(*args, **kwargs)

        count = lambda: int(counters["stats"]["unique_graphs"])
    elif variant in ("ours_blocks", "ours_blocks_load"):
        from compiler.blocks import BlockOptions, compile_blocks
        from compiler.store.registry import GraphRegistry
        from compiler.store.graph_store import GraphStore

        registry = GraphRegistry()
        options = BlockOptions(shape_range=model.shape_range(), label=model.name, store=GraphStore(job["graphs_dir"]),
                               autosave=variant == "ours_blocks")
        wrapper = compile_blocks(module, options, registry)
        eager_fn = wrapper.eager
        count = lambda: len(registry.compiles)
    elif variant.startswith("ours_"):
        from compiler.serving.compiled_forward import CompileOptions
        from compiler.diffusers_api import compile_module
        from compiler.store.registry import GraphRegistry
        from compiler.store.graph_store import GraphStore

        registry = GraphRegistry()
        backend = {"ours_inductor": "inductor", "ours_oneflow": "oneflow"}.get(variant, "aot")
        options = CompileOptions(backend=backend, shape_range=model.shape_range(), label=model.name,
                                 cover_range=backend != "oneflow")
        if variant == "ours_aot_cold":
            options = options.with_(store=GraphStore(job["graphs_dir"]), autosave=True)
        elif variant in ("ours_aot_load", "ours_aot_fresh", "ours_aot_load_cg"):
            options = options.with_(store=GraphStore(job["graphs_dir"]), cuda_graphs=variant == "ours_aot_load_cg")
        wrapper = compile_module(module, options, registry)
        compiled_fn = module
        eager_fn = wrapper.eager
        count = lambda: len(registry.compiles)
    else:
        raise ValueError(f"unknown variant {variant!r}")

    base = model.base_shape
    # -- first call: a cold compile, a warm-cache compile, a load, or eager's first call
    before = count()
    _say(f"{variant} {model.name}: built in {result['build_s']:.1f} s; first call at {base}")
    turns = CompileTurns(job.get("compile_lock"), job.get("turn_waits"))  # compiles one at a time (check.py)
    with turns.turn() if variant in COMPILING else contextlib.nullcontext():
        with CompileProfile() as profile:  # the CPU this job's processes used in it, where its main thread was
            result["first_call_s"] = timed(compiled_fn, base)
    result["first_call_turn_wait_s"] = round(turns.waited_s, 2)
    result["first_call_profile"] = {**profile.phases(), "main_thread": profile.sampler.top()}
    _say(f"first call {result['first_call_s']:.1f} s, {count() - before} compiles")
    result["first_result_at"] = time.time()  # wall clock: the parent subtracts its spawn time
    result["first_call_compiles"] = count() - before
    result["first_call_shape"] = list(base)
    if registry is not None:
        result["first_call_loads"] = len(registry.loads)
    # Where the first call's compile time went (phases.py): ours from its builds, torch.compile from its timers.
    if registry is not None and registry.compiles:
        result["first_call_phases"] = phases.ours_phases([e.detail for e in registry.compiles])
        result["first_call_build_main_thread"] = phases.slowest_build_samples([e.detail for e in registry.compiles])
    elif variant in ("torch_compile", "torch_compile_blocks"):
        result["first_call_phases"] = phases.torch_compile_phases()
    result["rss_after_first_call_mb"] = _rss_mb()
    if cuda:
        result["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    checkpoint(result)
    lock = _steady_lock(job.get("steady_lock"))

    # -- torch.compile's steady state on the graph specialised to the first shape, before any other shape
    if variant == "torch_compile" and job.get("steady_static", True):
        with lock():
            result["steady_static"] = _steady(timed, eager_fn, compiled_fn, [base], reps, count)

    if variant in ("torch_compile_warm", "ours_aot_fresh"):  # only their first call is of interest
        result["compile_turn_wait_s"] = round(turns.waited_s, 2)
        return _finish(result, variant, count, registry, wrapper, watcher, job, cuda)

    # -- static-shape graphs: the sweep's and steady shapes declared and warmed up before the sweep
    if variant == "ours_oneflow":
        declared = sorted(set(model.sweep()) | set(model.steady_shapes))
        before = count()
        started = time.perf_counter()
        with torch.no_grad():
            states = wrapper.warmup([inputs[shape] for shape in declared])
        result["warmup_s"] = time.perf_counter() - started
        result["warmup_compiles"] = count() - before
        result["warmup_states"] = states
        _say(f"warmup of {len(declared)} shapes: {result['warmup_s']:.1f} s, {result['warmup_compiles']} compiles")

    # -- the sweep: 5 resolutions x 3 batch sizes, one call each, in order (within `sweep_s`, if the job gives one)
    window = job.get("sweep_s")
    shapes_run = [base]
    if window is not None and window <= 0:
        result["sweep_cut"] = {"done": 0, "of": len(model.sweep()), "why": job.get("sweep_why", "")}
    else:
        sweep = []
        result["sweep_of"] = len(model.sweep())  # a job stopped half-way says how much of it it ran
        recompiles = contextlib.ExitStack()  # a sweep that recompiles takes its turn too
        if variant in SWEEP_COMPILES:
            recompiles.enter_context(turns.turn())
        sweep_started = time.perf_counter()
        for shape in model.sweep():
            if window is not None and sweep and time.perf_counter() - sweep_started > window:
                result["sweep_cut"] = {"done": len(sweep), "of": len(model.sweep()),
                                       "why": f"no shape started after {window:.0f} s of sweep"}
                break
            before = count()
            seconds = timed(compiled_fn, shape)
            sweep.append({"shape": list(shape), "s": seconds, "compiles": count() - before})
            shapes_run.append(shape)
            _say(f"sweep {shape}: {seconds:.2f} s, {count() - before} compiles")
            result.update(sweep=sweep, sweep_compiles=sum(row["compiles"] for row in sweep))
            checkpoint(result)
        result["sweep_wall_s"] = time.perf_counter() - sweep_started
        recompiles.close()
        result["sweep"] = sweep
        result["sweep_compiles"] = sum(row["compiles"] for row in sweep)
        if registry is not None and getattr(getattr(wrapper, "options", None), "verify", False) \
                and job.get("first_use_cost", True):
            result["first_use_check"] = _first_use_cost(timed, compiled_fn, eager_fn, inputs, model.sweep(), sweep,
                                                        registry)
        if registry is not None:
            result["verified"] = {"checks": len(registry.verdicts), "mismatches": len(registry.mismatches)}
        checkpoint(result)

    # -- steady state after the sweep, alternating eager and compiled calls (the
    # aot graphs of the cold run are the ones the load run times; eager alone needs no pairs)
    if variant not in ("eager", "ours_aot_cold", "ours_blocks") or job.get("steady_everywhere"):
        with lock():
            result["steady"] = _steady(timed, eager_fn, compiled_fn, model.steady_shapes, reps, count)
        checkpoint(result)
    if job.get("compare"):
        result["vs_eager"] = _differences(compiled_fn, eager_fn, inputs, _spread(shapes_run, 4))
    if variant.startswith("ours_aot") and model.steady_shapes:  # the pack's own work around its graph's run
        result["call_overhead"] = call_overhead.measure(timed, compiled_fn, model.steady_shapes[0])
    if variant.startswith(("ours_aot", "ours_blocks")) and model.steady_shapes:
        # weights replaced and put back, as LoRA patching does: whether the graphs keep the ones let go
        shape = model.steady_shapes[0]
        result["weight_release"] = weight_release.measure(module, lambda: timed(compiled_fn, shape), compiles=count)
        checkpoint(result)
    if cuda:
        result["cuda_call"] = _call_memory(compiled_fn, inputs, max(shapes_run, key=math.prod))
    if variant == "eager" and cuda and model.kind != "transformer" and job.get("channels_last", True):
        with lock():  # after every memory figure: the layout's copies of the weights are not the job's
            result["channels_last"] = _channels_last_steady(timed, module, inputs, model.steady_shapes, reps)
        checkpoint(result)
    result["compile_turn_wait_s"] = round(turns.waited_s, 2)
    return _finish(result, variant, count, registry, wrapper, watcher, job, cuda)


def _channels_last_steady(timed, module, inputs, shapes, reps: int) -> Dict[str, Any]:
    """Per steady shape, eager with the module's 4-D weights and its 4-D inputs channels-last (NHWC) against
    contiguous (NCHW), in alternating pairs: what cuDNN's NHWC convolutions could give a graph of this model at
    most, before any compile (compiler/build_process/conv_layout.py says why our range graphs run NCHW). The layout is
    changed between timed calls, never within one; the module is left contiguous."""
    import torch

    def laid_out(fmt):
        module.to(memory_format=fmt)
        laid = {shape: tuple(_formatted(value, fmt) for value in inputs[shape]) for shape in shapes}
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the copies done before the next timed call starts
        return laid

    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    times: Dict[str, Dict[Any, List[float]]] = {name: {shape: [] for shape in shapes} for name in formats}
    kept = dict(inputs)
    try:
        for index in range(reps + 1):  # the first pair untimed
            order = list(formats) if index % 2 == 0 else list(reversed(formats))
            for name in order:
                inputs.update(laid_out(formats[name]))
                for shape in shapes:
                    seconds = timed(module, shape)
                    if index:
                        times[name][shape].append(seconds)
    finally:
        inputs.update(kept)
        module.to(memory_format=torch.contiguous_format)
    out = {}
    for shape in shapes:
        contiguous, channels_last = (statistics.median(times[name][shape]) for name in formats)
        out["x".join(map(str, shape))] = {"contiguous_s": contiguous, "channels_last_s": channels_last,
                                          "channels_last_vs_contiguous": contiguous / channels_last}
    return out


def _formatted(value, fmt):
    """A call's args or kwargs with its 4-D tensors in memory format `fmt` (others as they are)."""
    import torch
    import torch.utils._pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(memory_format=fmt) if t.dim() == 4 else t, value)


def _call_memory(fn: Callable, inputs, shape) -> Dict[str, Any]:
    """GPU memory of one call at `shape` once every first-use check and compile is behind: what the process
    holds before it (weights, the job's inputs, whatever a compiled graph keeps) and the call's peak. The job's
    `cuda_max_memory_allocated_mb` is the peak over everything it ran, first-use checks (the inputs copied, eager
    run beside the graph's output) and comparisons included; this is the figure a sampler's steps see."""
    import torch

    args, kwargs = inputs[shape]
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fn(*args, **kwargs)
    torch.cuda.synchronize()
    return {"shape": list(shape), "held_mb": round(held / 2**20, 1),
            "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1)}


def _spread(shapes: List[Any], most: int) -> List[Any]:
    """At most `most` of `shapes`, the first and last among them, evenly apart."""
    if len(shapes) <= most:
        return list(shapes)
    step = (len(shapes) - 1) / (most - 1)
    return [shapes[round(i * step)] for i in range(most)]


def _differences(compiled_fn: Callable, eager_fn: Callable, inputs, shapes) -> Dict[str, Any]:
    """The largest difference of the compiled outputs from eager's, on the same inputs, over `shapes`: absolute, and
    relative to the largest eager value of that shape (for eager itself: a second eager call, the noise floor)."""
    import torch
    import torch.utils._pytree as pytree

    rows = []
    for shape in shapes:
        args, kwargs = inputs[shape]
        with torch.no_grad():
            eager = [t for t in pytree.tree_leaves(eager_fn(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            compiled = [t for t in pytree.tree_leaves(compiled_fn(*args, **kwargs)) if isinstance(t, torch.Tensor)]
        if len(eager) != len(compiled):
            rows.append({"shape": list(shape), "error": f"{len(compiled)} outputs, eager gives {len(eager)}"})
            continue
        worst, scale = 0.0, 0.0
        for e, c in zip(eager, compiled):
            worst = max(worst, float((c.float() - e.float()).abs().max()))
            scale = max(scale, float(e.float().abs().max()))
        rows.append({"shape": list(shape), "max_abs": worst, "max_rel": worst / scale if scale else None})
    measured = [row for row in rows if "max_abs" in row]
    return {"rows": rows, "max_abs": max((r["max_abs"] for r in measured), default=None),
            "max_rel": max((r["max_rel"] for r in measured if r["max_rel"] is not None), default=None)}


def _steady_lock(path: Optional[str]):
    """A context that holds `path` locked (fcntl) while steady-state pairs are timed; nothing without a path."""
    import contextlib

    from compiler.store import file_lock

    return (lambda: file_lock.held(path)) if path else contextlib.nullcontext


def _finish(result, variant, count, registry, wrapper, watcher, job, cuda) -> Dict[str, Any]:
    import torch

    result["compiles_total"] = count()
    if registry is not None:
        result["loads_total"] = len(registry.loads)
        result["events"] = [
            {"kind": e.kind, "reason": e.reason[:300], "seconds": round(e.seconds, 3),
             **{k: e.detail[k] for k in ("phase_s", "parts_phase_s", "slowest_kernels") if k in (e.detail or {})}}
            for e in registry.events if e.kind in ("compile", "load", "fallback", "refused")
        ]
        result["fallbacks"] = len(registry.fallbacks)
        result["graph_calls"] = wrapper.graph_calls
        result["eager_calls"] = wrapper.eager_calls
    replays = cuda_graph_replays(wrapper, registry)
    if replays is not None:
        result["cuda_graph_replays"] = replays
    if hasattr(wrapper, "report"):  # block engine: what ran compiled, per block structure
        result["block_report"] = wrapper.report()
    if variant in ("torch_compile", "torch_compile_warm", "torch_compile_blocks"):
        from torch._dynamo.utils import counters

        result["dynamo_stats"] = {k: int(v) for k, v in counters["stats"].items()}
        result["recompile_limit_hit"] = watcher.messages
        result["inductor_fxgraph_cache"] = {k: int(v) for k, v in counters["inductor"].items()
                                            if k.startswith("fxgraph_cache")}
    if variant in ("ours_aot_cold", "ours_blocks"):
        packages = list(Path(job["graphs_dir"]).rglob("*.pt2"))
        result["graphs_saved"] = len(packages)
        result["graphs_saved_mb"] = sum(p.stat().st_size for p in packages) / 1e6
    result["peak_rss_mb"] = _peak_rss_mb()
    if cuda:
        result["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    result["loadavg_end"] = list(os.getloadavg())
    return result


def _first_use_cost(timed, compiled_fn, eager_fn, inputs, shapes, sweep, registry) -> Dict[str, Any]:
    """What the first-use check cost over the sweep: each shape visited again, now checked.

    The extra seconds of a first visit are one eager call (plus the comparison); memory is the graph's output,
    held while that eager call runs.
    """
    import torch
    import torch.utils._pytree as pytree

    rows = []
    for shape, first in zip(shapes, sweep):
        repeat = timed(compiled_fn, shape)
        args, kwargs = inputs[shape]
        with torch.no_grad():
            held = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(eager_fn(*args, **kwargs))
                       if isinstance(t, torch.Tensor))
        rows.append({"shape": list(shape), "first_s": first["s"], "repeat_s": repeat, "held_mb": held / 2**20})
    extra = sum(max(0.0, row["first_s"] - row["repeat_s"]) for row in rows)
    return {"checks": len(registry.verdicts), "mismatches": len(registry.mismatches), "rows": rows,
            "extra_s": extra, "sweep_s": sum(row["first_s"] for row in rows),
            "held_mb_max": max((row["held_mb"] for row in rows), default=0.0)}


def _steady(timed, eager_fn, compiled_fn, shapes, reps: int, count) -> Dict[str, Any]:
    """Per shape: one untimed call of each, then `reps` timed pairs in alternating order."""
    out = {}
    for shape in shapes:
        _say(f"steady {shape}: {reps} alternating pairs")
        before = count()
        timed(eager_fn, shape)
        timed(compiled_fn, shape)
        eager, compiled = [], []
        started, cpu, machine = time.perf_counter(), _cpu_s(), machine_busy_seconds()
        for index in range(reps):
            if index % 2 == 0:
                eager.append(timed(eager_fn, shape))
                compiled.append(timed(compiled_fn, shape))
            else:
                compiled.append(timed(compiled_fn, shape))
                eager.append(timed(eager_fn, shape))
        out["x".join(map(str, shape))] = {
            "shape": list(shape), "eager": eager, "compiled": compiled,
            "eager_median_s": statistics.median(eager), "compiled_median_s": statistics.median(compiled),
            "eager_min_s": min(eager), "compiled_min_s": min(compiled),
            "compiles_during": count() - before,
            "process": _process_state(time.perf_counter() - started, _cpu_s() - cpu, machine),
        }
    return out


def _cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def _process_state(wall_s: float, cpu_s: float, machine_busy_before: Optional[float] = None) -> Dict[str, Any]:
    """What else ran while the pairs were timed: this process's CPU seconds against their wall time (above 1.0x:
    other threads were busy), its other threads, the machine's load, and the cores the whole machine kept busy
    meanwhile (`machine_cores_busy`: another lane's compiles, whose workers take every core). The third and fourth
    H200 runs' eager SD1.5 took 50.91 and 45.64 ms in one process, 28.85 and 29.72 ms in another: a GPU step
    that launches hundreds of kernels from one CPU thread waits for that thread, so a busy machine slows it."""
    import threading

    machine = machine_busy_seconds()
    busy = ({"machine_cores_busy": round((machine - machine_busy_before) / wall_s, 2)}
            if machine is not None and machine_busy_before is not None and wall_s > 0 else {})
    return {"wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3), **busy,
            "threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _write(path: Path, result: Dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def partial_path(result_path: Path) -> Path:
    """Where a job that checkpoints writes its figures so far (the parent reads it if the job is killed)."""
    return result_path.with_suffix(".partial.json")


def _print_stacks_later(seconds: float, waited: Optional[Callable[[], float]] = None) -> None:
    """Print every thread's Python stack after `seconds` of the job's own time (its waits for a turn at compiling,
    `waited()`, left out, as the runner's limit leaves them out), from a Python thread (holding the GIL).

    Not faulthandler.dump_traceback_later: on an H100 (torch 2.11+cu130) two jobs, in Inductor's compile, died
    with SIGSEGV within 0.2 s of its dump (frames "<shim>" and "<interpreter trampoline>" in it): it reads other
    threads' frames without the GIL. This waits for the GIL instead, so a thread that holds it delays the
    stacks; that thread's own stack is then printed as it is when it lets go."""
    import threading

    from compiler.build_process.stack_reports import other_threads_stacks

    def dump() -> None:
        lines = [f"Stacks after {seconds:.0f} s (the time limit is near):"] + other_threads_stacks()
        print("\n".join(lines), file=sys.stderr, flush=True)
        print_build_stacks()

    def wait_then_dump() -> None:
        started = time.time()
        while time.time() - started - (waited() if waited is not None else 0.0) < seconds:
            time.sleep(min(0.5, max(0.01, seconds / 20)))
        dump()

    threading.Thread(target=wait_then_dump, name="keepfast-stacks-later", daemon=True).start()


def print_build_stacks() -> None:
    """The last stacks each of this job's build processes reported (build_process.stack_reports._report_stacks)."""
    from compiler.settings import build_stacks

    folder = build_stacks()
    for path in sorted(Path(folder).glob("build-*.txt")) if folder else ():
        try:
            print(path.read_text(), file=sys.stderr, flush=True)
        except OSError:
            pass


def main(argv: List[str]) -> int:
    job_path, result_path = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())
    job.setdefault("turn_waits", str(waits_path(result_path)))  # where the runner reads this job's waits
    if job.get("dump_after_s"):  # where a long compile is when the parent's time limit comes
        import faulthandler
        import tempfile

        from compiler.settings import BUILD_STACKS

        faulthandler.enable()  # a crash prints the stacks as it happens
        stacks = tempfile.mkdtemp(prefix="keepfast-build-stacks-")
        os.environ[BUILD_STACKS.name] = stacks  # the build processes inherit it
        atexit.register(shutil.rmtree, stacks, True)
        _print_stacks_later(float(job["dump_after_s"]), lambda: waited_seconds(job["turn_waits"]))
    checkpoint = (lambda result: _write(partial_path(result_path), result)) if job.get("checkpoints") else \
        (lambda result: None)
    try:
        result = run_job(job, checkpoint)
        code = 0
    except BaseException as error:  # the parent records the failure and goes on
        result = {"variant": job.get("variant"), "model": job.get("model"),
                  "error": f"{type(error).__name__}: {str(error)[:2000]}", "traceback": traceback.format_exc()[-6000:]}
        code = 1
    _write(result_path, result)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
