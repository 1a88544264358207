"""diffusers' Z-Image transformer served block by block (compile_blocks), one tiny model, one compile.

Z-Image runs one block class in three stacks: the noise refiner on image
tokens, the context refiner (no time modulation) on text tokens, the main
layers on both joined; the model pads image and text tokens to multiples of
32 and takes per-sample lists, as ZImagePipeline passes them. The first call
compiles one graph per stack structure (3, for the real 2 + 2 refiner blocks
and 2 main layers); other sizes, batches and prompt lengths then run every
block from its graph, equal to eager within the tolerance of
tests/blocks/test_blocks.py, with no compile. A batch whose prompts pad to different
lengths (prompt and negative prompt, with guidance) runs the masked stacks
eager: their graphs are prepared without a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from compiler import GraphRegistry
from compiler.blocks import BlockEngine, BlockOptions, Dims, compile_blocks
from tests.support import tiny_transformers as tt

TOLERANCE = 1e-4  # float32, as tests/blocks/test_blocks.py


@dataclass
class Served:
    model: torch.nn.Module
    engine: BlockEngine
    registry: GraphRegistry
    first_compiles: int
    first_diff: float


@pytest.fixture(scope="module")
def served() -> Served:
    model = tt.build("zimage", seed=0)
    with torch.no_grad():
        expected = tt.call(model, tt.FIRST)
    registry = GraphRegistry()
    engine = compile_blocks(model, BlockOptions(shape_range=tt.RANGE), registry)
    with torch.no_grad():
        first = tt.call(model, tt.FIRST)
    return Served(model, engine, registry, len(registry.compiles), float((first - expected).abs().max()))


def test_each_stack_structure_compiles_once_and_every_block_is_served(served):
    assert served.first_compiles == tt.STRUCTURES["zimage"], [e.reason for e in served.registry.compiles]
    assert served.registry.fallbacks == [], [e.reason for e in served.registry.fallbacks]
    assert served.first_diff < TOLERANCE
    report = served.engine.report()
    assert report["family"] == "z-image"
    assert report["blocks"] == report["blocks_compiled"] == tt.BLOCKS["zimage"]
    stacks = {s["paths"][0].split(".")[0]: s for s in report["structures"]}
    assert set(stacks) == {"noise_refiner", "context_refiner", "layers"}
    # layer_id differs between a stack's blocks and is no structure
    assert {name: s["instances"] for name, s in stacks.items()} == {"noise_refiner": 2, "context_refiner": 2,
                                                                    "layers": 2}
    # the token axis each stack sees: image tokens, text tokens, both joined (all padded to multiples of 32)
    assert stacks["noise_refiner"]["roles"]["x"] == {1: "tokens", 0: "batch"}
    assert stacks["context_refiner"]["roles"]["x"] == {1: "sequence", 0: "batch"}
    assert stacks["layers"]["roles"]["x"] == {1: "joint", 0: "batch"}


# sizes, batches and prompt lengths other than the first call's (2 x 16 x 16, 12 tokens); 40 tokens pad to 64
@pytest.mark.parametrize("dims", [Dims(1, 8, 24, 1, 5), Dims(3, 24, 24, 1, 33), Dims(2, 24, 8, 1, 40)], ids=str)
def test_other_sizes_run_from_the_graphs_equal_to_eager_with_no_compile(served, dims):
    compiles, fallbacks, before = (len(served.registry.compiles), len(served.registry.fallbacks),
                                   served.engine.graph_calls)
    with torch.no_grad():
        out = tt.call(served.model, dims)
        ref = tt.reference(served.engine, dims)
    assert served.engine.graph_calls - before == tt.BLOCKS["zimage"]  # every block ran from its graph
    assert out.shape == (dims.batch, 4, 1, dims.height, dims.width)
    assert float((out - ref).abs().max()) < TOLERANCE
    assert len(served.registry.compiles) == compiles
    assert len(served.registry.fallbacks) == fallbacks, [e.reason for e in served.registry.fallbacks]


def test_prompts_of_different_lengths_in_one_batch_run_eager_for_the_masked_stacks(served):
    """With guidance, ZImagePipeline batches the prompt with the negative prompt: when their padded lengths
    differ, the model passes the context refiner and the main layers an attention mask (it passes none
    otherwise), an input structure their graphs were not prepared for. Those blocks run eager (a fallback
    that says why), the noise refiner (no mask: image tokens are all of one length) from its graph; the output
    equals eager and nothing compiles. ZImagePipeline's example samples Z-Image Turbo with guidance_scale=0.0 (no
    negative prompt), which never meets this; its default guidance_scale (5.0) can."""
    dims = Dims(2, 16, 16, 1, 40)
    (latents, timestep, prompts), kwargs = served.engine.family.example_call(served.model, dims)
    args = (latents, timestep, [prompts[0], prompts[1][:5]])  # 64 and 32 text tokens once padded
    compiles, fallbacks, before = (len(served.registry.compiles), len(served.registry.fallbacks),
                                   served.engine.graph_calls)
    with torch.no_grad():
        out = tt._batched(served.model(*args, **kwargs)[0])
        ref = tt._batched(served.engine.eager(*args, **kwargs)[0])
    assert float((out - ref).abs().max()) < TOLERANCE
    assert len(served.registry.compiles) == compiles
    assert served.engine.graph_calls - before == 2  # noise_refiner.0 and .1
    reasons = [e.reason for e in served.registry.fallbacks[fallbacks:]]
    assert reasons and all("attn_mask[" in r and "running eager" in r for r in reasons), reasons
    assert any("context_refiner.0" in r for r in reasons) and any("layers.0" in r for r in reasons), reasons
