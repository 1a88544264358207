"""A float16 VAE that runs upcast to float32 loads its float32 graph: no dtype crash."""

from __future__ import annotations

import torch

from compiler import GraphRegistry, ShapeRange, load_pipe, save_pipe
from compiler.diffusers_api import compiled_parts
from compiler.testing.tiny_models import tiny_sd_pipeline
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
