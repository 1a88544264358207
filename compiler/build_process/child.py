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
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import List, Optional

from . import (build_memo, build_profile, child_priority, cxx_linkage, gpu_reductions, interface_object,
               precompiled_headers, program_hints, stack_traces)

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
    setting = os.environ.get("KEEPFAST_LOADER_CHECK", "")
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
    """A tensor with no values made from its layout (package_builds._layout): shape, stride, dtype, device, whether
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


_job = {"folder": None, "watched": False}  # this process's build folder once it has one; the lifeline watched


def _stop_when_the_parent_is_gone(folder: Optional[str]) -> None:
    """Watch the parent's lifeline (a pipe whose write end only the parent holds): end-of-file means the parent
    is gone, however it ended (SIGTERM and SIGKILL run no exit handler there). Then stop this build and the
    compilers it started (this process's group), remove its folder, and sweep what the parent left (its run
    folder, with the sweep every process runs at start: compiler/store/extraction.py, loaded by path, stdlib only).
    A spare (`spare`) watches from its start, before it has a folder."""
    _job["folder"] = folder or _job["folder"]
    fd = os.environ.get("KEEPFAST_PARENT_LIFELINE_FD", "")
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
    sweeper = os.environ.get("KEEPFAST_SWEEPER")
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


MEMORY_ENV = "KEEPFAST_BUILD_MEMORY_MB"


def _memory_limit_mb() -> float:
    """The most a build may hold resident with its compilers: KEEPFAST_BUILD_MEMORY_MB (0: no limit), else half
    of this machine's memory (the model being served keeps the rest)."""
    value = os.environ.get(MEMORY_ENV, "")
    try:
        if value:
            return float(value)
    except ValueError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 / 2**20
    except (ValueError, OSError, AttributeError):
        return 0.0


