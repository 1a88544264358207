"""The block engine's pure parts: finding blocks, token ranges, probes, naming dimensions, range keys.

No compile here (fast).
"""

from __future__ import annotations

import pytest
import torch

from compiler import ShapeRange
from compiler.blocks import find_blocks
from compiler.blocks import tokens as T
from compiler.blocks.diffusers_families import diffusers_family
from compiler.keys.graph_keys import FamilyKey, GraphKey
from tests.support import tiny_transformers as tt


def test_blocks_are_grouped_by_structure_not_by_position():
    groups = find_blocks(tt.build("flux"))
    assert [(g.class_name, len(g.instances)) for g in groups] == [
        ("FluxTransformerBlock", 2), ("FluxSingleTransformerBlock", 3)]
    assert groups[1].paths == [f"single_transformer_blocks.{i}" for i in range(3)]
    sd3 = find_blocks(tt.build("sd3"))  # the last block drops the text output: a structure of its own
    assert [(g.class_name, len(g.instances)) for g in sd3] == [("JointTransformerBlock", 2), ("JointTransformerBlock", 1)]
    assert sd3[1].paths == ["transformer_blocks.2"]


def test_blocks_are_found_by_structure_without_declared_classes():
    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.proj = torch.nn.Linear(width, width)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList([Block(8), Block(8), Block(8)])
            self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Dropout()])  # not a stack

    groups = find_blocks(Model())
    assert [(g.class_name, g.paths) for g in groups] == [("Block", ["layers.0", "layers.1", "layers.2"])]


def test_token_ranges_follow_patches_and_frames():
    flux = diffusers_family(tt.build("flux")).geometry
    assert flux.token_range(ShapeRange(spatial=(16, 128))) == (8 * 8, 64 * 64)
    wan = diffusers_family(tt.build("wan")).geometry
    assert wan.token_range(ShapeRange(spatial=(8, 24), frames=(1, 5))) == (1 * 4 * 4, 5 * 12 * 12)
    assert wan.token_range(ShapeRange(spatial=(8, 24))) == (16, 21 * 144)  # 81 frames by default
    assert wan.tokens(T.Dims(1, 16, 24, frames=3)) == 3 * 8 * 12  # frames are their own axis


def test_a_range_without_frames_or_tokens_keeps_its_key():
    old = {"batch": [1, 4], "spatial": [8, 64], "sequence": [1, 77]}
    plain = ShapeRange.from_json(old)
    assert plain.to_json() == old  # graph ids of whole-model graphs do not change
    blocks = T.Geometry(patch=2).block_range(plain)
    assert blocks.tokens == (16, 32 * 32)
    assert ShapeRange.from_json(blocks.to_json()) == blocks
    family = FamilyKey("A", "s", "i", "float32", "cpu", "aot", "2")
    assert GraphKey(family, plain).id != GraphKey(family, blocks).id
    assert "tokens 16-1024" in blocks.describe()


def test_probes_change_every_role_differently():
    for rng in (tt.RANGE, ShapeRange(batch=(1, 2), spatial=(16, 16), sequence=(512, 512)),
                ShapeRange(batch=(1, 8), spatial=(32, 128), sequence=(1, 512))):
        geometry = T.Geometry(patch=2)
        first, second = T.probe_dims(geometry, rng, 2)
        a, b = T.counts_of(geometry, first), T.counts_of(geometry, second)
        changing = [(a[r], b[r]) for r in T.BASE_ROLES if a[r] != b[r]]
        assert len(set(changing)) == len(changing), (first, second)
        assert all(a[r] >= 2 for r in T.BASE_ROLES if a[r] != b[r])  # the traced probe
        for dims in (first, second):
            assert rng.batch[0] <= dims.batch <= rng.batch[1]
            assert rng.spatial[0] <= dims.height <= rng.spatial[1] and dims.height % 2 == 0
            assert rng.sequence[0] <= dims.text <= rng.sequence[1]


def test_padded_tokens_change_between_the_probes():
    """Z-Image pads text and image tokens to a multiple of 32: probes of 7 and 11 text tokens would both reach
    the blocks as 32 and the text axis would look static (the guard `freqs_cis.shape[1] == 32`)."""
    geometry = T.Geometry(patch=2, token_multiple=32)
    assert geometry.padded(7) == 32 and geometry.padded(64) == 64 and geometry.padded(65) == 96
    for rng in (ShapeRange(batch=(1, 4), spatial=(8, 128), sequence=(1, 231)),
                ShapeRange(batch=(1, 1), spatial=(16, 64), sequence=(1, 77)),
                # text pads to 32 or 64 only, as the smallest sides' image tokens do: larger sides are taken
                ShapeRange(batch=(1, 3), spatial=(8, 24), sequence=(1, 40)),
                ShapeRange(batch=(1, 2), spatial=(16, 32), sequence=(1, 64))):
        first, second = T.probe_dims(geometry, rng, 2)
        a, b = T.counts_of(geometry, first), T.counts_of(geometry, second)
        for role in (T.TOKENS, T.SEQUENCE, T.JOINT):
            assert a[role] != b[role], (role, first, second)
            assert a[role] % 32 == 0 and b[role] % 32 == 0
        assert first.text == a[T.SEQUENCE]  # probes send what the blocks see: the model pads nothing
        changing = [(a[r], b[r]) for r in T.BASE_ROLES if a[r] != b[r]]
        assert len(set(changing)) == len(changing)
        blocks = geometry.block_range(rng)
        assert blocks.sequence == (32, geometry.padded(rng.sequence[1]))
        assert blocks.tokens[0] % 32 == 0 and blocks.tokens[1] % 32 == 0
        for dims in (first, second):
            assert blocks.sequence[0] <= a[T.SEQUENCE] <= blocks.sequence[1]
            assert blocks.tokens[0] <= T.counts_of(geometry, dims)[T.TOKENS] <= blocks.tokens[1]
    plain = T.Geometry(patch=2)
    rng = ShapeRange(batch=(1, 4), spatial=(8, 128), sequence=(1, 231))
    assert plain.block_range(rng).sequence == (1, 231)  # unpadded families keep their keys


