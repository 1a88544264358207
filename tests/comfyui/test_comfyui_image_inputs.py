"""Image inputs beside the prompt with Model Speedup (needs COMFYUI_PATH): reference images (Flux Kontext, Flux 2
edits through ComfyUI's ReferenceLatent), Wan 2.2 5B's start image (Wan22ImageToVideoLatent), HunyuanVideo 1.5's
image-to-video (the image's latent and SigLIP features) and LTXV's and LTX-2's (LTXVImgToVideoInplace).

Run in ComfyUI's Python by kf_image_inputs.py. A reference image adds its tokens to the image's, within the node's
range: served by the block graphs with no compile, equal to the model without the node; past the range: eager,
saying which tokens and which node input covers them. Wan 2.2's 5B with a start image takes a timestep per latent
frame (its blocks' modulation gains a frames axis): before, that ran every block eager ("shape guard
e.shape[1] == 1 does not hold"); now the same graph serves it and text-to-video. LTXV and LTX-2 with a start image
give every token its own timestep: before, every block ran eager ("shape guard timestep.shape[1] == 1 does not
hold"); now one graph serves both forms.
"""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

STEPS = 2


_RUNS: dict = {}


def _findings(family: str, tmp_path_factory) -> dict:
    if family not in _RUNS:
        _RUNS[family] = S.run_family_script("kf_image_inputs.py", tmp_path_factory, family)
    return _RUNS[family]


@pytest.fixture(params=["flux", "flux2"])
def references(request, tmp_path_factory) -> dict:
    return _findings(request.param, tmp_path_factory)


@pytest.fixture
def start_image(tmp_path_factory) -> dict:
    return _findings("wan22", tmp_path_factory)


@pytest.fixture
def image_to_video(tmp_path_factory) -> dict:
    return _findings("hunyuan-video15", tmp_path_factory)


@pytest.fixture(params=["ltxv", "ltxav"])
def ltx_start_image(request, tmp_path_factory) -> dict:
    return _findings(request.param, tmp_path_factory)


def _served(findings, row) -> bool:
    events = row["events"]
    return (events["compile"] == 0 and events["fallback"] == 0 and events["block_eager_calls"] == 0
            and S.model_calls_from_graphs(findings, events) == STEPS and row["diff"] <= 1e-4 * max(1.0, row["scale"]))


def _first_compiles(findings) -> None:
    first = findings["rows"][0]
    assert first["events"]["compile"] >= 1 and first["events"]["fallback"] == 0, first
    assert first["diff"] <= 1e-4 * max(1.0, first["scale"]), first


def test_references_in_range_are_served_with_no_compile(references):
    _first_compiles(references)
    assert [len(row["call"][2]) for row in references["rows"][1:3]] == [1, 2]
    for row in references["rows"][1:-1]:
        assert _served(references, row), row


def test_references_past_the_range_run_eager_saying_what_covers_them(references):
    last = references["rows"][-1]
    events = last["events"]
    assert events["compile"] == 0 and events["block_graph_calls"] == 0 and events["block_eager_calls"] > 0, last
    assert last["diff"] == 0.0, last  # eager is the model's own call
    assert last["fallbacks"] and all("reference image" in reason and "max_resolution" in reason
                                     for reason in last["fallbacks"]), last


def test_wan22_start_image_and_text_to_video_share_the_graph(start_image):
    _first_compiles(start_image)
    assert [row["call"][3] for row in start_image["rows"]] == [False, True, True, False]
    for row in start_image["rows"][1:]:
        assert _served(start_image, row), row


def test_hunyuan_video15_image_to_video_with_a_long_prompt_is_served(image_to_video):
    """The start image's 729 SigLIP tokens join the prompt's: a 400-token prompt makes 1129 text tokens, which the
    family's text range holds (1024 + 729)."""
    _first_compiles(image_to_video)
    assert [(row["call"][3], row["call"][4]) for row in image_to_video["rows"]] == [
        (False, 7), (True, 7), (True, 7), (True, 400)]
    for row in image_to_video["rows"][1:]:
        assert _served(image_to_video, row), row


def test_ltx_start_image_and_text_to_video_share_the_graph(ltx_start_image):
    """A timestep a token (an image guiding the first frame) and one a sample, on one graph; LTX-2 with its audio."""
    _first_compiles(ltx_start_image)
    assert [row["call"][3] for row in ltx_start_image["rows"]] == [False, True, True, False]
    for row in ltx_start_image["rows"][1:]:
        assert _served(ltx_start_image, row), row
