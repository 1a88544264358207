"""torch.export in a spawned (fresh) process, for the caller a fork cannot serve: one that uses CUDA.

A fork cannot trace where this process has used CUDA or the call's tensors are on a GPU (forked_trace.py: a forked
child cannot use CUDA), so the trace ran in the caller there, and on a GPU the first image waited for torch.export
(over 30 s for the SD1.5 UNet on an H200). A fresh process can use CUDA, but it has nothing of the
caller's: the trace travels to it, pickled, without its weights.

How the trace travels: `trace` is a picklable callable (a functools.partial of a module-level function holding the
module, its forward and the call: aot.py, blocks/export.py). It is pickled with every parameter and persistent
buffer of each module in it, and the call's tensors, replaced by a descriptor (shape, stride, dtype, device,
requires_grad, parameter or not). The child rebuilds each as a fake tensor of one FakeTensorMode
(`torch.empty_strided` under the mode allocates no weight; on a CUDA device the first fake tensor initialises CUDA,
a context and one element, torch/_subclasses/fake_tensor.py `init_gpu_context`) and runs the same `trace_job` a
fork runs: torch.export traces a module whose weights and inputs are fake tensors of one mode (it takes that
mode as the ambient one: torch/export/_trace.py `has_ambient_mode`), and writes the same files a fork writes. A
fork's export turns every weight into a fake tensor as well, so their values were never read by a trace.

What travels by value: tensors that are none of those, i.e. non-persistent buffers and plain tensor attributes.
torch.export keeps them in the program's constants, with their values (a package is built with them), as a fork's
trace writes them; at most BY_VALUE_LIMIT bytes in all.

What cannot travel: a module or forward that does not pickle (a lambda hook, a closure, a class made inside a
function), a class of `__main__`, a tensor-subclass weight (a quantised one: its parts are not a plain
descriptor), more than BY_VALUE_LIMIT bytes of other tensors. The trace then runs in the caller, with the reason
(`CannotSend`). A module of a package loaded from a path under a name the import path does not give (ComfyUI loads
each custom node pack so) travels with that package's path, and the child loads it under the same name.

The child (`spawned_trace_child.py`, stdlib only, then this module's `child_main`) runs at a lower priority with
one intra-op thread, in a session of its own, with this process's import path; it ends with this process (the
fork's parent-death signal: forked_trace.run_child) and is killed past KEEPFAST_TRACE_TIMEOUT_S. Its output goes to
the build folder (the last line is in the failure's message). Starting Python and importing torch costs it seconds,
which the caller does not wait for.

Which process traces (`chosen`): a fork where one can (unchanged), a spawned process where the fork is refused only
for CUDA, else the caller. KEEPFAST_TRACE_PROCESS=spawn takes a spawned process even where a fork could (how the
tests reach this path on a CPU); KEEPFAST_TRACE_PROCESS=0 traces in the caller.
"""

from __future__ import annotations

import importlib.machinery
import io
import json
import logging
import os
import pickle
import sys
import types
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, NoReturn, Optional, Set, Tuple

import torch

from . import forked_trace
from ..settings import TRACE_SPAWN, trace_process
from ..backends.base import BuildInProcess

log = logging.getLogger(__name__)

SPAWN = TRACE_SPAWN  # KEEPFAST_TRACE_PROCESS=spawn: a spawned process even where a fork could trace
FORKED, SPAWNED, CALLER = "forked", "spawned", "caller"  # which process traces (PackageBuild.trace_process)
BOOTSTRAP = Path(__file__).with_name("spawned_trace_child.py")
JOB = "trace-job.json"  # what the bootstrap reads: import path, packages by path, this module's name, the parent
PAYLOAD = "trace-job.pkl"  # the work, pickled without its weights
PREPARE = "trace-prepare.pkl"  # what the child runs before it rebuilds the work (`prepare_children`)
OUTPUT = "trace-output.txt"  # the child's stdout and stderr
ERROR = "trace-error.json"  # its error, as a fork writes it (forked_trace.run_child)
BY_VALUE_LIMIT = 256 * 2 ** 20  # bytes of tensors that travel with their values (non-persistent buffers and such)
_disabled: Optional[str] = None  # why spawned traces are off in this process (set once one misbehaved)
_preparations: List[Callable[[], Callable[[], None]]] = []


def prepare_children(make: Callable[[], Callable[[], None]]) -> None:
    """Have every spawned trace process run `make()`'s result (a picklable callable, made here at each start)
    before it rebuilds the work: state of this process that the work's imports read and a fresh process does not
    have (ComfyUI's command-line settings, which comfy.model_management reads when it is imported: nodes/)."""
    if make not in _preparations:
        _preparations.append(make)


class CannotSend(Exception):
    """The trace cannot travel to a spawned process; the message says why (the caller traces instead)."""


