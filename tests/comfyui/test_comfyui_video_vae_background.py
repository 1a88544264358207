"""Wan's VAE through VAE Speedup with its default `build` (in the background), in ComfyUI's own Python (needs
COMFYUI_PATH; kf_video_vae.py, phase `background`).

Wan decodes a video one latent frame at a time with a feature cache: one graph per cache state (first chunk,
second chunk, every later chunk: compiler/serving/cached_steps.py), each built in a child process while decodes run
uncompiled. The first decode returns what the VAE without the node returns and starts the builds; no decode
waits for a build; each decode takes in the builds finished by then (recorded as built in the background),
and once all are in, decodes at other sizes, frame counts and batches compile nothing, fall back nowhere and equal the VAE
without the node.
"""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

from test_comfyui_video_vae import CACHE_STATES, TOLERANCE, _run  # noqa: E402

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    base = tmp_path_factory.mktemp("wan-vae-background")
    (base / "models" / "graphs").mkdir(parents=True)
    return _run(base, "background", "wan")


def test_the_first_decodes_run_uncompiled_while_the_chunk_graphs_build(background):
    # The first decode (3 latent frames) meets every cache state: one build each, queued one at a time.
    assert background["started_by_first"] == CACHE_STATES, background
    (first,) = background["first_rows"]
    assert any("building in the background" in reason for reason in first["reasons"]), first["reasons"]
    for row in background["first_rows"] + background["second_rows"]:
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row


def test_once_built_every_decode_runs_from_the_chunk_graphs(background):
    assert background["building_at_end"] == 0
    # Each decode takes in the builds finished by then: every graph was built in the background, none here.
    taken_in = background["first_rows"] + background["second_rows"] + background["landing_rows"]
    compiles = [r for row in taken_in for r in row["reasons"] if "first call" in r]
    assert sum(row["events"]["compile"] for row in taken_in) == CACHE_STATES == len(compiles), taken_in
    assert all("built in the background" in reason for reason in compiles), compiles
    (landing,) = background["landing_rows"]
    assert landing["events"]["fallback"] == 0 and landing["diff"] < TOLERANCE, landing
    for row in background["rows"]:
        assert row["events"] == {"compile": 0, "load": 0, "fallback": 0, "refused": 0, "mismatch": 0}, row
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row
    assert background["counts"]["mismatch"] == 0
