"""Inputs for the tiny models, the same in the test process and its subprocesses."""

from __future__ import annotations

import torch

# (batch, latent height, latent width): batch 1 first, then new resolutions,
# then new batch sizes, inside the tests' declared range.
UNET_SWEEP = [(2, 16, 16), (1, 16, 16), (2, 8, 24), (4, 24, 24), (3, 16, 8), (1, 24, 16)]
VAE_SWEEP = [(1, 16, 16), (2, 8, 8), (1, 24, 16), (3, 16, 24), (4, 24, 24)]
TEXT_LENGTHS = [77, 154, 10]


def unet_inputs(batch: int, height: int, width: int, length: int = 77, seed: int = 0):
    generator = torch.Generator().manual_seed(seed + batch * 1000 + height * 10 + width)
    sample = torch.randn(batch, 4, height, width, generator=generator)
    context = torch.randn(batch, length, 32, generator=generator)
    return (sample, torch.tensor(500.0)), {"encoder_hidden_states": context, "return_dict": False}


def latents(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + batch * 1000 + height * 10 + width)
    return torch.randn(batch, 4, height, width, generator=generator)


def unet_sweep_worst_difference(unet, eager) -> float:
    """Run the tiny UNet over every sweep shape and text length; the largest |out - eager| seen."""
    worst = 0.0
    with torch.no_grad():
        for shape in UNET_SWEEP:
            for length in TEXT_LENGTHS:
                args, kwargs = unet_inputs(*shape, length=length)
                out = unet(*args, **kwargs)[0]
                ref = eager(*args, **kwargs)[0]
                assert out.shape == ref.shape
                worst = max(worst, float((out - ref).abs().max()))
    return worst