def chosen(tensors: Iterable[torch.Tensor]) -> Tuple[str, Optional[str]]:
    """(which process traces a call with `tensors`: FORKED, SPAWNED or CALLER; why not a fork, None for a fork)."""
    tensors = list(tensors)
    if trace_process() == SPAWN:
        refused = _refusal()
        return (CALLER, refused) if refused else (SPAWNED, f"{forked_trace.ENV}={SPAWN}")
    general = forked_trace.general_refusal()
    if general is not None:
        return CALLER, general
    cuda = forked_trace.cuda_refusal(tensors)
    if cuda is None:
        return FORKED, None
    if any(tensor.device.type not in ("cpu", "cuda") for tensor in tensors):
        return CALLER, cuda  # another accelerator: not tried in a spawned process
    refused = _refusal()
    return (CALLER, f"{cuda}; {refused}") if refused else (SPAWNED, cuda)


def _refusal() -> Optional[str]:
    if not sys.platform.startswith("linux") or not hasattr(os, "posix_spawn"):
        return "this platform has no spawn with a parent-death signal"
    return _disabled


def disable(reason: str) -> None:
    """Trace in the caller from now on where a spawned process would have (a spawned trace misbehaved)."""
    global _disabled
    if _disabled is None:
        log.warning("graphs a fork cannot trace are traced in this process from now on (the first call of each "
                    "waits for it): %s", reason)
    _disabled = reason


class SpawnedTrace(forked_trace.TraceProcess):
    """One spawned child running `work()`, which travelled to it pickled without its weights."""

    how = SPAWNED

    def __init__(self, work: Callable[[], None], tensors: Iterable[torch.Tensor], folder: Path):
        """Write the job into `folder` and start the child now; CannotSend when `work` cannot travel (nothing is
        started then). The caller reaps it with `wait()` (on a thread of its own)."""
        payload, modules = _pickled(work, tensors)
        try:
            made = [make() for make in _preparations]
        except Exception as error:  # noqa: BLE001 - a preparation that cannot be made: trace in the caller
            raise CannotSend(f"the trace process cannot be prepared: {type(error).__name__}: {error}") from None
        preparations, prepared = _pickled(made, [])
        packages = _packages_by_path(modules | prepared | {__name__})
        (folder / PREPARE).write_bytes(preparations)
        (folder / PAYLOAD).write_bytes(payload)
        job = {"sys_path": [path for path in sys.path if path], "packages": packages, "entry": __name__,
               "parent": os.getpid()}
        (folder / JOB).write_text(json.dumps(job))
        self.output = folder / OUTPUT
        super().__init__(_spawn(folder, self.output), folder / ERROR)

    def disable(self, reason: str) -> None:
        disable(reason)

    def output_tail(self) -> str:
        try:
            lines = self.output.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


def _spawn(folder: Path, output: Path) -> int:
    """The child's pid: the bootstrap run by this Python, in a session of its own (a terminal's Ctrl-C reaches
    the caller, which stops it), stdin from /dev/null, stdout and stderr into `output`."""
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 1, str(output), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
               (os.POSIX_SPAWN_DUP2, 1, 2)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return os.posix_spawn(sys.executable, [sys.executable, str(BOOTSTRAP), str(folder)], env,
                          file_actions=actions, setsid=True)


# -- the work, pickled without its weights --------------------------------------------------------------------

class _WeightlessPickler(pickle.Pickler):
    """Pickles with weights and inputs as descriptors, counts the bytes of other tensors, notes the modules of
    the classes and functions it names (the child must import them)."""

    def __init__(self, file: io.BytesIO, inputs: Iterable[torch.Tensor]):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.described: Dict[int, int] = {}  # id(tensor) -> its key in the payload
        self.kept: List[Any] = []  # what `described` names, alive while pickling (ids stay unique)
        self.by_value = 0
        self.modules: Set[str] = set()
        for tensor in inputs:
            self._describe(tensor)

    def _describe(self, tensor: torch.Tensor) -> None:
        if id(tensor) not in self.described:
            self.described[id(tensor)] = len(self.described)
            self.kept.append(tensor)

    def _weights_of(self, module: torch.nn.Module) -> None:
        """Its parameters and persistent buffers travel as descriptors (the weights `weightless` leaves out)."""
        for _, parameter in module.named_parameters(remove_duplicate=False):
            self._describe(parameter)
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and name not in sub._non_persistent_buffers_set:
                    self._describe(buffer)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module) and getattr(obj.__dict__.get("forward"), "is_keepfast_dispatcher", False):
            # The pack's dispatcher installed as the module's forward (it holds the registry, its locks, the whole
            # model) stays here: a trace calls the class's forward (aot.py, blocks/export.py), as inductor.py's
            # skeleton does.
            reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            state = {name: value for name, value in reduced[2].items() if name != "forward"}
            return (reduced[0], reduced[1], state) + tuple(reduced[3:])
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            module = getattr(obj, "__module__", None)
            if module == "__main__":
                raise CannotSend(f"{getattr(obj, '__qualname__', obj)} is defined in __main__, which a trace "
                                 "process cannot import")
            if isinstance(module, str):
                self.modules.add(module)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.nn.Module):
            self._weights_of(obj)  # before its tensors: a module is pickled before its contents
            return None
        if not isinstance(obj, torch.Tensor):
            return None
        key = self.described.get(id(obj))
        if key is None:
            self.by_value += obj.nbytes
            if self.by_value > BY_VALUE_LIMIT:
                raise CannotSend(f"the module holds more than {BY_VALUE_LIMIT // 2 ** 20} MB of tensors that are "
                                 "not its weights (they would travel with their values)")
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise CannotSend(f"it has a {type(obj).__name__} weight (a tensor subclass), which a trace process "
                             "cannot rebuild from its layout")
        return ("weight", key, list(obj.shape), list(obj.stride()), str(obj.dtype).removeprefix("torch."),
                str(obj.device), bool(obj.requires_grad), isinstance(obj, torch.nn.Parameter))


