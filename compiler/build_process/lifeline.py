"""A build process's watch on its parent (build_process/child.py): when the parent is gone, however it ended,
the build stops and what it and the parent left is removed. The standard library and compiler/settings.py only.
"""

from __future__ import annotations

import os
from typing import Optional

from ..settings import parent_lifeline_fd, sweeper as sweeper_path

_job = {"folder": None, "watched": False}  # this process's build folder once it has one; the lifeline watched


def _stop_when_the_parent_is_gone(folder: Optional[str]) -> None:
    """Watch the parent's lifeline (a pipe whose write end only the parent holds): end-of-file means the parent
    is gone, however it ended (SIGTERM and SIGKILL run no exit handler there). Then stop this build and the
    compilers it started (this process's group), remove its folder, and sweep what the parent left (its run
    folder, with the sweep every process runs at start: compiler/store/extraction.py, loaded by path, stdlib only).
    A spare (spare.py) watches from its start, before it has a folder."""
    _job["folder"] = folder or _job["folder"]
    fd = parent_lifeline_fd()
    if not fd.isdigit() or _job["watched"]:
        return
    _job["watched"] = True
    import signal
    import threading

    # The clean-up runs in the main thread (a signal handler), so the build stops writing while it runs: a
    # blocked wait for a compiler is interrupted for it.
    signal.signal(signal.SIGTERM, lambda *_: _clean_up_after_the_parent(_job["folder"]))

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="keepfast-parent-lifeline", daemon=True).start()


def _clean_up_after_the_parent(folder: Optional[str]) -> None:
    import shutil
    import signal
    import time

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.killpg(os.getpgrp(), signal.SIGTERM)  # the compiler processes (this one ignores it)
    except OSError:
        pass
    if folder is None:  # a spare that had no build yet: nothing of its own to remove
        os._exit(1)
    time.sleep(0.2)
    shutil.rmtree(folder, ignore_errors=True)
    sweeper = sweeper_path()
    run_folder = os.path.dirname(os.path.abspath(folder))
    if sweeper and os.path.isfile(sweeper):
        import importlib.util

        try:
            spec = importlib.util.spec_from_file_location("keepfast_extraction_sweep", sweeper)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            for _ in range(50):  # the parent's lock is released when its last file closes: soon, not at once
                module.sweep()
                if not os.path.exists(run_folder):
                    break
                time.sleep(0.1)
        except Exception:  # noqa: BLE001 - the next start's sweep removes it then
            pass
    os._exit(1)
