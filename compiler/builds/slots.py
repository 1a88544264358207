"""How many package builds run at once (their slots: one per two cores unless KEEPFAST_BUILD_PROCESSES says), and
how many of Inductor's Triton compile workers each GPU build starts, and so how many parts of a GPU program build
side by side.
"""

from __future__ import annotations

import os
from typing import Optional

from ..settings import build_processes


def max_running() -> int:
    """Builds that run at once: KEEPFAST_BUILD_PROCESSES, else one per two cores."""
    configured = build_processes()
    if configured is not None:
        return configured
    return max(1, (os.cpu_count() or 2) // 2)


KERNEL_WORKERS_PER_PART = 4  # the fewest Triton compile workers a GPU program's part is built with


def kernel_worker_total() -> int:
    """Inductor's Triton compile workers this process's builds may start in all: TORCHINDUCTOR_COMPILE_THREADS
    where it is set (the user's number, or the device check's share per lane), else one per core."""
    configured = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "")
    return int(configured) if configured.isdigit() and int(configured) > 0 else (os.cpu_count() or 1)


def kernel_compile_threads(beside: int) -> Optional[int]:
    """Inductor's Triton compile workers for each of `beside` builds started together (a graph's parts): the
    total (`kernel_worker_total`) shared between them. None for a build on its own (Inductor's own number, from
    that variable or the cores). Each build process starts its own workers, and each imports torch and Triton:
    five parts with one worker per core would start five times the cores at once."""
    if beside <= 1:
        return None
    return max(1, kernel_worker_total() // beside)


def gpu_part_builders() -> int:
    """How many parts of a GPU program may be built side by side.

    A GPU build's longest phase is compiling its Triton kernels, which Inductor spreads over the build process's
    own workers; a part with one worker compiles them one after another in its process. On the H200 (docs/gpu.md,
    "Parts of a GPU program") the SD1.5 UNet was cut into parts by the CPU rule (one per core, 16), each given
    one of the lane's 5 workers: no part had finished its kernels after 327 s, its stacks in `triton.compile`
    inside AOTInductor's autotuning block. So each part keeps at least KERNEL_WORKERS_PER_PART workers, and there
    are no more parts than builds that run at once (each holds its workers while it waits)."""
    return max(1, min(max_running(), kernel_worker_total() // KERNEL_WORKERS_PER_PART))
