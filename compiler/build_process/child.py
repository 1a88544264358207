"""Run in a child process by `package_builds.py`: one AOTInductor package from a weight-free exported program.

    python compiler/build_process/run.py JOB_FOLDER

The folder holds `program.pt2` (torch.export.save of a program whose weights
are empty placeholders) and `job.json` (each weight's shape, stride, dtype and
device, the Inductor settings, and the modules that define the program's
custom operators, imported first). The weights are made again here, with no
values: a package built with its weights left out needs only their layout.
Writes `graph.pt2`, or `error.txt` (first line: what failed) and exits 1. Together with the compiler
processes it starts it holds at most KEEPFAST_BUILD_MEMORY_MB resident (default: half the machine's memory):
past that, the build stops with that reason.

It imports torch, those operator modules and this folder's modules (the pack's package name in ComfyUI
is not one a child process can import: run.py enters the compiler package under a name of its own). It lowers its own priority so the
sampler in the parent keeps the cores it needs, unless the parent waits for it (the job's "nice": 0). When the parent is gone (its lifeline pipe reads
end-of-file), it stops and removes what the build and the parent left.

In modules of their own: the lifeline's watch (lifeline.py), the memory bound (memory_bound.py), the CPU level and
vector-ISA probes (isa_probe.py), the stack reports (stack_reports.py) and the spare's wait (spare.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import List, Optional

from . import (build_memo, build_profile, child_priority, cxx_linkage, gpu_reductions, interface_object,
               precompiled_headers, program_hints, spare, stack_traces)
from .isa_probe import _no_isa_probe, _probe, _probe_isa, skips_isa_probe
from .lifeline import _stop_when_the_parent_is_gone
from .memory_bound import _bound_memory
from .stack_reports import _report_stacks
from ..settings import loader_check

BEGUN = time.perf_counter()


def _kind(spec: dict) -> str:
    """The device kind the program computes on: that of its first weight not on the CPU ("cpu" else)."""
    for _shape, _stride, _dtype, device, _parameter in spec.values():
        kind = str(device).split(":")[0]
        if kind != "cpu":
            return kind
    return "cpu"


def _load_first(folder: str, package: str, kind: str) -> dict:
    """Load the package just built, here, where its kind is loaded elsewhere before the caller loads it
    (loader_check.py: a GPU package; every package with KEEPFAST_LOADER_CHECK=all). torch's loader has killed
    the process loading a CUDA package (SIGSEGV, H100 with torch 2.11+cu130): let it kill this one, not the
    caller. The file "loading" (loader_check.LOADING_MARK), holding the kind, says the load was under way: the
    caller reads it beside the signal.
    Returns {"load_check_s": seconds} when it loaded, {} when not asked."""
    setting = loader_check()
    if setting == "0" or (kind == "cpu" and setting != "all"):
        return {}
    began = time.perf_counter()
    mark = os.path.join(folder, "loading")
    with open(mark, "w") as handle:
        handle.write(kind)
    from ..backends import package_loader

    package_loader.load_all(package)
    os.remove(mark)
    return {"load_check_s": round(time.perf_counter() - began, 2)}


def _made(layout: list):
    """A tensor with no values made from its layout (job_folder._layout): shape, stride, dtype, device, whether
    a Parameter."""
    import torch

    shape, stride, dtype, device, parameter = layout
    tensor = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
    return torch.nn.Parameter(tensor, requires_grad=False) if parameter else tensor


def _weights(spec: dict):
    return {name: _made(layout) for name, layout in spec.items()}


def _examples(examples, layouts: list):
    """The program's example inputs made again from their layouts (the parent sent placeholders, as for weights)."""
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(examples)
    return pytree.tree_unflatten([leaf if layout is None else _made(layout) for leaf, layout in zip(leaves, layouts)],
                                 spec)


# Inductor's own phase timers (torch._dynamo.utils.compilation_time_metrics) reported per build, under the names a
# reader knows: where a cold compile's time goes (docs/benchmarks.md). Each is part of "inductor" but the first.
PHASES = {
    "aot_trace": "create_aot_dispatcher_function",  # AOTInductor's own trace of the exported program
    "lowering": "GraphLowering.run",
    "scheduling": "Scheduler.__init__",  # inside codegen (GraphLowering.codegen makes the scheduler)
    # For a GPU program AOTInductor also waits for Triton's kernel builds and tunes them in codegen (the autotune
    # block it runs before writing the C++ wrapper); torch.compile waits for them later (async_compile.wait).
    "codegen": "GraphLowering.codegen",
    # Within code generation: writing the kernels; on a GPU, waiting for Triton's kernel builds (the autotune
    # block's async_compile.wait) and benchmarking each kernel's configurations at build time (the SD1.5 UNet's
    # code generation took 93.8 s on the H200 against torch.compile's 27.2 s, 2026-11-28: which of these it was).
    "kernel_codegen": "Scheduler.codegen",
    "kernel_wait": "async_compile.wait",
    "autotune": "CachingAutotuner.benchmark_all_configs",
    "cpp_build": "AotCodeCompiler.compile",  # the C++ wrapper and kernels, compiled and linked
    # Within the C++ build (torch 2.13 and later time it): making or waiting for the precompiled headers, which a
    # thread makes from the build's start (precompiled_headers.py; its own seconds: precompiled_header_s)
    "cpp_header": "aoti_precompile_header",
}


