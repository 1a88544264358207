"""ComfyUI's image transformer families served block by block: Flux (and Flux 2, Chroma), SD3, AuraFlow,
Qwen-Image, HunyuanImage 2.1, Lumina 2 (and Z-Image), HiDream. See comfy_family.py for what a family says."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Tuple

import torch

from ..compiler import Geometry
from .comfy_family import ComfyFamily, first_in, in_features
from .video_families import HunyuanVideoFamily


class FluxFamily(ComfyFamily):
    name = "flux"
    model_classes = ("Flux",)
    block_classes = ("DoubleStreamBlock", "SingleStreamBlock")

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(getattr(model, "patch_size", 2))
        kwargs = {
            "x": self.latent(model, dims, randn, in_features(model.img_in) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, in_features(model.txt_in)),
        }
        if getattr(model, "vector_in", None) is not None:
            kwargs["y"] = randn(dims.batch, in_features(model.vector_in.in_layer))
        if getattr(model.params, "guidance_embed", False):
            kwargs["guidance"] = torch.full((dims.batch,), 3.5, dtype=torch.float32, device=device)
        return kwargs


class Flux2Family(FluxFamily):
    """Flux 2: ComfyUI's Flux class with one modulation for all blocks of a kind, computed before
    them (its dataclasses are block inputs, as Chroma's), and a VAE of 32 channels at 1/8 whose latent is packed
    2x2 (EmptyFlux2LatentImage: 128 channels at 1/16), one latent pixel per token."""

    name = "flux2"
    geometry = Geometry(patch=1)
    spatial_multiple = 1
    latent_scale = 16

    def matches(self, model):
        # comfy.model_detection sets global_modulation for Flux 2 checkpoints only
        return bool(getattr(getattr(model, "params", None), "global_modulation", False))


class ChromaFamily(FluxFamily):
    name = "chroma"
    model_classes = ("Chroma",)

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(getattr(model, "patch_size", 2))
        return {
            "x": self.latent(model, dims, randn, in_features(model.img_in) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, in_features(model.txt_in)),
            "guidance": torch.zeros((dims.batch,), dtype=torch.float32, device=device),
        }


class SD3Family(ComfyFamily):
    name = "sd3"
    model_classes = ("OpenAISignatureMMDITWrapper",)
    block_classes = ("JointBlock",)

    # JointBlock.forward(*args, **kwargs) is called with (context, x) positionally: named here for the
    # graph's inputs, passed positionally again to the block.
    _POSITIONAL = ("context", "x")

    def block_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        args, kwargs = super().block_inputs(args, kwargs)
        if len(args) > len(self._POSITIONAL):
            return args, kwargs
        named = dict(zip(self._POSITIONAL, args))
        named.update(kwargs)
        return (), named

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        if not args and all(name in kwargs for name in self._POSITIONAL):
            args = tuple(kwargs.pop(name) for name in self._POSITIONAL)
        return super().block_forward(module, *args, **kwargs)

    def inputs(self, model, dims, randn, dtype, device):
        kwargs = {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.timesteps(dims, device, 500.0),
            "context": randn(dims.batch, dims.text, in_features(model.context_embedder)),
        }
        if getattr(model, "y_embedder", None) is not None:
            kwargs["y"] = randn(dims.batch, in_features(model.y_embedder.mlp[0]))
        return kwargs


class AuraFlowFamily(ComfyFamily):
    name = "auraflow"
    model_classes = ("MMDiT",)
    block_classes = ("MMDiTBlock", "DiTBlock")

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(model.patch_size)
        return {
            "x": self.latent(model, dims, randn, in_features(model.init_x_linear) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, in_features(model.cond_seq_linear)),
        }


class QwenImageFamily(ComfyFamily):
    name = "qwen-image"
    model_classes = ("QwenImageTransformer2DModel",)
    block_classes = ("QwenImageTransformerBlock",)

    def inputs(self, model, dims, randn, dtype, device):
        channels = in_features(model.img_in) // 4
        return {  # ComfyUI gives Qwen-Image its (Wan VAE) latent with a frame axis of 1
            "x": randn(dims.batch, channels, 1, dims.height, dims.width),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, in_features(model.txt_in)),
        }


class HunyuanImage21Family(HunyuanVideoFamily):
    """HunyuanImage 2.1: HunyuanVideo's class on images (2-D patches of 1) from a 64-channel VAE at 1/32
    (EmptyHunyuanImageLatent)."""

    name = "hunyuan-image21"
    video = False
    frame_scale = 1
    geometry = Geometry(patch=1)
    spatial_multiple = 1
    latent_scale = 32

    def matches(self, model):
        return len(model.patch_size) == 2


class Lumina2Family(ComfyFamily):
    name = "lumina2"
    model_classes = ("NextDiT",)
    block_classes = ("JointTransformerBlock",)
    ignored_settings = ComfyFamily.ignored_settings | {"layer_id"}  # stored by every block, read by none
    split_stacks = True  # noise_refiner (image tokens) and layers (image and text tokens): one class, two ranges

    def inputs(self, model, dims, randn, dtype, device):
        return {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, first_in(model.cap_embedder)),
            "num_tokens": dims.text,  # ComfyUI drops an all-ones mask and passes the token count
        }

    def model_geometry(self, model):
        # Z-Image pads caption and image tokens to a multiple of 32 (`pad_tokens_multiple`) before its
        # refiners: the blocks see only multiples of it, and the rotary table follows the padded count.
        multiple = getattr(model, "pad_tokens_multiple", None)
        return replace(self.geometry, token_multiple=int(multiple)) if multiple else self.geometry


class HiDreamFamily(ComfyFamily):
    name = "hidream"
    model_classes = ("HiDreamImageTransformer2DModel",)
    block_classes = ("HiDreamImageBlock",)

    def inputs(self, model, dims, randn, dtype, device):
        layers = max(model.llama_layers) + 1
        return {
            "x": self.latent(model, dims, randn, first_in(model.x_embedder) // 4),
            "t": self.timesteps(dims, device),
            "y": randn(dims.batch, first_in(model.p_embedder)),
            "context": randn(dims.batch, dims.text, first_in(model.caption_projection[-1])),
            "encoder_hidden_states_llama3": randn(dims.batch, layers, dims.text, first_in(model.caption_projection[0])),
        }
