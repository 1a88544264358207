"""A graph traced at 2 where the call has 1 must not serve 1 unless its guards were recorded honestly.

ComfyUI's TAESD decoder (diffusers' AutoencoderTiny is the same network), traced for a batch-1 decode at
batch 2 with size-oblivious tracing, accepted batch 1 and returned two images for one: the trace assumed a
size is never 1 and recorded no guard for it. The first-use check caught it in ComfyUI's default template;
here the graphs must be right without it: batch 1 and 2 decodes equal eager with verification off.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from compiler import ShapeRange, compile_pipe
from compiler.diffusers_api import compiled_parts
from compiler.registry import GraphRegistry


def _tiny_autoencoder(seed: int = 0):
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    return AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                           num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4).eval()


def test_a_batch_one_decode_and_then_batch_two_equal_eager_without_the_first_use_check():
    vae = _tiny_autoencoder()
    twin = copy.deepcopy(vae)
    registry = GraphRegistry()
    pipe = SimpleNamespace(vae=vae)
    compile_pipe(pipe, shape_range=ShapeRange(batch=(1, 2), spatial=(8, 16)),
                 ignores=("vae.encoder",), registry=registry, verify=False)
    with torch.no_grad():
        for batch, side in [(1, 16), (2, 8), (1, 12)]:
            latent = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(side))
            got, want = vae.decode(latent).sample, twin.decode(latent).sample
            assert got.shape == want.shape, (batch, side, got.shape, want.shape)
            assert float((got - want).abs().max()) < 1e-4, (batch, side)
    assert registry.fallbacks == [], [e.reason for e in registry.fallbacks]
    assert compiled_parts(pipe)["vae.decoder"].graph_calls == 3
