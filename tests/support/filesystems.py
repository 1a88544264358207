"""Real read-only and full file systems for fault tests.

As root (CI and this machine) a small tmpfs is mounted; elsewhere the same
OS error is raised at the boundary (the temp-file creation every write goes
through), so the store's handling is exercised either way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator


def _mount(target: Path, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                            capture_output=True, text=True)
    return result.returncode == 0


@contextlib.contextmanager
def small_filesystem(size_kib: int, read_only: bool = False, prefill: Path | None = None,
                     monkeypatch=None) -> Iterator[Path]:
    """A folder on a file system of `size_kib` (read-only if asked), optionally prefilled."""
    target = Path(tempfile.mkdtemp(prefix="keepfast-fs-"))
    mounted = _mount(target, f"size={size_kib}k")
    try:
        if prefill is not None:
            subprocess.run(["cp", "-a", f"{prefill}/.", str(target)], check=True)
        if mounted and read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
        if not mounted:
            from compiler.store import atomic

            code = errno.EROFS if read_only else errno.ENOSPC

            def refuse(*args, **kwargs):
                raise OSError(code, os.strerror(code))

            monkeypatch.setattr(atomic.tempfile, "mkstemp", refuse)
        yield target
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)
        subprocess.run(["rm", "-rf", str(target)], capture_output=True)
