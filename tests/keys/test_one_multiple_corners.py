"""Range corners at exactly one multiple of a UNet's downsampling (SD1.5's latent 8 under the UNet node's default
64 px minimum): no graph traced over a range serves them, so covering them on the first call built a whole
model's graph per corner (before the trace fix, eight failed traces: SD1.5 at the real depth took 239 s on this
project's CPU against 95 s). They compile when a call first needs them, and then serve equal to eager.
"""

from __future__ import annotations

import logging

import torch

from compiler import CompileOptions, GraphRegistry, ShapeRange, compile_module
from compiler.keys import alignment
from compiler.demo.tiny_models import tiny_unet
from tests.support.inputs import unet_inputs


def _four_level_unet() -> torch.nn.Module:
    """SD1.5's depth in levels (three downsamplers), the narrowest widths: a quick compile."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=32, block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D", "DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D", "UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4).eval()


def test_corners_of_one_multiple_compile_when_first_used_and_match_eager(caplog):
    unet = _four_level_unet()
    multiple = alignment.axis_multiples(unet)[0]
    assert multiple == 8  # three downsamplers, as SD1.5's: latent 8 is 1x1 at the lowest level
    wide = ShapeRange(batch=(1, 4), spatial=(multiple, 4 * multiple), sequence=(1, 160))
    assert alignment.one_multiple_sides(unet, wide.spatial[0]) == (multiple, multiple)
    assert alignment.one_multiple_sides(unet, 16) == (None, None)
    # one downsampler: its multiple is 2
    assert alignment.one_multiple_sides(tiny_unet(seed=0), wide.spatial[0]) == (None, None)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=wide), registry)
    args, kwargs = unet_inputs(2, 3 * multiple, 3 * multiple)
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="keepfast"):
        unet(*args, **kwargs)
    first = [e.reason for e in registry.compiles]
    assert not any(f"latent {multiple}x" in r or f"x{multiple} " in r for r in first), first
    assert f"range corners at latent {multiple}x{multiple}" in caplog.text, caplog.text
    compiles = len(registry.compiles)
    args, kwargs = unet_inputs(1, multiple, multiple)
    with torch.no_grad():
        out = unet(*args, **kwargs)[0]
        expected = forward.eager(*args, **kwargs)[0]
    assert len(registry.compiles) == compiles + 1, [e.reason for e in registry.compiles]  # its own graph, now
    assert forward.last_status == "compiled graph", forward.last_status
    assert float((out - expected).abs().max()) < 1e-4


def test_a_first_call_at_one_multiple_checks_its_corner_graphs_on_small_images():
    """A first call at latent 8x8, batch 1 (the UNet node's default minimum): its graph serves 8x8 only, so the
    range's corners compile in that call, each traced from a corner's own sizes; each such graph's check at a size
    of 1 (aot_export.size_one_disagreement) runs the model and the graph once. It ran them at the corner's size, the
    range's largest image (for the real-depth SD1.5 UNet on this CPU: latent 256x256, attention over 65536
    positions, the first call not ended in 10 minutes); now on the smallest image the graph serves."""
    unet = _four_level_unet()
    multiple = alignment.axis_multiples(unet)[0]
    top = 8 * multiple
    shape_range = ShapeRange(batch=(1, 4), spatial=(multiple, top), sequence=(1, 160))
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=shape_range), registry)
    sides = []
    from torch._subclasses.fake_tensor import is_fake

    def record(module, inputs):  # the model run on real tensors (a trace runs it on fake ones)
        if not is_fake(inputs[0]):
            sides.append(max(inputs[0].shape[-2:]))

    unet.conv_in.register_forward_pre_hook(record)
    args, kwargs = unet_inputs(1, multiple, multiple)
    with torch.no_grad():
        out = unet(*args, **kwargs)[0]
        expected = forward.eager(*args, **kwargs)[0]
    reasons = [e.reason for e in registry.compiles]
    assert any(f"range corner batch 1, latent {top}x{top}" in r for r in reasons), reasons  # the case itself
    assert sides and max(sides) <= 2 * multiple, (sides, reasons)  # the model never ran at a corner's size
    assert float((out - expected).abs().max()) < 1e-4
    # the corner graphs serve the corners, equal to eager
    compiles = len(registry.compiles)
    args, kwargs = unet_inputs(1, top, top)
    with torch.no_grad():
        out = unet(*args, **kwargs)[0]
        expected = forward.eager(*args, **kwargs)[0]
    assert len(registry.compiles) == compiles and forward.last_status == "compiled graph", forward.last_status
    assert float((out - expected).abs().max()) < 1e-4
