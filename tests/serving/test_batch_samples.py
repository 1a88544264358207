"""A VAE's batch served one image at a time by the graph of one image (compiler/serving/samples.py).

A diffusers AutoencoderKL with 16 latent channels (the layout of Flux's and SD3's VAE, tiny widths): on
this CPU torch's fake convolution guards on the batch, so the graph traced for one image serves one image
only, and before this each side of that guard cost a compile. Now one graph serves every batch size,
image by image, equal to eager, and the first-use check compares the joined batch with eager's.
TAESD (no batch guard here) shows the other side: a batch the graph's guards accept runs in one call.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.utils._pytree as pytree

from compiler import ShapeRange, compile_pipe
from compiler.backends import aot
from compiler.diffusers_api import compiled_parts
from compiler.store.registry import GraphRegistry
from compiler.serving.samples import CannotJoin, join_samples, samples_of
from compiler.keys.signature import FlatCall

RANGE = ShapeRange(batch=(1, 4), spatial=(8, 16))
ORDER = [(2, 16), (1, 8), (3, 12), (4, 16), (1, 16)]  # (batch, latent side): two images first


class Decoding:
    """A compiled tiny VAE, its uncompiled twin, and the batch of every graph run."""

    def __init__(self, vae, latent_channels: int, monkeypatch):
        self.vae, self.twin, self.latent_channels = vae, copy.deepcopy(vae), latent_channels
        self.registry = GraphRegistry()
        pipe = SimpleNamespace(vae=vae)
        compile_pipe(pipe, shape_range=RANGE, ignores=("vae.encoder",), registry=self.registry)
        self.decoder = compiled_parts(pipe)["vae.decoder"]
        self.runs = []
        self.offset = 0.0  # a test-only fault: added to every graph output when set
        run = aot.AotGraph.run

        def counted(graph, module, call, replay=False):
            self.runs.append(call.shapes[0][0])
            return pytree.tree_map_only(torch.Tensor, lambda t: t + self.offset, run(graph, module, call, replay))

        monkeypatch.setattr(aot.AotGraph, "run", counted)

    def decode(self, batch: int, side: int):
        """(largest difference from eager, the batch of each graph run the decode made)."""
        latent = torch.randn(batch, self.latent_channels, side, side, generator=torch.Generator().manual_seed(side))
        before = len(self.runs)
        with torch.no_grad():
            got, want = self.vae.decode(latent).sample, self.twin.decode(latent).sample
        assert got.shape == want.shape
        return float((got - want).abs().max()), self.runs[before:]


@pytest.fixture(scope="module")
def flux_like():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=16, norm_num_groups=8,
                        layers_per_block=1).eval()
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield Decoding(vae, 16, monkeypatch)


def test_one_graph_serves_every_batch_one_image_at_a_time(flux_like):
    for batch, side in ORDER:
        difference, runs = flux_like.decode(batch, side)
        assert difference < 1e-4, (batch, side, difference)
        assert runs == [1] * batch, (batch, runs)  # one image per graph run (plus none for eager)
    registry = flux_like.registry
    assert len(registry.compiles) == 1 and registry.compiles[0].detail["shapes"][0][0] == 1
    assert registry.fallbacks == [] and registry.mismatches == []
    assert flux_like.decoder.graph_calls == len(ORDER) and flux_like.decoder.eager_calls == 0
    (graph,) = registry.graphs()
    assert "L['flat'][0].size()[0] == 1" in graph.info.guards  # the batch guard that makes it one image


def test_a_graph_wrong_for_one_image_is_caught_in_a_batch_and_retired_for_batches_of_it(flux_like):
    flux_like.offset = 0.5
    try:
        difference, runs = flux_like.decode(2, 12)  # new shapes: checked, caught, eager's output returned
        assert difference == 0.0 and runs == [1, 1]
        assert len(flux_like.registry.mismatches) == 1
        assert flux_like.registry.mismatches[0].detail["shapes"] == [[2, 16, 12, 12]]
        difference, runs = flux_like.decode(1, 12)  # one image of those shapes: checked on its own, caught
        assert difference == 0.0 and len(flux_like.registry.mismatches) == 2
        difference, runs = flux_like.decode(3, 12)  # checked right before, but its images are retired: not run
        assert difference == 0.0 and runs == []
        assert "disagrees with eager" in flux_like.decoder.last.reason
        assert len(flux_like.registry.compiles) == 1
    finally:
        flux_like.offset = 0.0


def test_a_batch_the_graph_takes_whole_runs_in_one_call(monkeypatch):
    from diffusers import AutoencoderTiny

    torch.manual_seed(0)
    vae = AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                          num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4).eval()
    taesd = Decoding(vae, 4, monkeypatch)
    taesd.decode(1, 8)
    for batch, side in ORDER:
        difference, runs = taesd.decode(batch, side)
        assert difference < 1e-4 and runs == [batch], (batch, side, runs)
    assert len(taesd.registry.compiles) == 1 and taesd.registry.fallbacks == []


def _call(*tensors):
    return FlatCall(tuple(tensors), {})


def test_a_call_splits_only_along_one_batch_size():
    assert samples_of(_call(torch.zeros(1, 4, 8, 8))) is None
    assert samples_of(_call(torch.zeros(2, 4, 8, 8), torch.zeros(1, 3))) is None  # a broadcast: not split
    latent, context = torch.randn(3, 4, 8, 8), torch.randn(3, 7, 5)
    samples = samples_of(_call(latent, context))
    assert [s.shapes for s in samples] == [[(1, 4, 8, 8), (1, 7, 5)]] * 3
    assert torch.equal(samples[2].tensors[0], latent[2:3]) and torch.equal(samples[1].tensors[1], context[1:2])
    assert samples[0].signature.tensors == _call(latent[:1], context[:1]).signature.tensors


def test_outputs_join_along_the_batch_or_say_why_not():
    a, b = torch.ones(1, 3), torch.zeros(1, 3)
    joined = join_samples([(a, {"n": 2}), (b, {"n": 2})])
    assert torch.equal(joined[0], torch.cat([a, b])) and joined[1] == {"n": 2}
    with pytest.raises(CannotJoin):
        join_samples([(a,), (a, b)])
    with pytest.raises(CannotJoin):
        join_samples([(a, {"n": 1}), (b, {"n": 2})])
    with pytest.raises(CannotJoin):
        join_samples([a, torch.ones(1, 4)])
