"""How a build process starts: the script it runs (`CHILD`: build_process/run.py, or a test's own script), its
environment, and its lifeline, a pipe whose read end it watches for this process's end (build_process/lifeline.py).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from ..settings import PARENT_LIFELINE_FD, SWEEPER as SWEEPER_SETTING
from .kept_folders import kernel_cache

REAL_CHILD = Path(__file__).resolve().parent.parent / "build_process" / "run.py"
CHILD = REAL_CHILD  # what a build process runs (tests put scripts of their own here)
SWEEPER = Path(__file__).resolve().parent.parent / "store" / "extraction.py"  # stdlib only: a child loads it by path
LIFELINE_ENV = PARENT_LIFELINE_FD.name
_lifeline: Optional[Tuple[int, int, int]] = None  # (read, write, pid): the write end lives as long as this process
_lock = threading.Lock()


def _child_options(extra_env: Dict[str, str]) -> Dict[str, Any]:
    """How a build process is started. This process's import path, so the child finds the modules of the graph's
    custom operators. The lifeline's read end: it reads end-of-file when this process is gone, however it ended
    (ComfyUI stopped with SIGTERM or SIGKILL runs no exit handler), and the child then stops its build and removes
    what this process left (build_process/child.py). A session of its own: a terminal's Ctrl-C reaches ComfyUI,
    which stops the build itself, and cancelling kills the build's compiler processes with it (the whole group)."""
    lifeline = _lifeline_read_end()
    env = {"TRITON_CACHE_DIR": str(kernel_cache()), **os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), LIFELINE_ENV: str(lifeline),
           SWEEPER_SETTING.name: str(SWEEPER), **extra_env}
    return dict(env=env, pass_fds=(lifeline,), start_new_session=True)


def _lifeline_read_end() -> int:
    """The read end of this process's lifeline pipe (made once; its write end is never written or closed)."""
    global _lifeline
    with _lock:
        if _lifeline is None or _lifeline[2] != os.getpid():
            read, write = os.pipe()
            _lifeline = (read, write, os.getpid())
        return _lifeline[0]
