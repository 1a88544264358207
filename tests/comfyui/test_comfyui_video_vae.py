"""ComfyUI's video VAEs served from graphs (needs COMFYUI_PATH): Wan's (Wan 2.1/2.2 and Qwen-Image's VAE class)
chunk by chunk, LTX-Video's whole, frames its own axis.

Wan's VAE decodes one latent frame at a time and encodes 1, then 4 frames at a time, keeping a feature cache
between chunks; read as one graph, its frame axis was taken for a spatial side and every call ran eager.
kf_video_vae.py runs a tiny Wan 2.1 VAE built by `comfy.sd.VAE` from a state dict through VAE Speedup: Save
Graph before any video builds the chunk graphs of an example video (one per cache state and operation), then
decode at three frame counts and two sizes and encode at three frame counts and two sizes, at batch 1 and 2
(a video at a time), compile nothing and equal the VAE without the node; a new process with other weights loads
the graphs and compiles nothing.
Wan 2.2's VAE (ComfyUI's vae2_2 classes through ComfyUI's own loader branch, widths cut, kf_video_vae.py) is
served the same way.
LTX-Video's VAE decodes a whole video in one pass (causal 3-D convolutions): one graph per operation, frames a
dynamic axis, built by Save Graph before any video from an example of 9 frames (2 latent), then other frame
counts, sizes and batches, and after a restart, the same.
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
CACHE_STATES = 3  # first chunk, second chunk, every later chunk (compiler/serving/cached_steps.py)
# kind -> (ComfyUI's class, graphs per operation)
KINDS = {"wan": ("WanVAE", CACHE_STATES), "wan22": ("WanVAE", CACHE_STATES), "ltxv": ("VideoVAE", 1)}


def _run(base, phase: str, kind: str) -> dict:
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_video_vae.py"), str(S.REPO), str(base), phase, kind],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=3000,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


@pytest.fixture(scope="module", params=list(KINDS))
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"{request.param}-vae")
    (base / "models" / "graphs").mkdir(parents=True)
    first = _run(base, "first", request.param)
    return request.param, first, _run(base, "restart", request.param)


def test_it_is_comfyuis_video_vae(runs):
    kind, first, _ = runs
    assert first["model"] == KINDS[kind][0] and first["latent_dim"] == 3, first


def test_save_graph_before_any_video_builds_the_graphs_of_each_operation(runs):
    kind, first, _ = runs
    per_op = KINDS[kind][1]
    assert first["save_events"]["compile"] == 2 * per_op, first["save_report"]
    assert first["save_events"]["fallback"] == 0, first["save_report"]
    graphs = [f for f in first["files"] if f.count("/") >= 3]  # models/graphs/<folder>/<graph>.json
    assert len(graphs) == 2 * per_op, first["files"]


def test_frame_counts_and_sizes_compile_nothing_and_equal_eager(runs):
    _, first, _ = runs
    for row in first["rows"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, (row["reasons"], row)
        assert row["events"]["mismatch"] == 0, row
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row


def test_a_restart_loads_the_graphs_and_compiles_nothing(runs):
    kind, _, restart = runs
    assert restart["load_events"]["compile"] == 0, restart["load_report"]
    assert restart["load_events"]["load"] == 2 * KINDS[kind][1], restart["load_report"]
    for row in restart["rows"]:
        assert row["events"]["compile"] == 0 and row["events"]["fallback"] == 0, (row["reasons"], row)
        assert row["shape"] == row["want_shape"] and row["diff"] < TOLERANCE, row
