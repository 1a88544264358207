"""How a machine's Triton build time per kernel configuration changes with how many builds run at once.

Why: an AOTInductor build of the SD1.5 UNet with dynamic sizes on an H200 (torch 2.11.0+cu130, 2026-11-28) spent
0.77 s per Triton configuration in its compile workers (3 build processes x 5 workers at once) against
torch.compile's 0.18 s on the same machine, while one-at-a-time builds of the same kernels on a 2-core CPU cost
0.117 s (dynamic) and 0.092 s (static). This tells the host (SMT siblings, clock, a cgroup quota) from the kernels:
it builds the same kernel configurations (kernel_sources.py writes them) at 1, 4, 8 and 16 concurrent worker
processes, plus the static-size kernels at 1, and records the machine's CPU topology, within a time budget.
On that H200: 0.117 s a configuration at 1, 0.144 s at 16 (1.22x), on 16 cores with one thread each and no quota.
So not the host: the cause was a few persistent reductions over dynamic sizes, 80 s the slowest kernel
(docs/gpu.md, "What the pack does on a GPU"; compiler/build_process/gpu_reductions.py).

    python -m tools.kernel_builds.kernel_builds --sources .kernels/sd15_kernels.json --out DIR \
        [--configs 64] [--concurrency 1,4,8,16] [--target cuda:90] [--budget-s 60]

How each configuration is built: the kernel's source is loaded with Inductor's PyCodeCache, and for each entry of
the CachingAutotuner's `.configs` its `_create_compile_meta`/`_create_compile_options` give what
`triton.compile(ASTSource(...), target=..., options=...)` takes (what Inductor's `_precompile_config` does). The
sample is the first N configurations taken round-robin over the kernels (config 0 of each kernel, then config 1,
...), the same N at every level. Each level gets a fresh, empty TRITON_CACHE_DIR; every build is checked for a
cache hit through Triton's compilation listener, which also gives each stage's time (ttir ... cubin: ptxas).

Workers are plain subprocesses that load this file by path (no import of the pack, no diffusers), started once
for the largest level and warmed up (Triton's one-time hashing, ptxas's version probe, one build in a private
cache, each sampled kernel's source hash) so that a level times builds only; a level at concurrency C hands
configurations to C of them, one at a time, as Inductor's pool does. Each build's seconds and CPU seconds (the
worker's own and its ptxas children's, from getrusage) are measured in the worker. The target is the active
Triton driver's when a GPU is present, else `--target` with a fake driver (a CPU rehearsal).

Writes DIR/kernel_builds.json after every level (what it has when the budget ends): machine facts, per level
{set, concurrency, configs, wall_s, per_config_s {median, mean}, cpu_s, configs_per_s, stage medians, cgroup
throttling, clock mid-level, ratios against concurrency 1}. Imports only the standard library in the parent
process's own code, and torch and triton in the workers.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

DEFAULT_CONFIGS = 64
DEFAULT_CONCURRENCY = (1, 4, 8, 16)
DEFAULT_BUDGET_S = 60.0
DEFAULT_GRACE_S = 20.0
PROTOCOL = "@@kernel_builds "  # worker lines to the parent start with this; anything else a library prints is not


# ----------------------------------------------------------------------------------------------- machine facts

def parse_cpu_list(text: str) -> List[int]:
    """CPU numbers of a Linux CPU list such as "0-3,8,10-11" (thread_siblings_list, cpuset.cpus)."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def parse_cpuinfo(text: str) -> List[Dict[str, str]]:
    """/proc/cpuinfo as one dict per processor block."""
    blocks, block = [], {}
    for line in text.splitlines():
        if not line.strip():
            if block:
                blocks.append(block)
            block = {}
            continue
        key, _, value = line.partition(":")
        block[key.strip()] = value.strip()
    if block:
        blocks.append(block)
    return [b for b in blocks if "processor" in b]


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except OSError:
        return None


def _spread(values: Sequence[float]) -> Optional[Dict[str, float]]:
    if not values:
        return None
    return {"min": round(min(values), 1), "mean": round(statistics.fmean(values), 1), "max": round(max(values), 1)}


def cpu_mhz(root: Path = Path("/")) -> Optional[Dict[str, float]]:
    """Current clock over all CPUs (min, mean, max MHz): /proc/cpuinfo's "cpu MHz", else cpufreq's scaling_cur_freq.
    Sampled mid-level, it shows whether the clock drops as more cores build."""
    processors = parse_cpuinfo(_read(root / "proc/cpuinfo") or "")
    values = [float(p["cpu MHz"]) for p in processors if p.get("cpu MHz")]
    if not values:
        for path in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq")):
            text = _read(path)
            if text and text.strip().isdigit():
                values.append(int(text) / 1000.0)
    return _spread(values)


