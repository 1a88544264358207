"""What builds in the background now, per model, and the time left: what the page's badge and Graph Stats show.

One entry per model (a UNet, a transformer's blocks, a VAE operation) with
builds in flight: how many of its graphs have been built since its first build
began ("block 1 of 2"), which are building, and the time left. The time left
comes from this machine's measured build times (build_times.py) and the build
queue: `max_running()` slots, each running build finishing when its kind's
usual time has passed, each waiting build taking the first slot free, in the
order started. Unknown (None) until this machine has finished a build.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from . import times as build_times
from . import package_builds, slots
from .package_builds import BUILDING, BUILT, FAILED, TRACING, WAITING, BuildView


@dataclass(frozen=True)
class BuildProgress:
    """One model's background builds."""

    owner: str
    owner_id: str
    families: Tuple[str, ...]  # the page finds the node that made the model by these
    done: int  # builds ended (built or failed) since this model's first build in flight began
    total: int
    building: Tuple[str, ...]  # graphs whose build (or its trace: "... (tracing)") runs now
    ready: int  # built, taken in at the model's next call
    failed: int
    left_s: Optional[float]  # None: never built anything here yet, so no estimate

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def text(self) -> str:
        """"UNetModel: building in the background: graph 1 of 1 (UNetModel), about 40 s left"."""
        if self.finished:
            what = f"{self.ready} built, serving from the next call" if self.ready else "builds ended"
            if self.failed:
                what += f"; {self.failed} failed (those inputs run uncompiled)"
            return f"{self.owner}: {what}"
        now = ", ".join(self.building) if self.building else "waiting for a free build process"
        left = f", about {self.left_s:.0f} s left" if self.left_s is not None else ", time left known after a first build here"
        return (f"{self.owner}: building in the background: graph {min(self.done + 1, self.total)} of {self.total} "
                f"({now}){left}")

    def to_json(self) -> dict:
        return {"owner": self.owner, "families": list(self.families), "done": self.done, "total": self.total,
                "building": list(self.building), "ready": self.ready, "failed": self.failed,
                "left_s": None if self.left_s is None else round(self.left_s, 1), "text": self.text()}


def _finish_times(views: List[BuildView], slots: int) -> List[Optional[float]]:
    """Seconds from now until each build ends, by the queue's rules (None where no estimate exists)."""
    times = build_times.measured()
    free: List[float] = []
    ends: List[Optional[float]] = []
    unknown = False
    for view in views:
        if view.state == BUILDING:
            usual = build_times.estimate(view.label.times_key, times)
            unknown |= usual is None
            left = 0.0 if usual is None else max(usual - view.running_s, 1.0)
            free.append(left)
            ends.append(None if usual is None else left)
        else:
            ends.append(0.0 if view.state in (BUILT, FAILED) else None)
    heapq.heapify(free)
    while len(free) < slots:
        heapq.heappush(free, 0.0)
    for index, view in enumerate(views):
        if view.state not in (WAITING, TRACING):  # a build being traced takes a slot once traced
            continue
        usual = build_times.estimate(view.label.times_key, times)
        start = heapq.heappop(free)
        end = start + (usual or 0.0)
        heapq.heappush(free, end)
        unknown |= usual is None
        ends[index] = None if unknown else end
    return ends


def progress() -> List[BuildProgress]:
    """Every model with builds in flight or built and not yet taken in, in the order their builds started."""
    views, owners = package_builds.snapshot()
    ends = _finish_times(views, slots.max_running())
    grouped: Dict[str, List[Tuple[BuildView, Optional[float]]]] = {}
    for view, end in zip(views, ends):
        grouped.setdefault(view.label.group, []).append((view, end))
    out = []
    for group, entries in grouped.items():
        started, ended = owners.get(group, (len(entries), 0))
        pending = [(view, end) for view, end in entries if view.state in (TRACING, WAITING, BUILDING)]
        left = None if any(end is None for _, end in pending) else max((end for _, end in pending), default=0.0)
        families = tuple(dict.fromkeys(view.label.family for view, _ in entries if view.label.family))
        out.append(BuildProgress(
            owner=entries[0][0].label.owner, owner_id=group, families=families, done=ended, total=max(started, ended),
            building=tuple(view.label.what + (" (tracing)" if view.state == TRACING else "")
                           for view, _ in entries if view.state in (TRACING, BUILDING)),
            ready=sum(1 for view, _ in entries if view.state == BUILT),
            failed=sum(1 for view, _ in entries if view.state == FAILED), left_s=left))
    return out
