"""Cores for background builds: while builds run, the model's own threads leave them the cores they take.

A background build (AOTInductor and its C++ compiler in a child process) keeps
a core busy. On a machine whose cores the model's intra-op threads already
fill (a CPU-only ComfyUI: torch uses every core), the two fight: OpenMP's
threads wait at each parallel region for a thread the scheduler gave to the
build, and small ops pay that wait every time. Measured on this 2-core CPU
(the SD1.5-shaped quick UNet of the bench, calls while its graph builds):
0.07-0.27 s per call with 1 thread, 0.7-2.9 s with torch's default 2; the
same calls take 0.05-0.15 s with no build running. So while builds run,
each model call first sets torch's intra-op threads to what the builds
leave (the thread count it had, less one per running build, at least 1),
and the first call after the last build ended sets it back.

OpenMP keeps the thread count per calling thread: it is changed in the
thread that runs the model (ComfyUI's prompt worker), at the start of a
call, and only when the number of running builds changed since that
thread's last call (a plain integer read otherwise). A GPU machine has the
cores to spare and its model runs on the GPU: only its CPU ops (few) see
fewer threads, and only while builds run.
"""

from __future__ import annotations

import threading
import torch

from . import package_builds

_state = threading.local()  # seen: running builds at this thread's last call; before: its thread count before


def share() -> None:
    """At the start of a model call: give running builds their cores, or take them back once none runs."""
    running = package_builds.running_count()
    if getattr(_state, "seen", 0) == running:
        return
    _state.seen = running
    before = getattr(_state, "before", None)
    if running:
        if before is None:
            before = _state.before = torch.get_num_threads()
        wanted = max(1, before - running)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
    elif before is not None:
        torch.set_num_threads(before)
        _state.before = None


__all__ = ["share"]
