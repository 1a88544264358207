"""diffusers' transformer families: how their pipelines call them, built from the model's config.

Each example call has the input structure the family's pipeline uses (the
same keyword inputs, the same optional inputs present or absent), so the
block graphs prepared from it serve the pipeline's calls:

- Flux (`FluxTransformer2DModel`): packed latents `[B, (H/2)(W/2), C]`,
  `img_ids`/`txt_ids` position ids, pooled text, timestep (and guidance for
  guidance-distilled checkpoints);
- Flux 2 (`Flux2Transformer2DModel`): latents packed 2x2 by the pipeline
  (128 channels at 1/16), one token per packed pixel, 4-axis `img_ids` and
  `txt_ids` per sample, timestep and guidance (dev);
- SD3/3.5 (`SD3Transformer2DModel`): latents `[B, C, H, W]`, patch size from
  the config;
- Wan 2.1/2.2 (`WanTransformer3DModel`): latents `[B, C, F, H, W]`, frames a
  separate axis; image-to-video checkpoints also take 257 image tokens;
- Qwen-Image (`QwenImageTransformer2DModel`): packed latents and `img_shapes`;
  the pipeline passes no text mask for an unpadded prompt;
- Z-Image (`ZImageTransformer2DModel`): per-sample lists of latents
  `[C, 1, H, W]` and of prompt embeddings `[L, D]` (the pipeline strips each
  prompt's padding); the model pads both to a multiple of 32 tokens and
  batches them before its blocks, which see `[B, tokens, dim]` tensors.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .family import BlockFamily, _randn, config_value, generator_for, model_dtype_device
from .tokens import Dims, Geometry


_LAYERWISE_CASTING = "layerwise_casting"  # diffusers' hook name (diffusers.hooks.layerwise_casting)


class DiffusersFamily(BlockFamily):
    def why_not_compiled(self, block: torch.nn.Module) -> Optional[str]:
        for module in block.modules():
            hooks = getattr(module, "_diffusers_hook", None)
            if hooks is not None and hooks.get_hook(_LAYERWISE_CASTING) is not None:
                return ("diffusers' layerwise casting (enable_layerwise_casting) casts this block's weights inside "
                        "each call, which a graph that binds the stored weights cannot do; to compile it, load the "
                        "model in its compute dtype (torch_dtype=...) without layerwise casting")
        return None


class FluxFamily(DiffusersFamily):
    name = "flux"
    geometry = Geometry(patch=2)  # 2x2 latent pixels are packed into one token
    spatial_multiple = 2
    block_classes = ("FluxTransformerBlock", "FluxSingleTransformerBlock")

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        batch, text = dims.batch, dims.text
        height, width = dims.height // 2, dims.width // 2
        ids = torch.zeros(height, width, 3)
        ids[..., 1] += torch.arange(height)[:, None]
        ids[..., 2] += torch.arange(width)[None, :]
        kwargs = {
            "hidden_states": _randn((batch, height * width, config_value(model, "in_channels", 64)), like, gen),
            "encoder_hidden_states": _randn((batch, text, config_value(model, "joint_attention_dim", 4096)), like, gen),
            "pooled_projections": _randn((batch, config_value(model, "pooled_projection_dim", 768)), like, gen),
            "timestep": torch.full((batch,), 0.5, dtype=dtype, device=device),
            "img_ids": ids.reshape(height * width, 3).to(device=device, dtype=dtype),
            "txt_ids": torch.zeros(text, 3, device=device, dtype=dtype),
            "return_dict": False,
        }
        if config_value(model, "guidance_embeds", False):
            kwargs["guidance"] = torch.full((batch,), 3.5, dtype=torch.float32, device=device)
        return (), kwargs


class Flux2Family(DiffusersFamily):
    name = "flux2"
    geometry = Geometry(patch=1)  # the pipeline packs 2x2 latent pixels into its 128 channels: a token each
    spatial_multiple = 1
    block_classes = ("Flux2TransformerBlock", "Flux2SingleTransformerBlock")

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        """Flux2Pipeline's call: ids (time, height, width, layer) per sample, as `_prepare_latent_ids` and
        `_prepare_text_ids` make them; timestep in [0, 1]."""
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        batch, text, one = dims.batch, dims.text, torch.arange(1)
        img_ids = torch.cartesian_prod(one, torch.arange(dims.height), torch.arange(dims.width), one)
        txt_ids = torch.cartesian_prod(one, one, one, torch.arange(text))
        kwargs = {
            "hidden_states": _randn((batch, dims.height * dims.width, config_value(model, "in_channels", 128)),
                                    like, gen),
            "timestep": torch.full((batch,), 0.5, dtype=dtype, device=device),
            "encoder_hidden_states": _randn((batch, text, config_value(model, "joint_attention_dim", 15360)),
                                            like, gen),
            "txt_ids": txt_ids.expand(batch, -1, -1).to(device),
            "img_ids": img_ids.expand(batch, -1, -1).to(device),
            "joint_attention_kwargs": None,
            "return_dict": False,
        }
        if config_value(model, "guidance_embeds", False):
            kwargs["guidance"] = torch.full((batch,), 4.0, dtype=dtype, device=device)
        return (), kwargs


class SD3Family(DiffusersFamily):
    name = "sd3"
    spatial_multiple = 2
    block_classes = ("JointTransformerBlock",)

    def __init__(self, patch: int = 2):
        self.geometry = Geometry(patch=patch)
        self.spatial_multiple = patch

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        batch = dims.batch
        return (), {
            "hidden_states": _randn((batch, config_value(model, "in_channels", 16), dims.height, dims.width), like, gen),
            "encoder_hidden_states": _randn((batch, dims.text, config_value(model, "joint_attention_dim", 4096)), like, gen),
            "pooled_projections": _randn((batch, config_value(model, "pooled_projection_dim", 2048)), like, gen),
            "timestep": torch.full((batch,), 500.0, dtype=dtype, device=device),
            "return_dict": False,
        }


class WanFamily(DiffusersFamily):
    name = "wan"
    block_classes = ("WanTransformerBlock",)

    def __init__(self, patch: Tuple[int, int, int] = (1, 2, 2)):
        p_t, p_h, p_w = patch
        # 81 video frames are 21 latent frames (the VAE keeps the first and packs 4 per latent after it)
        self.geometry = Geometry(patch=p_h, patch_frames=p_t, video=True, default_frames=(1, 21))
        self.spatial_multiple = p_h

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        batch = dims.batch
        kwargs = {
            "hidden_states": _randn((batch, config_value(model, "in_channels", 16), dims.frames, dims.height,
                                     dims.width), like, gen),
            "timestep": torch.full((batch,), 500, dtype=torch.long, device=device),
            "encoder_hidden_states": _randn((batch, dims.text, config_value(model, "text_dim", 4096)), like, gen),
            "return_dict": False,
        }
        image_dim = config_value(model, "image_dim", None)
        if image_dim:  # image-to-video: CLIP image tokens (257) come before the text
            kwargs["encoder_hidden_states_image"] = _randn((batch, 257, image_dim), like, gen)
        return (), kwargs


class QwenImageFamily(DiffusersFamily):
    name = "qwen-image"
    geometry = Geometry(patch=2)
    spatial_multiple = 2
    block_classes = ("QwenImageTransformerBlock",)

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        batch = dims.batch
        height, width = dims.height // 2, dims.width // 2
        kwargs = {
            "hidden_states": _randn((batch, height * width, config_value(model, "in_channels", 64)), like, gen),
            "timestep": torch.full((batch,), 0.5, dtype=dtype, device=device),
            "encoder_hidden_states": _randn((batch, dims.text, config_value(model, "joint_attention_dim", 3584)),
                                            like, gen),
            "encoder_hidden_states_mask": None,
            "img_shapes": [[(1, height, width)]] * batch,
            "return_dict": False,
        }
        if config_value(model, "guidance_embeds", False):
            kwargs["guidance"] = torch.full((batch,), 4.0, dtype=dtype, device=device)
        return (), kwargs


class ZImageFamily(DiffusersFamily):
    """Z-Image (Turbo): one block class in three stacks.

    `noise_refiner` (image tokens) and `layers` (image then text tokens) are
    the same structure, `context_refiner` (text tokens, no time modulation)
    another; the stacks are kept apart because their token ranges differ.
    Every block stores its `layer_id`, which its forward never reads.
    """

    name = "z-image"
    # 2x2 latent pixels per token (the pipeline never passes `patch_size`: the forward's default, 2); image and
    # text tokens are each padded to a multiple of 32 (diffusers' SEQ_MULTI_OF) before the refiners.
    geometry = Geometry(patch=2, token_multiple=32)
    spatial_multiple = 2
    block_classes = ("ZImageTransformerBlock",)
    ignored_settings = frozenset({"layer_id"})
    split_stacks = True

    def example_call(self, model, dims: Dims) -> Tuple[tuple, dict]:
        """ZImagePipeline's call: lists of one latent and one prompt per sample, timestep in [0, 1] as float32.

        Every prompt has `dims.text` tokens, so the model passes its blocks no
        attention mask (it makes one only when the samples' lengths differ).
        """
        like, gen = model_dtype_device(model), generator_for(dims)
        dtype, device = like
        channels, text_width = config_value(model, "in_channels", 16), config_value(model, "cap_feat_dim", 2560)
        latents = [_randn((channels, 1, dims.height, dims.width), like, gen) for _ in range(dims.batch)]
        prompts = [_randn((dims.text, text_width), like, gen) for _ in range(dims.batch)]
        timestep = torch.full((dims.batch,), 0.5, dtype=torch.float32, device=device)
        return (latents, timestep, prompts), {"joint_attention_kwargs": None, "return_dict": False}


def diffusers_family(model: torch.nn.Module) -> Optional[BlockFamily]:
    """The block family of a diffusers transformer, or None for a class it does not know."""
    name = type(model).__name__
    if name == "FluxTransformer2DModel":
        return FluxFamily()
    if name == "Flux2Transformer2DModel":
        return Flux2Family()
    if name == "SD3Transformer2DModel":
        return SD3Family(patch=int(config_value(model, "patch_size", 2)))
    if name == "WanTransformer3DModel":
        return WanFamily(patch=tuple(config_value(model, "patch_size", (1, 2, 2))))
    if name == "QwenImageTransformer2DModel":
        return QwenImageFamily()
    if name == "ZImageTransformer2DModel":
        return ZImageFamily()
    return None


KNOWN: Dict[str, str] = {
    "FluxTransformer2DModel": "flux", "Flux2Transformer2DModel": "flux2", "SD3Transformer2DModel": "sd3",
    "WanTransformer3DModel": "wan", "QwenImageTransformer2DModel": "qwen-image",
    "ZImageTransformer2DModel": "z-image",
}