def _group_rss_mb(profile) -> float:
    """Resident memory of this process and the compiler processes it started (its process group), MB
    (`profile`: build_profile.py, loaded once)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return sum(int(fields[21]) * page for fields in profile.group_process_stats(os.getpgrp())) / 2**20


def _bound_memory(folder: str) -> None:
    """Stop the build (and its compilers) once they hold more than the limit together, saying so in error.txt."""
    limit = _memory_limit_mb()
    if limit <= 0 or not os.path.isdir("/proc"):
        return
    import signal
    import threading
    import time

    profile = build_profile

    def watch() -> None:
        while True:
            used = _group_rss_mb(profile)
            if used > limit:
                with open(os.path.join(folder, "error.txt"), "w") as handle:
                    handle.write(f"MemoryError: the build held {used:.0f} MB with its compilers, more than its limit "
                                 f"of {limit:.0f} MB ({MEMORY_ENV}); stopped\n")
                os.killpg(os.getpgrp(), signal.SIGKILL)  # this process too: the parent reads error.txt
            time.sleep(0.25)

    threading.Thread(target=watch, name="keepfast-build-memory", daemon=True).start()


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


def _probe(folder: str, machine_fit: str) -> dict:
    """The CPU level to build for, picked here (the pack's machine_fit.py, loaded by path), written to
    probe.json for the parent; the Inductor settings it adds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("keepfast_machine_fit", machine_fit)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = module.build_probe()
    with open(os.path.join(folder, "probe.json"), "w") as handle:
        json.dump(probe, handle)
    return {"cpp.march": probe["march"]} if probe.get("march") else {}


def _probe_isa(kept: str) -> None:
    """Inductor's vector-ISA probe, its test programs built in `kept` (a folder kept per machine and torch): after
    the first build they are found there, not built again. Its result stays in this process (Inductor caches it),
    so the build itself then runs in its own fresh cache."""
    if not kept:
        return
    build_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        os.makedirs(kept, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = kept
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    except Exception:  # noqa: BLE001 - the build probes in its own cache then, as Inductor always does
        pass
    finally:
        if build_cache is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = build_cache


def skips_isa_probe(configs: dict) -> bool:
    """Whether a job's Inductor settings leave the host code without a vector ISA (a GPU program's:
    package_builds.GPU_HOST_ISA), so that no probe of one may run in this process."""
    return configs.get("cpp.vec_isa_ok") is False


def _no_isa_probe() -> None:
    """No vector ISA for this process's host code, set before anything asks Inductor for one: its probe caches what
    it found per process, and a probe run once (in torch 2.11, a Python importing torch per ISA checked) would
    decide the package's ISA whatever the build's own settings say."""
    try:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.vec_isa_ok = False
    except (ImportError, AttributeError):
        pass


STACKS_ENV = "KEEPFAST_BUILD_STACKS"  # a folder: this process writes its stacks there every STACKS_EVERY_S
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


def _report_stacks(folder: str) -> None:
    """Where a slow build is (the device check's SD1.5 build had not ended in 230 s on a GPU, and the stacks the
    job printed were its own, waiting on this process): every STACKS_EVERY_S, this process's Python stacks into
    `$KEEPFAST_BUILD_STACKS/build-<pid>.txt` (replaced whole), which the bench's worker prints at its time limit.
    From a Python thread holding the GIL (worker._print_stacks_later says why not faulthandler)."""
    where = os.environ.get(STACKS_ENV)
    if not where:
        return
    import threading

    path = os.path.join(where, f"build-{os.getpid()}.txt")

    def report() -> None:
        while True:
            time.sleep(STACKS_EVERY_S)
            lines = [f"build process {os.getpid()} ({os.path.basename(folder)}), {time.perf_counter() - BEGUN:.0f} s "
                     "after its start:"] + other_threads_stacks(depth=25)
            try:
                with open(path + ".partial", "w") as handle:
                    handle.write("\n".join(lines) + "\n")
                os.replace(path + ".partial", path)
            except OSError:
                return

    threading.Thread(target=report, name="keepfast-build-stacks", daemon=True).start()


def warm_kernel_compilers(threads: Optional[int]) -> bool:
    """Start Inductor's Triton compile workers now, for a GPU program (True if they were asked to start).

    torch.compile starts them as it begins (its inductor backend calls `maybe_warm_pool`); AOTInductor does not.
    Its first kernel then asks for the pool (torch 2.11-2.13's `AsyncCompile.use_process_pool`), and every kernel
    until the pool is ready (a process of its own that imports torch, then its workers, each importing torch and
    Triton) compiles one after another in this process. On the H200 code generation took 8.7 s for a 50-line
    module and 8.3 s for a Flux block (docs/gpu.md); how much of that was this wait is for the next GPU run to
    show. Started here, the workers start while this process reads the program and lowers it. `threads`: how many
    (package_builds.kernel_compile_threads; None: Inductor's own choice or TORCHINDUCTOR_COMPILE_THREADS)."""
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
    _report_stacks(folder)
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
        # programs are built once. A GPU program's job says no ISA (package_builds.GPU_HOST_ISA), so none is
        # probed; nor is the CPU level (`probe`): a CUDA program's host code is built with no -march, and the
        # parent wrote what it is built for (package_builds._write_job).
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


# What a build imports after torch, imported by a spare while it waits for its build: reading a program
# (torch.export's deserialiser) and AOTInductor's compiler, with Triton's code generation for a GPU program.
# On this 2-core CPU (torch 2.13) torch.export.load of a small program took 1.05-1.16 s in a process that had
# imported torch only, 0.02 s after these imports (1.8 s); a spare starts while its caller traces, so that time
# is off the build's path.
BUILD_IMPORTS = ("torch.export", "torch._export.serde.serialize", "torch._inductor.compile_fx",
                 "torch._inductor.codecache", "torch._inductor.graph", "torch._inductor.scheduler",
                 "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.package")
GPU_BUILD_IMPORTS = ("triton", "torch._inductor.codegen.triton", "torch._inductor.codegen.cpp_wrapper_gpu",
                     "torch._inductor.runtime.triton_heuristics")


def _warm_imports(kind: str) -> List[str]:
    """Import what a build of `kind` ("cpu" or "gpu") will (BUILD_IMPORTS); the modules that would not import
    are left to the build, which says why if it needs them."""
    import importlib

    failed = []
    for name in BUILD_IMPORTS + (GPU_BUILD_IMPORTS if kind != "cpu" else ()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a CPU-only torch has no Triton; the build imports what it needs
            failed.append(name)
    return failed


SPARE_WAIT_S = 600  # a spare that gets no build in this time ends (its memory is the parent's machine's)


def spare(kept_isa_cache: str, kind: str = "cpu") -> int:
    """A build process started before its build (package_builds.prestart): torch imported, and for a `kind` "cpu"
    build the ISA probe run, while the parent traces the graph; then it reads its job folder from stdin and builds
    as `main` does (the parent gives it a build of its kind only). It ends without building on end-of-file, after
    SPARE_WAIT_S, or with its parent."""
    import select

    _stop_when_the_parent_is_gone(None)
    import torch  # noqa: F401 - what the spare is for

    if kind == "cpu":
        _probe_isa(kept_isa_cache)
    else:
        _no_isa_probe()
    _warm_imports(kind)
    ready, _, _ = select.select([sys.stdin], [], [], SPARE_WAIT_S)
    folder = sys.stdin.readline().strip() if ready else ""
    if not folder:
        return 0
    global BEGUN
    BEGUN = time.perf_counter()  # its phases count from its build, not from its start
    output = os.open(os.path.join(folder, "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "cache")
    return main(folder)


def run(argv: List[str]) -> int:
    """`run.py JOB_FOLDER` builds that job; `run.py --spare ISA_CACHE [KIND]` waits for one as a spare."""
    if argv[0] == "--spare":
        return spare(argv[1], argv[2] if len(argv) > 2 else "cpu")
    return main(argv[0])
