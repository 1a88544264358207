"""Every transformer family ComfyUI loads, served block by block (needs COMFYUI_PATH).

Each family is a tiny model built with ComfyUI's own classes
(`benchmarks/comfy/families.py`), in float32 and, for Flux, Wan and
SD3, in the dtypes checkpoints run in (bfloat16, float16, float8 weights
computing in bfloat16), sampled through
comfy.sample in ComfyUI's Python by kf_families.py: Save Graph before any image, a sweep of
resolutions, batch sizes, prompt lengths and frame counts against the model
without the node, LoRA patches at two strengths and off, one block whose
weights are patched per call; then a new process with other weights loads
the saved graphs and samples again.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

FAMILIES = ["flux", "flux2", "flux2-klein", "chroma", "sd3", "auraflow", "wan", "wan22", "qwen-image", "hunyuan-video",
            "hunyuan-video15", "hunyuan-image21", "ltxv", "ltxav", "kandinsky5", "lumina2", "z-image", "hidream"]
# The dtypes checkpoints run in (ComfyUI's --bf16-unet / --fp16-unet / --fp8_e4m3fn-unet): one image, one video
# and one float16 family, and float8 weights that compute in bfloat16 (ComfyUI's manual cast).
LOW_PRECISION = [("flux", "bfloat16"), ("wan", "bfloat16"), ("sd3", "float16"), ("flux", "float8_e4m3fn")]
CASES = [(family, "float32") for family in FAMILIES] + LOW_PRECISION
# Latent differences after two sampling steps, relative to the latent's scale (at least 1). float32: the same
# maths reordered; otherwise what rounding the model's output to 8 (bfloat16) or 11 (float16) bits gives
# (seen: 8e-3 and 8e-4).
TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 5e-3, "float8_e4m3fn": 2e-2}


def _run(base, family: str, phase: str, dtype: str) -> dict:
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_families.py"), str(S.REPO), str(base), family, phase, dtype],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


_RUNS: dict = {}


def _runs(case, tmp_path_factory):
    """(first, restart) findings of one family in one dtype; run once and shared by its tests."""
    if case not in _RUNS:
        family, dtype = case
        base = tmp_path_factory.mktemp(f"family-{family}-{dtype}")
        (base / "models" / "graphs").mkdir(parents=True)
        first = _run(base, family, "first", dtype)
        restart = _run(base, family, "restart", dtype) if first.get("engine") else None
        _RUNS[case] = (first, restart)
    return _RUNS[case]


@pytest.fixture(params=CASES, ids=[f"{family}-{dtype}" for family, dtype in CASES])
def runs(request, tmp_path_factory):
    return _runs(request.param, tmp_path_factory)


@pytest.fixture(params=FAMILIES)
def runs32(request, tmp_path_factory):
    """float32 only: weight patches are checked where rounding does not hide their effect."""
    return _runs((request.param, "float32"), tmp_path_factory)


def _close(row: dict, dtype: str) -> bool:
    return row["finite"] and row["diff"] < TOLERANCE[dtype] * max(1.0, row["scale"])


def test_save_graph_before_any_image_compiles_each_block_structure_once(runs):
    first, _ = runs
    assert first["engine"], f"{first['family']}: no block family for its diffusion model"
    structures = len(first["structures"])
    assert first["save_events"]["compile"] == structures, first["save_report"]
    assert first["save_events"]["fallback"] == 0, first["save_report"]
    report = first["report"]
    assert report["blocks_compiled"] == report["blocks"] > structures - 1, report
    graphs = [f for f in first["files"] if f.count("/") >= 3]  # models/graphs/<folder>/<graph>.json
    assert len(graphs) == structures, first["files"]
    assert f"models/graphs/{first['family']}.json" in first["files"], first["files"]  # the graph set


def test_sweep_has_no_compile_and_no_fallback_and_equals_eager(runs):
    first, _ = runs
    assert first["sweep_fallbacks"] == []
    for row in first["sweep"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert _close(row, first["dtype"]), row
    graph_calls, eager_calls = first["block_calls"]
    assert graph_calls > 0 and eager_calls == 0


def test_lora_on_off_and_strength_need_no_compile(runs32):
    first, _ = runs32
    tolerance = TOLERANCE["float32"]
    assert first["lora_patched_keys"] >= len(first["structures"])
    on, half, off = first["lora"]
    for row in (on, half):
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert row["diff"] < tolerance and row["changed"] > 10 * tolerance, row  # the patch took effect
    assert off["diff"] < tolerance and off["events"]["compile"] == 0, off
    # every patched weight the graphs were bound to is freed once ComfyUI unpatches it
    assert first["lora_patched_bound"] >= first["lora_patched_keys"] and first["lora_patched_kept"] == 0, first


def test_a_block_patched_on_the_fly_runs_eager_alone(runs32):
    first, _ = runs32
    found = first["on_the_fly"]
    row = found["rows"][0]
    assert _close(row, "float32") and row["events"]["compile"] == 0, row
    calls = found["eager_calls"]  # every call of that one block, and no call of another block
    assert calls > 0 and found["graph_calls"] == (first["report"]["blocks"] - 1) * calls, found
    assert any(found["block"] in reason and "patched on the fly" in reason for reason in found["fallbacks"]), found


def test_a_restart_loads_the_saved_graphs_with_no_compile(runs):
    first, restart = runs
    assert restart is not None
    assert restart["load_events"]["compile"] == 0, restart["load_report"]
    assert restart["load_events"]["load"] == len(first["structures"]), restart["load_report"]
    assert restart["sweep_fallbacks"] == []
    for row in restart["sweep"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert _close(row, restart["dtype"]), row
