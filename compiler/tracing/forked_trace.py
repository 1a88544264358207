"""torch.export in a forked copy of this process, so that the call that starts a background build does not wait for it.

A background build still had to trace in the caller: torch.export reads the live module, and that trace was
most of what the first image paid over eager (5.2 s of a quick SD1.5 UNet's 9.0 s first image on a 2-core
CPU). It cannot run on another thread beside the model: while it traces, torch.fx patches
`torch.nn.Module.__call__` for the whole process and export turns mkldnn and cuDNN off process-wide, so a model
call on another thread runs into the tracer (tried on torch 2.13: the trace failed with "ProxyTorchDispatchMode
slot already occupied" and "CURRENT_PATCHER is None"). A child started from scratch would need the live module
as ComfyUI patched it, wrappers and all; a fork has it as it is, copy-on-write, with nothing pickled.

Where it cannot: a process that has used CUDA (a forked child cannot use CUDA, and tracing fake CUDA tensors
initialises it) or tensors on a CUDA device: the trace runs in a spawned process instead (spawned_trace.py, which
chooses); tensors on another device, a platform without fork, or KEEPFAST_TRACE_PROCESS=0: the trace runs in the
caller, as before. `TraceProcess` (waiting, the timeout, failures) and `run_child` (the child's life) serve the
spawned process too. The child runs at a lower priority with one intra-op thread, ends
with this process (its parent-death signal) and then sweeps what this process left, never returns into the
caller's code (os._exit, whatever happens), and is killed when it runs longer than KEEPFAST_TRACE_TIMEOUT_S
(default 300).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, NoReturn, Optional

import torch

from ..store import extraction
from ..build_process import child_priority
from ..settings import TRACE_PROCESS, TRACE_TIMEOUT_S, trace_process, trace_timeout_s

log = logging.getLogger(__name__)

ENV = TRACE_PROCESS.name
TIMEOUT_ENV = TRACE_TIMEOUT_S.name
_PR_SET_PDEATHSIG = 1
KINDS = {"CompileFailed": "compile", "BuildInProcess": "in_process"}  # the child's error -> its kind ("error" else)
FORK = "fork"  # the kind of a failure of the fork itself (killed, overran, no result)
_disabled: Optional[str] = None  # why this process traces in the caller from now on (set once a fork misbehaved)


def unavailable(tensors: Iterable[torch.Tensor]) -> Optional[str]:
    """Why a trace of a call with these tensors must run in this process (None: it can run in a fork)."""
    return general_refusal() or cuda_refusal(tensors)


def general_refusal() -> Optional[str]:
    """Why no fork traces here whatever the call (KEEPFAST_TRACE_PROCESS=0, the platform, a fork misbehaved)."""
    if trace_process() == "0":
        return f"{ENV}=0"
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "this platform has no fork with a parent-death signal"
    if _disabled is not None:
        return _disabled
    return None


def cuda_refusal(tensors: Iterable[torch.Tensor]) -> Optional[str]:
    """Why a fork cannot trace a call with these tensors for their device or this process's CUDA (None: it can).
    A reason that names CUDA is one a spawned process serves (spawned_trace.py); another device is not."""
    if torch.cuda.is_initialized():
        return "this process uses CUDA, which a forked process cannot"
    for tensor in tensors:
        if tensor.device.type != "cpu":
            return f"the call has tensors on {tensor.device.type}"
    return None


def disable(reason: str) -> None:
    """Trace in the caller from now on (a forked trace failed in a way a fork should not)."""
    global _disabled
    if _disabled is None:
        log.warning("graphs are traced in this process from now on (the first call of each waits for it): %s", reason)
    _disabled = reason


def _timeout() -> float:
    return trace_timeout_s()


@dataclass(frozen=True)
class TraceFailure:
    """Why a forked trace ended without a program: `kind` is "compile" (torch.export's CompileFailed), "error"
    (another exception in the traced code), "in_process" (the graph must be built in the caller) or "fork"."""

    kind: str
    message: str

    @property
    def of_the_fork(self) -> bool:
        """Not the model's doing: traces should run in the caller from now on."""
        return self.kind in (FORK, "in_process")


class TraceProcess:
    """One child process tracing a program (forked here, or spawned: spawned_trace.py); the caller's watcher
    thread reaps it with `wait()`, and `failure()` says why it ended without success."""

    how = "trace"  # "forked" or "spawned": which process traced (PackageBuild.trace_process)

    def __init__(self, pid: int, error_file: Path):
        self.error_file = error_file
        self.status: Optional[int] = None  # os.waitpid's status, once reaped
        self.timed_out = False
        self.pid = pid
        self._reaped = threading.Event()

    def running(self) -> bool:
        return not self._reaped.is_set()

    def wait(self) -> None:
        """Wait for the child (killing it past the timeout) and reap it; called by one watcher thread."""
        deadline = time.monotonic() + _timeout()
        while True:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler that reaps all): nothing to read
                pid, status = self.pid, -1
            if pid == self.pid:
                break
            if time.monotonic() > deadline and not self.timed_out:
                self.timed_out = True
                self.kill()
            time.sleep(0.02)
        self.status = status
        self._reaped.set()

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass

    def disable(self, reason: str) -> None:
        """Trace in the caller from now on where this kind of process would have traced (it misbehaved)."""
        disable(reason)

    def output_tail(self) -> str:
        """The last line the child wrote, where it wrote to a file of its own ("" where it did not)."""
        return ""

    def failure(self) -> Optional[TraceFailure]:
        """None when the child succeeded (or was reaped elsewhere and wrote no error), else why it did not."""
        try:
            error = json.loads(self.error_file.read_text())
            if isinstance(error, dict) and "message" in error:
                return TraceFailure(str(error.get("kind", "error")), str(error["message"]))
        except (OSError, ValueError):
            pass
        if self.status in (0, -1):  # -1: reaped elsewhere; the caller looks for the child's result
            return None
        if self.timed_out:
            return TraceFailure(FORK, f"the trace process ran longer than {_timeout():.0f} s ({TIMEOUT_ENV}) and "
                                      "was stopped")
        tail = self.output_tail()
        said = f" ({tail})" if tail else ""
        if os.WIFSIGNALED(self.status):
            return TraceFailure(FORK, f"the trace process was killed by signal {os.WTERMSIG(self.status)}{said}")
        return TraceFailure(FORK, f"the trace process ended with status {os.WEXITSTATUS(self.status)} and no "
                                  f"message{said}")


