"""The CPU a compile used and where its main thread was (compiler/build_process/build_profile.py), for ours and for
torch.compile alike: on the H200 the SD1.5 build waited 76.4 s for its Triton kernels where torch.compile waited
0.3 s, and the phase timers cannot say whether the kernel compilers were busy or idle in that wait."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from compiler.backends import aot_build, aot_parts
from compiler.build_process import build_profile
from compiler.builds import package_builds
from benchmarks import phases, report

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

SPIN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def _spin_here(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_group_cpu_counts_this_process_and_the_children_it_reaped():
    before = build_profile.group_cpu_seconds()
    subprocess.run([sys.executable, "-c", SPIN.format(seconds=0.6)], check=True)  # same group, reaped by us
    _spin_here(0.3)
    used = build_profile.group_cpu_seconds() - before
    assert used >= 0.8, used  # the child's 0.6 s (and its start) and this process's 0.3 s


def test_another_group_is_not_counted():
    before = build_profile.group_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=1.0)], start_new_session=True)
    assert build_profile.group_cpu_seconds(child.pid) >= 0.0  # its own group, readable while it runs
    child.wait()  # reaped by us: from now on in our cutime, as a compiler the build waited for would be
    time.sleep(0.05)
    assert build_profile.group_cpu_seconds() - before >= 0.9


def test_the_sampler_names_where_the_main_thread_spends_its_time():
    with build_profile.CompileProfile(every_s=0.02) as profile:
        _spin_here(0.6)
    top = profile.sampler.top()
    assert top and "test_build_profile._spin_here" in top[0][0], top
    assert top[0][1] >= 0.5, top
    figures = profile.phases()
    assert figures["compile_cpu_s"] >= 0.5 and figures["compile_cores_busy"] > 0.5, figures
    assert figures["compile_processes_max"] >= 1, figures
    # the whole machine was at least as busy as this process (other processes may add to it)
    assert figures["machine_cores_busy"] >= figures["compile_cores_busy"] - 0.2, figures


def test_a_build_reports_its_cpu_and_where_its_main_thread_was(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).eval()
    program = torch.export.export(module, (torch.randn(2, 8),))
    build = package_builds.start(program, dict(aot_build.PACKAGE_CONFIG), now=True)
    build.result(timeout=600)
    figures = build.usage["phase_s"]
    assert figures["compile_cpu_s"] > 0 and figures["compile_processes_max"] >= 1, figures
    assert figures["headers_precompiled"] >= 0, figures  # 1 where this machine had not built its header yet
    assert figures["compile_cpu_s"] <= figures["inductor_s"] * (os.cpu_count() or 1) + 5, figures
    assert build.usage["main_thread"] and all(0 < share <= 1 for _, share in build.usage["main_thread"])


def test_parts_add_their_cpu_and_keep_the_slowest_part_s_samples():
    usages = [{"phase_s": {"inductor_s": 40.0, "compile_cpu_s": 100.0, "compile_cores_busy": 2.5},
               "main_thread": [["a.f", 1.0]]},
              {"phase_s": {"inductor_s": 55.0, "compile_cpu_s": 120.0, "compile_cores_busy": 2.2},
               "main_thread": [["b.g", 0.7]]}]
    usage = aot_parts._parts_usage(usages)
    assert usage["phase_s"]["compile_cpu_s"] == 220.0 and usage["phase_s"]["compile_cores_busy"] == 4.7
    assert usage["phase_s"]["inductor_s"] == 55.0 and usage["main_thread"] == [["b.g", 0.7]]
    assert [p["inductor_s"] for p in usage["parts_phase_s"]] == [40.0, 55.0]  # each part's own, in order
    assert "slowest_kernels" not in usage  # none reported: none listed
    usages[0]["slowest_kernels"], usages[1]["slowest_kernels"] = [["k_a", 9.0, 2], ["k_b", 1.0, 1]], [["k_c", 5.0, 3]]
    assert aot_parts._parts_usage(usages)["slowest_kernels"] == [["k_a", 9.0, 2], ["k_c", 5.0, 3], ["k_b", 1.0, 1]]


def test_the_report_puts_the_call_s_cpu_beside_the_build_s_and_lists_the_samples():
    ours = {"phase_s": {"inductor_s": 50.0, "compile_cpu_s": 90.0}, "main_thread": [["x.wait", 0.8]]}
    assert phases.slowest_build_samples([ours, {"phase_s": {"inductor_s": 10.0}}]) == [["x.wait", 0.8]]
    merged = phases.with_call_profile({"codegen_s": 1.0}, {"compile_cpu_s": 12.5, "compile_cores_busy": 3.1,
                                                           "compile_processes_max": 9.0, "main_thread": [],
                                                           "machine_cores_busy": 11.0})
    assert merged == {"codegen_s": 1.0, "call_cpu_s": 12.5, "call_cores_busy": 3.1, "call_machine_cores_busy": 11.0}
    model = {"cold_compile": {"ratio": 3.0, "ours_s": 180.0, "torch_compile_s": 60.0,
                              "phases": {"ours_aot_cold": {"compile_cpu_s": 90.0},
                                         "torch_compile": merged},
                              "main_thread": {"ours_aot_cold": {"build": [["x.wait", 0.8]], "call": []},
                                              "torch_compile": {"build": [], "call": [["y.compile", 0.6]]}}}}
    text = "\n".join(report.cold_compile_markdown(model))
    assert "| CPU seconds of the build processes and the compilers they ran (ours) | 90.0 | not run |" in text, text
    assert "80% `x.wait`" in text and "60% `y.compile`" in text, text


def test_headers_precompiled_during_a_compile_are_counted(tmp_path, monkeypatch):
    from torch._inductor import codecache

    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))
    assert build_profile.precompiled_headers() == 0  # no folder yet: none made on this machine
    (tmp_path / "headers").mkdir()
    (tmp_path / "headers" / "old.h.gch").write_bytes(b"x")
    with build_profile.CompileProfile(every_s=0.05) as profile:
        (tmp_path / "headers" / "new.h.gch").write_bytes(b"x")
        (tmp_path / "headers" / "new.h").write_text("#include <x>\n")  # the header itself is not counted
    assert profile.phases()["headers_precompiled"] == 1.0
    with build_profile.CompileProfile(every_s=0.05) as again:
        pass
    assert again.phases()["headers_precompiled"] == 0.0


def test_triton_kernels_and_their_configurations_are_counted_by_kind():
    """Inductor's own record of each kernel built (async_compile._add_triton_kernel_info, called by the worker path
    and the in-process path alike) is read during a compile and left as it was after it."""
    from torch._inductor import async_compile

    original = async_compile._add_triton_kernel_info
    async_compile._compile_start()  # Inductor keeps its record between a compile's start and end
    try:
        with build_profile.CompileProfile(every_s=0.05) as profile:
            assert async_compile._add_triton_kernel_info is not original  # read while the block runs
            record = async_compile._add_triton_kernel_info
            record("triton_poi_fused_add_0", {"autotune_cache_state": "miss", "num_configs": 6,
                                              "compile_time_us": 2_000_000})
            record("triton_poi_fused_mul_1", {"autotune_cache_state": "only 1 config", "compile_time_us": 400_000})
            record("triton_red_fused_sum_2", {"autotune_cache_state": "miss", "num_configs": 4,
                                              "compile_time_us": 1_500_000})
            record("triton_per_fused_norm_3", {"autotune_cache_state": "hit", "compile_time_us": 100_000})
            record("triton_tem_fused_mm_4", {"compile_time_us": 50_000})  # caches off: configurations not said
        assert async_compile._triton_kernel_metrics["triton_red_fused_sum_2"]["num_configs"] == 4  # still recorded
    finally:
        async_compile._compile_end()
    assert async_compile._add_triton_kernel_info is original  # as it was
    figures = profile.phases()
    assert figures["triton_kernels"] == 5.0 and figures["triton_configs"] == 12.0, figures
    assert figures["triton_kernels_pointwise"] == 2.0 and figures["triton_configs_pointwise"] == 7.0, figures
    assert figures["triton_configs_reduction"] == 4.0 and figures["triton_configs_persistent"] == 1.0, figures
    assert figures["triton_configs_unknown"] == 1.0 and figures["triton_build_s"] == 4.05, figures
    assert figures["triton_build_s_pointwise"] == 2.4 and figures["triton_build_s_reduction"] == 1.5, figures
    assert profile.kernel_builds.slowest(2) == [["triton_poi_fused_add_0", 2.0, 6], ["triton_red_fused_sum_2", 1.5, 4]]
    # per configuration, over the kernels whose configurations are known: 0.1, 0.333, 0.375, 0.4
    assert figures["kernel_build_per_config_median_s"] == 0.354 and figures["kernel_build_slowest_s"] == 2.0, figures
    with build_profile.CompileProfile(every_s=0.05) as none_built:
        pass
    assert not any(key.startswith("triton_") for key in none_built.phases())  # a CPU compile: no such rows


def test_parts_add_their_triton_counts_and_the_call_profile_brings_torch_compile_s():
    usages = [{"phase_s": {"inductor_s": 40.0, "triton_kernels": 180.0, "triton_configs": 600.0,
                           "triton_build_s": 300.0}},
              {"phase_s": {"inductor_s": 55.0, "triton_kernels": 188.0, "triton_configs": 610.0,
                           "triton_build_s": 320.0}}]
    figures = aot_parts._parts_usage(usages)["phase_s"]
    assert (figures["triton_kernels"], figures["triton_configs"], figures["triton_build_s"]) == (368.0, 1210.0, 620.0)
    merged = phases.with_call_profile({"codegen_s": 27.7}, {"compile_cpu_s": 200.0, "triton_kernels": 378.0,
                                                            "triton_configs": 420.0})
    assert merged["triton_kernels"] == 378.0 and merged["triton_configs"] == 420.0, merged
    carried = phases.with_call_profile({}, {"kernel_build_per_config_median_s": 0.18, "kernel_build_slowest_s": 2.5})
    assert carried == {"kernel_build_per_config_median_s": 0.18, "kernel_build_slowest_s": 2.5}
    kept = phases.with_call_profile({"triton_kernels": 368.0}, {"triton_kernels": 0.0})
    assert kept["triton_kernels"] == 368.0  # the builds' own count wins over the caller's process's
