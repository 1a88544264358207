"""Where a slow build is: a build process's (build_process/child.py) Python stacks, written every STACKS_EVERY_S
where KEEPFAST_BUILD_STACKS names a folder, for the bench's worker to print at its time limit. The standard
library and compiler/settings.py only.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import List, Optional

from ..settings import BUILD_STACKS, build_stacks

STACKS_ENV = BUILD_STACKS.name  # a folder: this process writes its stacks there every STACKS_EVERY_S
STACKS_EVERY_S = 30.0


def other_threads_stacks(depth: Optional[int] = None) -> List[str]:
    """Every other thread's Python stack as lines ("Thread NAME:", then its last `depth` frames), read from a
    Python thread that holds the GIL (the bench's worker._print_stacks_later says why not faulthandler)."""
    import threading

    names = {thread.ident: thread.name for thread in threading.enumerate()}
    lines: List[str] = []
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            lines.append(f"Thread {names.get(ident, ident)}:")
            lines += [line.rstrip() for line in traceback.format_stack(frame)[-(depth or 0):]]
    return lines


def _report_stacks(folder: str, begun: float) -> None:
    """Where a slow build is (the device check's SD1.5 build had not ended in 230 s on a GPU, and the stacks the
    job printed were its own, waiting on this process): every STACKS_EVERY_S, this process's Python stacks into
    `$KEEPFAST_BUILD_STACKS/build-<pid>.txt` (replaced whole), which the bench's worker prints at its time limit.
    From a Python thread holding the GIL (worker._print_stacks_later says why not faulthandler). `begun`: when the
    process began, or its build where it was a spare (time.perf_counter)."""
    where = build_stacks()
    if not where:
        return
    import threading

    path = os.path.join(where, f"build-{os.getpid()}.txt")

    def report() -> None:
        while True:
            time.sleep(STACKS_EVERY_S)
            lines = [f"build process {os.getpid()} ({os.path.basename(folder)}), {time.perf_counter() - begun:.0f} s "
                     "after its start:"] + other_threads_stacks(depth=25)
            try:
                with open(path + ".partial", "w") as handle:
                    handle.write("\n".join(lines) + "\n")
                os.replace(path + ".partial", path)
            except OSError:
                return

    threading.Thread(target=report, name="keepfast-build-stacks", daemon=True).start()
