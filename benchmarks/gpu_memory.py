"""What holds GPU memory after a sample: live allocations grouped by the Python line that made them.

Why: on the H200 (2026-11-28, fourth session) Flux under ComfyUI's partial loading peaked at 11396 MB with our
block graphs for a model of 1311 MB, and ComfyUI then kept none of it loaded for ours (eager: 620 MB). A peak alone
cannot say whose or what: the allocations still live after the samples, by the frame that made them, can (memory
that grows call after call is still there at the end). torch's own allocator history gives the frames
(`torch.cuda.memory._record_memory_history`, a private API: where it is missing or changed, the summary says
so and the sample runs as it would).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

HISTORY_ENTRIES = 200_000
OWN_FRAMES = ("torch/", "contextlib.py", "threading.py")  # frames skipped to reach the caller's line


@contextlib.contextmanager
def allocation_history() -> Iterator[Dict[str, Any]]:
    """Record the CUDA allocator's history while in the block; the dict gets `live_by_frame` (the top live
    allocations at the end, grouped by the first frame outside torch) or `unavailable` with why."""
    import torch

    found: Dict[str, Any] = {}
    try:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    except Exception as error:  # noqa: BLE001 - a private API: the sample runs without it
        found["unavailable"] = f"{type(error).__name__}: {error}"
        yield found
        return
    try:
        yield found
        try:
            found["live_by_frame"] = live_by_frame(torch.cuda.memory._snapshot())
        except Exception as error:  # noqa: BLE001
            found["unavailable"] = f"{type(error).__name__}: {error}"
    finally:
        try:
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # noqa: BLE001
            pass


def _caller(frames: List[dict]) -> str:
    for frame in frames or ():
        name = str(frame.get("filename", ""))
        if not any(part in name for part in OWN_FRAMES):
            return f"{'/'.join(name.split('/')[-2:])}:{frame.get('line')} {frame.get('name')}"
    return "no Python frame (allocated in C++ or before the history began)"


def live_by_frame(snapshot: Dict[str, Any], top: int = 8) -> List[Dict[str, Any]]:
    """[{"where", "mb", "blocks"}] of the allocations live in `snapshot`, the largest first."""
    totals: Dict[str, List[float]] = {}
    for segment in snapshot.get("segments", ()):
        for block in segment.get("blocks", ()):
            if block.get("state") != "active_allocated":
                continue
            where = _caller(block.get("frames") or [])
            entry = totals.setdefault(where, [0.0, 0])
            entry[0] += block.get("size", 0) / 2 ** 20
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return [{"where": where, "mb": round(mb, 1), "blocks": count} for where, (mb, count) in ranked]


def allocated_mb() -> Optional[float]:
    """The CUDA allocator's live memory now (MB), None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return round(torch.cuda.memory_allocated() / 2 ** 20, 1)
