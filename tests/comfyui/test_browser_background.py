"""The page while graphs build in the background, in a real browser (needs COMFYUI_PATH, Debian's chromium
and node; skipped with the reason otherwise, as test_browser.py).

The bundled txt2img workflow with the nodes' defaults (`build`: in the background), queued from the page on a
ComfyUI of its own: the prompt finishes with the UNet uncompiled; the Model Speedup's badge then shows the
build ("building 1 of 1 in background", a bar), from events that name no running node (no prompt runs),
and ends "built: serves from the next step". Screenshots node-building.png and node-built.png.
"""

from __future__ import annotations

import pytest

from test_browser import MODEL_SPEEDUP, artifacts, page_server, txt2img_phase  # noqa: F401  (fixtures)

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def watched(page_server, artifacts) -> dict:
    return txt2img_phase(page_server, artifacts, "background", {})  # build: its default


def test_the_prompt_finishes_uncompiled_while_the_graph_builds(watched, page_server):
    assert watched["done"]["ok"] is True, watched["done"]
    counts = page_server.counts()
    assert counts["unet_eager_calls"] > 0 and counts["unet_graph_calls"] == 0, counts


def test_the_badge_follows_the_build_until_it_is_built(watched):
    building = watched["building"]
    assert building and building["text"] == "building 1 of 1 in background", watched["seen"]
    progress = [e for e in watched["events"] if e["kind"] == "building"]
    assert progress and all(e["node"] is None and e["total"] == 1 for e in progress), progress
    assert watched["built"] and watched["built"]["text"] == "built: serves from the next step", watched["seen"]
    states = [s["state"] for s in watched["seen"] if s["node"] == MODEL_SPEEDUP]
    assert states.index("building") < states.index("built"), states
    assert watched["screenshots"] == ["node-building.png", "node-built.png"]