def cpu_topology(root: Path = Path("/")) -> Dict[str, Any]:
    """lscpu's CPU(s), threads per core, cores per socket, sockets and model name, from /proc/cpuinfo and
    /sys/devices/system/cpu/cpu*/topology (lscpu itself may be missing on the machine)."""
    processors = parse_cpuinfo(_read(root / "proc/cpuinfo") or "")
    model = next((p.get("model name") or p.get("Model") for p in processors
                  if p.get("model name") or p.get("Model")), None)
    siblings, cores, packages = [], set(), set()
    for topo in sorted((root / "sys/devices/system/cpu").glob("cpu[0-9]*/topology")):
        listed = _read(topo / "thread_siblings_list")
        if listed is not None:
            siblings.append(len(parse_cpu_list(listed)))
        package = (_read(topo / "physical_package_id") or "").strip()
        core = (_read(topo / "core_id") or "").strip()
        if package:
            packages.add(package)
            if core:
                cores.add((package, core))
    if not packages:  # no /sys: cpuinfo's x86 fields
        packages = {p["physical id"] for p in processors if "physical id" in p}
        cores = {(p["physical id"], p["core id"]) for p in processors if "physical id" in p and "core id" in p}
    logical = len(processors) or len(siblings) or None
    threads = collections.Counter(siblings).most_common(1)[0][0] if siblings else None
    if threads is None and cores and logical:
        threads = logical // len(cores)
    sockets = len(packages) or None
    cpufreq = root / "sys/devices/system/cpu/cpu0/cpufreq"
    max_khz = (_read(cpufreq / "cpuinfo_max_freq") or "").strip()
    return {
        "logical_cpus": logical,
        "threads_per_core": threads,
        "cores_per_socket": len(cores) // sockets if cores and sockets else None,
        "sockets": sockets,
        "model_name": model,
        "mhz": _spread([float(p["cpu MHz"]) for p in processors if p.get("cpu MHz")]),
        "max_mhz": int(max_khz) / 1000.0 if max_khz.isdigit() else None,
        "governor": (_read(cpufreq / "scaling_governor") or "").strip() or None,
        "smt_active": (_read(root / "sys/devices/system/cpu/smt/active") or "").strip() or None,
        "online": (_read(root / "sys/devices/system/cpu/online") or "").strip() or None,
    }


def _cgroup_dirs(root: Path) -> Tuple[List[Path], List[Path]]:
    """(v2 dirs from this process's cgroup up to the mount, innermost first; v1 cpu controller dirs)."""
    base = root / "sys/fs/cgroup"
    v2, v1 = [], []
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], parts[2].strip().lstrip("/")
        if parts[0] == "0" and controllers == "":
            here = base / path if path else base
            while True:
                v2.append(here)
                if here == base or base not in here.parents:
                    break
                here = here.parent
        elif "cpu" in controllers.split(","):
            for mount in (base / "cpu", base / "cpu,cpuacct", base / "cpuacct,cpu"):
                v1.extend([mount / path, mount] if path else [mount])
    if base not in v2:
        v2.append(base)
    v1.extend([base / "cpu", base / "cpu,cpuacct"])
    return v2, v1


def cgroup_cpu(root: Path = Path("/")) -> Dict[str, Any]:
    """The cgroup CPU quota in CPUs (the tightest cpu.max from this process's cgroup up, or v1's
    cfs_quota_us/cfs_period_us; None: no quota), its cpuset, and its throttling counters (cpu.stat)."""
    v2, v1 = _cgroup_dirs(root)
    facts: Dict[str, Any] = {"version": None, "quota_cpus": None, "quota": None, "cpuset": None,
                             "throttling": None, "stat_path": None}
    for here in v2:
        text = _read(here / "cpu.max")
        if text is None:
            continue
        facts["version"] = 2
        fields = text.split()
        quota, period = fields[0], fields[1] if len(fields) > 1 else "100000"
        if quota != "max":
            cpus = int(quota) / int(period)
            if facts["quota_cpus"] is None or cpus < facts["quota_cpus"]:
                facts["quota_cpus"], facts["quota"] = round(cpus, 3), f"{quota} {period} ({here})"
    if facts["version"] is None:
        for here in v1:
            quota, period = _read(here / "cpu.cfs_quota_us"), _read(here / "cpu.cfs_period_us")
            if quota is None or period is None:
                continue
            facts["version"] = 1
            if int(quota) > 0:
                facts["quota_cpus"] = round(int(quota) / int(period), 3)
                facts["quota"] = f"{quota.strip()} {period.strip()} ({here})"
            break
    for here in v2 + v1:
        cpuset = _read(here / "cpuset.cpus.effective") or _read(here / "cpuset.cpus")
        if cpuset and cpuset.strip() and facts["cpuset"] is None:
            facts["cpuset"] = {"cpus": cpuset.strip(), "count": len(parse_cpu_list(cpuset))}
        if facts["stat_path"] is None and _read(here / "cpu.stat") is not None:
            facts["stat_path"] = str(here / "cpu.stat")
    facts["throttling"] = cgroup_throttling(Path(facts["stat_path"])) if facts["stat_path"] else None
    return facts


