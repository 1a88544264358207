"""ComfyUI's Wan VAE (Wan 2.1/2.2 and Qwen-Image's VAE class) is served chunk by chunk from graphs (needs
COMFYUI_PATH).

Wan's VAE decodes one latent frame at a time and encodes 1, then 4 frames at a time, keeping a feature cache
between chunks; read as one graph, its frame axis was taken for a spatial side and every call ran eager.
kf_video_vae.py runs a tiny Wan 2.1 VAE built by `comfy.sd.VAE` from a state dict through VAE Speedup: Save
Graph before any video builds the chunk graphs of an example video (one per cache state and operation), then
decode at three frame counts and two sizes and encode at three frame counts and two sizes, at batch 1 and 2
(a video at a time), compile nothing and equal the VAE without the node; a new process with other weights loads
the graphs and compiles nothing.
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

TOLERANCE = 1e-4  # float32 pixels in [-1, 1]
CACHE_STATES = 3  # first chunk, second chunk, every later chunk (compiler/cached_steps.py)


def _run(base, phase: str) -> dict:
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_video_vae.py"), str(S.REPO), str(base), phase],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=3000,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("wan-vae")
    (base / "models" / "graphs").mkdir(parents=True)
    first = _run(base, "first")
    return first, _run(base, "restart")


def test_it_is_comfyuis_video_vae(runs):
    first, _ = runs
    assert first["model"] == "WanVAE" and first["latent_dim"] == 3, first


def test_save_graph_before_any_video_builds_one_graph_per_cache_state_and_operation(runs):
    first, _ = runs
    assert first["save_events"]["compile"] == 2 * CACHE_STATES, first["save_report"]
    assert first["save_events"]["fallback"] == 0, first["save_report"]
    graphs = [f for f in first["files"] if f.count("/") >= 3]  # models/graphs/<folder>/<graph>.json
    assert len(graphs) == 2 * CACHE_STATES, first["files"]


def test_frame_counts_and_sizes_compile_nothing_and_equal_eager(runs):
    first, _ = runs
    for row in first["rows"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, (row["reasons"], row)
        assert row["events"]["mismatch"] == 0, row
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row


def test_a_restart_loads_the_chunk_graphs_and_compiles_nothing(runs):
    _, restart = runs
    assert restart["load_events"]["compile"] == 0, restart["load_report"]
    assert restart["load_events"]["load"] == 2 * CACHE_STATES, restart["load_report"]
    for row in restart["rows"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, (row["reasons"], row)
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row
