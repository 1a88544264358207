"""Where loaded graph packages are unpacked, and how what dead processes left is swept.

torch's package loader unpacks each package into a folder of its own
(``$TMPDIR/aotinductor_XXXXXX`` in torch 2.13, ``/tmp/XXXXXX`` before) and
removes it only when the loader object is destroyed; a process stopped with
SIGTERM or SIGKILL, which is how services and containers stop, leaves one
folder per loaded graph behind, forever. So the pack unpacks packages itself,
into a folder it owns, and hands torch the unpacked folder:

    $TMPDIR/keepfast-<uid>/run-<pid>-<token>.lock   flock-ed for the process's life
    $TMPDIR/keepfast-<uid>/run-<pid>-<token>/       the process's packages
        <label>-XXXXXXXX/                          one per loaded graph, removed with it

Whether a run folder's owner is alive is read from its lock, never from the
pid: the kernel drops an flock however its holder dies, and a reused pid
cannot hold a dead process's lock. A process sweeps the run folders whose
lock nobody holds before it unpacks its first package, and removes its own
at a normal exit. Nothing here knows about torch.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import io
import os
import secrets
import shutil
import stat
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import List, Optional

RUN_PREFIX = "run-"
LOCK_SUFFIX = ".lock"
_NEW_SUFFIX = ".new"  # a lock file being set up: locked first, then renamed into place


class ExtractionError(OSError):
    """A package could not be unpacked; the message says why."""


def root() -> Path:
    """The pack's folder in TMPDIR, one per user (another user's is never touched)."""
    return Path(tempfile.gettempdir()) / f"keepfast-{os.getuid()}"


def _ensure_root() -> Path:
    folder = root()
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as error:
        raise ExtractionError(error.errno, f"cannot create {folder} to unpack graphs: {error.strerror}") from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise ExtractionError(errno.EPERM, f"{folder} is not a folder of this user; graphs are not unpacked there")
    return folder


class _Run:
    """This process's folder and the lock that says it is alive."""

    def __init__(self) -> None:
        last: Optional[OSError] = None
        for _ in range(5):  # a sweeper may take a half-made lock (see _sweep_one); start again
            folder = _ensure_root()
            name = f"{RUN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            new = folder / (name + _NEW_SUFFIX)
            try:
                fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError as error:  # the root was removed by an exiting process meanwhile
                last = error
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.rename(new, folder / (name + LOCK_SUFFIX))
                (folder / name).mkdir(mode=0o700)
            except OSError as error:
                os.close(fd)
                for path in (new, folder / (name + LOCK_SUFFIX)):  # this attempt's own names only
                    path.unlink(missing_ok=True)
                last = error
                continue
            self.pid = os.getpid()
            self.fd = fd
            self.lock = folder / (name + LOCK_SUFFIX)
            self.folder = folder / name
            return
        raise ExtractionError(getattr(last, "errno", errno.EIO), f"cannot set up a folder in {root()}: {last}")

    def close(self) -> None:
        """Remove the folder, then the lock (a lock without its folder is swept; the reverse never exists)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            self.lock.unlink()
        except OSError:
            pass
        os.close(self.fd)
        try:
            self.lock.parent.rmdir()  # only when no other process has anything there
        except OSError:
            pass


_lock = threading.Lock()
_run: Optional[_Run] = None


def run_folder() -> Path:
    """This process's folder; the first call sweeps what dead processes left."""
    global _run
    with _lock:
        if _run is None or _run.pid != os.getpid():  # a forked child gets its own
            sweep()
            _run = _Run()
        return _run.folder


def leave_parents_run() -> None:
    """In a forked child: close its copy of the parent's run lock (an flock lives while any copy is open, so the
    child's copy would keep a dead parent's folder from being swept), without taking the parent's lock object."""
    global _run
    run = _run
    if run is not None and run.pid != os.getpid():
        try:
            os.close(run.fd)
        except OSError:
            pass
        _run = None


@atexit.register
def _remove_own() -> None:
    global _run
    with _lock:
        if _run is not None and _run.pid == os.getpid():
            _run.close()
        _run = None


def extract(package: bytes, label: str = "graph") -> Path:
    """Unpack a package (a zip) into a new folder of this process; `remove` it when done."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in label)[:40] or "graph"
    folder = Path(tempfile.mkdtemp(prefix=safe + "-", dir=run_folder()))
    try:
        with zipfile.ZipFile(io.BytesIO(package)) as archive:
            archive.extractall(folder)  # zipfile drops absolute paths and '..' from member names
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(error, OSError):
            raise ExtractionError(error.errno, f"cannot unpack a graph into {folder.parent}: {error.strerror}") from None
        raise ExtractionError(errno.EINVAL, f"the package is not a readable archive: {error}") from None
    return folder


def remove(folder: os.PathLike | str) -> None:
    """Remove one unpacked package (only ever a folder under the pack's root)."""
    path = Path(folder)
    if root() in path.parents:
        shutil.rmtree(path, ignore_errors=True)


def _sweep_one(lock_path: Path) -> Optional[Path]:
    """Remove a run folder and its lock if no live process holds the lock."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # its process is alive
        name = lock_path.name[: -len(LOCK_SUFFIX)] if lock_path.name.endswith(LOCK_SUFFIX) else None
        folder = lock_path.parent / name if name else None
        if folder is not None and folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
        lock_path.unlink(missing_ok=True)
        return folder or lock_path
    finally:
        os.close(fd)


def sweep() -> List[Path]:
    """Remove what processes that are gone left in the pack's folder; returns what was removed.

    A live process's files are never touched: its lock is held. A lock still
    being set up (``.new``) is taken only if its creator has not locked it yet,
    and the creator then fails to rename it and starts again.
    """
    folder = root()
    if not folder.is_dir() or folder.is_symlink():
        return []
    removed: List[Path] = []
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(RUN_PREFIX):
            continue
        if path.name.endswith((LOCK_SUFFIX, _NEW_SUFFIX)):
            done = _sweep_one(path)
            if done is not None:
                removed.append(done)
        elif path.is_dir() and not path.is_symlink() and not (folder / (path.name + LOCK_SUFFIX)).exists():
            # A run folder is made after its lock and removed before it: one without a lock is
            # no live process's (asked now, not from the listing, which may be older than the folder).
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        try:
            folder.rmdir()  # only when nothing of a live process is there
        except OSError:
            pass
    return removed


__all__ = ["ExtractionError", "extract", "remove", "root", "run_folder", "sweep", "leave_parents_run"]
