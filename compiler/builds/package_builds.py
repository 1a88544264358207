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
"""

from __future__ import annotations

import atexit
import copy
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
import torch.utils._pytree as pytree

from . import times as build_times
from ..store import extraction
from ..machine import machine_fit
from ..build_process import build_memo, child_priority, conv_layout, gpu_reductions
from ..tracing import forked_trace, spawned_trace, weight_inputs
from ..backends import loader_check
from ..backends.base import UNLABELLED, BuildInProcess, BuildLabel, CompileFailed, call_device

REAL_CHILD = Path(__file__).resolve().parent.parent / "build_process" / "run.py"
CHILD = REAL_CHILD  # what a build process runs (tests put scripts of their own here)
SWEEPER = Path(__file__).resolve().parent.parent / "store" / "extraction.py"  # stdlib only: a child loads it by path
MACHINE_FIT = Path(__file__).resolve().parent.parent / "machine" / "machine_fit.py"  # stdlib at the top: loaded by path too
LIFELINE_ENV = "KEEPFAST_PARENT_LIFELINE_FD"
_lifeline: Optional[Tuple[int, int, int]] = None  # (read, write, pid): the write end lives as long as this process
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


def max_running() -> int:
    """Builds that run at once: KEEPFAST_BUILD_PROCESSES, else one per two cores."""
    configured = os.environ.get("KEEPFAST_BUILD_PROCESSES", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, (os.cpu_count() or 2) // 2)


BUILTIN_NAMESPACES = ("aten", "prims", "higher_order", "_operator", "quantized_decomposed")


def operator_modules(ep: "torch.export.ExportedProgram") -> List[str]:
    """The Python modules that define the custom operators `ep` calls (ComfyUI's comfy_kitchen.apply_rope):
    the child imports them before it reads the program, which names those operators."""
    import importlib.util

    from torch._library import custom_ops

    modules: List[str] = []
    for node in ep.graph.nodes:
        namespace = getattr(node.target, "namespace", None) if node.op == "call_function" else None
        if namespace is None or namespace in BUILTIN_NAMESPACES:
            continue
        qualname = node.target._schema.name
        definition = custom_ops.OPDEFS.get(qualname)
        module = getattr(getattr(definition, "_init_fn", None), "__module__", None)
        if module is None and importlib.util.find_spec(namespace) is not None:
            module = namespace  # an operator library registered by importing its package
        if module is None:
            raise BuildInProcess(f"the graph calls the custom operator {qualname}, and the module that defines "
                                 "it is not known, so a build process could not read the graph")
        if module not in modules:
            modules.append(module)
    return modules


def weightless(ep: "torch.export.ExportedProgram") -> Tuple["torch.export.ExportedProgram", Dict[str, list]]:
    """(a copy of `ep` whose weights are empty placeholders, each weight's layout to make it again).

    Raises BuildInProcess where this torch's ExportedProgram keeps its weights elsewhere than `_state_dict`
    (the caller then builds in its own process).
    """
    weights = getattr(ep, "_state_dict", None)
    if not isinstance(weights, dict):
        raise BuildInProcess(f"torch {torch.__version__}'s exported programs keep their weights where the pack "
                             "cannot leave them out")
    layout = {name: _layout(tensor) for name, tensor in weights.items()}
    light = copy.copy(ep)
    light._state_dict = {name: _placeholder(tensor) for name, tensor in weights.items()}
    return light, layout


def _layout(tensor: torch.Tensor) -> list:
    """What a build process makes a tensor again from (build_process.child._weights): its values are never read."""
    return [list(tensor.shape), list(tensor.stride()), str(tensor.dtype).removeprefix("torch."), str(tensor.device),
            isinstance(tensor, torch.nn.Parameter)]


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    placeholder = torch.empty(0, dtype=tensor.dtype)
    return torch.nn.Parameter(placeholder, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else placeholder


def light_examples(ep: "torch.export.ExportedProgram") -> Tuple["torch.export.ExportedProgram", Optional[List[list]]]:
    """(`ep`, None), or where its example inputs hold weights (a block graph's lifted weights, weight_inputs.py:
    the examples are the module's own weights) a copy whose examples are empty placeholders, with each example's
    layout to make it again (None for a leaf that is not a tensor)."""
    if not weight_inputs.takes_weights(ep):
        return ep, None
    leaves, spec = pytree.tree_flatten(ep.example_inputs)
    layouts = [_layout(leaf) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    light = copy.copy(ep)
    light._example_inputs = pytree.tree_unflatten(
        [_placeholder(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)
    return light, layouts


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
        kind = job_kind(self.folder)
        try:
            self.process = _take_spare(self.folder, kind)
            if self.process is None:
                with open(self.folder / "output.txt", "w") as output:
                    # Its own Inductor cache, removed with the folder: two processes building the same graph at
                    # once in one cache can read each other's half-written files.
                    self.process = subprocess.Popen([sys.executable, str(CHILD), str(self.folder)], stdout=output,
                                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                    **_child_options({"TORCHINDUCTOR_CACHE_DIR":
                                                                      str(self.folder / "cache")}))
            if waiting_builds() or tracing_builds():
                prestart(kind)  # the next build's (most likely of this one's kind): one is waiting or being traced
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
                self.traced = json.loads((self.folder / TRACED).read_text())
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
                self.usage = _read_usage(self.folder)
                self.probe = _read_probe(self.folder)
                if "load_check_s" in self.usage.get("phase_s", {}):
                    loader_check.record(self._loaded_kind(), True, "a package loaded in its build process")
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

    def _loaded_kind(self) -> str:
        """The device kind the child loaded its package for (what it wrote in the mark; "cpu" if nothing)."""
        try:
            return (self.folder / loader_check.LOADING_MARK).read_text().strip() or "cpu"
        except OSError:
            return _kind_of_job(self.folder)

    def _loader_crash(self) -> Optional[str]:
        """The reason, when the child died by a signal while loading the package it built (loader_check.py); the
        machine's verdict is kept, so no later graph of that kind is built for nothing."""
        code = self.process.returncode if self.process is not None else None
        if code is None or code >= 0 or not (self.folder / loader_check.LOADING_MARK).is_file():
            return None
        kind = self._loaded_kind()
        reason = loader_check.crash_reason(kind, code, f"loading the {kind} graph its build process had just built")
        loader_check.record(kind, False, reason)
        self.usage = _read_usage(self.folder)  # the build itself had ended: where its time went
        log.warning("%s (the build's phases, s: %s)", reason, self.usage.get("phase_s", "not written"))
        return reason

    def _reason(self) -> str:
        error = self.folder / "error.txt"
        if error.is_file():
            text = error.read_text(errors="replace")
            if text.strip():
                # the reason is its first line; the build's stack goes to the log, where a report can quote it
                log.warning("a package build failed; its stack, last lines:\n%s",
                            "\n".join(text.strip().splitlines()[-40:]))
            return text.splitlines()[0] if text.strip() else "no message"
        output = self.folder / "output.txt"
        tail = output.read_text(errors="replace").strip().splitlines()[-1:] if output.is_file() else []
        code = self.process.returncode
        if code is not None and code < 0:  # a compiler crash (SIGSEGV), the OOM killer or a stack overflow
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            what = f"the build process died ({name})"
        else:
            what = f"exit status {code}"
        return what + (f" ({tail[0]})" if tail else "")

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


def _child_options(extra_env: Dict[str, str]) -> Dict[str, Any]:
    """How a build process is started. This process's import path, so the child finds the modules of the graph's
    custom operators. The lifeline's read end: it reads end-of-file when this process is gone, however it ended
    (ComfyUI stopped with SIGTERM or SIGKILL runs no exit handler), and the child then stops its build and removes
    what this process left (build_process/child.py). A session of its own: a terminal's Ctrl-C reaches ComfyUI,
    which stops the build itself, and cancelling kills the build's compiler processes with it (the whole group)."""
    lifeline = _lifeline_read_end()
    env = {"TRITON_CACHE_DIR": str(kernel_cache()), **os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), LIFELINE_ENV: str(lifeline),
           "KEEPFAST_SWEEPER": str(SWEEPER), **extra_env}
    return dict(env=env, pass_fds=(lifeline,), start_new_session=True)


# Build processes started ahead of their builds (build_process.child.spare), each (process, the child script it
# runs, the pid of the process that started it, the kind of program it builds). Starting Python and importing torch
# takes seconds (about 4 s on a busy 2-core CPU): a spare does it while this process traces the graph, or between
# builds. A spare for a CPU program also runs Inductor's vector-ISA probe then; one for a GPU program never does
# (host_kind, build_process.child.skips_isa_probe), so a spare serves builds of its own kind only. A GPU program
# cut into parts starts its parts at once: one spare each (prestart's `count`); on the H200 (2026-11-28) the SD1.5
# UNet's second part, which found none, started in 9.6 s.
Spare = Tuple[subprocess.Popen, Path, int, str]
_spares: List[Spare] = []
SPARE_ENV = "KEEPFAST_SPARE_BUILDER"


def host_kind(device: str) -> str:
    """What a build process does for a program on `device` ("cpu", "cuda", "cuda:0"): "cpu" (Inductor's
    vector-ISA probe picks the host code's CPU level) or "gpu" (the host code only launches kernels: no probe)."""
    return "cpu" if str(device).split(":")[0] == "cpu" else "gpu"


def job_kind(folder: Path) -> str:
    """The kind of build process the job in `folder` needs ("cpu" where its job cannot be read): "gpu" where its
    settings leave the host code without a vector ISA (build_process.child.skips_isa_probe, the child's own test),
    whatever the program's device. A CPU spare has probed, and Inductor caches the ISA it found per process: given
    a job that says no ISA it would build one in anyway."""
    from ..build_process.child import skips_isa_probe

    try:
        configs = json.loads((folder / "job.json").read_text()).get("configs") or {}
        return "gpu" if skips_isa_probe(configs) else "cpu"
    except (OSError, ValueError, AttributeError):
        return "cpu"


def prestart(device: str = "cpu", count: int = 1) -> None:
    """Have `count` spare build processes ready for the next builds, programs on `device` (spares of another kind
    are stopped; KEEPFAST_SPARE_BUILDER=0: never)."""
    if os.environ.get(SPARE_ENV, "1") == "0" or CHILD != REAL_CHILD:  # a test's own child script takes no job so
        return
    kind = host_kind(device)
    with _lock:
        ready = sum(1 for spare in _spares if _serves(spare, kind))
        if ready < len(_spares):
            _stop_spares(lambda spare: not _serves(spare, kind))
        for _ in range(max(0, count - ready)):
            try:
                log_file = open(extraction.run_folder() / "spare-builder.txt", "a")
                with log_file:
                    process = subprocess.Popen([sys.executable, str(CHILD), "--spare", str(isa_cache()), kind],
                                               stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT,
                                               **_child_options({}))
            except Exception:  # noqa: BLE001 - no spare: the next build starts its own process, as always
                return
            _spares.append((process, CHILD, os.getpid(), kind))


def _serves(spare: Optional[Spare], kind: str) -> bool:
    """Whether `spare` can take this process's next build of `kind`: this process started it, for the child script
    that runs now and that kind of program, and it is still running."""
    return (spare is not None and spare[2] == os.getpid() and spare[1] == CHILD and spare[3] == kind
            and spare[0].poll() is None)


def _take_spare(folder: Path, kind: str = "cpu") -> Optional[subprocess.Popen]:
    """A spare build process, given `folder` as its build (None: there is none for this process, child and
    `kind` of program; then the spares of another kind are stopped)."""
    with _lock:
        spare = next((candidate for candidate in _spares if _serves(candidate, kind)), None)
        if spare is None:
            _stop_spares(lambda _spare: True)
            return None
        _spares.remove(spare)
    process = spare[0]
    try:
        process.stdin.write(f"{folder}\n".encode())
        process.stdin.close()
    except OSError:
        _kill(process)
        return None
    return process


def _stop_spares(which: Callable[[Spare], bool] = lambda _spare: True) -> None:
    """Stop this process's spares that `which` picks (all by default)."""
    with _lock:
        stopped = [spare for spare in _spares if which(spare)]
        _spares[:] = [spare for spare in _spares if spare not in stopped]
    for spare in stopped:
        if spare[2] == os.getpid():
            _kill(spare[0])


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.wait(timeout=5)
    except Exception:  # noqa: BLE001
        pass


def _kind_of_job(folder: Path) -> str:
    """The device kind of a build's program, from its job's weight layout ("cpu" when it cannot be read)."""
    try:
        weights = json.loads((folder / "job.json").read_text())["weights"]
        return next((str(w[3]).split(":")[0] for w in weights.values() if not str(w[3]).startswith("cpu")), "cpu")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return "cpu"


def _read_usage(folder: Path) -> Dict[str, Any]:
    """The child's peak memory (MB) and `phase_s`, seconds per phase of the build (build_process/child.py)."""
    try:
        data = json.loads((folder / "usage.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    usage: Dict[str, Any] = {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
    phases = data.get("phase_s")
    if isinstance(phases, dict):
        usage["phase_s"] = {k: float(v) for k, v in phases.items() if isinstance(v, (int, float))}
    samples = data.get("main_thread")
    if isinstance(samples, list):  # where the build's main thread was (build_profile.py): [[signature, share]]
        usage["main_thread"] = [list(item) for item in samples if isinstance(item, list) and len(item) == 2]
    slowest = data.get("slowest_kernels")
    if isinstance(slowest, list):  # the longest Triton kernel builds: [[name, seconds, configurations]]
        usage["slowest_kernels"] = [list(item) for item in slowest if isinstance(item, list) and len(item) == 3]
    return usage


PROBE = "probe.json"  # what a package is built for: the child's probe of a CPU program, or _write_job's for a GPU one


def _read_probe(folder: Path) -> Optional[dict]:
    try:
        data = json.loads((folder / PROBE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _lifeline_read_end() -> int:
    """The read end of this process's lifeline pipe (made once; its write end is never written or closed)."""
    global _lifeline
    with _lock:
        if _lifeline is None or _lifeline[2] != os.getpid():
            read, write = os.pipe()
            _lifeline = (read, write, os.getpid())
        return _lifeline[0]


def _pump() -> None:
    """Start waiting builds while fewer than max_running() children run."""
    with _lock:
        while _queue and sum(1 for build in _live if build._running()) < max_running():
            _queue.pop(0)._launch()


TRACED = "traced.json"  # what a trace process says besides the program


ISA_CACHE_ENV = "KEEPFAST_ISA_CACHE"


def isa_cache() -> Path:
    """Where build processes keep Inductor's vector-ISA probe: KEEPFAST_ISA_CACHE, else beside the trust list, per
    torch version. The probe compiles and loads a test program per ISA (about 10 s a build on a busy 2-core CPU,
    repeated by every build in its own fresh Inductor cache); kept here, a machine runs it once."""
    from ..store.trust import default_trust_path

    configured = os.environ.get(ISA_CACHE_ENV)
    base = Path(configured) if configured else default_trust_path().with_name("inductor-isa-probe")
    return base / torch.__version__.replace("+", "_")


def cxx_link_folder() -> Path:
    """Where the pack keeps its wrapper of a C++ compiler that links libstdc++ statically (cxx_linkage.py): beside
    the ISA probe's folder."""
    return isa_cache().parent.with_name("cxx-link")


def interface_object_folder() -> Path:
    """Where the pack keeps its compiler wrapper that compiles AOTInductor's runtime interface once, and those
    objects (interface_object.py): beside the ISA probe's folder."""
    return isa_cache().parent.with_name("cxx-interface")


def kernel_cache() -> Path:
    """Where build processes keep Triton's compiled GPU kernels (TRITON_CACHE_DIR, unless the user set it): beside
    the ISA probe's folder. Each build has a fresh Inductor cache (two builds of one graph at once must not read
    each other's files), and Triton's cache lives inside it by default, so every build compiled every kernel again,
    a kernel that an earlier build of the same model, another block structure or another shape range had compiled
    included. Triton keys a kernel by its source, options and target and writes each entry whole (a temporary
    file, then a rename), so builds share it safely."""
    probe = isa_cache()
    return probe.parent.with_name("triton-kernels") / probe.name


def program_device(ep: "torch.export.ExportedProgram", layout: Optional[Dict[str, list]] = None) -> str:
    """The device type a program computes on: its weights' (`layout`, as `weightless` gives it), else that of
    its placeholders' example values (its weights and inputs); "cpu" when nothing says otherwise."""
    for entry in (layout or {}).values():
        device = torch.device(entry[3])
        if device.type != "cpu":
            return device.type
    for node in ep.graph.nodes:
        device = getattr(node.meta.get("val"), "device", None) if node.op == "placeholder" else None
        if device is not None and device.type != "cpu":
            return device.type
    return "cpu"


KERNEL_WORKERS_PER_PART = 4  # the fewest Triton compile workers a GPU program's part is built with


def kernel_worker_total() -> int:
    """Inductor's Triton compile workers this process's builds may start in all: TORCHINDUCTOR_COMPILE_THREADS
    where it is set (the user's number, or the device check's share per lane), else one per core."""
    configured = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "")
    return int(configured) if configured.isdigit() and int(configured) > 0 else (os.cpu_count() or 1)


def kernel_compile_threads(beside: int) -> Optional[int]:
    """Inductor's Triton compile workers for each of `beside` builds started together (a graph's parts): the
    total (`kernel_worker_total`) shared between them. None for a build on its own (Inductor's own number, from
    that variable or the cores). Each build process starts its own workers, and each imports torch and Triton:
    five parts with one worker per core would start five times the cores at once."""
    if beside <= 1:
        return None
    return max(1, kernel_worker_total() // beside)


def gpu_part_builders() -> int:
    """How many parts of a GPU program may be built side by side.

    A GPU build's longest phase is compiling its Triton kernels, which Inductor spreads over the build process's
    own workers; a part with one worker compiles them one after another in its process. On the H200 (docs/gpu.md,
    "Parts of a GPU program") the SD1.5 UNet was cut into parts by the CPU rule (one per core, 16), each given
    one of the lane's 5 workers: no part had finished its kernels after 327 s, its stacks in `triton.compile`
    inside AOTInductor's autotuning block. So each part keeps at least KERNEL_WORKERS_PER_PART workers, and there
    are no more parts than builds that run at once (each holds its workers while it waits)."""
    return max(1, min(max_running(), kernel_worker_total() // KERNEL_WORKERS_PER_PART))


# A GPU program's host code is built with no vector ISA: Inductor's probe of one (cpu_vec_isa.VecISA.check_build)
# in torch 2.11 starts a Python that imports torch for every ISA and variant it checks -- 10 of them, 16.3 s on this
# 2-core CPU with its test programs already built; a fresh build process on the H200 took 55-62 s before its build
# began -- and the host code only unpacks arguments and launches kernels. The package then names no ISA
# (AOTI_CPU_ISA "INVALID_VEC_ISA": machine_fit.needs_of_package asks nothing of the CPU). Set in the build process
# only: Inductor caches what its probe found for the life of a process, so a caller's own CPU graphs would
# lose their vector code if it were set there.
GPU_HOST_ISA = {"cpp.vec_isa_ok": False}


def gpu_program_settings(ep: "torch.export.ExportedProgram") -> dict:
    """Inductor's settings for a GPU program's kernels, wherever it is built (a build process, or this process
    where the program cannot travel): the convolution layout, and persistent reductions off for the whole program
    where its sizes are dynamic and they cannot be left out per kernel (`gpu_program_heuristics`)."""
    return {**conv_layout.gpu_settings(ep), **gpu_reductions.gpu_settings(ep)}


def gpu_program_heuristics(ep: "torch.export.ExportedProgram") -> dict:
    """What a GPU program's build changes in Inductor's heuristics for its thread (not settings: a job carries
    them beside its configs): no persistent reduction over a dynamic size (gpu_reductions.py)."""
    return {"fixed_size_persistent_reductions": gpu_reductions.per_kernel(ep)}


def _write_job(ep: "torch.export.ExportedProgram", configs: dict, probe: bool, folder: Path,
               beside: int = 1, waited: bool = False) -> None:
    """The build's inputs in its folder: the program without its weights, their layout, the configuration.

    `probe` asks the child for the CPU level (machine_fit.build_probe) -- for a CPU program only. A GPU program's
    host code is built with no -march (machine_fit.gpu_host_build: no level, no probe); what it was built for
    is written here, as probe.json, for the parent to read as it reads a child's probe. `device`: the child starts
    Inductor's kernel compile workers for a GPU program before it reads it (build_process.child.warm_kernel_compilers),
    `compile_threads` of them when `beside` builds start together."""
    light, layout = weightless(ep)
    light, examples = light_examples(light)
    device = program_device(ep, layout)
    job = {"weights": layout, "examples": examples, "configs": configs, "imports": operator_modules(ep), "isa_cache": str(isa_cache()),
           "cxx_link": str(cxx_link_folder()), "interface_objects": str(interface_object_folder()),
           "device": device, "compile_threads": kernel_compile_threads(beside),
           "nice": 0 if waited else child_priority.niceness(),  # a build the caller waits for keeps its priority
           "memo": _memo_folder()}
    built_for = None
    if device != "cpu":
        march, settings = machine_fit.gpu_host_build()
        job["configs"] = {**configs, **settings, **gpu_program_settings(ep), **GPU_HOST_ISA}
        job["heuristics"] = gpu_program_heuristics(ep)
        built_for = {"march": march, "vec_isa": None, "vec_flags": None}
    elif probe:
        job["probe"] = str(MACHINE_FIT)
    try:
        torch.export.save(light, str(folder / "program.pt2"))
        if built_for is not None:
            (folder / PROBE).write_text(json.dumps(built_for))
        (folder / "job.json").write_text(json.dumps(job))
    except Exception as error:  # noqa: BLE001 - a build that cannot start is a failed compile
        raise CompileFailed(f"the package build could not start: {type(error).__name__}: {error}") from error


def _memo_folder() -> str:
    """Where packages built before are kept (build_memo.py; "" where KEEPFAST_BUILD_MEMO is unset). "" too while a
    build's memory is bounded or its stacks are written: those settings are about a compile, which a hit skips."""
    from ..build_process.child import MEMORY_ENV, STACKS_ENV

    if os.environ.get(MEMORY_ENV) or os.environ.get(STACKS_ENV):
        return ""
    return build_memo.folder_for_job()


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
        _write_job(ep, configs, probe, folder, beside, waited=now or waited)
    except Exception:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    build = _new_build(folder, label, queued=not now)
    if now:
        build._launch()
    _pump()
    _notify()
    return build


Trace = Callable[[], Tuple["torch.export.ExportedProgram", dict]]


def trace_job(trace: Trace, configs: dict, probe: bool, folder: Path, beside: int = 1) -> None:
    """What a trace process does (forked or spawned alike): trace, then write the build's job and TRACED."""
    ep, traced = trace()
    _write_job(ep, configs, probe, folder, beside)
    (folder / TRACED).write_text(json.dumps(traced))


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
        work = functools.partial(trace_job, trace, configs, probe, folder, beside)
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
        prestart(str(call_device(tensors)))  # its build process starts Python and torch while this process traces
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
    _stop_spares()
