"""An exclusive lock on a file (fcntl) held for a block: read-modify-write of a small file that several processes
write (the package loader's verdicts), or work that must not overlap between processes (the bench's timed pairs).
The lock goes with the process: one that dies holding it releases it."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator, Union


@contextlib.contextmanager
def held(path: Union[str, Path]) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
