"""The ComfyUI-on-GPU run (benchmarks/comfy_gpu.py) rehearsed on the CPU with the tiny
configs (needs COMFYUI_PATH): in ComfyUI's Python, the pack loaded as ComfyUI loads it, SD1.5's UNet (whole) and
Flux (by blocks) sampled through comfy.sample with and without Model Speedup, every call of ours served by graphs
and equal to eager; the partial-loading row says that a CPU never loads a model partly."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui


def test_the_gpu_run_rehearsed_on_the_cpu_serves_graphs_equal_to_eager(tmp_path):
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(tmp_path / "trust.json"), "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([S.PYTHON, "-m", "benchmarks.comfy_gpu", "--out", str(tmp_path / "out"),
                           "--device", "cpu", "--tiny", "--steps", "3"], cwd=S.REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "comfy_gpu.json").read_text())
    rows = {(row["model"], row.get("mode")): row for row in report["rows"]}
    assert set(rows) == {("sd15", "full"), ("sd15", "partial"), ("flux", "full"), ("flux", "partial")}, rows
    for model in ("sd15", "flux"):
        full = rows[(model, "full")]
        assert full["events"]["compile"] >= 1 and full["events"]["fallback"] == 0, full["reasons"]
        assert full["graph_calls"] > 0 and full["eager_calls"] == 0, full
        assert full["finite"] and full["max_abs_diff"] <= 1e-3 * max(1.0, full["scale"]), full
        assert full["first_max_abs_diff"] <= 1e-3 * max(1.0, full["scale"]), full
        assert full["eager_step_ms"] > 0 and full["ours_step_ms"] > 0
        assert "partly on a GPU only" in rows[(model, "partial")]["skipped"]
    # SD1.5 again through a second node with CUDA graph replays asked for: its graph from memory (no compile),
    # equal to eager, and on the CPU a note (not a fallback) that replays need CUDA; Flux's blocks have none
    replayed = rows[("sd15", "full")]["cuda_graphs"]
    assert replayed["events"]["compile"] == 0 and replayed["events"]["fallback"] == 0, replayed
    assert replayed["max_abs_diff"] <= 1e-3 * max(1.0, rows[("sd15", "full")]["scale"]), replayed
    assert replayed["step_ms"] > 0 and replayed["events"]["note"] == 1, replayed
    assert "runs on cpu" in replayed["notes"][0], replayed
    assert "cuda_graphs" not in rows[("flux", "full")]
