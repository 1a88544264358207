"""Kandinsky 5's videos past 8192 tokens served by the block graphs (needs COMFYUI_PATH); kf_kandinsky.py runs
ComfyUI's Kandinsky5 class in small in ComfyUI's Python."""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

STEPS = 2


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("kandinsky")
    (base / "models" / "graphs").mkdir(parents=True)
    return S.run_script("kf_kandinsky.py", base)


def test_text_and_visual_blocks_compile_once_and_cover_the_range(findings):
    first = findings["rows"][0]
    assert first["events"]["compile"] == 2 and first["events"]["fallback"] == 0, first
    assert set(findings["structures"]) == {"TransformerEncoderBlock", "TransformerDecoderBlock"}
    for structure in findings["structures"].values():
        assert structure["status"] == "compiled graph" and structure["notes"] == [], structure  # no corner left out


def test_a_video_past_8192_tokens_is_served_by_the_same_graphs(findings):
    large = findings["rows"][1]
    events = large["events"]
    assert events["compile"] == 0 and events["fallback"] == 0 and events["block_eager_calls"] == 0, large
    assert S.model_calls_from_graphs(findings, events) == STEPS, large
    for row in findings["rows"]:
        assert row["diff"] <= 1e-4 * max(1.0, row["scale"]), row
