"""The memory bound of a build process (build_process/child.py): it and the compiler processes it starts hold at most
KEEPFAST_BUILD_MEMORY_MB resident together (default: half the machine's memory); past that the build stops, saying
so in its error.txt.
"""

from __future__ import annotations

import os

from . import build_profile
from ..settings import BUILD_MEMORY_MB, build_memory_mb

MEMORY_ENV = BUILD_MEMORY_MB.name


def _memory_limit_mb() -> float:
    """The most a build may hold resident with its compilers: KEEPFAST_BUILD_MEMORY_MB (0: no limit), else half
    of this machine's memory (the model being served keeps the rest)."""
    configured = build_memory_mb()
    if configured is not None:
        return configured
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 / 2**20
    except (ValueError, OSError, AttributeError):
        return 0.0


def _group_rss_mb(profile) -> float:
    """Resident memory of this process and the compiler processes it started (its process group), MB
    (`profile`: build_profile.py, loaded once)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(fields[21]) * page for fields in profile.group_process_stats(os.getpgrp())) / 2**20


def _bound_memory(folder: str) -> None:
    """Stop the build (and its compilers) once they hold more than the limit together, saying so in error.txt."""
    limit = _memory_limit_mb()
    if limit <= 0 or not os.path.isdir("/proc"):
        return
    import signal
    import threading
    import time

    profile = build_profile

    def watch() -> None:
        while True:
            used = _group_rss_mb(profile)
            if used > limit:
                with open(os.path.join(folder, "error.txt"), "w") as handle:
                    handle.write(f"MemoryError: the build held {used:.0f} MB with its compilers, more than its limit "
                                 f"of {limit:.0f} MB ({MEMORY_ENV}); stopped\n")
                os.killpg(os.getpgrp(), signal.SIGKILL)  # this process too: the parent reads error.txt
            time.sleep(0.25)

    threading.Thread(target=watch, name="keepfast-build-memory", daemon=True).start()
