"""ComfyUI's context windows with Model Speedup (needs COMFYUI_PATH).

Every window's call is served by the graphs with no compile (a window is a shorter batch or fewer frames, inside
the node's range), in either node order, and the fused latent matches the context windows on the model without
the pack's node. Before, an SD-style UNet under context windows ran every call eager ("transformer_options
carries context_window"). Run in ComfyUI's Python by kf_context_windows.py for SD1.5 (windows over the batch) and
Wan (windows over frames).
"""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

STEPS = 2  # kf_context_windows.STEPS
# The model's input per window call: SD1.5, 2 of 4 latents with cond and uncond batched; Wan, 3 of 5 latent frames.
WINDOW_INPUT = {"sd15": [4, 4, 16, 16], "wan": [2, 16, 3, 16, 16]}
WINDOWS = {"sd15": 3, "wan": 2}


@pytest.fixture(scope="module", params=["sd15", "wan"])
def findings(request, tmp_path_factory) -> dict:
    return S.run_family_script("kf_context_windows.py", tmp_path_factory, request.param)



def test_the_model_is_called_on_windows(findings):
    family = findings["family"]
    assert findings["window_calls"] == [WINDOW_INPUT[family]] * (WINDOWS[family] * STEPS)
    assert findings["warm"]["compile"] >= 1 and S.model_calls_from_graphs(findings, findings["warm"]) == STEPS


def test_every_window_is_served_by_graphs_with_no_compile_in_either_order(findings):
    assert {row["order"] for row in findings["rows"]} == {"windows, then speedup", "speedup, then windows"}
    for row in findings["rows"]:
        events = row["events"]
        assert events["compile"] == 0 and events["fallback"] == 0 and events["refused"] == 0, row
        assert events["eager_calls"] == 0 and events["block_eager_calls"] == 0, row
        assert S.model_calls_from_graphs(findings, events) == WINDOWS[findings["family"]] * STEPS, row
    assert findings["fallbacks"] == []


def test_the_fused_latent_matches_the_windows_without_the_pack(findings):
    for row in findings["rows"]:
        assert row["diff"] <= 1e-4 * max(1.0, row["scale"]), row