class ForkedTrace(TraceProcess):
    """One forked child running `work()`."""

    how = "forked"

    def __init__(self, work: Callable[[], None], error_file: Path):
        """Run `work()` in a forked child now; the caller reaps it with `wait()` (on a thread of its own)."""
        super().__init__(_fork(work, error_file), error_file)


def _fork(work: Callable[[], None], error_file: Path) -> int:
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # nothing buffered here is written twice
        except Exception:  # noqa: BLE001 - a closed or odd stream
            pass
    pid = os.fork()
    if pid:
        return pid
    run_child(work, error_file, parent)


def run_child(work: Callable[[], None], error_file: Path, parent: int, niced: bool = False) -> NoReturn:
    """The trace process's life (forked, or spawned: spawned_trace.py): become the parent's child (`niced`: its
    priority is lowered already), run `work()`, write its error as the parent reads it, and end the process."""
    status = 1  # never returns into the caller's code
    try:
        _become_child(parent, niced)
        work()
        status = 0
    except _ParentGone:
        pass
    except BaseException as error:  # noqa: BLE001 - everything becomes the child's message
        kind = KINDS.get(type(error).__name__, "error")
        message = f"{type(error).__name__}: {error}" if kind == "error" else str(error)
        try:
            error_file.write_text(json.dumps({"kind": kind, "message": message}))
        except Exception:  # noqa: BLE001
            pass
    finally:
        try:
            if os.getppid() != parent:  # the parent is gone: remove what it left, as its build processes do
                extraction.leave_parents_run()  # a parent gone before _become_child got that far: its lock's copy
                extraction.sweep()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except BaseException:  # noqa: BLE001 - nothing may keep this process from ending here
            pass
        os._exit(status)


class _ParentGone(BaseException):
    """Raised in the child by the parent-death signal (a BaseException: nothing in the traced code catches it)."""


def _become_child(parent: int, niced: bool = False) -> None:
    """End with the parent, yield the cores to it, and compute on one thread (OpenMP's pool is the parent's).

    The parent-death signal is SIGTERM, handled: the kernel also sends it when the thread that forked ends
    while the process lives on, which is no reason to stop. The child's copy of the parent's run lock is closed
    (extraction.py), so the parent's folder can be swept once the parent is gone."""
    import ctypes

    def parent_gone(signum, frame) -> None:
        if os.getppid() != parent:
            raise _ParentGone()

    extraction.leave_parents_run()  # first: a parent gone before the checks below leaves its lock to be swept
    # Streams and log handlers may be wrapped in locks that another thread of the parent held at the fork (ComfyUI's
    # log interceptor has one): the child writes to the bare file descriptors and logs nothing.
    logging.disable(logging.CRITICAL)
    sys.stdout = open(1, "w", closefd=False, buffering=1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    signal.signal(signal.SIGTERM, parent_gone)  # the forking thread is this process's main thread now
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the signal was set
        raise _ParentGone()
    if not niced:
        child_priority.lower()
    torch.set_num_threads(1)


__all__ = ["ForkedTrace", "TraceProcess", "TraceFailure", "run_child", "unavailable", "general_refusal", "cuda_refusal",
           "disable", "ENV", "TIMEOUT_ENV"]
