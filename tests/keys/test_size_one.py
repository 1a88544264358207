"""A graph traced at 2 where a call has 1: ComfyUI's TAESD decoder (diffusers' AutoencoderTiny is the same network).

With a batch range of 1 to 2, the size-oblivious trace (the aot backend's) assumes the batch is not 1, so to
Inductor the range was 2 alone: the graph was built for 2, its guards accepted 1, and it returned two images
for one. Now a size with a range of 1 to 2 is traced up to 3 (`aot_export._traced_high`): one graph serves 1 and 2.
As a safety net for whatever else a size-oblivious trace gets wrong at 1, a graph whose guards accept 1 is run
there once when it is built and compared with the model; where they differ it serves 2 and up and 1 gets its
own graph (checked here by bringing the old tracing back). All with the first-use check off, so nothing else
catches it. The inductor backend is right too (Dynamo guards size 1 itself).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from compiler import ShapeRange, compile_pipe
from compiler.diffusers_api import compiled_parts
from compiler.store.registry import GraphRegistry

ORDER = [(1, 16), (2, 8), (1, 12)]  # (batch, latent side): a one-image decode first, then two, then one
TWO_FIRST = [(2, 16), (1, 8), (2, 12), (1, 16)]


def _tiny_autoencoder(seed: int = 0):
    from diffusers import AutoencoderTiny

    torch.manual_seed(seed)
    return AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                           num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), latent_channels=4).eval()


def _decode_in_order(backend: str, verify: bool, order=ORDER, samples_independent: bool = True):
    """(largest difference from eager, registry, compiled decoder) over ORDER; shapes must match eager's.

    `samples_independent=False`: the decoder is compiled as any module is, from the call's whole batch
    (a VAE's graphs are otherwise built from one image, which would leave the batch of 2 untraced here).
    """
    vae = _tiny_autoencoder()
    twin = copy.deepcopy(vae)
    registry = GraphRegistry()
    pipe = SimpleNamespace(vae=vae)
    compile_pipe(pipe, shape_range=ShapeRange(batch=(1, 2), spatial=(8, 16)), ignores=("vae.encoder",),
                 registry=registry, verify=verify, backend=backend)
    decoder = compiled_parts(pipe)["vae.decoder"]
    decoder.options = decoder.options.with_(samples_independent=samples_independent)
    worst = 0.0
    with torch.no_grad():
        for batch, side in order:
            latent = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(side))
            got, want = vae.decode(latent).sample, twin.decode(latent).sample
            assert got.shape == want.shape, (batch, side, got.shape, want.shape)
            worst = max(worst, float((got - want).abs().max()))
    return worst, registry, decoder


def test_without_the_first_use_check_every_decode_equals_eager():
    worst, registry, decoder = _decode_in_order("aot", verify=False)
    assert worst < 1e-4
    assert decoder.graph_calls == len(ORDER) and decoder.eager_calls == 0
    assert registry.fallbacks == [] and registry.log.of_kind("mismatch") == []
    assert len(registry.compiles) == 1  # one graph serves 1 and 2


def test_two_images_first_then_one_equal_eager_without_the_first_use_check():
    worst, registry, decoder = _decode_in_order("aot", verify=False, order=TWO_FIRST)
    assert worst < 1e-4
    assert decoder.graph_calls == 4 and decoder.eager_calls == 0
    assert registry.fallbacks == [] and registry.log.of_kind("mismatch") == []
    assert len(registry.compiles) == 1


def test_a_graph_that_computes_differently_at_one_serves_two_and_up(monkeypatch):
    """The safety net, seen with the old tracing (a range of 1 to 2 traced as 1 to 2): the graph traced at 2 is
    checked at 1 as it is built, differs, is held to 2 and up, and batch 1 gets its own graph."""
    from compiler.backends import aot_export

    monkeypatch.setattr(aot_export, "_traced_high", lambda low, high: high)
    for order in (ORDER, TWO_FIRST):
        worst, registry, decoder = _decode_in_order("aot", verify=False, order=order, samples_independent=False)
        assert worst < 1e-4, order
        assert decoder.graph_calls == len(order) and decoder.eager_calls == 0
        assert registry.fallbacks == [] and registry.log.of_kind("mismatch") == []
        assert len(registry.compiles) == 2  # one for 2 and up, one for 1


def test_the_inductor_backend_is_right_without_the_check():
    worst, registry, decoder = _decode_in_order("inductor", verify=False)
    assert worst < 1e-4 and decoder.graph_calls == len(ORDER) and registry.fallbacks == []


def test_a_call_is_cut_to_the_smallest_image_a_graph_serves_keeping_its_values():
    """probes.cropped_call / smallest_served: what aot_export.size_one_disagreement runs its one model and graph call on."""
    from compiler.keys.probes import cropped_call, smallest_served
    from compiler.keys.shapes import BATCH, SPATIAL
    from compiler.keys.signature import FlatCall

    image = {0: BATCH, 2: SPATIAL, 3: SPATIAL}
    roles = {"args[0]": image, "hint": image}
    sample, hint, text = torch.randn(1, 4, 32, 48), torch.randn(1, 3, 100, 150), torch.randn(1, 7, 8)
    call = FlatCall((sample,), {"hint": hint, "text": text},
                    lambda path, tensor: roles.get(path, {0: BATCH}))
    cut = cropped_call(call, 16, 24)
    assert cut.shapes == [(1, 4, 16, 24), (1, 3, 50, 75), (1, 7, 8)]
    assert torch.equal(cut.tensors[0], sample[:, :, :16, :24])  # the caller's values, top left
    assert torch.equal(cut.tensors[1], hint[:, :, :50, :75])  # a second image in proportion
    assert cut.tensors[2] is text
    assert cropped_call(call, 64, 48) is None  # never larger
    assert cropped_call(call, 12, 24) is None  # 12 * 100 / 32 is not a whole size
    # the smallest sides (multiples of 8) accepted, height first
    served = smallest_served(call, lambda c: c.shapes[0][2] >= 16 and c.shapes[0][3] >= 24)
    assert served.shapes[0] == (1, 4, 16, 24)
    assert smallest_served(call, lambda c: False) is call  # nothing smaller served: the call itself
    flat = FlatCall((text,), {}, lambda path, tensor: {0: BATCH})
    assert smallest_served(flat, lambda c: True) is flat  # no image in the call
