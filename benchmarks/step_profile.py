"""One sample under torch's profiler, summed per step: the GPU's kernel time against the step's wall time.

Why: in ComfyUI on the H200 our Flux blocks took 21.89 ms a step against eager's 20.59 (0.94x), while the same
blocks in the device check ran 1.26x eager. Whether ours' steps carry more kernel time (the graphs' kernels) or
wait on the host (the pack's work per block call, launches) is what a kernel-time sum says beside the wall time;
the few kernels that take most of it say which. A profiler run is slower than a plain one, so it is a sample of
its own, after the timed ones.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Tuple

TOP = 8  # kernels listed, by total time


def _kernels(prof) -> List[Tuple[str, float]]:
    """(name, microseconds) of each kernel the device ran: the profiler's device-side events (`device_type` CUDA;
    their own time range, as torch's `device_time_total` reads it for them)."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA]


def per_step(kernels: List[Tuple[str, float]], steps: int) -> Dict[str, Any]:
    """Kernel ms and launches per step, and the `TOP` kernels by total time (ms and launches per step)."""
    by_name: Dict[str, List[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    ranked = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP]
    return {"kernel_ms_per_step": round(sum(us for _, us in kernels) / 1e3 / steps, 2),
            "launches_per_step": round(len(kernels) / steps, 1),
            "top": [{"kernel": name[:90], "ms_per_step": round(sum(times) / 1e3 / steps, 3),
                     "per_step": round(len(times) / steps, 1)} for name, times in ranked]}


def profile(sample: Callable[[], Any], steps: int, cuda: bool) -> Dict[str, Any]:
    """`sample()` (one sampler run of `steps` steps) under the profiler: per step its wall ms, on CUDA its kernel
    ms and launches, and the kernels taking the most time. Never raises: a profiler that fails says why."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            sample()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - started
        result: Dict[str, Any] = {"steps": steps, "wall_ms_per_step": round(wall * 1e3 / steps, 2)}
        if cuda:
            result.update(per_step(_kernels(prof), steps))
    except Exception as error:  # noqa: BLE001 - a figure missing, never the bench stopped
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    return result
