"""Spare build processes: started ahead of their builds (`prestart`), each is handed the next build of its kind
(`_take_spare`), so a build does not wait for Python and torch to start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from . import launch
from ..settings import SPARE_BUILDER, spare_builder
from ..store import extraction
from .kept_folders import isa_cache

# Build processes started ahead of their builds (build_process/spare.py), each (process, the child script it
# runs, the pid of the process that started it, the kind of program it builds). Starting Python and importing torch
# takes seconds (about 4 s on a busy 2-core CPU): a spare does it while this process traces the graph, or between
# builds. A spare for a CPU program also runs Inductor's vector-ISA probe then; one for a GPU program never does
# (host_kind, build_process.isa_probe.skips_isa_probe), so a spare serves builds of its own kind only. A GPU program
# cut into parts starts its parts at once: one spare each (prestart's `count`); on the H200 (2026-11-28) the SD1.5
# UNet's second part, which found none, started in 9.6 s.
Spare = Tuple[subprocess.Popen, Path, int, str]
_spares: List[Spare] = []
SPARE_ENV = SPARE_BUILDER.name
_lock = threading.RLock()


def host_kind(device: str) -> str:
    """What a build process does for a program on `device` ("cpu", "cuda", "cuda:0"): "cpu" (Inductor's
    vector-ISA probe picks the host code's CPU level) or "gpu" (the host code only launches kernels: no probe)."""
    return "cpu" if str(device).split(":")[0] == "cpu" else "gpu"


def job_kind(folder: Path) -> str:
    """The kind of build process the job in `folder` needs ("cpu" where its job cannot be read): "gpu" where its
    settings leave the host code without a vector ISA (build_process.isa_probe.skips_isa_probe, the child's own test),
    whatever the program's device. A CPU spare has probed, and Inductor caches the ISA it found per process: given
    a job that says no ISA it would build one in anyway."""
    from ..build_process.isa_probe import skips_isa_probe

    try:
        configs = json.loads((folder / "job.json").read_text()).get("configs") or {}
        return "gpu" if skips_isa_probe(configs) else "cpu"
    except (OSError, ValueError, AttributeError):
        return "cpu"


def prestart(device: str = "cpu", count: int = 1) -> None:
    """Have `count` spare build processes ready for the next builds, programs on `device` (spares of another kind
    are stopped; KEEPFAST_SPARE_BUILDER=0: never)."""
    if not spare_builder() or launch.CHILD != launch.REAL_CHILD:
        return  # a test's own child script takes no job so
    kind = host_kind(device)
    with _lock:
        ready = sum(1 for spare in _spares if _serves(spare, kind))
        if ready < len(_spares):
            _stop_spares(lambda spare: not _serves(spare, kind))
        for _ in range(max(0, count - ready)):
            try:
                log_file = open(extraction.run_folder() / "spare-builder.txt", "a")
                with log_file:
                    process = subprocess.Popen([sys.executable, str(launch.CHILD), "--spare", str(isa_cache()), kind],
                                               stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                                               **launch._child_options({}))
            except Exception:  # noqa: BLE001 - no spare: the next build starts its own process, as always
                return
            _spares.append((process, launch.CHILD, os.getpid(), kind))


def _serves(spare: Optional[Spare], kind: str) -> bool:
    """Whether `spare` can take this process's next build of `kind`: this process started it, for the child script
    that runs now and that kind of program, and it is still running."""
    return (spare is not None and spare[2] == os.getpid() and spare[1] == launch.CHILD and spare[3] == kind
            and spare[0].poll() is None)


def _take_spare(folder: Path, kind: str = "cpu") -> Optional[subprocess.Popen]:
    """A spare build process, given `folder` as its build (None: there is none for this process, child and
    `kind` of program; then the spares of another kind are stopped)."""
    with _lock:
        spare = next((candidate for candidate in _spares if _serves(candidate, kind)), None)
        if spare is None:
            _stop_spares(lambda _spare: True)
            return None
        _spares.remove(spare)
    process = spare[0]
    try:
        process.stdin.write(f"{folder}\n".encode())
        process.stdin.close()
    except OSError:
        _kill(process)
        return None
    return process


def _stop_spares(which: Callable[[Spare], bool] = lambda _spare: True) -> None:
    """Stop this process's spares that `which` picks (all by default)."""
    with _lock:
        stopped = [spare for spare in _spares if which(spare)]
        _spares[:] = [spare for spare in _spares if spare not in stopped]
    for spare in stopped:
        if spare[2] == os.getpid():
            _kill(spare[0])


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.wait(timeout=5)
    except Exception:  # noqa: BLE001
        pass