def _phases(started: float, loaded: float, compiled: float) -> dict:
    """Seconds per phase of this build: startup (interpreter, torch, the ISA probe), reading the program, the
    whole Inductor compile and packaging, and Inductor's own phases within it."""
    out = {"startup_s": round(started, 2), "read_program_s": round(loaded - started, 2),
           "inductor_s": round(compiled - loaded, 2)}
    try:
        from torch._dynamo.utils import compilation_time_metrics
        from torch._inductor import metrics

        for name, key in PHASES.items():
            times = compilation_time_metrics.get(key)
            if times:
                out[name + "_s"] = round(sum(times), 2)
        out["kernels"] = float(metrics.generated_kernel_count)  # kernels Inductor generated (a count, like parts)
    except Exception:  # noqa: BLE001 - phases are a report, never a reason to fail a build
        pass
    return out


def _write_usage(folder: str, phases: dict, samples: Optional[list] = None, slowest: Optional[list] = None) -> None:
    """Peak memory of this process and of the largest compiler process it ran (MB), and where the time went
    (`samples`: where the main thread was during the compile, build_profile.py), for the parent's log and the
    bench."""
    try:
        import resource

        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        compilers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        with open(os.path.join(folder, "usage.json"), "w") as handle:
            json.dump({"peak_rss_mb": round(own, 1), "compiler_peak_rss_mb": round(compilers, 1),
                       "phase_s": phases, "main_thread": samples or [], "slowest_kernels": slowest or []}, handle)
    except (ImportError, OSError):
        pass


def warm_kernel_compilers(threads: Optional[int]) -> bool:
    """Start Inductor's Triton compile workers now, for a GPU program (True if they were asked to start).

    torch.compile starts them as it begins (its inductor backend calls `maybe_warm_pool`); AOTInductor does not.
    Its first kernel then asks for the pool (torch 2.11-2.13's `AsyncCompile.use_process_pool`), and every kernel
    until the pool is ready (a process of its own that imports torch, then its workers, each importing torch and
    Triton) compiles one after another in this process. On the H200 code generation took 8.7 s for a 50-line
    module and 8.3 s for a Flux block (docs/gpu.md); how much of that was this wait is for the next GPU run to
    show. Started here, the workers start while this process reads the program and lowers it. `threads`: how many
    (slots.kernel_compile_threads; None: Inductor's own choice or TORCHINDUCTOR_COMPILE_THREADS)."""
    try:
        import torch._inductor.config as inductor_config
        from torch._inductor.async_compile import maybe_warm_pool

        if threads:
            inductor_config.compile_threads = int(threads)
        maybe_warm_pool()  # nothing where Triton is not installed (a CPU-only torch)
        return True
    except Exception:  # noqa: BLE001 - the kernels then compile as Inductor would have compiled them anyway
        return False


def main(folder: str) -> int:
    _stop_when_the_parent_is_gone(folder)
    _bound_memory(folder)
    _report_stacks(folder, BEGUN)
    try:
        import torch

        with open(os.path.join(folder, "job.json")) as handle:
            job = json.load(handle)
        # below the caller's priority unless the caller waits for this build (job "nice" 0: child_priority.py);
        # before the kernel compilers start, which take this process's priority
        child_priority.lower(job.get("nice"))
        configs = dict(job["configs"])
        no_isa = skips_isa_probe(configs)
        if no_isa:
            _no_isa_probe()  # first: nothing below may probe one
        import importlib

        for module in job.get("imports", []):  # the modules that register the graph's custom operators
            try:
                importlib.import_module(module)
            except Exception as error:  # noqa: BLE001
                raise RuntimeError(f"the graph's custom operators come from {module}, which the build process "
                                   f"cannot import ({type(error).__name__}: {error})") from error
        if job.get("device", "cpu") != "cpu":
            warm_kernel_compilers(job.get("compile_threads"))
        if job.get("cxx_link"):  # libstdc++ linked as a shared library, or no package (cxx_linkage.py)
            cxx_linkage.apply(job["cxx_link"])
        if job.get("interface_objects"):  # torch's runtime interface compiled once, not in every wrapper
            interface_object.apply(job["interface_objects"])
            os.environ[interface_object.LOG_ENV] = os.path.join(folder, INTERFACE_LOG)
        # Inductor picks the vector ISA for the host code of every package, a CUDA one too (AotCodeCompiler calls
        # pick_vec_isa). For a CPU program the probe runs here: from the folder kept per machine, where its test
        # programs are built once. A GPU program's job says no ISA (job_folder.GPU_HOST_ISA), so none is
        # probed; nor is the CPU level (`probe`): a CUDA program's host code is built with no -march, and the
        # parent wrote what it is built for (job_folder._write_job).
        if not no_isa:
            _probe_isa(job.get("isa_cache", ""))
        if job.get("probe"):
            configs.update(_probe(folder, job["probe"]))
        started = time.perf_counter() - BEGUN
        target = os.path.join(folder, "graph.partial.pt2")
        # A package built before from this very program (build_memo.py: off unless the parent's job names a folder)
        memo, memo_folder, memo_key, recorded = build_memo, job.get("memo") or "", "", None
        if memo_folder:
            memo_key = memo.key(os.path.join(folder, "program.pt2"), job, configs, torch.__version__)
            recorded = memo.fetch(memo_folder, memo_key, target)
        if recorded is not None:
            phases, samples, slowest = {**recorded, "startup_s": round(started, 2), "memo_hit": 1.0}, [], []
        else:
            phases, samples, slowest = _compile(folder, job, configs, target, started)
        _write_usage(folder, phases, samples, slowest)  # first: a load that kills this process leaves where the time went
        checked = _load_first(folder, target, _kind(job["weights"]))
        if checked:
            _write_usage(folder, {**phases, **checked}, samples, slowest)
        if memo_key and recorded is None:
            memo.keep(memo_folder, memo_key, target, phases)
        os.replace(target, os.path.join(folder, "graph.pt2"))  # whole, or not there
        return 0
    except BaseException as error:  # noqa: BLE001 - the parent reads the reason from error.txt
        with open(os.path.join(folder, "error.txt"), "w") as handle:
            handle.write(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}\n")
            handle.write(traceback.format_exc())
        return 1


