"""Test-only ComfyUI nodes for the template tests: the loaders a template's files cannot feed here.

ComfyUI's loaders fix most widths of a family from its class (Flux's 24 heads, Wan's
head count, the text encoders' JSON configs), so a file small enough for this CPU is
refused by `UNETLoader` and no 4-7 B parameter text encoder runs here. These nodes give
what those loaders give, built from ComfyUI's own classes at tiny widths
(`benchmarks/comfy/families.py`): a ModelPatcher of the family (what UNETLoader
returns) and a CLIP whose encoder returns that family's conditioning (what
CLIPTextEncode then returns), one token per word of the prompt, seeded by the prompt's text so a
run with and a run without the pack see the same conditioning. Every other node of a
template (its sampler, model patches, LoRA, subgraphs, VAE loader and decode) runs as
ComfyUI ships it. Linked into the test ComfyUI's custom_nodes by test_comfyui_templates.py;
never part of the pack.
"""

from __future__ import annotations

import os
import sys
import zlib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
if _REPO not in sys.path:
    sys.path.append(_REPO)  # appended: ComfyUI's own `nodes` and `utils` stay first

from benchmarks.comfy import families as comfy_families  # noqa: E402

_MODELS: dict = {}


def _family_model(family: str, seed: int):
    """One tiny model per (family, seed) for the server's life, as ComfyUI caches a loader's output."""
    key = (family, seed)
    if key not in _MODELS:
        _MODELS[key] = comfy_families.build(family, seed=seed)
    return _MODELS[key]


class _TinyTextEncoder:
    """What CLIPTextEncode needs of a CLIP: tokenize() and encode_from_tokens_scheduled()."""

    def __init__(self, family: str):
        self.family = family

    def tokenize(self, text: str, **_):
        return {"text": text}

    def encode_from_tokens_scheduled(self, tokens, unprojected=False, add_dict=None, show_pbar=True):
        text = tokens["text"]
        words = max(1, len(text.split()))
        conditioning = comfy_families._conditioning_fn(self.family)(words, zlib.crc32(text.encode()))
        for _, extras in conditioning:
            extras.update(add_dict or {})
        return conditioning


class KeepFastTestTinyModel:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"family": (list(comfy_families.TEMPLATE_FAMILIES),),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 1000})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, family, seed):
        return (_family_model(family, seed).patcher,)


class KeepFastTestTextEncoder:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"family": (list(comfy_families.TEMPLATE_FAMILIES),)}}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, family):
        return (_TinyTextEncoder(family),)


class KeepFastTestCheckpoint:
    """CheckpointLoaderSimple's (MODEL, CLIP, VAE): the tiny model and encoder, the VAE from models/vae."""

    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        return {"required": {"family": (list(comfy_families.TEMPLATE_FAMILIES),),
                             "vae_name": (folder_paths.get_filename_list("vae"),)}}

    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self, family, vae_name):
        import comfy.sd
        import comfy.utils
        import folder_paths

        # as a checkpoint's VAE is loaded: with the file's metadata (LTX-Video's VAE config lives there)
        sd, metadata = comfy.utils.load_torch_file(folder_paths.get_full_path_or_raise("vae", vae_name),
                                                   return_metadata=True)
        vae = comfy.sd.VAE(sd=sd, metadata=metadata)
        return (_family_model(family, 0).patcher, _TinyTextEncoder(family), vae)


class _TinyClipVision:
    """What CLIPVisionEncode needs of a CLIP_VISION: encode_image(), giving CLIP-ViT-H-shaped hidden states
    seeded by the image's pixels (a run with and one without the pack see the same features)."""

    def encode_image(self, image, crop=True):
        import torch
        from comfy.clip_vision import Output

        seed = zlib.crc32(image.float().mul(255).round().to(torch.uint8).numpy().tobytes())
        g = torch.Generator().manual_seed(seed)
        shape = (image.shape[0], comfy_families.CLIP_VISION_TOKENS, comfy_families.CLIP_VISION_WIDTH)
        out = Output()
        out["penultimate_hidden_states"] = torch.randn(shape, generator=g)
        out["last_hidden_state"] = torch.randn(shape, generator=g)
        out["image_embeds"] = torch.randn((image.shape[0], 1024), generator=g)
        out["mm_projected"] = None
        return out


class KeepFastTestCLIPVision:
    """CLIPVisionLoader's CLIP_VISION: ComfyUI fixes CLIP-ViT-H's widths (632 M parameters)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("CLIP_VISION",)
    FUNCTION = "load"
    CATEGORY = "testing"

    def load(self):
        return (_TinyClipVision(),)


NODE_CLASS_MAPPINGS = {
    "KeepFastTestCLIPVision": KeepFastTestCLIPVision,
    "KeepFastTestTinyModel": KeepFastTestTinyModel,
    "KeepFastTestTextEncoder": KeepFastTestTextEncoder,
    "KeepFastTestCheckpoint": KeepFastTestCheckpoint,
}
