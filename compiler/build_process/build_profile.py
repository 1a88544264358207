"""Where a compile's time goes beyond its phase timers: the CPU its processes used, and where its main thread was.

Why: on the H200 (2026-11-28, fourth session) the SD1.5 UNet's build waited 76.4 s for Triton's kernel builds
after writing its 368 kernels, where torch.compile's first call waited 0.3 s for 378 of its own. Inductor's timers
say how long the wait was, not whether the kernel compilers were busy all that time (each kernel costs more to
build) or idle (the kernels were built one after another somewhere). Two figures tell them apart, the same way for
a build process and for torch.compile's own process:

- `group_cpu_seconds()`: CPU seconds of every process in this process's group (a build process and the Triton
  compile workers and compilers it started: `start_new_session` gives each its own group), the ended compilers
  included once their parents reaped them. Over a compile, this against its wall time is how many cores it kept
  busy.
- `MainThreadSampler`: the main thread's innermost frames, sampled from a Python thread every `every_s`, counted
  by signature: waiting on a future (the workers build) or compiling (this process builds). A sample needs the
  GIL, so C code that holds it is seen late: a share is a guide, not a measure.

- `KernelBuilds`: the Triton kernels built and the configurations each was built for.

Standalone (the standard library only, torch where it counts kernels): a build process loads it by its path
(build_process/child.py).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Iterator, List, Optional, Tuple

FRAMES = 3  # innermost frames in a signature


def group_process_stats(group: int) -> Iterator[List[str]]:
    """The fields of /proc/<pid>/stat after the command's name (fields[0] is the state, [2] the group, [11:15] the
    CPU ticks, [21] the resident pages) of every process in process group `group`; none where /proc is not there."""
    if not os.path.isdir("/proc"):
        return
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            yield fields


def _group_stats(group: int) -> Tuple[float, int]:
    """(CPU seconds, processes) of the processes in `group`, from /proc ((0.0, 0) where there is none)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total, count = 0, 0
    for fields in group_process_stats(group):
        count += 1
        total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return total / ticks, count


def group_cpu_seconds(group: Optional[int] = None) -> float:
    """CPU seconds used so far by the processes of `group` (this process's by default) and the children they
    reaped; 0.0 where /proc is not there."""
    return _group_stats(os.getpgrp() if group is None else group)[0]


def machine_busy_seconds() -> Optional[float]:
    """CPU seconds every process on this machine has used since boot (/proc/stat: user, nice, system, irq, softirq,
    steal), None where unknown: over a compile, against its wall time, how many cores the whole machine kept busy
    (the device check runs two lanes at once: was ours compiling beside the other's compiles?)."""
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = [int(fields[i]) for i in (1, 2, 3, 6, 7, 8) if i < len(fields)]  # user nice system irq softirq steal
    return sum(busy) / ticks


