"""A timestep once per sample or once per token, served by one block graph (compiler/blocks/family.py).

LTXV and LTX-2 in ComfyUI give every token its own timestep where an image guides frames, and one per sample
otherwise: the block's modulation input is `[batch, tokens, ...]` or `[batch, 1, ...]`. A graph traced from one
form ran the other eager ("shape guard timestep.shape[1] == 1 does not hold"). A family names such inputs
(`timestep_rows`); its example calls send one a token, the dimension becomes a timestep's rows (bounds 1 to the
tokens' highest), and what the graph computes spreads the rows over the tokens (`spread_rows`). Here a tiny model
of that shape goes through the real block engine: one compile, both forms from the graph, equal to eager.
"""

from __future__ import annotations

import pytest
import torch

from compiler import GraphRegistry, ShapeRange
from compiler.blocks import BlockEngine, BlockFamily, BlockOptions, Dims, Geometry
from compiler.blocks import tokens as T
from compiler.blocks.family import spread_rows

WIDTH, CHANNELS = 16, 4


class ModulatedBlock(torch.nn.Module):
    """As LTXV's block: shift and scale from a table plus the timestep's rows, one per sample or per token."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(2, WIDTH) * 0.1)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x, timestep=None):
        shift, scale = (self.table[None, None] + timestep.reshape(x.shape[0], timestep.shape[1], 2, -1)).unbind(2)
        return x + self.proj(torch.nn.functional.layer_norm(x, (WIDTH,)) * (1 + scale) + shift)


class RowsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(CHANNELS, WIDTH)
        self.time = torch.nn.Linear(1, 2 * WIDTH)
        self.blocks = torch.nn.ModuleList([ModulatedBlock() for _ in range(3)])
        self.out = torch.nn.Linear(WIDTH, CHANNELS)

    def forward(self, latent, t):
        """latent [B, C, H, W]; t [B] (one timestep a sample) or [B, H * W] (one a token)."""
        x = self.embed(latent.flatten(2).transpose(1, 2))
        rows = t.reshape(t.shape[0], -1, 1)
        timestep = self.time(rows)
        for block in self.blocks:
            x = block(x, timestep=timestep)
        return self.out(x).transpose(1, 2).reshape(latent.shape)


class RowsFamily(BlockFamily):
    name = "rows-test"
    geometry = Geometry(patch=1)
    spatial_multiple = 1
    block_classes = ("ModulatedBlock",)
    timestep_rows = ("timestep",)

    def example_call(self, model, dims: Dims):
        tokens = self.geometry.tokens(dims)
        latent = torch.randn(dims.batch, CHANNELS, dims.height, dims.width)
        return (latent, torch.linspace(0.2, 0.8, tokens).expand(dims.batch, tokens).contiguous()), {}

    def row_tokens(self, arguments):
        return {"timestep": arguments["x"].shape[1]}


def test_spread_rows_gives_every_token_its_row():
    per_sample = torch.arange(2.0).reshape(2, 1, 1)
    assert torch.equal(spread_rows(per_sample, 3), per_sample.expand(2, 3, 1))
    per_token = torch.arange(6.0).reshape(2, 3, 1)
    assert torch.equal(spread_rows(per_token, 3), per_token)


def test_a_timestep_s_rows_reach_down_to_one_and_follow_their_tokens():
    roles = T.rows_roles({"timestep": {0: "batch", 1: "tokens"}, "x": {0: "batch", 1: "tokens"}}, ["timestep"])
    assert roles == {"timestep": {0: "batch", 1: "rows:tokens"}, "x": {0: "batch", 1: "tokens"}}
    block_range = ShapeRange(batch=(1, 4), spatial=(2, 8), sequence=(1, 8), tokens=(4, 64))
    assert T.role_bounds("rows:tokens", block_range) == (1, 64)
    assert T.role_words("rows:tokens").startswith("timestep rows (one, or one for each of the image tokens")
    counts = T.role_values({T.BATCH: 2, T.TOKENS: 20, T.SEQUENCE: 7})
    assert T.shapes_at([(2, 9, 32)], ["timestep"], roles, counts) == [(2, 20, 32)]
    counts = T.role_values({T.BATCH: 2, T.TOKENS: 20, T.SEQUENCE: 7, "rows:tokens": 1})
    assert T.shapes_at([(2, 9, 32)], ["timestep"], roles, counts) == [(2, 1, 32)]


@pytest.fixture(scope="module")
def served():
    torch.manual_seed(0)
    model = RowsModel().eval()
    reference = RowsModel().eval()
    reference.load_state_dict(model.state_dict())
    registry = GraphRegistry()
    options = BlockOptions(shape_range=ShapeRange(batch=(1, 3), spatial=(2, 8), sequence=(1, 8)))
    engine = BlockEngine(model, RowsFamily(), options, registry)
    engine.install()
    return model, reference, engine, registry


@pytest.mark.parametrize("batch, side, per_token", [(2, 4, True), (2, 4, False), (1, 6, False), (3, 5, True),
                                                     (1, 8, True), (3, 2, False)])
def test_one_graph_serves_a_timestep_per_sample_and_per_token(served, batch, side, per_token):
    model, reference, engine, registry = served
    generator = torch.Generator().manual_seed(batch * 10 + side)
    latent = torch.randn(batch, CHANNELS, side, side, generator=generator)
    t = torch.rand((batch, side * side) if per_token else (batch,), generator=generator)
    graph_calls = engine.graph_calls
    with torch.no_grad():
        got, want = model(latent, t), reference(latent, t)
    assert [e.reason for e in registry.fallbacks] == []
    assert len(registry.compiles) == 1
    assert engine.graph_calls - graph_calls == 3  # every block from the graph
    assert (got - want).abs().max().item() < 1e-5
