"""ComfyUI's TorchCompileModel on the same model as Model Speedup (needs COMFYUI_PATH).

In either node order the pack's graphs serve the model, TorchCompileModel's wrapper never runs, and one note per
Speedup node says so; the latents match the model without either node. Before, torch.compile traced into the
pack's serving code (a first call of 374 s against 76 s, recompile limits hit in the pack's build code). Run in
ComfyUI's Python by kf_other_compilers.py for SD1.5 (a whole-model graph) and Flux (block graphs).
"""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

STEPS = 2  # kf_other_compilers: two sampling steps a call


@pytest.fixture(scope="module", params=["sd15", "flux"])
def findings(request, tmp_path_factory) -> dict:
    return S.run_family_script("kf_other_compilers.py", tmp_path_factory, request.param)


def test_the_packs_graphs_serve_every_call_in_either_order(findings):
    assert {row["order"] for row in findings["rows"]} == {"torch.compile, then speedup", "speedup, then torch.compile"}
    for row in findings["rows"]:
        events = row["events"]
        assert events["fallback"] == 0 and events["refused"] == 0, row
        assert events["eager_calls"] == 0 and events["block_eager_calls"] == 0, row
        assert S.model_calls_from_graphs(findings, events) == STEPS, row
    assert findings["fallbacks"] == []


def test_torch_compile_is_skipped_and_never_compiles(findings):
    rows = findings["rows"]
    assert all(row["events"]["torch_compile_calls"] == 0 for row in rows), rows
    assert rows[0]["events"]["compile"] >= 1  # the pack's own graphs, once
    assert all(row["events"]["compile"] == 0 for row in rows[1:]), rows


def test_one_note_per_speedup_node_says_why(findings):
    notes = [note for note in findings["notes"] if "TorchCompileModel" in note]
    assert len(notes) == 2, findings["notes"]
    assert all("torch.compile is skipped" in note and "remove one of the two nodes" in note for note in notes)


def test_the_latents_match_the_model_without_either_node(findings):
    for row in findings["rows"]:
        assert row["diff"] <= 1e-4 * max(1.0, row["scale"]), row
