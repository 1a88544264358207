"""Crash-safe file writes and content hashes.

Every file the store writes goes through here so that a killed writer, a full
disk or two processes writing the same name never leave a half-written file
under a name that a reader would pick up: data lands in a hidden temp file in
the same folder, is flushed to disk, and only then renamed into place (rename
is atomic on one file system).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Union

TEMP_PREFIX = ".tmp-"
_CHUNK = 1 << 20


def sha256_file(path: Union[str, Path]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_via(target: Union[str, Path], produce: Callable[[Path], None]) -> Path:
    """Let `produce` write a temp file beside `target`, then rename it into place.

    On any failure the temp file is removed and the previous `target` (if any)
    is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=".part", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        produce(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)
    return target


def write_bytes(target: Union[str, Path], data: bytes) -> Path:
    return write_via(target, lambda tmp: tmp.write_bytes(data))


def copy_file(source: Union[str, Path], target: Union[str, Path]) -> Path:
    return write_via(target, lambda tmp: shutil.copyfile(source, tmp))


def remove_stale_temps(folder: Union[str, Path], older_than_s: float = 3600.0) -> int:
    """Delete temp files a killed writer left behind (they never look valid).

    Only old ones: a young temp file may belong to a writer still at work.
    """
    import time

    removed = 0
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    now = time.time()
    for leftover in folder.rglob(TEMP_PREFIX + "*"):
        try:
            if now - leftover.stat().st_mtime < older_than_s:
                continue
            leftover.unlink()
            removed += 1
        except OSError:
            pass
    return removed