def test_dimensions_are_named_from_two_probes():
    a = {"batch": 2, "tokens": 20, "sequence": 7, "joint": 27}
    b = {"batch": 3, "tokens": 25, "sequence": 11, "joint": 36}
    paths = ["hidden", "text", "rotary", "image_and_text", "table"]
    roles = T.infer_roles(paths, [(2, 20, 32), (2, 7, 32), (27, 16), (2, 257 + 7, 32), (1, 20, 1, 8)],
                          [(3, 25, 32), (3, 11, 32), (36, 16), (3, 257 + 11, 32), (1, 25, 1, 8)], a, b)
    assert roles == {"hidden": {0: "batch", 1: "tokens"}, "text": {0: "batch", 1: "sequence"},
                     "rotary": {0: "joint"}, "image_and_text": {0: "batch", 1: "sequence+257"},
                     "table": {1: "tokens"}}
    with pytest.raises(T.UnknownDimension, match=r"odd\.shape\[1\] is 40 in one call and 50"):
        T.infer_roles(["odd"], [(2, 40)], [(3, 50)], a, b)
    rng = ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 40), tokens=(16, 144))
    assert T.role_bounds("joint", rng) == (17, 184)
    assert T.role_bounds("sequence+257", rng) == (258, 297)


def test_a_frames_axis_is_named_apart_from_the_batch():
    """Wan 2.2 5B's modulation has a latent-frames axis where ComfyUI gives each frame its own timestep: the video
    probes change the frames unlike the batch, and that axis is named `frames`, bounded by the frames range."""
    geometry = T.Geometry(patch=2, video=True, default_frames=(1, 21))
    for rng in (ShapeRange(batch=(1, 4), spatial=(8, 64), sequence=(1, 512), frames=(1, 21)),
                ShapeRange(batch=(1, 2), spatial=(8, 32), sequence=(1, 77), frames=(1, 3))):
        first, second = T.probe_dims(geometry, rng, 2)
        a, b = T.counts_of(geometry, first), T.counts_of(geometry, second)
        assert a[T.FRAMES] != b[T.FRAMES] and (a[T.FRAMES], b[T.FRAMES]) != (a[T.BATCH], b[T.BATCH])
        modulation = [(a[T.BATCH], a[T.FRAMES], 6, 32)], [(b[T.BATCH], b[T.FRAMES], 6, 32)]
        assert T.infer_roles(["e"], *modulation, a, b) == {"e": {0: "batch", 1: "frames"}}
        assert T.role_bounds("frames", geometry.block_range(rng)) == rng.frames
    image = T.Geometry(patch=2)
    first, second = T.probe_dims(image, ShapeRange(batch=(1, 4), spatial=(8, 64), sequence=(1, 77)), 2)
    assert T.counts_of(image, first)[T.FRAMES] == T.counts_of(image, second)[T.FRAMES] == 1  # never a role


