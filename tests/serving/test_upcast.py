"""A VAE runs in the dtypes its pipeline gives it, and save_pipe builds those: no dtype crash, no compile
after a restart.

- A float16 VAE that runs upcast to float32 loads its float32 graph.
- A float32 VAE in a bfloat16 img2img pipeline: diffusers encodes upcast (float32), then casts
  the VAE to the pipeline's dtype and decodes in it (bfloat16); a float16 one upcasts again (float16 with
  force_upcast). save_pipe before any image builds those; a restart loads them and compiles nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from compiler import GraphRegistry, ShapeRange, load_pipe, save_pipe
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import tiny_sd_pipeline
from tests.support.inputs import latents

VAE_ONLY = ("unet", "vae.encoder")
RANGE = ShapeRange(batch=(1, 1), spatial=(8, 16), sequence=(1, 77))


def test_save_writes_both_dtypes_and_an_upcast_vae_loads_its_graph(tmp_path):
    graphs = tmp_path / "graphs"
    pipe = tiny_sd_pipeline(seed=0, vae_dtype=torch.float16)
    assert pipe.vae.config.force_upcast and pipe.vae.dtype == torch.float16
    report = save_pipe(pipe, graphs, shape_range=RANGE, ignores=VAE_ONLY, registry=GraphRegistry())
    assert report.problems == []
    assert any("(float16)" in line for line in report.saved), report.saved
    assert any("(float32)" in line for line in report.saved), report.saved
    assert pipe.vae.dtype == torch.float16  # saving did not leave it upcast

    registry = GraphRegistry()
    fresh = tiny_sd_pipeline(seed=0, vae_dtype=torch.float16)
    loaded = load_pipe(fresh, graphs, shape_range=RANGE, ignores=VAE_ONLY, registry=registry)
    assert loaded.problems == []
    fresh.vae.to(torch.float32)  # what diffusers' upcast does before decoding
    decoder = compiled_parts(fresh)["vae.decoder"]
    with torch.no_grad():
        for shape in [(1, 16, 16), (1, 8, 16)]:
            z = latents(*shape)
            out = fresh.vae.decode(z).sample
            ref = decoder.eager(fresh.vae.post_quant_conv(z))
            assert out.dtype == torch.float32
            assert float((out - ref).abs().max()) < 1e-4
    assert registry.compiles == [] and registry.fallbacks == []
    assert decoder.graph_calls == 2


ROOT = Path(__file__).resolve().parents[2]
BFLOAT16_TOLERANCE = 3e-2  # images in [0, 1], rounded to 8 bits


# bfloat16: the case with two decoder dtypes (the VAE cast to the pipeline's dtype). A float16 pipeline decodes
# upcast (force_upcast) on the float32 graph, which the test above and the fp16_vae restart of
# test_api_sequences.py load.
def test_a_float32_vae_in_a_bfloat16_img2img_pipeline_restarts_with_zero_compiles(tmp_path):
    from tests.support import api_sequence

    kind = "img2img_bfloat16"
    graphs = tmp_path / "graphs"
    pipe = api_sequence.build(kind, seed=0)
    assert pipe.vae.dtype == torch.float32 and pipe.unet.dtype == torch.bfloat16
    report = save_pipe(pipe, graphs, shape_range=api_sequence.RANGE, ignores=api_sequence.IGNORES[kind],
                       registry=GraphRegistry())
    assert report.problems == [], report
    saved = sorted({line.split(" -> ")[0] for line in report.saved})  # range corners may add a graph
    assert saved == ["vae.decoder (bfloat16)", "vae.decoder (float32)", "vae.encoder (float32)"], saved

    result = subprocess.run([sys.executable, "-m", "tests.support.api_sequence", str(graphs), "load_alone", kind],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    restarted = json.loads(result.stdout.strip().splitlines()[-1])
    assert restarted["compiles"] == [] and restarted["fallbacks"] == [], restarted
    assert restarted["graph_calls"]["vae.decoder"] > 0 and restarted["graph_calls"]["vae.encoder"] > 0, restarted
    assert restarted["max_diff"] < BFLOAT16_TOLERANCE, restarted
