"""Build claims: one process at a time builds a graph family for a shared graphs folder.

Two ComfyUI processes (two GPUs of one machine, workers of a fleet on one
network folder) that share models/graphs and meet the same model would each
compile the same graph. Before compiling a graph it will write into a store,
a process claims the family in that store: an exclusive `flock` on a hidden
file in the family's folder (`GraphStore.claim_path`), held until the graph
is written (or its build failed or was cancelled). A process that finds the
claim taken does not build: a blocking compile waits for the claim, then
looks in the store again (the other's graph loads with no compile); a
background build runs its calls eager meanwhile, with the holder named in
the reason, and looks again when the claim is free.

The kernel drops a `flock` when its holder dies however it died, so a
crashed builder never blocks anybody. The holder removes the file when it
releases; a file a killed holder left behind is taken over by the next
claimant (the inode check below makes removal and re-creation race-free).
Where `flock` is missing (Windows) or the folder cannot be written, nobody
claims: every process builds, as without claims, and the store still ends
with one valid graph (`GraphStore._write`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..settings import CLAIM_WAIT_S, DEFAULT_CLAIM_WAIT_S, claim_wait_s

try:
    import fcntl
except ImportError:  # Windows: no claims
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("keepfast")

WAIT_ENV = CLAIM_WAIT_S.name
DEFAULT_WAIT_S = DEFAULT_CLAIM_WAIT_S  # a full-depth Wan block set builds in minutes on a GPU machine; 30 min is generous
POLL_S = 0.5


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as its file says (for messages only: the lock, not the text, decides)."""

    pid: Optional[int]
    host: str
    since: float

    def describe(self) -> str:
        if self.pid == os.getpid() and self.host == socket.gethostname():
            return "another model in this process"
        who = f"process {self.pid}" if self.pid else "another process"
        where = "" if self.host == socket.gethostname() else f" on {self.host}"
        age = time.time() - self.since if self.since else 0.0
        return f"{who}{where} (for {age:.0f} s)" if age >= 1 else f"{who}{where}"


def _read_holder(path: Path) -> Holder:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").split()
        return Holder(int(text[0]), text[1], float(text[2]))
    except (OSError, ValueError, IndexError):
        return Holder(None, "", 0.0)


def _close(handle) -> None:
    try:
        handle.close()
    except OSError:
        pass


class Claim:
    """A held claim; `release()` (idempotent, also when garbage collected) frees it and removes its file."""

    def __init__(self, path: Path, handle):
        self.path = path
        self._handle = handle
        self._finalizer = weakref.finalize(self, _release, path, handle)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        self._finalizer()


def _release(path: Path, handle) -> None:
    try:  # remove while still holding it: a waiter that opened the old file sees the inode change and retries
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
            os.unlink(path)
    except OSError:
        pass
    _close(handle)  # closing drops the flock


@dataclass(frozen=True)
class Taken:
    """The claim is held elsewhere: by whom."""

    holder: Holder

    def reason(self) -> str:
        return (f"its graph is being built by {self.holder.describe()}, which shares the graphs folder; "
                "it loads from there once written")


def try_claim(path: Optional[Path]) -> "Claim | Taken | None":
    """Claim `path` now: a Claim, Taken (held elsewhere) or None (no claims here: build as without them)."""
    if path is None or fcntl is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        log.debug("no build claim in %s: %s", path.parent, error)
        return None
    for _ in range(20):  # re-opened while a releaser removed the file: bounded, each round is a real change
        try:
            handle = open(path, "a+", encoding="utf-8")
        except OSError as error:
            log.debug("no build claim at %s: %s", path, error)
            return None
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _close(handle)
            return Taken(_read_holder(path))
        except OSError as error:  # a filesystem without locks
            _close(handle)
            log.debug("no build claim at %s: %s", path, error)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the holder removed it between our open and lock: try the new file
            _close(handle)
            continue
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n")
            handle.flush()
        except OSError:
            pass  # the lock is what counts; the text only names the holder
        return Claim(path, handle)
    return None


def wait_seconds() -> float:
    """How long a blocking compile waits for another process's build ($KEEPFAST_CLAIM_WAIT_S)."""
    return claim_wait_s()


def claim_or_wait(path: Optional[Path], on_wait: Optional[Callable[[Taken], None]] = None,
                  timeout: Optional[float] = None) -> "Claim | Taken | None":
    """Claim `path`, waiting while another process holds it (a blocking compile).

    Returns a Claim, None (no claims here), or Taken when the wait timed out
    (the caller builds anyway and says so). The caller looks in the store
    again after a wait: the holder's graph is there when its build succeeded.
    """
    result = try_claim(path)
    if not isinstance(result, Taken):
        return result
    if on_wait is not None:
        on_wait(result)
    deadline = time.monotonic() + (wait_seconds() if timeout is None else timeout)
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        result = try_claim(path)
        if not isinstance(result, Taken):
            return result
    return result


def release(claim: "Claim | Taken | None") -> None:
    """Release `claim` if it is one held here (Taken and None are nothing to release)."""
    if isinstance(claim, Claim):
        claim.release()


__all__ = ["Claim", "Holder", "Taken", "try_claim", "claim_or_wait", "release", "wait_seconds", "WAIT_ENV"]
