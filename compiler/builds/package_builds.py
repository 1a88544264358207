"""AOTInductor package builds in a child process: the caller's process never waits on Inductor.

Why a process and not a thread: Inductor is not thread-safe
(pytorch/pytorch#168042), and the model keeps running eagerly in the caller
while its graph is built. The exported program travels to the child without
its weights (`weightless`): a package is built with its weights left out
(they are bound from the live module at run time), so the child needs only
their layout, and a build moves kilobytes, not the checkpoint. The child
(`build_process/child.py`) imports torch only and runs at a lower priority.

A build's folder lives in this process's run folder (compiler/store/extraction.py,
swept when a dead process left one) and is removed when the build is read or
cancelled; live children are killed when this process exits. At most
`max_running()` children build at once (one per two cores: a build keeps one
core busy, and the model keeps running beside it); the rest wait their turn
in the order they were started.

Beside it: the job folder written and read (job_folder.py), how a build process starts (launch.py), the spares
started ahead (spares.py), how many build at once (slots.py) and the folders kept per machine (kept_folders.py).
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

from . import job_folder, launch, slots, spares
from . import times as build_times
from .job_folder import Trace
from ..store import extraction
from ..tracing import forked_trace, spawned_trace
from ..backends import loader_check
from ..backends.base import UNLABELLED, BuildLabel, CompileFailed, call_device

_live: Set["PackageBuild"] = set()
_queue: List["PackageBuild"] = []  # started, waiting for a free slot
_owners: Dict[str, List[int]] = {}  # owner id -> [builds started, builds ended] while it has builds
_listeners: List[Callable[[], None]] = []
_lock = threading.RLock()
log = logging.getLogger(__name__)
_running_count = 0  # children launched and not yet ended (read without the lock: build_cores.py, every call)


@dataclass(frozen=True)
class BuildView:
    """One build as status reports see it."""

    label: BuildLabel
    state: str  # TRACING, WAITING, BUILDING, BUILT (waiting to be taken in) or FAILED
    running_s: float  # seconds since its child started (0 while waiting; since the trace began while tracing)


TRACING, WAITING, BUILDING, BUILT, FAILED = "tracing", "waiting", "building", "built", "failed"


def add_listener(listener: Callable[[], None]) -> None:
    """Call `listener()` (from any thread) when a build starts, ends or is taken in or cancelled."""
    with _lock:
        if listener not in _listeners:
            _listeners.append(listener)


def _notify() -> None:
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        try:
            listener()
        except Exception:  # noqa: BLE001 - a status display must never break a build
            pass


class PackageBuild:
    """One package build running in a child process; read it with `result()`, or `cancel()` it."""

    def __init__(self, folder: Path, label: BuildLabel = UNLABELLED):
        self.folder = folder
        self.label = label
        self.process: Optional[subprocess.Popen] = None  # None while it waits for a slot
        self.started = time.perf_counter()
        self.launched: Optional[float] = None  # when its child started
        self.ended: Optional[float] = None  # when its child ended
        self.finished: Optional[float] = None
        self.failed_to_start: Optional[str] = None
        self.usage: Dict[str, Any] = {}  # the child's peak memory (MB) and phase times, once read
        # What the child built for (machine_fit.build_probe: march, vector ISA and its flags), once read;
        # None where the caller chose the configuration itself.
        self.probe: Optional[dict] = None
        # start_traced: the process tracing the program (forked or spawned; None: traced in the caller), and what
        # the trace says besides the program (guards, output structure), once it ended.
        self.tracer: Optional[forked_trace.TraceProcess] = None
        self.traced: Optional[dict] = None
        self.trace_process: Optional[str] = None  # start_traced: "forked", "spawned" or "caller"
        self.trace_note: Optional[str] = None  # traced in the caller: why not in a trace process

    def _launch(self) -> None:
        kind = spares.job_kind(self.folder)
        try:
            self.process = spares._take_spare(self.folder, kind)
            if self.process is None:
                with open(self.folder / "output.txt", "w") as output:
                    # Its own Inductor cache, removed with the folder: two processes building the same graph at
                    # once in one cache can read each other's half-written files.
                    self.process = subprocess.Popen([sys.executable, str(launch.CHILD), str(self.folder)],
                                                    stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    **launch._child_options({"TORCHINDUCTOR_CACHE_DIR":
                                                                             str(self.folder / "cache")}))
            if waiting_builds() or tracing_builds():
                # the next build's (most likely of this one's kind): one is waiting or being traced
                spares.prestart(kind)
        except Exception as error:  # noqa: BLE001 - read as a failed build
            self.failed_to_start = f"the build process could not start: {type(error).__name__}: {error}"
            self._ended()
            return
        self.launched = time.perf_counter()
        global _running_count
        with _lock:
            _running_count += 1
        # The next waiting build starts when this one ends, whether or not anything calls the model meanwhile.
        threading.Thread(target=self._start_next_when_done, name="keepfast-build-watch", daemon=True).start()

    def _start_next_when_done(self) -> None:
        self.process.wait()
        if self.process.returncode < 0:  # it died (a crash, the OOM killer): its compilers stop with it
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
        self._ended()  # counted before its time is kept: whoever sees the time sees the build ended
        if self.process.returncode == 0 and (self.folder / "graph.pt2").is_file():
            build_times.record(self.label.times_key, self.ended - self.launched)
        _pump()
        _notify()

    def _ended(self) -> None:
        global _running_count
        with _lock:
            if self.ended is None:
                self.ended = time.perf_counter()
                if self.launched is not None:
                    _running_count -= 1
                counts = _owners.get(self.label.group)
                if counts is not None:
                    counts[1] += 1

    def _queue_when_traced(self) -> None:
        """The watcher of a trace process: queue the build once the program is written, or fail it with why."""
        global _running_count
        tracer = self.tracer
        tracer.wait()
        with _lock:
            _running_count -= 1
            cancelled = self not in _live
        if cancelled:  # killed by cancel(), which removed its folder
            self.failed_to_start = "cancelled"
            self._ended()
            return
        failure = tracer.failure()
        if failure is None:
            try:
                self.traced = json.loads((self.folder / job_folder.TRACED).read_text())
            except (OSError, ValueError) as error:
                failure = forked_trace.TraceFailure(forked_trace.FORK, "the trace process left no readable "
                                                    f"result ({error})")
        if failure is not None:
            if failure.of_the_fork:
                tracer.disable(f"a trace in a {tracer.how} process failed ({failure.message})")
            self.failed_to_start = failure.message
            self._ended()
        else:
            with _lock:
                if self in _live:  # not cancelled meanwhile
                    _queue.append(self)
            _pump()
        _notify()

    def view(self) -> BuildView:
        if self._tracing():
            return BuildView(self.label, TRACING, time.perf_counter() - self.started)
        if self.waiting:
            return BuildView(self.label, WAITING, 0.0)
        if self._running():
            return BuildView(self.label, BUILDING, time.perf_counter() - self.launched)
        ok = self.failed_to_start is None and self.process.returncode == 0
        return BuildView(self.label, BUILT if ok else FAILED, (self.ended or time.perf_counter()) - (self.launched or self.started))

    @property
    def waiting(self) -> bool:
        return self.process is None and self.failed_to_start is None

    def _tracing(self) -> bool:
        return self.tracer is not None and self.traced is None and self.failed_to_start is None

    def _running(self) -> bool:
        return self._tracing() or (self.process is not None and self.process.poll() is None)

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def done(self) -> bool:
        _pump()
        if self.waiting or self._running():
            return False
        self.finished = self.finished or time.perf_counter()
        return True

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until the build finished (True) or `timeout` s passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def result(self, timeout: Optional[float] = None) -> bytes:
        """The package's bytes (waiting up to `timeout` s); CompileFailed with the child's reason if it failed."""
        if not self.wait(timeout):
            self.cancel()
            raise CompileFailed(f"the package build did not finish in {timeout:.0f} s; cancelled")
        try:
            if self.failed_to_start:
                raise CompileFailed(self.failed_to_start)
            package = self.folder / "graph.pt2"
            if self.process.returncode == 0 and package.is_file():
                self.usage = job_folder._read_usage(self.folder)
                self.probe = job_folder._read_probe(self.folder)
                if "load_check_s" in self.usage.get("phase_s", {}):
                    loader_check.record(job_folder._loaded_kind(self.folder), True,
                                        "a package loaded in its build process")
                return package.read_bytes()
            crashed = self._loader_crash()
            if crashed:
                raise CompileFailed(crashed)
            raise CompileFailed("AOTInductor failed in the build process: " + self._reason())
        finally:
            self._clean()

    def cancel(self) -> None:
        """Stop the child (or its turn in the queue) and remove what it wrote; nothing is left behind."""
        with _lock:
            if self in _queue:
                _queue.remove(self)
        if self.tracer is not None and self.tracer.running():
            self.tracer.kill()  # its watcher reaps it and, the build no longer live, queues nothing
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # the child and the compilers it started
            except OSError:
                self.process.kill()
            self.process.wait()
        self._clean()

    def _loader_crash(self) -> Optional[str]:
        """The reason, when the child died by a signal while loading the package it built (loader_check.py); the
        machine's verdict is kept, so no later graph of that kind is built for nothing."""
        code = self.process.returncode if self.process is not None else None
        if code is None or code >= 0 or not (self.folder / loader_check.LOADING_MARK).is_file():
            return None
        kind = job_folder._loaded_kind(self.folder)
        reason = loader_check.crash_reason(kind, code, f"loading the {kind} graph its build process had just built")
        loader_check.record(kind, False, reason)
        self.usage = job_folder._read_usage(self.folder)  # the build itself had ended: where its time went
        log.warning("%s (the build's phases, s: %s)", reason, self.usage.get("phase_s", "not written"))
        return reason

    def _reason(self) -> str:
        reason, stack = job_folder._failure(self.folder, self.process.returncode)
        if stack:  # the build's stack goes to the log, where a report can quote it
            log.warning("a package build failed; its stack, last lines:\n%s", stack)
        return reason

    def _clean(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        with _lock:
            was_live = self in _live
            _live.discard(self)
            if not any(build.label.group == self.label.group for build in _live):
                _owners.pop(self.label.group, None)
        _pump()
        if was_live:
            _notify()


def _pump() -> None:
    """Start waiting builds while fewer than max_running() children run."""
    with _lock:
        while _queue and sum(1 for build in _live if build._running()) < slots.max_running():
            _queue.pop(0)._launch()


def _new_build(folder: Path, label: BuildLabel, queued: bool) -> PackageBuild:
    build = PackageBuild(folder, label)
    with _lock:
        _live.add(build)
        if queued:
            _queue.append(build)
        _owners.setdefault(label.group, [0, 0])[0] += 1
    return build


def start(ep: "torch.export.ExportedProgram", configs: dict, label: BuildLabel = UNLABELLED,
          probe: bool = False, now: bool = False, beside: int = 1, waited: bool = False) -> PackageBuild:
    """Start building `ep`'s package (weights left out) in a child process; `label` says what for.

    `probe`: the child picks the CPU level to build for (machine_fit.build_probe, Inductor's ISA probe,
    which compiles test programs) and adds it to `configs`; `PackageBuild.probe` says what it found. The
    caller then never runs the probe on the path of the call that started the build.
    `now`: the build starts at once, whatever else runs (a caller waits for it: not behind background builds).
    `beside`: the builds started together with this one, it included (a graph's parts): they share the cores.
    `waited`: the caller waits for it though it queues (`now` says so too): it runs at the caller's priority
    (child_priority.py); a background build runs below it."""
    folder = Path(tempfile.mkdtemp(prefix="build-", dir=extraction.run_folder()))
    try:
        job_folder._write_job(ep, configs, probe, folder, beside, waited=now or waited)
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    build = _new_build(folder, label, queued=not now)
    if now:
        build._launch()
    _pump()
    _notify()
    return build


# Why a build the caller waits for is traced in the caller where a spawned process could have traced it: on the
# H200 (2026-11-28) Flux's two block structures, traced in spawned processes side by side, reached their builds 21.0
# and 19.8 s after they began, for traces of 3.0 and 2.8 s; the rest was the processes' start (Python, torch, the
# pack). One after the other here they take the traces' time, and each build starts as its trace ends.
WAITED_TRACE = ("the caller waits for this build, and a spawned process would add its start (Python, torch and "
                "the pack) to the wait")


def start_traced(trace: Trace, tensors: List[torch.Tensor], configs: dict, label: BuildLabel = UNLABELLED,
                 probe: bool = False, beside: int = 1, waited: bool = False) -> PackageBuild:
    """Trace (`trace()` -> (program, a JSON-able dict of what else the trace found)) and build, off this process
    where it can: in a fork (forked_trace.py: a call with `tensors` on the CPU, no CUDA here), else in a spawned
    process (spawned_trace.py: where only CUDA keeps a fork from it, and `trace` pickles), else here first.
    `waited`: the caller waits for the build (a block engine's structures built side by side before its first
    call returns), so it is traced here where a spawned process would have traced it (WAITED_TRACE); a fork
    starts in a moment and still traces beside the caller.

    The dict is the build's `traced` once the trace ended; `trace_process` says where it ran (and `trace_note`
    why here). Traced here, the trace's errors (CompileFailed, BuildInProcess) are raised now; traced in a child
    process, they are the build's failure (`result()` raises it). `beside`: as `start`'s (a block engine's
    structures built side by side share the kernel compilers)."""
    how, why = spawned_trace.chosen(tensors)
    if waited and how == spawned_trace.SPAWNED:
        how, why = spawned_trace.CALLER, WAITED_TRACE
    tracer: Optional[forked_trace.TraceProcess] = None
    if how != spawned_trace.CALLER:
        folder = Path(tempfile.mkdtemp(prefix="build-", dir=extraction.run_folder()))
        work = functools.partial(job_folder.trace_job, trace, configs, probe, folder, beside)
        try:
            if how == spawned_trace.FORKED:
                tracer = forked_trace.ForkedTrace(work, folder / spawned_trace.ERROR)
            else:
                tracer = spawned_trace.SpawnedTrace(work, tensors, folder)
        except spawned_trace.CannotSend as error:
            why = str(error)
        except OSError as error:  # no process now (memory, process limits): trace here
            why = f"a {how} trace process failed to start: {error}"
            (forked_trace.disable if how == spawned_trace.FORKED else spawned_trace.disable)(why)
        if tracer is None:
            shutil.rmtree(folder, ignore_errors=True)
    if tracer is None:
        log.info("%s: traced in this process (%s)", label.owner, why)
        # its build process starts Python and torch while this process traces
        spares.prestart(str(call_device(tensors)))
        ep, traced = trace()
        build = start(ep, configs, label, probe, beside=beside, waited=waited)
        build.traced, build.trace_process, build.trace_note = traced, spawned_trace.CALLER, why
        return build
    log.info("%s: traced in a %s process%s", label.owner, tracer.how, f" ({why})" if why else "")
    build = _new_build(folder, label, queued=False)
    build.tracer, build.trace_process = tracer, tracer.how
    global _running_count
    with _lock:
        _running_count += 1  # the trace takes a core: model calls leave it one (build_cores.py)
    threading.Thread(target=build._queue_when_traced, name="keepfast-trace-watch", daemon=True).start()
    _notify()
    return build


def snapshot() -> Tuple[List[BuildView], Dict[str, Tuple[int, int]]]:
    """(every build not yet taken in or cancelled, in the order started; per owner id: (started, ended) since
    its first build in flight began) -- for build_status.py."""
    with _lock:
        builds = sorted(_live, key=lambda build: build.started)
        owners = {owner: (counts[0], counts[1]) for owner, counts in _owners.items()}
    return [build.view() for build in builds], owners


def running_count() -> int:
    """Build processes running now (a plain read: cheap enough for every model call)."""
    return _running_count


def live_builds() -> int:
    """Builds whose child is still running (for tests and the page)."""
    with _lock:
        return sum(1 for build in _live if build._running())


def tracing_builds() -> int:
    """Builds whose program is still being traced in a trace process (forked_trace.py, spawned_trace.py)."""
    with _lock:
        return sum(1 for build in _live if build._tracing())


def waiting_builds() -> int:
    """Builds waiting for a free slot."""
    with _lock:
        return len(_queue)


@atexit.register
def _cancel_all() -> None:
    with _lock:
        builds = list(_live)
    for build in builds:
        build.cancel()
    spares._stop_spares()
