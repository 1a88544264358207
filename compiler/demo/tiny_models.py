"""Small diffusion models built from configs with random weights.

No weights can be downloaded, so the demo, the tests and the benchmarks build
their models here: the same diffusers classes as real checkpoints, with
configs scaled down (`tiny_*`) or real layouts (`sd15_unet`, `sdxl_unet`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .model_configs import SD15_UNET, SD_VAE, SDXL_UNET


def tiny_unet(seed: int = 0, cross_attention_dim: int = 32):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=8,
        sample_size=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=8,
    ).eval()


def tiny_vae(seed: int = 0, force_upcast: bool = True):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        block_out_channels=(32, 64),
        norm_num_groups=8,
        latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        force_upcast=force_upcast,
    ).eval()


def sd15_unet(seed: int = 0):
    """SD1.5's UNet layout (860M parameters): benchmarks only."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=64, cross_attention_dim=768, attention_head_dim=8,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2,
    ).eval()


def small_sd15_unet(seed: int = 0):
    """SD1.5's block layout at a quarter of the width, for CPU benchmarks."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=64, cross_attention_dim=768, attention_head_dim=8,
        block_out_channels=(64, 128, 256, 256), layers_per_block=1, norm_num_groups=32,
    ).eval()


def tiny_sd_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, vae_dtype: Optional[torch.dtype] = None):
    """A StableDiffusionPipeline without text encoder: call it with prompt_embeds."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionPipeline

    unet = tiny_unet(seed).to(dtype)
    vae = tiny_vae(seed + 1).to(vae_dtype or dtype)
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=None, tokenizer=None, unet=unet,
        scheduler=EulerDiscreteScheduler(steps_offset=1), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32, vae_dtype: Optional[torch.dtype] = None):
    """A StableDiffusionXLPipeline without text encoders (SDXL's `text_time` conditioning): call it with
    prompt_embeds and pooled_prompt_embeds (`prompt_embeds(..., dim=32)`, `pooled_embeds(...)`)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=8,
        sample_size=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
        addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=SDXL_POOLED + 6 * 8,
    ).eval()
    vae = tiny_vae(seed + 1)
    if dtype != torch.float32:
        unet = unet.to(dtype)
    if (vae_dtype or dtype) != torch.float32:
        vae = vae.to(vae_dtype or dtype)  # float16 with force_upcast: the pipeline decodes in float32
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None,
        unet=unet, scheduler=EulerDiscreteScheduler(steps_offset=1),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


SDXL_POOLED = 16


def pooled_embeds(batch: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, SDXL_POOLED, generator=generator).to(dtype)


def prompt_embeds(batch: int = 1, length: int = 77, dim: int = 32, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, dim, generator=generator).to(dtype)


# -- the real configs' depth at narrow widths ----------------------------------------------------------------
# Compile time follows depth (levels, layers per block, attention placement, transformer layers per block), not
# width: these keep every depth setting of the real configs (model_configs.py, one source) and
# narrow only the channels, so a test sees the real graphs' structure (nested down- and up-sampling, SDXL's ten
# transformer layers per block) at a size a CPU compiles in minutes.
NARROW_SD15 = dict(block_out_channels=(32, 32, 64, 64), norm_num_groups=8)
NARROW_SDXL = dict(block_out_channels=(40, 80, 160), norm_num_groups=8)  # heads 5/10/20 of 8 channels each
NARROW_VAE = dict(block_out_channels=(32, 32, 64, 64), norm_num_groups=8)


def real_depth_unet(name: str, seed: int = 0):
    """SD1.5's (`sd15`) or SDXL's (`sdxl`) UNet at its real depth, narrow widths, real conditioning sizes."""
    from diffusers import UNet2DConditionModel

    config = {"sd15": {**SD15_UNET, **NARROW_SD15}, "sdxl": {**SDXL_UNET, **NARROW_SDXL}}[name]
    torch.manual_seed(seed)
    return UNet2DConditionModel(**config).eval()


def real_depth_vae_decoder(seed: int = 0):
    """The SD/SDXL VAE's decoder at its real depth (4 levels, 3 resnets each, mid-block attention), narrow."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(**{**SD_VAE, **NARROW_VAE}).decoder.eval()