def weightless_pickle(work: Callable[[], None], inputs: Iterable[torch.Tensor]
                      ) -> Tuple[bytes, Dict[str, List[Any]]]:
    """(`work` pickled with weights and `inputs` as descriptors, the packages the child must load by path:
    name -> [its __init__ file, its folders]); CannotSend says why it cannot travel."""
    payload, modules = _pickled(work, inputs)
    return payload, _packages_by_path(modules | {__name__})


def _pickled(work: Any, inputs: Iterable[torch.Tensor]) -> Tuple[bytes, Set[str]]:
    """(`work` pickled without its weights, the modules of the classes and functions it names)."""
    buffer = io.BytesIO()
    pickler = _WeightlessPickler(buffer, inputs)
    try:
        pickler.dump(work)
    except CannotSend as why:
        raise CannotSend(f"the module cannot be sent to a trace process: {why}") from None
    except Exception as error:  # noqa: BLE001 - pickle's errors are many (PicklingError, TypeError, AttributeError)
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise CannotSend(f"the module cannot be sent to a trace process: {type(error).__name__}: {first}") from None
    return buffer.getvalue(), pickler.modules


def _packages_by_path(modules: Set[str]) -> Dict[str, List[Any]]:
    """The top-level packages of `modules` that the import path does not give under their name (ComfyUI names a
    custom node pack by its folder's path): name -> [origin, submodule folders or None]."""
    out: Dict[str, List[Any]] = {}
    for top in sorted({name.split(".")[0] for name in modules}):
        module = sys.modules.get(top)
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if not origin or not os.path.isfile(origin):
            continue  # built in, frozen or namespace: found by name
        try:
            found = importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if p])
        except (ImportError, ValueError):
            found = None
        if found is None or found.origin != origin:
            locations = spec.submodule_search_locations
            out[top] = [origin, list(locations) if locations is not None else None]
    return out


# -- the child ---------------------------------------------------------------------------------------------

class _Rebuilder(pickle.Unpickler):
    """Unpickles the work with each descriptor made a fake tensor of `mode` (tied weights stay one tensor)."""

    def __init__(self, file: io.BufferedReader, mode: Any):
        super().__init__(file)
        self.mode = mode
        self.made: Dict[int, torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> torch.Tensor:
        _, key, shape, stride, dtype, device, requires_grad, parameter = pid
        made = self.made.get(key)
        if made is None:
            with self.mode:
                made = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
                if parameter:
                    made = torch.nn.Parameter(made, requires_grad=requires_grad)
            self.made[key] = made
        return made


def fake_mode() -> Any:
    """The mode the child's weights and inputs are made in: one shape environment export can track."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True)


def rebuilt(payload: Path) -> Callable[[], None]:
    """The work of `payload`, its weights and inputs fake tensors; BuildInProcess when it does not unpickle."""
    try:
        with open(payload, "rb") as file:
            return _Rebuilder(file, fake_mode()).load()
    except Exception as error:  # noqa: BLE001 - a class the child cannot import, a torch that reads it otherwise
        first = (str(error).strip().splitlines() or [""])[0][:300]
        raise BuildInProcess(f"the trace process could not rebuild the module: {type(error).__name__}: "
                             f"{first}") from None


def child_main(folder: Path, parent: int) -> NoReturn:
    """The spawned process's work (from spawned_trace_child.py): prepare, rebuild the work and run it as a fork
    does."""
    def work() -> None:
        try:
            for preparation in pickle.loads((folder / PREPARE).read_bytes()):  # no tensors: a plain load
                preparation()
        except Exception as error:  # noqa: BLE001
            raise BuildInProcess(f"the trace process could not be prepared: {type(error).__name__}: {error}") \
                from None
        rebuilt(folder / PAYLOAD)()

    forked_trace.run_child(work, folder / ERROR, parent, niced=True)


__all__ = ["SpawnedTrace", "CannotSend", "chosen", "disable", "prepare_children", "weightless_pickle", "rebuilt",
           "child_main", "SPAWN", "FORKED", "SPAWNED", "CALLER"]