def _compile(folder: str, job: dict, configs: dict, target: str, started: float):
    """Compile the job's program into `target`; (its phases, where the main thread was, the slowest kernels)."""
    import torch

    # The build's settings in force from here to its end: the precompiled headers are made on a thread under
    # them while the program is read, traced and lowered (precompiled_headers.py)
    with torch._inductor.config.patch(configs):
        headers = precompiled_headers.start(job.get("device", "cpu"))
        program = torch.export.load(os.path.join(folder, "program.pt2"))
        hinted = program_hints.restore_hints(program)  # the example sizes torch's loader drops
        program._state_dict.update(_weights(job["weights"]))
        if job.get("examples"):  # a block graph's weights are its examples too (weight_inputs.py)
            program._example_inputs = _examples(program.example_inputs, job["examples"])
        loaded = time.perf_counter() - BEGUN
        # AOTInductor traces the program again (aot_export_module) before it lowers it: without recording each
        # node's Python stack where torch can skip it (stack_traces.py: 21.4 s against 27.4-29.5 s for the
        # real-depth SD1.5 UNet on a 2-core CPU, torch 2.13)
        heuristics = job.get("heuristics") or {}
        with build_profile.CompileProfile() as profile, \
                stack_traces.without_stack_traces(), \
                gpu_reductions.fixed_size_persistent_reductions(
                    bool(heuristics.get("fixed_size_persistent_reductions"))):
            precompiled_headers.compile_with_sound_headers(
                lambda: torch._inductor.aoti_compile_and_package(program, package_path=target,
                                                                 inductor_configs=configs))
    if headers.wait(10).error:  # done: the build waited for the same headers
        print(f"the precompiled headers were left to AOTInductor: {headers.error}", file=sys.stderr)
    phases = {**_phases(started, loaded, time.perf_counter() - BEGUN), **profile.phases(), **headers.report(),
              "hints_restored": float(len(hinted)), **_interface_objects(folder)}
    return phases, profile.sampler.top(), profile.kernel_builds.slowest()


INTERFACE_LOG = "interface.log"  # in the build's folder: a line per wrapper compiled (interface_object.LOG_ENV)


def _interface_objects(folder: str) -> dict:
    """How this build's wrappers were compiled (interface_object.py): {"interface_made" | "interface_reused" |
    "interface_whole": count}, the nonzero ones; why a wrapper was compiled whole goes to stderr."""
    log = os.path.join(folder, INTERFACE_LOG)
    if not os.path.isfile(log):
        return {}
    counts = interface_object.read_log(log)
    reason = counts.pop("interface_whole_reason", "")
    if reason:
        print(f"a wrapper was compiled with torch's runtime interface in it: {reason}", file=sys.stderr)
    return {name: float(count) for name, count in counts.items() if count}


def run(argv: List[str]) -> int:
    """`run.py JOB_FOLDER` builds that job; `run.py --spare ISA_CACHE [KIND]` waits for one as a spare."""
    if argv[0] == "--spare":
        folder = spare.wait_for_build(argv[1], argv[2] if len(argv) > 2 else "cpu")
        if not folder:
            return 0
        global BEGUN
        BEGUN = time.perf_counter()  # its phases count from its build, not from its start
        return main(folder)
    return main(argv[0])
