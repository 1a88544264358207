"""A sample under torch's profiler, summed per step (benchmarks/step_profile.py): what the ComfyUI GPU
bench reads beside each step time, kernel time against wall time."""

from __future__ import annotations

import torch

from benchmarks import step_profile


def test_kernels_are_summed_per_step_and_ranked():
    kernels = [("gemm", 300.0), ("softmax", 50.0), ("gemm", 300.0), ("add", 20.0), ("softmax", 50.0)]
    figures = step_profile.per_step(kernels, steps=2)
    assert figures["kernel_ms_per_step"] == 0.36 and figures["launches_per_step"] == 2.5
    assert [row["kernel"] for row in figures["top"]] == ["gemm", "softmax", "add"]
    assert figures["top"][0] == {"kernel": "gemm", "ms_per_step": 0.3, "per_step": 1.0}


def test_a_cpu_sample_gives_its_wall_time_and_a_failure_its_reason():
    model = torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)

    def sample():
        for _ in range(4):
            model(x)

    figures = step_profile.profile(sample, steps=4, cuda=False)
    assert figures["steps"] == 4 and figures["wall_ms_per_step"] > 0 and "kernel_ms_per_step" not in figures

    def broken():
        raise RuntimeError("no sampler")

    assert step_profile.profile(broken, steps=4, cuda=False) == {"error": "RuntimeError: no sampler"}


def test_the_device_events_are_read_as_torch_reads_a_kernel_s_time():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(16, 16) @ torch.randn(16, 16)
    events = prof.events()
    assert events and all(hasattr(e, "device_type") and e.time_range.elapsed_us() >= 0 for e in events)
    assert step_profile._kernels(prof) == []  # no device here: no kernels
