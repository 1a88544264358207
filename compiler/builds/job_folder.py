"""A package build's job folder as this process writes and reads it: the program without its weights (`weightless`),
each weight's layout, Inductor's settings and what the build process is asked to do (job.json, `_write_job`); and
what the build process leaves there (usage.json, probe.json) or a trace process (traced.json).
"""

from __future__ import annotations

import copy
import json
import signal
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..backends import loader_check
from ..backends.base import BuildInProcess, CompileFailed
from ..build_process import build_memo, child_priority, conv_layout, gpu_reductions
from ..machine import machine_fit
from ..tracing import weight_inputs
from .kept_folders import cxx_link_folder, interface_object_folder, isa_cache
from .slots import kernel_compile_threads

MACHINE_FIT = Path(__file__).resolve().parent.parent / "machine" / "machine_fit.py"  # stdlib at the top: loaded by path too
TRACED = "traced.json"  # what a trace process says besides the program


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
    from ..settings import BUILD_MEMORY_MB, BUILD_STACKS, get

    if get(BUILD_MEMORY_MB) or get(BUILD_STACKS):
        return ""
    return build_memo.folder_for_job()


Trace = Callable[[], Tuple["torch.export.ExportedProgram", dict]]


def trace_job(trace: Trace, configs: dict, probe: bool, folder: Path, beside: int = 1) -> None:
    """What a trace process does (forked or spawned alike): trace, then write the build's job and TRACED."""
    ep, traced = trace()
    _write_job(ep, configs, probe, folder, beside)
    (folder / TRACED).write_text(json.dumps(traced))


def _kind_of_job(folder: Path) -> str:
    """The device kind of a build's program, from its job's weight layout ("cpu" when it cannot be read)."""
    try:
        weights = json.loads((folder / "job.json").read_text())["weights"]
        return next((str(w[3]).split(":")[0] for w in weights.values() if not str(w[3]).startswith("cpu")), "cpu")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return "cpu"


def _loaded_kind(folder: Path) -> str:
    """The device kind the child loaded its package for (what it wrote in the mark; "cpu" if nothing)."""
    try:
        return (folder / loader_check.LOADING_MARK).read_text().strip() or "cpu"
    except OSError:
        return _kind_of_job(folder)


def _failure(folder: Path, code: Optional[int]) -> Tuple[str, str]:
    """Why a build process failed: (the reason, the last lines of the stack it wrote; "" where none). The reason is
    the first line of its error.txt, else its exit status `code` (a signal where negative) with the last line of its
    output."""
    error = folder / "error.txt"
    if error.is_file():
        text = error.read_text(errors="replace")
        if text.strip():  # the reason is its first line
            return text.splitlines()[0], "\n".join(text.strip().splitlines()[-40:])
        return "no message", ""
    output = folder / "output.txt"
    tail = output.read_text(errors="replace").strip().splitlines()[-1:] if output.is_file() else []
    if code is not None and code < 0:  # a compiler crash (SIGSEGV), the OOM killer or a stack overflow
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        what = f"the build process died ({name})"
    else:
        what = f"exit status {code}"
    return what + (f" ({tail[0]})" if tail else ""), ""


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
