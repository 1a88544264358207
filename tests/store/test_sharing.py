"""One graph per architecture: other weights, in-place deltas and new input structures."""

from __future__ import annotations

import torch

from compiler import CompileOptions, compile_module
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import tiny_unet
from tests.support.inputs import unet_inputs

TOLERANCE = 1e-4


def _run(module, shape=(2, 16, 24)):
    args, kwargs = unet_inputs(*shape)
    with torch.no_grad():
        return module(*args, **kwargs)[0], module.forward.eager(*args, **kwargs)[0]


def test_two_checkpoints_of_one_architecture_share_one_graph(saved_pipe, test_range):
    registry = saved_pipe.registry
    compiles, graphs = len(registry.compiles), len(registry.graphs())
    other = tiny_unet(seed=7)
    compile_module(other, CompileOptions(shape_range=test_range), registry)
    out_other, eager_other = _run(other)
    out_first, eager_first = _run(saved_pipe.pipe.unet)
    assert len(registry.compiles) == compiles and len(registry.graphs()) == graphs
    assert float((out_other - eager_other).abs().max()) < TOLERANCE
    assert float((out_first - eager_first).abs().max()) < TOLERANCE
    assert float((out_other - out_first).abs().max()) > 1e-2  # really different weights


def test_weight_changes_reach_the_graph_without_recompiling(saved_pipe, test_range):
    registry = saved_pipe.registry
    model = tiny_unet(seed=3)
    compile_module(model, CompileOptions(shape_range=test_range), registry)
    compiles = len(registry.compiles)
    before, _ = _run(model)
    with torch.no_grad():  # a LoRA-like delta applied in place
        for name, param in model.named_parameters():
            if "attn" in name and name.endswith("weight"):
                param.add_(0.05 * torch.ones_like(param))
    after_inplace, eager_inplace = _run(model)
    # ...and a patch that replaces a Parameter (new storage), as ComfyUI may do
    model.conv_in.weight = torch.nn.Parameter(model.conv_in.weight.detach() * 1.5)
    after_replaced, eager_replaced = _run(model)
    assert len(registry.compiles) == compiles
    assert float((after_inplace - before).abs().max()) > 1e-3
    assert float((after_inplace - eager_inplace).abs().max()) < TOLERANCE
    assert float((after_replaced - after_inplace).abs().max()) > 1e-3
    assert float((after_replaced - eager_replaced).abs().max()) < TOLERANCE


def test_a_new_input_structure_adds_a_graph_and_the_first_keeps_serving(saved_pipe):
    registry, unet = saved_pipe.registry, saved_pipe.pipe.unet
    compiled = compiled_parts(saved_pipe.pipe)["unet"]
    saved_options = compiled.options
    compiled.options = saved_options.with_(cover_range=False)  # one compile is enough to show it
    try:
        args, kwargs = unet_inputs(2, 16, 16)
        generator = torch.Generator().manual_seed(5)
        # ControlNet-style residuals: one per down-block output, plus the mid block.
        residuals = tuple(torch.randn(2, c, h, h, generator=generator) * 0.1
                          for c, h in ((32, 16), (32, 16), (32, 8), (64, 8)))
        mid = torch.randn(2, 64, 8, 8, generator=generator) * 0.1
        control = dict(kwargs, down_block_additional_residuals=residuals, mid_block_additional_residual=mid)
        compiles, families_before = len(registry.compiles), {g.key.family.id for g in registry.graphs()}
        with torch.no_grad():
            out = unet(*args, **control)[0]
            ref = compiled.eager(*args, **control)[0]
        assert float((out - ref).abs().max()) < TOLERANCE
        assert len(registry.compiles) == compiles + 1
        assert "first call" in registry.compiles[-1].reason
        families_after = {g.key.family.id for g in registry.graphs()}
        assert families_before < families_after  # added, none thrown away
        compiles = len(registry.compiles)
        with torch.no_grad():
            plain = unet(*args, **kwargs)[0]
            plain_ref = compiled.eager(*args, **kwargs)[0]
            again = unet(*args, **control)[0]
        assert len(registry.compiles) == compiles
        assert float((plain - plain_ref).abs().max()) < TOLERANCE
        assert float((again - ref).abs().max()) < TOLERANCE
    finally:
        compiled.options = saved_options