def _signature(frame, depth: int = FRAMES) -> str:
    names: List[str] = []
    while frame is not None and len(names) < depth:
        module = os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]
        names.append(f"{module}.{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names)


class MainThreadSampler:
    """Counts the signatures of the main thread's stack (innermost frames first) and the most processes its
    group held at once, while running; `top()` gives the commonest with their share of the samples."""

    def __init__(self, every_s: float = 0.25, processes_every: int = 8):
        self.every_s = every_s
        self.processes_every = processes_every  # /proc is walked on every n-th sample only
        self.counts: Counter = Counter()
        self.samples = 0
        self.processes_max = 0
        self._target = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "MainThreadSampler":
        self._thread = threading.Thread(target=self._run, name="keepfast-build-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        group = os.getpgrp()
        while not self._stop.wait(self.every_s):
            frame = sys._current_frames().get(self._target)
            if frame is not None:
                self.counts[_signature(frame)] += 1
                self.samples += 1
            if self.samples % self.processes_every == 0:
                self.processes_max = max(self.processes_max, _group_stats(group)[1])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.every_s + 1)

    def top(self, count: int = 8) -> List[List]:
        """[[signature, share of the samples], ...], the commonest first."""
        if not self.samples:
            return []
        return [[name, round(seen / self.samples, 3)] for name, seen in self.counts.most_common(count)]


def precompiled_headers() -> Optional[int]:
    """How many C++ headers Inductor has precompiled on this machine (its folder of them, kept across processes
    and keyed by compiler, flags and headers: torch._inductor.codecache._HEADER_DIR), None where unknown. An
    AOTInductor build precompiles its wrapper's header there the first time, then every build reuses it: a first
    build on a fresh machine pays for it (the H200's Flux blocks, the machine's first builds, spent 24.4 s in their
    C++ build)."""
    try:
        from torch._inductor import codecache

        folder = getattr(codecache, "_HEADER_DIR", None)
        if not folder:
            return None
        return sum(1 for name in os.listdir(folder) if name.endswith((".gch", ".pch"))) if os.path.isdir(folder) else 0
    except Exception:  # noqa: BLE001 - a figure for the report only
        return None


# Triton kernels by the prefix Inductor names them with: pointwise, reduction, persistent reduction, template.
KERNEL_KINDS = (("triton_poi", "pointwise"), ("triton_red", "reduction"), ("triton_per", "persistent"),
                ("triton_tem", "template"))


SLOWEST_KERNELS = 6  # the slowest kernel builds a build reports by name


class KernelBuilds:
    """How many Triton kernels this process built or took from its compile workers over a compile (`with` block),
    how many configurations they were built for, and the seconds their builds took, by kind of kernel.

    Why: on the H200 our SD1.5 build waited 76.4 s for 368 kernels where torch.compile waited 0.3 s for 378, about
    2 s of a compile worker per kernel against under 0.6 s. Inductor builds a kernel once per configuration it
    will benchmark, and how many it lists depends on what it knows of the sizes: a 2-D pointwise kernel whose
    sizes are arguments (a graph for a range of sizes) gets 6 where one for fixed sizes gets 1
    (torch/_inductor/codegen/triton.py's tile hint; runtime/triton_heuristics.py `pointwise`), a reduction whose
    layout Inductor cannot tell 6 where one it can gets 1. These figures say whether that is the difference.
    They come from Inductor's own record of each kernel (`async_compile._add_triton_kernel_info`: the build's
    seconds, in the worker or here, and the configurations listed), read while the block runs and left as it was
    after it; None where the torch at hand has no such record."""

    def __init__(self):
        self.available = False
        self.kernels: Counter = Counter()
        self.configs: Counter = Counter()
        self.unknown_configs = 0
        self.build_s = 0.0
        self.build_s_by_kind: Counter = Counter()
        self.builds: List[Tuple[float, str, int]] = []  # (seconds, kernel, configurations; 0: not said) of each
        self._module = None
        self._original = None

    def __enter__(self) -> "KernelBuilds":
        try:
            from torch._inductor import async_compile
        except Exception:  # noqa: BLE001 - no Inductor here: nothing to count
            return self
        original = getattr(async_compile, "_add_triton_kernel_info", None)
        if not callable(original):
            return self

        def recorded(kernel_name, info, *rest, **named):
            self.record(kernel_name, info)
            return original(kernel_name, info, *rest, **named)

        self._module, self._original, self.available = async_compile, original, True
        async_compile._add_triton_kernel_info = recorded
        return self

    def __exit__(self, *exc) -> None:
        if self._module is not None:
            self._module._add_triton_kernel_info = self._original
            self._module = None

    def record(self, kernel_name: str, info: dict) -> None:
        """One kernel built: its name says its kind; `info` its configurations (`num_configs` where Inductor
        listed several, "only 1 config" where one) and its build's microseconds."""
        kind = next((k for prefix, k in KERNEL_KINDS if str(kernel_name).startswith(prefix)), "other")
        info = info if isinstance(info, dict) else {}
        self.kernels[kind] += 1
        configs = info.get("num_configs")
        if configs is None and info.get("autotune_cache_state") in ("only 1 config", "hit"):
            configs = 1  # one listed, or the best one read from the tuning cache: one build
        if configs is None:
            self.unknown_configs += 1
        else:
            self.configs[kind] += int(configs)
        seconds = float(info.get("compile_time_us") or 0) / 1e6
        self.build_s += seconds
        self.build_s_by_kind[kind] += seconds
        self.builds.append((seconds, str(kernel_name), int(configs or 0)))

    def phases(self) -> dict:
        """The counts as phases (numbers only): kernels and configurations in all and by kind, build seconds."""
        if not self.available or not self.kernels:
            return {}
        out = {"triton_kernels": float(sum(self.kernels.values())),
               "triton_configs": float(sum(self.configs.values())),
               "triton_build_s": round(self.build_s, 2)}
        for kind, count in self.kernels.items():
            out[f"triton_kernels_{kind}"] = float(count)
            out[f"triton_configs_{kind}"] = float(self.configs.get(kind, 0))
            out[f"triton_build_s_{kind}"] = round(self.build_s_by_kind[kind], 2)
        if self.unknown_configs:
            out["triton_configs_unknown"] = float(self.unknown_configs)
        # Not "triton_"-prefixed: over a graph's parts these are the largest part's, not a sum. A per-configuration
        # cost the same in every kernel points at the machine (its workers sharing cores); a few slow kernels at
        # the kernels themselves (the H200's SD1.5: 0.77 s a configuration against torch.compile's 0.18 s).
        per_config = [seconds / configs for seconds, _, configs in self.builds if configs]
        if per_config:
            out["kernel_build_per_config_median_s"] = round(statistics.median(per_config), 3)
        out["kernel_build_slowest_s"] = round(max(seconds for seconds, _, _ in self.builds), 2)
        return out

    def slowest(self, count: int = SLOWEST_KERNELS) -> List[list]:
        """The kernels whose builds took longest: [[name, seconds, configurations]], slowest first. The H200's
        SD1.5 build (2026-11-28) spent 332 of its 422 build seconds on persistent reductions, one kernel 80 s."""
        return [[name, round(seconds, 2), configs] for seconds, name, configs in sorted(self.builds, reverse=True)[:count]]


class CompileProfile:
    """CPU seconds of this process's group and the main thread's samples over one compile (`with` block), the
    C++ headers precompiled meanwhile, and the Triton kernels built (KernelBuilds)."""

    def __init__(self, every_s: float = 0.25):
        self.sampler = MainThreadSampler(every_s)
        self.cpu_s = 0.0
        self.wall_s = 0.0
        self.headers_precompiled: Optional[int] = None
        self.machine_cpu_s: Optional[float] = None  # every process on the machine, over the compile
        self.kernel_builds = KernelBuilds()

    def __enter__(self) -> "CompileProfile":
        self._cpu0, self._wall0 = group_cpu_seconds(), time.perf_counter()
        self._machine0 = machine_busy_seconds()
        self._headers0 = precompiled_headers()
        self.kernel_builds.__enter__()
        self.sampler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.stop()
        self.kernel_builds.__exit__(*exc)
        self.cpu_s = round(group_cpu_seconds() - self._cpu0, 2)
        self.wall_s = round(time.perf_counter() - self._wall0, 2)
        machine = machine_busy_seconds()
        self.machine_cpu_s = (round(machine - self._machine0, 2)
                              if machine is not None and self._machine0 is not None else None)
        after = precompiled_headers()
        if after is not None and self._headers0 is not None:
            self.headers_precompiled = max(0, after - self._headers0)

    def phases(self) -> dict:
        """The figures as phases (numbers only): CPU seconds, cores kept busy on average, most processes, headers
        precompiled (this compile's, or another process's at the same time)."""
        out = {"compile_cpu_s": self.cpu_s, "compile_processes_max": float(self.sampler.processes_max)}
        if self.wall_s > 0:
            out["compile_cores_busy"] = round(self.cpu_s / self.wall_s, 2)
            if self.machine_cpu_s is not None:
                out["machine_cores_busy"] = round(self.machine_cpu_s / self.wall_s, 2)
        if self.headers_precompiled is not None:
            out["headers_precompiled"] = float(self.headers_precompiled)
        return {**out, **self.kernel_builds.phases()}