def cgroup_throttling(stat_path: Path) -> Optional[Dict[str, float]]:
    """{periods, throttled periods, throttled seconds} from a cgroup cpu.stat (v2 throttled_usec, v1 throttled_time
    in ns): their growth over a level says whether the quota stopped the builds."""
    text = _read(stat_path)
    if text is None:
        return None
    fields = dict(line.split(None, 1) for line in text.splitlines() if len(line.split()) == 2)
    if "throttled_usec" in fields:
        seconds = int(fields["throttled_usec"]) / 1e6
    elif "throttled_time" in fields:
        seconds = int(fields["throttled_time"]) / 1e9
    else:
        seconds = None
    return {"nr_periods": int(fields.get("nr_periods", 0)), "nr_throttled": int(fields.get("nr_throttled", 0)),
            "throttled_s": seconds}


def machine_facts(root: Path = Path("/")) -> Dict[str, Any]:
    """The CPU topology and cgroup CPU limits under `root` (a fake tree in tests), plus this process's view."""
    facts = {"topology": cpu_topology(root), "cgroup": cgroup_cpu(root)}
    if root == Path("/"):
        facts["cpu_count"] = os.cpu_count()
        facts["affinity"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        facts["loadavg"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
        pressure = _read(root / "proc/pressure/cpu")
        facts["cpu_pressure"] = pressure.strip().splitlines() if pressure else None
    return facts


def describe_machine(facts: Dict[str, Any]) -> str:
    """One line: CPUs, cores x threads, sockets, model, clock, affinity, quota, load."""
    topo, cgroup = facts["topology"], facts["cgroup"]
    mhz = topo.get("mhz") or {}
    return (f"{topo.get('logical_cpus')} logical CPUs ({topo.get('sockets')} socket(s) x "
            f"{topo.get('cores_per_socket')} cores x {topo.get('threads_per_core')} threads), "
            f"{topo.get('model_name')}, {mhz.get('mean')} MHz now (max {topo.get('max_mhz')}); "
            f"affinity {facts.get('affinity')}, cgroup quota {cgroup.get('quota_cpus') or 'none'} CPUs, "
            f"load {facts.get('loadavg')}")


# ------------------------------------------------------------------------------------------- sample and maths

def round_robin(config_counts: Sequence[int], n: int) -> List[Tuple[int, int]]:
    """The first `n` (kernel, config) pairs visiting kernels in turn: config 0 of every kernel, then config 1 of
    those that have one, ... so that a small sample covers many kernels."""
    tasks: List[Tuple[int, int]] = []
    rank = 0
    while len(tasks) < n and any(count > rank for count in config_counts):
        for kernel, count in enumerate(config_counts):
            if count > rank:
                tasks.append((kernel, rank))
                if len(tasks) == n:
                    break
        rank += 1
    return tasks


def _num(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(value, digits)


def summarize_level(set_name: str, concurrency: int, results: Sequence[Dict[str, Any]], wall_s: float,
                    planned: Optional[int] = None) -> Dict[str, Any]:
    """One level's figures from its workers' results ({"task", "ok", "s", "cpu_self_s", "cpu_children_s",
    "cache_hit", "stages_ms", "error"}): per-configuration seconds are each build's own, measured in its worker."""
    ok = [r for r in results if r.get("ok")]
    seconds = [r["s"] for r in ok]
    cpu = [r.get("cpu_self_s", 0.0) + r.get("cpu_children_s", 0.0) for r in ok]
    failed = [r for r in results if not r.get("ok")]
    stages: Dict[str, List[float]] = collections.defaultdict(list)
    for r in ok:
        for stage, ms in (r.get("stages_ms") or {}).items():
            stages[stage].append(ms)
    return {
        "set": set_name,
        "concurrency": concurrency,
        "configs": len(ok),
        "planned": len(results) if planned is None else planned,
        "wall_s": _num(wall_s, 3),
        "per_config_s": {"median": _num(statistics.median(seconds)) if seconds else None,
                         "mean": _num(statistics.fmean(seconds)) if seconds else None},
        "cpu_s": _num(sum(cpu), 3),
        "cpu_per_config_s": _num(statistics.fmean(cpu)) if cpu else None,
        "cpu_self_per_config_s": _num(statistics.fmean(r.get("cpu_self_s", 0.0) for r in ok)) if ok else None,
        "ptxas_cpu_per_config_s": _num(statistics.fmean(r.get("cpu_children_s", 0.0) for r in ok)) if ok else None,
        "configs_per_s": _num(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "build_s_per_wall_s": _num(sum(seconds) / wall_s, 3) if wall_s > 0 else None,
        "stages_ms_median": {k: round(statistics.median(v), 1) for k, v in stages.items()},
        "failures": len(failed),
        "first_error": failed[0].get("error") if failed else None,
        "cache_hits": sum(1 for r in ok if r.get("cache_hit")),
        "seconds": {str(r["task"]): round(r["s"], 4) for r in ok},
    }


def add_ratios(levels: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """Each dynamic level's per-configuration median, mean and CPU seconds against the dynamic set's concurrency-1
    level (`vs_c1`; `paired_median`: the median over configurations of its own ratio), and the static set's
    concurrency 1 against it (`dynamic_over_static`). Returns the base level or None."""
    base = next((lv for lv in levels if lv["set"] == "dynamic" and lv["concurrency"] == 1
                 and lv["per_config_s"]["median"]), None)
    if base is None:
        return None

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return round(a / b, 3) if a is not None and b else None

    for level in levels:
        if level["set"] == "dynamic":
            paired = [level["seconds"][t] / base["seconds"][t] for t in level["seconds"]
                      if base["seconds"].get(t)]
            level["vs_c1"] = {
                "per_config_median": ratio(level["per_config_s"]["median"], base["per_config_s"]["median"]),
                "per_config_mean": ratio(level["per_config_s"]["mean"], base["per_config_s"]["mean"]),
                "cpu_per_config": ratio(level["cpu_per_config_s"], base["cpu_per_config_s"]),
                "paired_median": round(statistics.median(paired), 3) if paired else None,
            }
        elif level["set"] == "static" and level["concurrency"] == 1:
            level["dynamic_over_static"] = {
                "per_config_median": ratio(base["per_config_s"]["median"], level["per_config_s"]["median"]),
                "per_config_mean": ratio(base["per_config_s"]["mean"], level["per_config_s"]["mean"]),
            }
    return base


def describe_level(level: Dict[str, Any], base: Optional[Dict[str, Any]]) -> str:
    """The line printed as a level ends."""
    median = level["per_config_s"]["median"]
    line = (f"{level['set']} concurrency {level['concurrency']}: {level['configs']} configs in "
            f"{level['wall_s']} s wall, {median} s per config")
    if level["set"] == "dynamic" and base is not None and level is not base and median:
        line += f" ({median / base['per_config_s']['median']:.2f}x the single-process " \
                f"{base['per_config_s']['median']} s)"
    if level["set"] == "static" and base is not None and median:
        line += f" (dynamic's {base['per_config_s']['median']} s is {base['per_config_s']['median'] / median:.2f}x)"
    line += f", cpu {level['cpu_per_config_s']} s per config, {level['configs_per_s']} configs/s"
    if level.get("throttled_s"):
        line += f", cgroup throttled {level['throttled_s']} s"
    if level["failures"]:
        line += f", {level['failures']} failed: {level['first_error']}"
    if level["cache_hits"]:
        line += f", {level['cache_hits']} cache hits (!)"
    if level.get("cut"):
        line += " [cut by the budget]"
    return line


def run_levels(levels: Sequence[Tuple[str, int]], run_level: Callable[[str, int], Dict[str, Any]],
               budget_s: float, clock: Callable[[], float] = time.monotonic,
               started: Optional[float] = None, on_level: Optional[Callable[[Dict[str, Any]], None]] = None
               ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Run the levels in order until the budget (seconds since `started`) is spent: no level starts after it.
    Returns (the levels' summaries, the skipped levels with their reason)."""
    started = clock() if started is None else started
    done, skipped = [], []
    for set_name, concurrency in levels:
        spent = clock() - started
        if spent >= budget_s:
            skipped.append({"set": set_name, "concurrency": concurrency,
                            "reason": f"budget of {budget_s} s spent ({spent:.1f} s)"})
            continue
        summary = run_level(set_name, concurrency)
        done.append(summary)
        if on_level is not None:
            on_level(summary)
    return done, skipped


# --------------------------------------------------------------------------------------------------- workers

def parse_target(text: str) -> Tuple[str, int]:
    """("cuda", 90) from "cuda:90"."""
    backend, _, arch = text.partition(":")
    if not arch.isdigit():
        raise ValueError(f"--target must look like cuda:90, not {text!r}")
    return backend, int(arch)


def install_fake_driver(arch: int = 90, warp_size: int = 32, backend: str = "cuda") -> None:
    """Make Triton believe a GPU of `arch` is present on a machine with no GPU driver (CPU rehearsals and
    kernel_sources.py): Inductor's Triton code asks the active driver for the target and device; builds go through
    `triton.compile(..., target=GPUTarget(...))`, which needs no GPU (ptxas ships with Triton)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    class FakeDriver:
        def get_current_target(self):
            return GPUTarget(backend, arch, warp_size)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def __getattr__(self, name):
            raise AttributeError(name)

    triton.runtime.driver.set_active(FakeDriver())


def select_target(fallback: str):
    """(GPUTarget, how): the active Triton driver's target where a GPU driver is active, else `fallback` with a
    fake driver (and Inductor's set_driver_to_gpu, which the kernel sources call on loading, made a no-op)."""
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        return triton.runtime.driver.active.get_current_target(), "driver"
    except Exception as error:  # RuntimeError "0 active drivers": no GPU
        backend, arch = parse_target(fallback)
        install_fake_driver(arch, 32, backend)
        from torch._inductor.runtime import triton_helpers

        triton_helpers.set_driver_to_gpu = lambda: None
        return GPUTarget(backend, arch, 32), f"--target {fallback}, fake driver ({error})"


def retarget_source(source: str, arch: int) -> str:
    """The kernel source with its CUDA device properties' compute capability set to `arch` (sources are written
    for sm_90; Inductor derives the build target from them)."""
    return re.sub(r"(DeviceProperties\(type='cuda'[^)]*?)cc=\d+, major=\d+",
                  lambda m: f"{m.group(1)}cc={arch}, major={arch // 10}", source)


class _Worker:
    """The worker process's side: loads the sampled kernels, warms up, then builds one configuration per request."""

    def __init__(self, spec: Dict[str, Any], emit: Callable[[Dict[str, Any]], None]):
        started = time.perf_counter()
        self.emit = emit
        os.environ["TRITON_CACHE_DIR"] = spec["setup_cache"]
        import torch
        import triton

        self.target, self.target_how = select_target(spec["target"])
        from torch._inductor.codecache import PyCodeCache
        from triton.compiler import ASTSource

        self.triton, self.ASTSource = triton, ASTSource
        self.listened: Dict[str, Any] = {}
        listener_ok = hasattr(triton, "knobs") and hasattr(triton.knobs.compilation, "listener")
        if listener_ok:
            triton.knobs.compilation.listener = self._listen
        sources = json.loads(Path(spec["sources"]).read_text())
        self.kernels: Dict[str, List[Any]] = {}
        self.plans: Dict[str, List[Tuple[int, int]]] = {}
        names: Dict[str, List[List[Any]]] = {}
        for set_name, n in spec["sets"].items():
            entries = sources["sets"][set_name]
            loaded = []
            for entry in entries[:n] if n < len(entries) else entries:  # config 0 of the first n kernels covers n
                source = entry["source"]
                if self.target.backend == "cuda" and isinstance(self.target.arch, int) and self.target.arch != 90:
                    source = retarget_source(source, self.target.arch)
                module = PyCodeCache.load(source)
                kernel = getattr(module, entry["name"])
                _ = kernel.fn.cache_key  # the source hash (memoized): once per kernel, not per build
                loaded.append(kernel)
            self.kernels[set_name] = loaded
            self.plans[set_name] = round_robin([len(k.configs) for k in loaded], n)
            names[set_name] = [[k, c, sources["sets"][set_name][k]["name"], str(loaded[k].configs[c])]
                               for k, c in self.plans[set_name]]
        loaded_s = time.perf_counter() - started
        warm = None
        first = next((name for name, plan in self.plans.items() if plan), None)
        for task in range(min(3, len(self.plans[first])) if first else 0):
            # Triton's package hash, ptxas --version, MLIR setup: once per process, with the first that builds
            warm = self.build(first, task, spec["setup_cache"])
            if warm["ok"]:
                break
        emit({"kind": "ready", "torch": torch.__version__, "triton": triton.__version__,
              "python": sys.version.split()[0], "target": f"{self.target.backend}:{self.target.arch}",
              "target_how": self.target_how, "plans": names, "listener": listener_ok,
              "load_s": round(loaded_s, 3), "warmup": warm, "pid": os.getpid()})

    def _listen(self, src=None, metadata=None, metadata_group=None, times=None, cache_hit=False, **kwargs):
        self.listened["cache_hit"] = bool(cache_hit)
        if times is not None:
            stages = {"ir_init": times.ir_initialization / 1000.0}
            stages.update({name: us / 1000.0 for name, us in times.lowering_stages})
            if getattr(times, "store_results", None):
                stages["store"] = times.store_results / 1000.0
            self.listened["stages_ms"] = {k: round(v, 2) for k, v in stages.items()}

    def build(self, set_name: str, task: int, cache_dir: str) -> Dict[str, Any]:
        """Build plan[task] of `set_name` into `cache_dir` as Inductor's _precompile_config does, timed."""
        kernel_index, config_index = self.plans[set_name][task]
        kernel = self.kernels[set_name][kernel_index]
        config = kernel.configs[config_index]
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        self.listened = {}
        result: Dict[str, Any] = {"kind": "result", "set": set_name, "task": task, "ok": True, "error": None}
        self_before = resource.getrusage(resource.RUSAGE_SELF)
        children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        try:
            meta = kernel._create_compile_meta(config)
            options = kernel._create_compile_options(config, meta)
            source = self.ASTSource(kernel.fn, meta["signature"], meta["constants"], meta["configs"][0])
            self.triton.compile(source, target=self.target, options=options)
        except Exception as error:  # recorded, the run goes on
            result.update(ok=False, error=f"{type(error).__name__}: {str(error).strip()[:400]}")
        result["s"] = time.perf_counter() - started
        self_after = resource.getrusage(resource.RUSAGE_SELF)
        children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        result["cpu_self_s"] = round((self_after.ru_utime - self_before.ru_utime)
                                     + (self_after.ru_stime - self_before.ru_stime), 4)
        result["cpu_children_s"] = round((children_after.ru_utime - children_before.ru_utime)
                                         + (children_after.ru_stime - children_before.ru_stime), 4)
        result["cache_hit"] = self.listened.get("cache_hit", False)
        result["stages_ms"] = self.listened.get("stages_ms")
        return result


def worker_main(argv: Sequence[str]) -> int:
    """A worker process: `argv[0]` is its spec (JSON); requests arrive on stdin, one JSON line each."""
    spec = json.loads(argv[0])
    protocol = sys.stdout
    sys.stdout = sys.stderr  # whatever torch, triton or ptxas print goes to the worker's log, not the protocol

    def emit(message: Dict[str, Any]) -> None:
        protocol.write(PROTOCOL + json.dumps(message) + "\n")
        protocol.flush()

    try:
        worker = _Worker(spec, emit)
    except Exception as error:
        emit({"kind": "failed", "error": f"{type(error).__name__}: {str(error)[:400]}"})
        raise
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        emit(worker.build(request["set"], request["task"], request["cache_dir"]))
    return 0


_BOOT = ("import importlib.util, sys; "
         "spec = importlib.util.spec_from_file_location('_kernel_builds_worker', sys.argv[1]); "
         "module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module; "
         "spec.loader.exec_module(module); sys.exit(module.worker_main(sys.argv[2:]))")


class WorkerPool:
    """The parent's side: worker subprocesses (this file loaded by path, so the pack is not imported there) and a
    queue of their messages, read by one thread per worker."""

    def __init__(self, specs: Sequence[Dict[str, Any]], work: Path, python: str = sys.executable):
        self.events: "queue.Queue[Tuple[int, Optional[Dict[str, Any]]]]" = queue.Queue()
        self.procs: List[subprocess.Popen] = []
        self.logs = []
        for index, spec in enumerate(specs):
            home = work / f"worker{index}"
            home.mkdir(parents=True, exist_ok=True)
            log = open(work / f"worker{index}.log", "w")
            self.logs.append(log)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(home / "inductor"), "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen([python, "-c", _BOOT, str(Path(__file__).resolve()), json.dumps(spec)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=str(home),
                                    env=env, text=True, bufsize=1)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()
        self.alive = set(range(len(self.procs)))

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if line.startswith(PROTOCOL):
                self.events.put((index, json.loads(line[len(PROTOCOL):])))
        proc.wait()
        self.events.put((index, None))

    def send(self, index: int, message: Dict[str, Any]) -> bool:
        try:
            self.procs[index].stdin.write(json.dumps(message) + "\n")
            self.procs[index].stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def kill(self, index: int) -> None:
        self.procs[index].kill()

    def close(self, timeout_s: float = 10.0) -> None:
        for index, proc in enumerate(self.procs):
            if proc.poll() is None:
                self.send(index, {"op": "exit"})
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def _wait_ready(pool: WorkerPool, deadline: float) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, str]]:
    """Every worker's "ready" message, or why it has none (failed, exited, not ready by `deadline`)."""
    ready: Dict[int, Dict[str, Any]] = {}
    failed: Dict[int, str] = {}
    while len(ready) + len(failed) < len(pool.procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for index in set(range(len(pool.procs))) - set(ready) - set(failed):
                failed[index] = "not ready by the time limit"
                pool.kill(index)
            break
        try:
            index, message = pool.events.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            continue
        if message is None:
            failed.setdefault(index, f"exited with {pool.procs[index].returncode} before it was ready")
        elif message["kind"] == "ready":
            ready[index] = message
        elif message["kind"] == "failed":
            failed[index] = message["error"]
    pool.alive = set(ready)
    return ready, failed


def _run_level(pool: WorkerPool, set_name: str, concurrency: int, tasks: int, cache_dir: Path,
               soft_deadline: float, hard_deadline: float, root: Path, stat_path: Optional[Path],
               candidates: Optional[Iterable[int]] = None) -> Dict[str, Any]:
    """Hand `tasks` configurations to `concurrency` workers (of `candidates`, default all alive), one at a time
    each, until all are built or the budget ends (no new configuration after `soft_deadline`; builds still running
    at `hard_deadline` are abandoned)."""
    cache_dir.mkdir(parents=True, exist_ok=False)
    workers = sorted(pool.alive if candidates is None else pool.alive & set(candidates))[:concurrency]
    pending = collections.deque(range(tasks))
    busy: Dict[int, int] = {}
    results: List[Dict[str, Any]] = []
    cut, mhz_mid = False, None
    throttled_before = cgroup_throttling(stat_path) if stat_path else None

    def dispatch(index: int) -> None:
        nonlocal mhz_mid
        task = pending.popleft()
        if pool.send(index, {"op": "build", "set": set_name, "task": task, "cache_dir": str(cache_dir)}):
            busy[index] = task
        else:
            results.append({"task": task, "ok": False, "error": f"worker {index} gone"})
        if mhz_mid is None and len(pending) <= tasks // 2:
            mhz_mid = cpu_mhz(root)

    started = time.perf_counter()
    for index in workers:
        if pending:
            dispatch(index)
    while busy:
        if time.monotonic() >= hard_deadline:
            for index, task in list(busy.items()):
                results.append({"task": task, "ok": False, "error": "abandoned at the time limit"})
                pool.kill(index)
                pool.alive.discard(index)
            busy.clear()
            cut = True
            break
        try:
            index, message = pool.events.get(timeout=1.0)
        except queue.Empty:
            continue
        if message is None:
            pool.alive.discard(index)
            if index in busy:
                code = pool.procs[index].returncode
                results.append({"task": busy.pop(index), "ok": False, "error": f"worker exited with {code}"})
            continue
        if message.get("kind") != "result" or busy.get(index) != message.get("task"):
            continue
        del busy[index]
        results.append(message)
        if pending and time.monotonic() < soft_deadline:
            dispatch(index)
        elif pending:
            cut = True
    wall = time.perf_counter() - started
    summary = summarize_level(set_name, concurrency, results, wall, planned=tasks)
    summary["workers"] = len(workers)
    summary["cut"] = cut or bool(pending)
    summary["mhz_mid"] = mhz_mid
    summary["loadavg_end"] = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    throttled_after = cgroup_throttling(stat_path) if stat_path else None
    if throttled_before and throttled_after:
        summary["throttled_periods"] = throttled_after["nr_throttled"] - throttled_before["nr_throttled"]
        if throttled_after["throttled_s"] is not None and throttled_before["throttled_s"] is not None:
            summary["throttled_s"] = round(throttled_after["throttled_s"] - throttled_before["throttled_s"], 3)
    return summary


def measure(sources: Path, out: Path, configs: int = DEFAULT_CONFIGS,
            concurrency: Sequence[int] = DEFAULT_CONCURRENCY, target: str = "cuda:90",
            budget_s: float = DEFAULT_BUDGET_S, grace_s: float = DEFAULT_GRACE_S, static: bool = True,
            keep: bool = False, python: str = sys.executable) -> Dict[str, Any]:
    """The whole measurement: start and warm the workers, run the levels within the budget, write
    out/kernel_builds.json after each level, and return what it wrote."""
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    facts = machine_facts()
    print(f"kernel_builds: machine: {describe_machine(facts)}", flush=True)
    sources_doc = json.loads(sources.read_text())
    levels = [("dynamic", c) for c in concurrency] + ([("static", 1)] if static else [])
    widest = max(concurrency)
    specs = [{"sources": str(sources.resolve()), "target": target, "setup_cache": str(work / f"worker{i}" / "setup"),
              "sets": {"dynamic": configs, **({"static": configs} if static and i == 0 else {})}}
             for i in range(widest)]
    doc: Dict[str, Any] = {
        "sources": str(sources), "sources_torch": sources_doc.get("torch"), "sources_triton": sources_doc.get("triton"),
        "sources_kernels": {k: len(v) for k, v in sources_doc.get("sets", {}).items()},
        "configs": configs, "concurrency": list(concurrency), "budget_s": budget_s, "grace_s": grace_s,
        "machine": facts, "levels": [], "skipped": [], "workers": {}, "stopped": None,
    }
    del sources_doc
    result_file = out / "kernel_builds.json"

    def write() -> None:
        doc["elapsed_s"] = round(time.monotonic() - started, 2)
        result_file.write_text(json.dumps(doc, indent=1))

    pool = WorkerPool(specs, work, python=python)
    try:
        ready, failed = _wait_ready(pool, started + budget_s + grace_s)
        failed = {index: f"{why}; log: {_tail(work / f'worker{index}.log')}" for index, why in failed.items()}
        doc["workers"] = {"started": widest, "ready": len(ready), "failed": failed,
                          "ready_after_s": round(time.monotonic() - started, 2),
                          "load_s": [m["load_s"] for m in ready.values()],
                          "warmup_s": [round(m["warmup"]["s"], 3) for m in ready.values() if m.get("warmup")]}
        if not ready:
            doc["stopped"] = f"no worker ready: {failed}"
            write()
            print(f"kernel_builds: {doc['stopped']}", flush=True)
            return doc
        first = ready[min(ready)]
        doc.update(torch=first["torch"], triton=first["triton"], python=first["python"], target=first["target"],
                   target_how=first["target_how"], listener=first["listener"], sample=first["plans"])
        print(f"kernel_builds: {len(ready)} workers ready after {doc['workers']['ready_after_s']} s; target "
              f"{first['target']} ({first['target_how']}); torch {first['torch']}, triton {first['triton']}",
              flush=True)
        for index, message in ready.items():
            if message["plans"].get("dynamic") != first["plans"].get("dynamic"):
                raise RuntimeError(f"worker {index} sampled other configurations than worker {min(ready)}")
        stat_path = Path(facts["cgroup"]["stat_path"]) if facts["cgroup"].get("stat_path") else None
        base: List[Optional[Dict[str, Any]]] = [None]

        def run_one(set_name: str, width: int) -> Dict[str, Any]:
            tasks = len(first["plans"].get(set_name, []))
            return _run_level(pool, set_name, width, tasks, work / f"triton-{set_name}-c{width}",
                              started + budget_s, started + budget_s + grace_s, Path("/"), stat_path,
                              candidates=[0] if set_name == "static" else None)  # worker 0 loaded the static set

        def on_level(level: Dict[str, Any]) -> None:
            doc["levels"].append(level)
            base[0] = add_ratios(doc["levels"])
            print("kernel_builds: " + describe_level(level, base[0]), flush=True)
            write()

        done, skipped = run_levels(levels, run_one, budget_s, started=started, on_level=on_level)
        doc["skipped"] = skipped
        for skip in skipped:
            print(f"kernel_builds: skipped {skip['set']} concurrency {skip['concurrency']}: {skip['reason']}",
                  flush=True)
        if skipped:
            doc["stopped"] = skipped[0]["reason"]
    finally:
        pool.close()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        doc["workers_cpu_s_total"] = round(children.ru_utime + children.ru_stime, 2)  # imports and setup included
        write()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"kernel_builds: wrote {result_file} ({doc['elapsed_s']} s)", flush=True)
    return doc


def _tail(path: Path, lines: int = 8) -> str:
    return " | ".join((_read(path) or "").strip().splitlines()[-lines:])


def _levels(text: str) -> List[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels are positive integers, e.g. 1,4,8,16")
    return values


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", required=True, help="kernel_sources.py's JSON file")
    parser.add_argument("--out", required=True, help="folder for kernel_builds.json (and worker logs with --keep)")
    parser.add_argument("--configs", type=int, default=DEFAULT_CONFIGS,
                        help="configurations per level, round-robin over the kernels (default %(default)s)")
    parser.add_argument("--concurrency", type=_levels, default=list(DEFAULT_CONCURRENCY),
                        help="worker processes building at once, per level (default 1,4,8,16)")
    parser.add_argument("--target", default="cuda:90",
                        help="the build target where no GPU driver is active (default cuda:90; with a GPU: the GPU's)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="no level (and no configuration) starts after this many seconds (default %(default)s)")
    parser.add_argument("--grace-s", type=float, default=DEFAULT_GRACE_S,
                        help="builds still running this long after the budget are abandoned (default %(default)s)")
    parser.add_argument("--no-static", action="store_true", help="leave out the static set's concurrency-1 level")
    parser.add_argument("--keep", action="store_true", help="keep DIR/work (worker logs, Triton caches)")
    args = parser.parse_args(None if argv is None else list(argv))
    doc = measure(Path(args.sources), Path(args.out), configs=args.configs, concurrency=args.concurrency,
                  target=args.target, budget_s=args.budget_s, grace_s=args.grace_s, static=not args.no_static,
                  keep=args.keep)
    return 0 if doc["levels"] else 1


if __name__ == "__main__":
    sys.exit(main())
