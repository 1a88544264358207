"""ComfyUI's AutoencoderKL VAE serves every size from one graph per operation, whatever attention ComfyUI
picked (needs COMFYUI_PATH).

On a CPU ComfyUI's VAE attention is split attention (`normal_attention`),
which slices by free memory; traced as it is, it gave a graph per latent
area. A graph now computes ComfyUI's pytorch_attention for it (eager calls
keep ComfyUI's choice). kf_vae.py runs a tiny AutoencoderKL built from a
config with ComfyUI's own classes through VAE Speedup: the first decode and
the first encode each compile (with the range corners), then three other sizes (batch 1
and 2) run with zero compiles and zero fallbacks, equal to the VAE without
the node. Once with ComfyUI's default attention, once with
--use-pytorch-cross-attention.
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

TOLERANCE = 1e-4  # float32 outputs of scale ~1; the graph's attention differs from split attention by ~1e-6
MODES = {"default": ([], "normal_attention"), "pytorch": (["--use-pytorch-cross-attention"], "pytorch_attention")}


@pytest.fixture(scope="module", params=list(MODES))
def findings(request, tmp_path_factory):
    flags, _ = MODES[request.param]
    base = tmp_path_factory.mktemp(f"vae-{request.param}")
    (base / "models" / "graphs").mkdir(parents=True)
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_vae.py"), str(S.REPO), str(base), *flags],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return request.param, json.loads(lines[-1][len("KEEPFAST-RESULT "):])


def test_comfyui_picked_the_attention_of_its_mode_and_keeps_it(findings):
    mode, found = findings
    assert found["attention"] == [MODES[mode][1]]
    assert found["attention_after"] == found["attention"]  # swapped only while a graph was traced


def test_one_graph_per_operation_serves_every_size(findings):
    _, found = findings
    for op in ("decode", "encode"):
        rows = [row for row in found["rows"] if row["op"] == op]
        first, rest = rows[0], rows[1:]
        # The first call compiles its graph, and one for a range corner the graph's guards leave out
        # (export specializes a batch-1 example to batch 1); every later size is served.
        assert first["events"]["compile"] >= 1 and first["events"]["fallback"] == 0, first
        assert all("first call" in reason or "range corner" in reason for reason in first["reasons"]), first
        for row in rest:
            assert row["events"] == {"compile": 0, "load": 0, "fallback": 0, "refused": 0}, row


def test_outputs_equal_the_vae_without_the_node(findings):
    _, found = findings
    for row in found["rows"]:
        width, height, batch = row["call"]
        expected = [batch, 4, height // 8, width // 8] if row["op"] == "encode" else [batch, height, width, 3]
        assert row["shape"] == expected, row
        assert row["scale"] > 0.01 and row["diff"] < TOLERANCE, row
