"""Where a cold compile's time goes, under one set of names for ours and for torch.compile.

Ours: each build reports its phases (`phase_s` in the compile event: the trace with torch.export in the caller,
the build process's start and reading of the program, then AOTInductor's own phases, build_process/child.py).
torch.compile: Inductor's and Dynamo's own timers in the worker process (torch._dynamo.utils.
compilation_time_metrics), read after the first call. The same Inductor phases (lowering, scheduling, code
generation) carry the same names; what differs is named for what it is.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

# Rows of the report's phase table, in order: (key, what it is).
ROWS = (
    ("export_s", "trace (ours: torch.export in the caller; torch.compile: Dynamo)"),
    ("startup_s", "build process start (ours)"),
    ("read_program_s", "build process reads the program (ours)"),
    ("aot_trace_s", "AOT autograd trace of the graph"),
    ("lowering_s", "Inductor lowering"),
    ("scheduling_s", "Inductor scheduling and fusion"),
    ("codegen_s", "Inductor code generation (scheduling included; ours on a GPU: Triton's kernel builds and "
                  "tuning too)"),
    ("kernel_codegen_s", "of which writing the kernels"),
    ("kernel_wait_s", "of which waiting for Triton's kernel builds (ours on a GPU)"),
    ("autotune_s", "benchmarking kernel configurations (ours on a GPU: in code generation; torch.compile: in its "
                   "first call)"),
    ("cpp_build_s", "C++ build (ours: wrapper and kernels; torch.compile: waiting for kernel builds)"),
    ("cpp_header_s", "of which making or waiting for the precompiled C++ headers (ours; torch 2.13 and later)"),
    ("precompiled_header_s", "the build's thread making those headers from its start, beside the rest (ours)"),
    ("compile_cpu_s", "CPU seconds of the build processes and the compilers they ran (ours)"),
    ("compile_cores_busy", "cores the build processes kept busy on average (ours: every part's added)"),
    ("machine_cores_busy", "cores the whole machine kept busy during the build (ours; other jobs included)"),
    ("call_cpu_s", "CPU seconds of the first call's process and every process it ran and reaped (torch.compile: "
                   "its whole compile; ours: the trace and the build processes with their compilers)"),
    ("call_cores_busy", "cores the first call's process kept busy on average"),
    ("call_machine_cores_busy", "cores the whole machine kept busy during the first call (another lane's jobs "
                                "included: what the compile competed with)"),
    ("headers_precompiled", "C++ headers precompiled during the build (ours: the first build on a machine makes "
                            "its wrapper's; a count)"),
    ("triton_kernels", "Triton kernels built (a count; ours: every part's)"),
    ("triton_configs", "configurations they were built for (a count: each one a Triton build)"),
    ("triton_configs_pointwise", "of which for pointwise kernels"),
    ("triton_configs_reduction", "of which for reductions"),
    ("triton_configs_persistent", "of which for persistent reductions"),
    ("triton_build_s", "seconds of the kernels' builds, added up over the compile workers"),
    ("triton_build_s_pointwise", "of which pointwise kernels'"),
    ("triton_build_s_reduction", "of which reductions'"),
    ("triton_build_s_persistent", "of which persistent reductions'"),
    ("kernel_build_per_config_median_s", "a kernel's build seconds per configuration, the median kernel (ours: "
                                         "the largest part's)"),
    ("kernel_build_slowest_s", "the slowest kernel's build seconds"),
    ("hints_restored", "size symbols given back their example after torch's loader dropped it (ours; a count, "
                       "every part's)"),
    ("parts", "parts built side by side (ours)"),
    ("kernels", "kernels generated (a count; ours: every part's)"),
)

# torch.compile: our names -> the timers that make them up.
_TORCH_COMPILE = {
    "export_s": ("bytecode_tracing",),
    "lowering_s": ("GraphLowering.run",),
    "scheduling_s": ("Scheduler.__init__",),
    "codegen_s": ("GraphLowering.codegen",),
    "kernel_codegen_s": ("Scheduler.codegen",),
    "autotune_s": ("CachingAutotuner.benchmark_all_configs",),
    "cpp_build_s": ("async_compile.wait",),
}


def torch_compile_phases() -> Dict[str, float]:
    """The phases of every compile this process ran so far with torch.compile (seconds, summed)."""
    from torch._dynamo.utils import compilation_time_metrics

    def total(names: Iterable[str]) -> float:
        return sum(sum(compilation_time_metrics.get(name, [])) for name in names)

    out = {key: round(total(names), 2) for key, names in _TORCH_COMPILE.items()}
    try:
        from torch._inductor import metrics

        out["kernels"] = float(metrics.generated_kernel_count)  # every graph's this process compiled
    except Exception:  # noqa: BLE001 - a count for the report only
        pass
    inner = total(("compile_fx.<locals>.fw_compiler_base",))
    aot = total(("create_aot_dispatcher_function",))
    if aot:
        out["aot_trace_s"] = round(max(0.0, aot - inner), 2)
    return {key: value for key, value in out.items() if value}


def ours_phases(compile_details: List[dict]) -> Dict[str, float]:
    """The phases of our compiles (their events' `phase_s`), summed over compiles; `parts` the largest count."""
    out: Dict[str, float] = {}
    for detail in compile_details:
        for key, value in (detail.get("phase_s") or {}).items():
            if key == "parts":
                out[key] = max(out.get(key, 0.0), value)
            else:
                out[key] = round(out.get(key, 0.0) + value, 2)
    return out


def slowest_build_samples(compile_details: List[dict]) -> List[list]:
    """Where the main thread of our slowest build was (build_profile.py samples, [[signature, share]])."""
    builds = [d for d in compile_details if d.get("main_thread")]
    if not builds:
        return []
    return max(builds, key=lambda d: (d.get("phase_s") or {}).get("inductor_s", 0.0))["main_thread"]


def with_call_profile(phase_s: Dict[str, float], profile: Optional[dict]) -> Dict[str, float]:
    """A job's phases with its first call's own CPU figures (worker.py's `first_call_profile`) as `call_*`."""
    profile = profile or {}
    extra = {f"call_{key[len('compile_'):]}": value for key, value in profile.items()
             if key in ("compile_cpu_s", "compile_cores_busy") and value}
    # Triton kernels built in the first call's own process (torch.compile's; ours builds them in build processes,
    # whose counts are already in its phases)
    extra.update({key: value for key, value in profile.items()
                  if key.startswith(("triton_", "kernel_build_")) and key not in phase_s})
    if profile.get("machine_cores_busy"):
        extra["call_machine_cores_busy"] = profile["machine_cores_busy"]
    return {**phase_s, **extra}