def test_an_audio_stream_is_a_role_of_its_own_sized_by_the_frames():
    """LTX-2's blocks take the soundtrack's tokens beside the video's: the probes change them unlike every other
    count, the axis is named `audio`, its range follows the frames range, and a range without audio keeps its key."""
    geometry = T.Geometry(patch=1, video=True, default_frames=(1, 13), audio_per_frame=25.0)
    for rng in (ShapeRange(batch=(1, 4), spatial=(2, 16), sequence=(1, 1024), frames=(1, 3)),
                ShapeRange(batch=(1, 2), spatial=(4, 4), sequence=(1, 77), frames=(1, 13))):
        first, second = T.probe_dims(geometry, rng, 1)
        a, b = T.counts_of(geometry, first), T.counts_of(geometry, second)
        changing = [(a[r], b[r]) for r in T.BASE_ROLES if a[r] != b[r]]
        assert a[T.AUDIO] != b[T.AUDIO] and a[T.AUDIO] >= 2 and len(set(changing)) == len(changing), (first, second)
        blocks = geometry.block_range(rng)
        assert blocks.audio == (1, 25 * rng.frames[1])
        assert blocks.audio[0] <= min(a[T.AUDIO], b[T.AUDIO]) and max(a[T.AUDIO], b[T.AUDIO]) <= blocks.audio[1]
        assert ShapeRange.from_json(blocks.to_json()) == blocks
        streams = [(a[T.BATCH], a[T.TOKENS], 64), (a[T.BATCH], a[T.AUDIO], 32)], \
            [(b[T.BATCH], b[T.TOKENS], 64), (b[T.BATCH], b[T.AUDIO], 32)]
        assert T.infer_roles(["vx", "ax"], *streams, a, b) == {"vx": {0: "batch", 1: "tokens"},
                                                              "ax": {0: "batch", 1: "audio"}}
        role, why = T.outside_range(["ax"], [(2, blocks.audio[1] + 1, 32)], {"ax": {1: "audio"}}, blocks)
        assert role == "audio" and why.startswith(f"ax.shape[1] is {blocks.audio[1] + 1}, audio tokens")
    video = T.Geometry(patch=1, video=True, default_frames=(1, 13))
    rng = ShapeRange(batch=(1, 4), spatial=(2, 16), sequence=(1, 1024), frames=(1, 3))
    assert video.block_range(rng).audio is None and "audio" not in video.block_range(rng).to_json()
    assert T.counts_of(video, T.probe_dims(video, rng, 1)[0])[T.AUDIO] == 0


def test_a_call_outside_the_range_is_named_by_what_it_counts():
    """Flux Kontext and Flux 2 edits add a reference image's tokens to the image tokens: a call past the range
    says so in those words, not as a bare shape guard."""
    rng = ShapeRange(batch=(1, 4), spatial=(4, 32), sequence=(1, 512), tokens=(16, 1024))
    roles = {"img": {0: "batch", 1: "tokens"}, "pe": {2: "joint"}, "txt": {1: "sequence"}}
    paths = ["img", "pe", "txt"]
    assert T.outside_range(paths, [(2, 1024, 64), (1, 1, 1024 + 512, 16), (2, 512, 64)], roles, rng) is None
    role, why = T.outside_range(paths, [(2, 2048, 64), (1, 1, 2048 + 7, 16), (2, 7, 64)], roles, rng)
    assert role == "tokens" and why == (
        "img.shape[1] is 2048, image tokens (the latent's, and any reference image's): more than the 1024 its graph "
        "was built for")
    role, why = T.outside_range(paths, [(6, 64, 64), (1, 1, 71, 16), (6, 7, 64)], roles, rng)
    assert role == "batch" and "is 6, the batch: more than the 4" in why
    assert T.role_words("sequence*3+257") == "3 x text tokens + 257"


def test_a_scoped_engine_serves_blocks_only_inside_its_scope():
    """ComfyUI shares one module among every clone of a MODEL: blocks outside the node's hook stay untouched."""
    from compiler.blocks import BlockEngine
    from compiler.store.registry import GraphRegistry

    model = tt.build("flux", seed=0)
    reference = tt.call(model, tt.FIRST).detach()
    registry = GraphRegistry()
    engine = BlockEngine(model, diffusers_family(model), registry=registry, scoped=True)
    engine.install_blocks()
    with torch.no_grad():
        outside = tt.call(model, tt.FIRST)
    assert torch.equal(outside, reference) and engine.eager_calls == 0 and registry.fallbacks == []
    with engine.serving(), torch.no_grad():  # inside: every block goes through its server (not prepared here)
        inside = tt.call(model, tt.FIRST)
    assert torch.equal(inside, reference)
    assert engine.eager_calls == len(engine.instances)
    assert {e.reason.split(": ", 1)[1] for e in registry.fallbacks} == {"not prepared yet; running eager"}
    engine.uninstall()
    assert all("forward" not in instance.module.__dict__ for instance in engine.instances)


def test_text_tokens_of_several_encoders_are_named_as_multiples():
    """HiDream joins T5, Llama and a per-block Llama layer: its blocks see image tokens + 3 x the prompt."""
    a = T.role_values({T.BATCH: 2, T.TOKENS: 20, T.SEQUENCE: 7})
    b = T.role_values({T.BATCH: 3, T.TOKENS: 25, T.SEQUENCE: 11})
    roles = T.infer_roles(["rope", "text"], [(2, 41, 8), (2, 21, 8)], [(3, 58, 8), (3, 33, 8)], a, b)
    assert roles == {"rope": {0: "batch", 1: "joint*3"}, "text": {0: "batch", 1: "sequence*3"}}
    block_range = ShapeRange(batch=(1, 4), spatial=(8, 64), sequence=(1, 128), tokens=(16, 1024))
    assert T.role_bounds("joint*3", block_range) == (16 + 3, 1024 + 384)
    assert T.role_bounds("sequence*3+8", block_range) == (3 + 8, 384 + 8)
    assert T.shapes_at([(2, 41, 8)], ["rope"], roles, T.role_values({T.BATCH: 1, T.TOKENS: 100, T.SEQUENCE: 50})) == [
        (1, 250, 8)]
