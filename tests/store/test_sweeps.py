"""One compile serves every resolution, batch size and prompt length in range."""

from __future__ import annotations

import torch

from compiler.cli import main as cli_main
from compiler.diffusers_api import compiled_parts
from tests.support.inputs import TEXT_LENGTHS, UNET_SWEEP, VAE_SWEEP, latents, unet_inputs, unet_sweep_worst_difference

TOLERANCE = 1e-4  # float32 graph vs eager, seen ~2e-6


def _count_torch_compiles(monkeypatch):
    """Count torch's own compile entry points, whatever our registry says."""
    calls = {"export": 0, "aoti": 0}
    real_export, real_aoti = torch.export.export, torch._inductor.aoti_compile_and_package

    def export(*args, **kwargs):
        calls["export"] += 1
        return real_export(*args, **kwargs)

    def aoti(*args, **kwargs):
        calls["aoti"] += 1
        return real_aoti(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", aoti)
    return calls


def test_save_before_any_run_wrote_verified_graphs(saved_pipe):
    saved = saved_pipe.report.saved
    assert any(line.startswith("unet") for line in saved), saved_pipe.report
    assert any(line.startswith("vae.decoder") for line in saved), saved_pipe.report
    assert saved_pipe.report.problems == []
    assert list(saved_pipe.graphs.rglob("*.pt2")) and list(saved_pipe.graphs.rglob("*.json"))
    assert cli_main(["graphs", "verify", str(saved_pipe.graphs)]) == 0


def test_unet_resolution_batch_and_text_length_sweep_compiles_nothing(saved_pipe, monkeypatch):
    registry, unet = saved_pipe.registry, saved_pipe.pipe.unet
    compiled = compiled_parts(saved_pipe.pipe)["unet"]
    compiles, fallbacks = len(registry.compiles), len(registry.fallbacks)
    torch_calls = _count_torch_compiles(monkeypatch)
    worst = unet_sweep_worst_difference(unet, compiled.eager)
    assert len(registry.compiles) == compiles, [e.reason for e in registry.compiles[compiles:]]
    assert torch_calls == {"export": 0, "aoti": 0}
    assert len(registry.fallbacks) == fallbacks, [e.reason for e in registry.fallbacks[fallbacks:]]
    assert compiled.graph_calls >= len(UNET_SWEEP) * len(TEXT_LENGTHS)
    assert worst < TOLERANCE


def test_vae_decoder_sweep_compiles_nothing(saved_pipe, monkeypatch):
    registry, vae = saved_pipe.registry, saved_pipe.pipe.vae
    decoder = compiled_parts(saved_pipe.pipe)["vae.decoder"]
    compiles = len(registry.compiles)
    torch_calls = _count_torch_compiles(monkeypatch)
    with torch.no_grad():
        for shape in VAE_SWEEP:
            z = latents(*shape)
            out = vae.decode(z).sample
            ref = decoder.eager(vae.post_quant_conv(z))
            assert float((out - ref).abs().max()) < TOLERANCE
    assert len(registry.compiles) == compiles
    assert torch_calls == {"export": 0, "aoti": 0}
    assert decoder.eager_calls == 0


def test_whole_pipeline_image_matches_eager_at_new_sizes(saved_pipe):
    from compiler.demo.tiny_models import prompt_embeds

    pipe, registry = saved_pipe.pipe, saved_pipe.registry
    compiles = len(registry.compiles)

    def generate():
        with torch.no_grad():
            return pipe(prompt_embeds=prompt_embeds(2), negative_prompt_embeds=prompt_embeds(2, seed=1),
                        height=40, width=32, num_inference_steps=2, guidance_scale=5.0,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images

    compiled_image = generate()
    parts = compiled_parts(pipe)
    for part in parts.values():  # the same modules, eager
        part.module.__dict__.pop("forward")
    try:
        eager_image = generate()
    finally:
        for part in parts.values():
            part.module.forward = part
    assert len(registry.compiles) == compiles
    assert float((compiled_image - eager_image).abs().max()) < 1e-3


def test_outside_the_declared_range_runs_eager_with_the_reason(saved_pipe):
    registry, unet = saved_pipe.registry, saved_pipe.pipe.unet
    compiles = len(registry.compiles)
    args, kwargs = unet_inputs(1, 40, 40)  # latent 40 > declared spatial max 24
    with torch.no_grad():
        out = unet(*args, **kwargs)[0]
        ref = compiled_parts(saved_pipe.pipe)["unet"].eager(*args, **kwargs)[0]
    assert torch.equal(out, ref)
    assert len(registry.compiles) == compiles
    reason = registry.fallbacks[-1].reason
    assert "outside" in reason and "40" in reason and "running eager" in reason


def test_a_non_contiguous_input_gives_the_eager_result(saved_pipe):
    registry, unet = saved_pipe.registry, saved_pipe.pipe.unet
    compiles = len(registry.compiles)
    args, kwargs = unet_inputs(2, 16, 24)
    sample = args[0].transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    assert not sample.is_contiguous()
    with torch.no_grad():
        out = unet(sample, args[1], **kwargs)[0]
        ref = compiled_parts(saved_pipe.pipe)["unet"].eager(sample, args[1], **kwargs)[0]
    assert float((out - ref).abs().max()) < TOLERANCE
    assert len(registry.compiles) == compiles
