"""GGUF models loaded by ComfyUI-GGUF, served by block graphs that dequantise inside (needs COMFYUI_PATH and
KEEPFAST_GGUF_PATH, a ComfyUI-GGUF checkout; its `gguf` package installed in ComfyUI's Python).

A tiny Flux and a tiny Wan 2.1 (256 wide, so every block weight quantises:
Q4_K packs 256 values per block) are written as GGUF in Q8_0 and Q4_K and loaded with
ComfyUI-GGUF's own loader functions, and as an fp8-scaled checkpoint loaded
as comfy.sd loads one (the fp8 case needs no ComfyUI-GGUF); kf_quantised.py samples it through
comfy.sample with and without Model Speedup: Save Graph before any image,
a sweep of sizes, batches and prompt lengths, a LoRA through LoraLoader's
path at two strengths and off, a `set` patch (eager per block with the
reason), then a new process loads the saved graphs. And the unquantised tiny
Flux with a LoRA, partly unloaded by ComfyUI's own `partially_unload` (on a
CPU ComfyUI never loads a model partly during sampling): the blocks low-VRAM
mode patches per call are served by their graphs.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)
GGUF_PATH = os.environ.get("KEEPFAST_GGUF_PATH", "")
HAVE_GGUF = bool(GGUF_PATH and os.path.isfile(os.path.join(GGUF_PATH, "nodes.py")))
NO_GGUF = ("KEEPFAST_GGUF_PATH is not set to a ComfyUI-GGUF checkout (github.com/city96/ComfyUI-GGUF); "
           "the GGUF cases load models with its loader")
if not HAVE_GGUF:
    print(f"[KeepFast] skipping the GGUF cases: {NO_GGUF}")

pytestmark = pytest.mark.comfyui

FP8 = "fp8_scaled"
GGUF_CASES = [("flux", "Q8_0"), ("flux", "Q4_K"), ("wan", "Q8_0"), ("wan", "Q4_K"), ("flux", "Q4_K:bfloat16")]
STRUCTURES = {"flux": [["DoubleStreamBlock", 2], ["SingleStreamBlock", 2]], "wan": [["WanAttentionBlock", 2]]}
CASES = [pytest.param(case, marks=pytest.mark.skipif(not HAVE_GGUF, reason=NO_GGUF)) for case in GGUF_CASES] + \
    [("flux", FP8)]
IDS = [f"{family}-{qtype.replace(':', '-')}" for family, qtype in GGUF_CASES + [("flux", FP8)]]
# Latent after two sampling steps, relative to its scale (at least 1): the graph dequantises the same bytes with
# the same code, then the same maths reordered (float32, seen: 2e-5 to 1e-4); in bfloat16 what rounding the
# model's output to 8 bits gives (seen: 5.5e-3; test_comfyui_families.py allows bfloat16 the same 2e-2).
TOLERANCE = 1e-3
TOLERANCES = {"float32": TOLERANCE, "bfloat16": 2e-2}


def _run(base, family: str, qtype: str, phase: str) -> dict:
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_quantised.py"), str(S.REPO), str(base), family, qtype, phase],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


_RUNS: dict = {}


@pytest.fixture(params=CASES, ids=IDS)
def runs(request, tmp_path_factory):
    """(first, restart) findings of one model in one quantisation type; run once, shared by the tests."""
    case = request.param
    if case not in _RUNS:
        family, qtype = case
        base = tmp_path_factory.mktemp(f"gguf-{family}-{qtype}")
        (base / "models" / "graphs").mkdir(parents=True)
        first = _run(base, family, qtype, "first")
        restart = _run(base, family, qtype, "restart") if first.get("engine") else None
        _RUNS[case] = (first, restart)
    return _RUNS[case]


def _close(row: dict, qtype: str = "") -> bool:
    tolerance = TOLERANCES[qtype.partition(":")[2] or "float32"]
    return row["finite"] and row["diff"] < tolerance * max(1.0, row["scale"])


def test_the_model_is_quantised_as_asked(runs):
    first, _ = runs
    if first["qtype"] == FP8:
        assert first["weight_class"] == "QuantizedTensor"  # ComfyUI's mixed-precision ops hold fp8 and a scale
        assert first["stored"]["float8_e4m3fn"] >= 20, first["stored"]
        return
    assert first["weight_class"] == "GGMLTensor"
    assert first["stored"].get(first["qtype"].partition(":")[0], 0) >= 20, first["stored"]  # every block Linear quantised
    assert first["q4_k_roundtrip"] < 0.1  # the Q4_K encoder read back by gguf's own numpy dequantize


def test_every_block_compiles_once_per_structure_and_quantisation_type(runs):
    first, _ = runs
    assert first["engine"]
    structures = first["structures"]
    expected = STRUCTURES[first["family"]]
    assert [s[:2] for s in structures] == expected, structures
    assert first["save_events"]["compile"] == len(expected), first["save_report"]
    assert first["save_events"]["fallback"] == 0, first["save_report"]
    report = first["report"]
    assert report["blocks_compiled"] == report["blocks"] == sum(n for _, n in expected), report


def test_quantisation_types_never_share_a_graph():
    if len(_RUNS) < 2:
        pytest.skip("needs two quantisation types run first (run the whole module)")
    keys = {case: {s[2] for s in first["structures"]} for case, (first, _) in _RUNS.items() if first.get("engine")}
    seen: set = set()
    for case, structures in keys.items():
        assert structures and not (structures & seen), keys
        seen |= structures


def test_sweep_has_no_compile_and_no_fallback_and_equals_the_gguf_model(runs):
    first, _ = runs
    assert first["sweep_fallbacks"] == []
    for row in first["sweep"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert row["events"]["mismatch"] == 0 and _close(row, first["qtype"]), row
    graph_calls, eager_calls = first["block_calls"]
    assert graph_calls > 0 and eager_calls == 0


def test_lora_on_gguf_at_two_strengths_and_off_needs_no_compile(runs):
    first, _ = runs
    assert first["lora_keys"] >= 20
    *on, off = first["lora"]
    assert [row["strength"] for row in on] == [1.0, 1.0, 0.5, 0.5]
    for row in on:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert row["events"]["mismatch"] == 0 and _close(row, first["qtype"]), row
        if row["changed"] is not None:
            assert row["changed"] > 100 * TOLERANCE, row  # the LoRA took effect
    assert off["diff"] == 0.0 and off["events"]["compile"] == 0 and off["events"]["fallback"] == 0, off


def test_a_patch_that_is_no_delta_runs_its_block_eager_with_the_reason(runs):
    first, _ = runs
    found = first["set_patch"]
    assert _close(found, first["qtype"]), found
    if first["qtype"] == FP8:  # ComfyUI applies it when it loads the weights (requantised): the graph binds them
        assert _close(found) and found["changed"] > 100 * TOLERANCE, found
        assert found["events"]["compile"] == 0 and found["eager_calls"] == 0 and found["graph_calls"] > 0, found
        return
    assert found["changed"] > 100 * TOLERANCE, found
    assert found["events"]["compile"] == 0, found
    others = first["report"]["blocks"] - 1  # the patched block eager, every other block from its graph
    assert found["eager_calls"] > 0 and found["graph_calls"] == others * found["eager_calls"], found
    assert any(found["block"] in reason and "'set' patch" in reason for reason in found["fallbacks"]), found


def test_a_restart_loads_the_gguf_graphs_with_no_compile(runs):
    first, restart = runs
    assert restart is not None
    assert restart["load_events"]["compile"] == 0, restart["load_report"]
    assert restart["load_events"]["load"] == len(first["structures"]), restart["load_report"]
    assert restart["sweep_fallbacks"] == []
    for row in restart["sweep"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert _close(row, restart["qtype"]), row


@pytest.fixture(scope="module")
def low_vram(tmp_path_factory):
    base = tmp_path_factory.mktemp("lowvram-flux")
    (base / "models" / "graphs").mkdir(parents=True)
    return _run(base, "flux", "float32", "lowvram")


def test_low_vram_lora_patched_per_call_is_served_by_the_graphs(low_vram):
    """ComfyUI's partial unloading sets LowVramPatch on every block Linear of the LoRA'd model; each call binds
    the weights patched as ComfyUI patches them: every block from its graph, 0 compiles, equal to eager."""
    rows = low_vram["lowvram"]
    assert [row["strength"] for row in rows] == [1.0, 1.0, 0.5, 0.5]
    for row in rows:
        assert row["lowvram_layers"] >= 20, row  # ComfyUI's own mechanics patched them per call
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, row
        assert row["graph_calls"] == low_vram["report"]["blocks"] and row["eager_calls"] == 0, row
        assert row["finite"] and row["diff"] < TOLERANCE * max(1.0, row["scale"]), row
    assert low_vram["changed_by_lora"] > 100 * TOLERANCE  # the per-call LoRA took effect
    # each weight patched for a call is freed after it: torch's user-managed constants kept every one (on the H200
    # a partly loaded Flux peaked at 11396 MB for a model of 1311 MB)
    assert low_vram["per_call_tensors"] > 0 and low_vram["per_call_tensors_kept"] == 0, low_vram["per_call_tensors"]
