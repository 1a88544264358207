"""The device check's compiles take turns: one compile at a time on the machine, with every core.

Why: the check runs its jobs in lanes, two or three at once, to fit a machine's minutes. On an H200
(2026-11-28) our SD1.5 UNet's cold compile ran while the other lane compiled Flux with torch.compile, and
torch.compile's SD1.5 compile ran last, alone: 192.6 s against 61.6 s, a ratio of two compiles under different
loads. A compile (the first call of a cold variant, and a sweep that recompiles) now holds a lock on a file that
every job of the run shares, so compiles never overlap and each has the machine's cores; eager runs, loads and
timed pairs go on beside it as before.

A job that waits for its turn is not charged for it: the worker writes how long it has waited (and since when it
is waiting) into a small file the runner reads, and the runner's time limit counts the job's time less its waits
(joblog.py). The check's budget still bounds the job's whole time.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Iterator, Optional, Union

from compiler.store import atomic, file_lock

# Variants whose first call compiles; torch_compile_blocks also recompiles in its sweep.
COMPILING = ("ours_aot_cold", "ours_blocks", "ours_inductor", "torch_compile", "torch_compile_blocks")
SWEEP_COMPILES = ("torch_compile_blocks",)


def waits_path(result_path: Union[str, Path]) -> Path:
    """Where a job's worker writes its waits, beside its result."""
    return Path(result_path).with_suffix(".waits.json")


class CompileTurns:
    """A job's turns at compiling: `turn()` holds the run's compile lock for a block; `waited_s` is the time spent
    waiting for it so far, also written to `waits` for the runner."""

    def __init__(self, lock: Optional[Union[str, Path]], waits: Optional[Union[str, Path]]):
        self.lock = Path(lock) if lock else None
        self.waits = Path(waits) if waits else None
        self.waited_s = 0.0
        self.turns = 0

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The block run with no other job compiling (nothing held without a lock file: a run of one job)."""
        if self.lock is None:
            yield
            return
        since = time.time()
        self._write(since)
        with file_lock.held(self.lock):
            self.waited_s += time.time() - since
            self.turns += 1
            self._write(None)
            yield

    def _write(self, waiting_since: Optional[float]) -> None:
        if self.waits is None:
            return
        atomic.write_bytes(self.waits, json.dumps({"waited_s": self.waited_s, "waiting_since": waiting_since}).encode())


def waited_seconds(waits: Union[str, Path], now: Optional[float] = None) -> float:
    """How long the job whose waits file this is has waited for its turns, its current wait included; 0.0 where it
    wrote none."""
    try:
        data = json.loads(Path(waits).read_text())
    except (OSError, ValueError):
        return 0.0
    since = data.get("waiting_since")
    current = max(0.0, (now or time.time()) - since) if since else 0.0
    return float(data.get("waited_s") or 0.0) + current
