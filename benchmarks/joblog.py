"""One log for every process of a run, written line by line as they print.

The device check (check.py) runs its configurations in processes, several at
once, on a machine that gives back a few files and kills the command at its
time limit: each line goes into one file as soon as its process prints it,
prefixed with the job's name, so a run killed half-way still leaves what every
job said up to then (and Python's stacks, which worker.py dumps shortly before
a job's own limit).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Deque, Dict, List, Optional, Sequence

WATCH_S = 0.25  # how often a job's time is checked against its limit
TAIL_LINES = 15  # a failed job's error quotes this many of its last lines
STEP = re.compile(r"^\[\s*\d+(\.\d+)? s\] ")  # worker.py's progress lines: "[    12.3 s] first call ..."


class JobLog:
    """Appends the runner's own lines and its jobs' output to `path`, each line with its source."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._tails: Dict[str, Deque[str]] = {}
        self._steps: Dict[str, str] = {}
        self._started = time.time()

    def write(self, source: str, text: str) -> None:
        """One line (or several) from `source`, stamped with the seconds since the log began."""
        stamp = f"{time.time() - self._started:7.1f}"
        with self._lock, open(self.path, "a", encoding="utf-8", errors="replace") as handle:
            for line in text.rstrip("\n").split("\n"):
                handle.write(f"{stamp} {source} | {line}\n")
                self._tails.setdefault(source, collections.deque(maxlen=TAIL_LINES)).append(line)
                if STEP.match(line):
                    self._steps[source] = line

    def say(self, text: str) -> None:
        """A line of the runner's own, printed and logged."""
        print(text, flush=True)
        self.write("runner", text)

    def tail(self, source: str) -> str:
        with self._lock:
            return "\n".join(self._tails.get(source, ()))

    def last_step(self, source: str) -> Optional[str]:
        """The last progress line `source` printed (worker.py's `[  12.3 s] ...`): where a job that was stopped
        was, when its last lines are Python's stacks."""
        with self._lock:
            return self._steps.get(source)

    def run(self, source: str, command: Sequence[str], cwd: str, env: Dict[str, str], timeout: float,
            waited: Optional[Callable[[], float]] = None, hard_timeout: Optional[float] = None) -> Optional[int]:
        """Run `command`, its output into this log as it comes; its exit status, or None when it was killed (with
        whatever it started in its session) at `timeout` seconds of its own time: its wall time less what
        `waited()` says it spent waiting for its turn (compile_turns.py), and at `hard_timeout` seconds of wall
        time whatever it waited."""
        process = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, text=True, errors="replace")
        killed: List[bool] = []
        done = threading.Event()
        started = time.time()

        def watch() -> None:
            while not done.wait(WATCH_S):
                elapsed = time.time() - started
                own = elapsed - (waited() if waited is not None else 0.0)
                if own > timeout or (hard_timeout is not None and elapsed > hard_timeout):
                    killed.append(True)
                    try:
                        os.killpg(process.pid, signal.SIGKILL)
                    except OSError:
                        pass
                    return

        watcher = threading.Thread(target=watch, name=f"joblog-limit-{source}", daemon=True)
        watcher.start()
        try:
            for line in process.stdout:
                self.write(source, line)
            process.wait()
        finally:
            done.set()
            process.stdout.close()
        return None if killed else process.returncode
