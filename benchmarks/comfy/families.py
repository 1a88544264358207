"""Tiny random-weight models of ComfyUI's DiT families, ready to sample through `comfy.sample`.

The ComfyUI tests and the bench need every model family the pack compiles
(Flux, Chroma, SD3, AuraFlow, Wan 2.1, Qwen-Image, HunyuanVideo, LTXV, LTX-2, Lumina 2,
Z-Image, HiDream) without downloading weights. Each family is built from ComfyUI's own
classes (`comfy.supported_models.<X>(unet_config).get_model(state_dict={})`),
so the diffusion model, its `model_base` wrapper, the extra conds and the
sampling code are exactly what ComfyUI runs; only the widths and depths are
tiny (2 blocks of each repeated kind, hidden size 64-128, 2 heads, text
features of 32-64 channels) and the weights random.

Imported in-process by tests that run in ComfyUI's Python with COMFYUI_PATH
set. Importing this module imports torch only: ComfyUI is imported by the
functions (through `comfy_models._comfy`, which also forces `--cpu` before
`comfy.model_management` is imported), so `compiler/` never imports ComfyUI.

    family = build("flux")
    positive, negative = family.conditioning(12), family.conditioning(12, seed=1)
    out = sample(family, positive, negative, family.latent(256, 256))
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .models import _FLOAT8, _INIT_TYPES, _comfy, _init

FAMILIES: Tuple[str, ...] = (
    "flux", "flux2", "flux2-klein", "chroma", "sd3", "auraflow", "wan", "wan22", "qwen-image", "hunyuan-video",
    "hunyuan-video15", "hunyuan-image21", "ltxv", "ltxav", "kandinsky5", "lumina2", "z-image", "hidream",
)
VIDEO_FAMILIES: Tuple[str, ...] = ("wan", "wan22", "wan-i2v", "hunyuan-video", "hunyuan-video15", "ltxv", "ltxav",
                                    "kandinsky5")
# SD-style UNets (whole-model graphs, not blocks): ComfyUI's UNetModel as SD1.5 and SDXL configure it.
UNET_FAMILIES: Tuple[str, ...] = ("sd15", "sdxl")
# Variants only the template tests build (their workflows feed what these take: a start image, CLIP vision).
TEMPLATE_FAMILIES: Tuple[str, ...] = FAMILIES + ("wan-i2v",)
LTX2_AUDIO_LATENTS_PER_SECOND = 25  # LTX-2's audio VAE: 16 kHz, a mel hop of 160, 4 mel frames a latent
CLIP_VISION_TOKENS, CLIP_VISION_WIDTH = 257, 1280  # CLIP-ViT-H's penultimate hidden states, as Wan i2v takes them

# Sizes of the text features each tiny family takes (the real models take 2048-4096).
_TXT = 32          # T5 / umT5 / Llama / Qwen2.5 / Gemma hidden states
_POOLED = 32       # CLIP-L pooled vector (Flux, HunyuanVideo)
_SD3_TXT = 64      # SD3's CLIP-L/G + T5 context
_SD3_POOLED = 64   # SD3's CLIP-L + CLIP-G pooled
_HIDREAM_T5 = 32
_HIDREAM_LLAMA = 48
_HIDREAM_LLAMA_LAYERS = 4
_HIDREAM_POOLED = 64
_SD_CONTEXT = 64    # CLIP-L (768) / CLIP-L+G (2048) hidden states
_SDXL_POOLED = 1280  # CLIP-G pooled: SDXL's ADM vector is 1280 + 6 x 256 size embeddings = 2816 wide

# unet_config per family: the keys comfy.model_detection would produce for a
# checkpoint of that family, with tiny values (plus the widths detection takes
# from the class defaults of the real model, which a tiny model must override).
UNET_CONFIGS: Dict[str, Dict[str, Any]] = {
    "sd15": {
        # Two levels (32 and 64 channels: ComfyUI's GroupNorm takes 32 groups), attention on both and in the middle,
        # so GroupNorm, LayerNorm, self- and cross-attention all see the batch. SD15 sets 8 heads itself.
        "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32, "num_res_blocks": [1, 1],
        "channel_mult": [1, 2], "transformer_depth": [1, 1], "transformer_depth_output": [1, 1, 1, 1],
        "transformer_depth_middle": 1, "use_spatial_transformer": True, "context_dim": _SD_CONTEXT,
        "use_linear_in_transformer": False, "legacy": False, "adm_in_channels": None,
        "use_temporal_resblock": False, "use_temporal_attention": False,
    },
    "sdxl": {
        # SDXL's layout in small: linear transformer projections, attention from the second level on (64-channel
        # heads, SDXL's default), the 2816-wide ADM vector (pooled text + size embeddings).
        "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32, "num_res_blocks": [1, 1],
        "channel_mult": [1, 2], "transformer_depth": [0, 1], "transformer_depth_output": [0, 0, 1, 1],
        "transformer_depth_middle": 1, "use_spatial_transformer": True, "context_dim": _SD_CONTEXT,
        "use_linear_in_transformer": True, "legacy": False, "adm_in_channels": 2816, "num_classes": "sequential",
        "use_temporal_resblock": False, "use_temporal_attention": False,
    },
    "flux": {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": _POOLED,
        "context_in_dim": _TXT, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 2, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "guidance_embed": True,
        "txt_ids_dims": [], "yak_mlp": False, "txt_norm": False,
    },
    "flux2": {
        # comfy.model_detection's Flux 2 keys: shared (global) modulation computed once per call outside the blocks,
        # gated SiLU MLPs, no biases, 4 rotary axes with text positions on the last, latents of 128 channels (the
        # VAE's 32 packed 2x2) taken one latent pixel per token. Flux 2 dev has guidance; klein does not.
        "image_model": "flux2", "in_channels": 128, "out_channels": 128, "patch_size": 1, "vec_in_dim": None,
        "context_in_dim": _TXT, "hidden_size": 64, "mlp_ratio": 3.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 2, "axes_dim": [8, 8, 8, 8], "theta": 2000, "qkv_bias": False, "guidance_embed": True,
        "global_modulation": True, "mlp_silu_act": True, "ops_bias": False, "default_ref_method": "index",
        "ref_index_scale": 10.0, "txt_ids_dims": [3], "yak_mlp": False, "txt_norm": False,
    },
    "chroma": {
        "image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2, "vec_in_dim": None,
        "context_in_dim": _TXT, "hidden_size": 64, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
        "depth_single_blocks": 2, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "txt_ids_dims": [],
        # distilled_guidance_layer (Approximator): in_dim is fixed at 64 by the model (16+16+32 embeddings),
        # out_dim must equal hidden_size.
        "in_dim": 64, "out_dim": 64, "hidden_dim": 64, "n_layers": 2,
    },
    "sd3": {
        # MMDiT derives width from depth: hidden = 64 * depth, heads = depth. SD3.5-style options
        # (RMS qk-norm, one x-block self-attention layer) so both JointBlock variants are present.
        "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
        "adm_in_channels": _SD3_POOLED,
        "context_embedder_config": {"target": "torch.nn.Linear",
                                    "params": {"in_features": _SD3_TXT, "out_features": 128}},
        # pos_embed covers 64x64 patches = latents up to 128x128 = 1024x1024 px; larger asserts in cropped_pos_embed.
        "num_patches": 64 * 64, "pos_embed_max_size": 64, "pos_embed_scaling_factor": None,
        "qk_norm": "rms", "x_block_self_attn_layers": [0],
    },
    "auraflow": {
        # max_seq 4096 = 64x64 patches (latent 128x128); larger latents interpolate the table (allowed).
        "cond_seq_dim": _TXT, "max_seq": 64 * 64, "n_double_layers": 2, "n_layers": 4, "dim": 64, "n_heads": 2,
        "global_conddim": 64, "in_channels": 4, "out_channels": 4, "patch_size": 2,
    },
    "wan": {
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "out_dim": 16, "num_heads": 2, "ffn_dim": 128,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": _TXT,
    },
    "wan22": {  # Wan 2.2 TI2V 5B: Wan 2.1's model on the 48-channel Wan 2.2 VAE (1/16 in space, 4 frames per latent)
        "image_model": "wan2.1", "model_type": "t2v", "dim": 64, "out_dim": 48, "num_heads": 2, "ffn_dim": 128,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 48, "text_dim": _TXT,
    },
    "wan-i2v": {  # Wan 2.1 image-to-video: the start image's latent and mask concatenated (36 channels in),
        # CLIP vision features projected to 257 more context tokens
        "image_model": "wan2.1", "model_type": "i2v", "dim": 64, "out_dim": 16, "num_heads": 2, "ffn_dim": 128,
        "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
        "cross_attn_norm": True, "eps": 1e-6, "in_dim": 36, "text_dim": _TXT,
    },
    "qwen-image": {
        "image_model": "qwen_image", "in_channels": 64, "out_channels": 16, "patch_size": 2, "num_layers": 2,
        "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": _TXT,
        "axes_dims_rope": (8, 12, 12),
    },
    "hunyuan-video": {
        "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "patch_size": [1, 2, 2],
        "vec_in_dim": _POOLED, "axes_dim": [8, 12, 12], "meanflow": False, "context_in_dim": _TXT, "hidden_size": 64,
        "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "theta": 256, "qkv_bias": True,
        "byt5": False, "guidance_embed": True, "use_cond_type_embedding": False, "vision_in_dim": None,
        "meanflow_sum": False,
    },
    "hunyuan-video15": {
        # HunyuanVideo 1.5: HunyuanVideo's class with one latent pixel per token on a 32-channel VAE at 1/16 (the
        # input also takes an image latent and a mask: 65 channels), double blocks only, SigLIP image features
        # and a condition-type embedding, no guidance embedding.
        "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1],
        "vec_in_dim": None, "axes_dim": [8, 12, 12], "meanflow": False, "context_in_dim": _TXT, "hidden_size": 64,
        "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 0, "theta": 256, "qkv_bias": True,
        "byt5": False, "guidance_embed": False, "use_cond_type_embedding": True, "vision_in_dim": 32,
        "meanflow_sum": True,
    },
    "hunyuan-image21": {
        # HunyuanImage 2.1: HunyuanVideo's class on images (2-D patches of 1) from a 64-channel VAE at 1/32.
        "image_model": "hunyuan_video", "in_channels": 64, "out_channels": 64, "patch_size": [1, 1],
        "vec_in_dim": None, "axes_dim": [16, 16], "meanflow": False, "context_in_dim": _TXT, "hidden_size": 64,
        "mlp_ratio": 4.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 2, "theta": 256, "qkv_bias": True,
        "byt5": False, "guidance_embed": False, "use_cond_type_embedding": False, "vision_in_dim": None,
        "meanflow_sum": False,
    },
    "ltxv": {
        # inner dim = heads * head_dim = 64; cross_attention_dim must equal it (captions are projected to it).
        "image_model": "ltxv", "num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
        "cross_attention_dim": 64, "caption_channels": _TXT, "in_channels": 128,
    },
    "ltxav": {
        # LTX-2: LTXV's video stream beside an audio stream (8 channels x 16 frequency bins a latent, patched to
        # 128), each with its own heads, joined by cross-attention both ways in every block. The audio stream's
        # width (heads x head width) is also its cross-attention width, as in the real model (32 x 64 = 2048).
        "image_model": "ltxav", "num_layers": 2, "attention_head_dim": 32, "num_attention_heads": 2,
        "cross_attention_dim": 64, "caption_channels": _TXT, "in_channels": 128, "audio_in_channels": 128,
        "audio_attention_head_dim": 16, "audio_num_attention_heads": 2, "audio_cross_attention_dim": 32,
    },
    "kandinsky5": {
        # Kandinsky 5 video lite in small: 33 input channels (latent, image latent, mask) in 1x2x2 patches,
        # Qwen2.5-VL hidden states and a CLIP-L pooled vector, head width sum(axes_dims).
        "image_model": "kandinsky5", "in_visual_dim": 16, "out_visual_dim": 16, "in_text_dim": _TXT,
        "in_text_dim2": _POOLED, "time_dim": 32, "model_dim": 64, "ff_dim": 128, "visual_embed_dim": 33 * 4,
        "patch_size": (1, 2, 2), "num_text_blocks": 2, "num_visual_blocks": 2, "axes_dims": (8, 12, 12),
    },
    "lumina2": {
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": _TXT, "n_layers": 2,
        "qk_norm": True, "n_heads": 2, "n_kv_heads": 1, "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512],
        "rope_theta": 10000.0, "ffn_dim_multiplier": 4.0,
    },
    "z-image": {
        # Lumina 2's NextDiT as comfy.model_detection configures Z-Image: z_image_modulation, a time scale
        # of 1000, and caption and image tokens padded to a multiple of 32 before the refiners.
        # dim 256: the refiners' modulation takes min(dim, 256) features from a 256-wide time embedding.
        "image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 256, "cap_feat_dim": _TXT, "n_layers": 2,
        "qk_norm": True, "n_heads": 4, "n_kv_heads": 4, "axes_dims": [16, 24, 24], "axes_lens": [1536, 512, 512],
        "rope_theta": 256.0, "ffn_dim_multiplier": 8.0 / 3.0, "z_image_modulation": True, "time_scale": 1000.0,
        "pad_tokens_multiple": 32,
    },
    "hidream": {
        "image_model": "hidream", "attention_head_dim": 32, "axes_dims_rope": [16, 8, 8],
        "caption_channels": [_HIDREAM_T5, _HIDREAM_LLAMA], "max_resolution": [128, 128], "in_channels": 16,
        # one Llama hidden-state layer per block (num_layers + num_single_layers entries)
        "llama_layers": [0, 1, 2, 3], "num_attention_heads": 2, "num_routed_experts": 4,
        "num_activated_experts": 2, "num_layers": 2, "num_single_layers": 2, "out_channels": 16, "patch_size": 2,
        "text_emb_dim": _HIDREAM_POOLED,
    },
}

# Flux 2 klein: dev's layout without guidance distillation (Qwen3 text features).
UNET_CONFIGS["flux2-klein"] = {**UNET_CONFIGS["flux2"], "guidance_embed": False}

# The real models' configs (comfy.model_detection's keys for the released checkpoints), for the GPU runs
# (benchmarks/comfy_gpu.py): SD1.5's UNet, and Flux dev at full width, built with REAL_FLUX_BLOCKS
# (1 double + 2 single, as the device check builds it, of the real 19 + 38). With their text features' real widths.
REAL_UNET_CONFIGS: Dict[str, Dict[str, Any]] = {
    "sd15": {
        "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2, 2],
        "channel_mult": [1, 2, 4, 4], "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
        "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], "transformer_depth_middle": 1,
        "use_spatial_transformer": True, "context_dim": 768, "use_linear_in_transformer": False, "legacy": False,
        "adm_in_channels": None, "use_temporal_resblock": False, "use_temporal_attention": False,
    },
    "flux": {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 768,
        "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
        "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True,
        "txt_ids_dims": [], "yak_mlp": False, "txt_norm": False,
    },
}
REAL_WIDTHS: Dict[str, Dict[str, int]] = {"sd15": {"context": 768}, "flux": {"txt": 4096, "pooled": 768}}
REAL_FLUX_BLOCKS = (1, 2)  # (double, single): the device check's Flux, full width

_SUPPORTED = {  # family -> class name in comfy.supported_models
    "sd15": "SD15", "sdxl": "SDXL",
    "flux": "Flux", "flux2": "Flux2", "flux2-klein": "Flux2", "chroma": "Chroma", "sd3": "SD3", "auraflow": "AuraFlow", "wan": "WAN21_T2V", "wan22": "WAN22_T2V", "wan-i2v": "WAN21_I2V",
    "qwen-image": "QwenImage", "hunyuan-video": "HunyuanVideo",
    "hunyuan-video15": "HunyuanVideo15", "hunyuan-image21": "HunyuanImage21", "ltxv": "LTXV",
    "ltxav": "LTXAV", "kandinsky5": "Kandinsky5", "lumina2": "Lumina2",
    "z-image": "ZImage", "hidream": "HiDream",
}


@dataclass
class TinyFamily:
    """A tiny model of one family plus the inputs ComfyUI's nodes would give it."""

    name: str
    patcher: Any  # comfy.model_patcher.ModelPatcher (float32, CPU)
    video: bool
    latent_channels: int
    _latent: Callable[[int, int, int, int], torch.Tensor] = field(repr=False, default=None)
    _conditioning: Callable[[int, int], list] = field(repr=False, default=None)

    def latent(self, width: int, height: int, batch: int = 1, frames: int = 1) -> torch.Tensor:
        """Zeros shaped as the family's empty-latent node makes them.

        width/height are pixels; frames is the video length in pixel frames (the
        node's `length`), ignored for image families. Nodes: EmptySD3LatentImage
        (Flux, Chroma, SD3, Qwen-Image, Lumina 2, Z-Image, HiDream: 16 ch, /8; Qwen-Image's
        4-D latent becomes 5-D [B,16,1,h,w] in `sample`, as in KSampler),
        EmptyLatentImage (AuraFlow: 4 ch, /8), EmptyHunyuanLatentVideo (Wan,
        HunyuanVideo: 16 ch, /8, (frames-1)//4+1 latent frames), EmptyLTXVLatentVideo
        (LTXV: 128 ch, /32, (frames-1)//8+1 latent frames; LTX-2 with its audio latent, 25 a second at 25 fps,
        as ComfyUI's NestedTensor).
        """
        return self._latent(width, height, batch, frames)

    def conditioning(self, text_tokens: int, seed: int = 0) -> list:
        """[[cond, extras]] as CLIPTextEncode (+FluxGuidance where used) gives, with random features.

        text_tokens is the length of the encoder's output sequence (after any
        padding the real tokenizer does), so tests choose the prompt-length axis directly.
        """
        return self._conditioning(text_tokens, seed)


def _randn(shape, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32)


def _conditioning_fn(name: str, widths: Optional[Dict[str, int]] = None) -> Callable[[int, int], list]:
    """[[cond, extras]] of random features; `widths` (REAL_WIDTHS) for a real-width model."""
    widths = widths or {}

    def make(tokens: int, seed: int) -> list:
        if tokens < 1:
            raise ValueError("text_tokens must be >= 1, got %d" % tokens)
        g = torch.Generator().manual_seed(seed)
        extras: Dict[str, Any] = {"pooled_output": None}
        if name == "sd15":
            cond = _randn((1, tokens, widths.get("context", _SD_CONTEXT)), g)  # CLIP: 77 tokens per prompt chunk
        elif name == "sdxl":
            cond = _randn((1, tokens, _SD_CONTEXT), g)
            extras["pooled_output"] = _randn((1, _SDXL_POOLED), g)  # width/height default to 768, as ComfyUI's
        elif name == "flux":
            cond = _randn((1, tokens, widths.get("txt", _TXT)), g)
            extras.update(pooled_output=_randn((1, widths.get("pooled", _POOLED)), g), guidance=3.5)  # FluxGuidance
        elif name in ("flux2", "flux2-klein"):  # Mistral's (dev) or Qwen3's (klein) hidden states, padded to 512
            cond = _randn((1, tokens, _TXT), g)
            extras["guidance"] = 4.0
        elif name == "kandinsky5":  # Qwen2.5-VL hidden states, CLIP-L pooled
            cond = _randn((1, tokens, _TXT), g)
            extras["pooled_output"] = _randn((1, _POOLED), g)
        elif name == "sd3":
            cond = _randn((1, tokens, _SD3_TXT), g)
            extras["pooled_output"] = _randn((1, _SD3_POOLED), g)
        elif name == "hunyuan-video":
            cond = _randn((1, tokens, _TXT), g)
            extras.update(pooled_output=_randn((1, _POOLED), g), guidance=6.0)
        elif name == "ltxav":
            # LTX-2's Gemma 3 features through its two connectors, joined: the video half then the audio half (the
            # model splits them), with an all-ones mask as its text encoder gives.
            cond = torch.cat([_randn((1, tokens, _TXT), g), _randn((1, tokens, _TXT), g)], dim=-1)
            extras["attention_mask"] = torch.ones((1, tokens), dtype=torch.long)
        elif name == "ltxv":
            # T5 with return_attention_masks: long mask, the padded tail masked out (LTXVModel.forward requires
            # attention_mask positionally). Here the last quarter of the tokens plays the padding.
            cond = _randn((1, tokens, _TXT), g)
            mask = torch.ones((1, tokens), dtype=torch.long)
            mask[:, tokens - tokens // 4:] = 0
            extras["attention_mask"] = mask
        elif name in ("lumina2", "z-image"):
            # Gemma returns an all-ones mask; model_base.Lumina2 turns it into num_tokens (a Python int).
            cond = _randn((1, tokens, _TXT), g)
            extras["attention_mask"] = torch.ones((1, tokens), dtype=torch.long)
        elif name == "hidream":
            cond = _randn((1, tokens, _HIDREAM_T5), g)  # T5 hidden states
            extras["pooled_output"] = _randn((1, _HIDREAM_POOLED), g)  # CLIP-L + CLIP-G pooled
            extras["conditioning_llama3"] = _randn((1, _HIDREAM_LLAMA_LAYERS, tokens, _HIDREAM_LLAMA), g)
        else:  # chroma, auraflow, wan, wan22, wan-i2v, qwen-image, and HunyuanVideo 1.5 and HunyuanImage 2.1 (whose
            # Qwen2.5-VL encoders drop an all-ones mask): one text encoder, no pooled vector
            cond = _randn((1, tokens, _TXT), g)
        return [[cond, extras]]

    return make


def _latent_fn(name: str) -> Callable[[int, int, int, int], torch.Tensor]:
    def make(width: int, height: int, batch: int, frames: int) -> torch.Tensor:
        if name == "wan22":  # Wan22ImageToVideoLatent
            return torch.zeros([batch, 48, ((frames - 1) // 4) + 1, height // 16, width // 16])
        if name == "hunyuan-video15":  # EmptyHunyuanVideo15Latent
            return torch.zeros([batch, 32, ((frames - 1) // 4) + 1, height // 16, width // 16])
        if name == "hunyuan-image21":  # EmptyHunyuanImageLatent
            return torch.zeros([batch, 64, height // 32, width // 32])
        if name in ("wan", "wan-i2v", "hunyuan-video", "kandinsky5"):
            return torch.zeros([batch, 16, ((frames - 1) // 4) + 1, height // 8, width // 8])
        if name == "ltxv":
            return torch.zeros([batch, 128, ((frames - 1) // 8) + 1, height // 32, width // 32])
        if name == "ltxav":  # LTXVConcatAVLatent of EmptyLTXVLatentVideo and LTXVEmptyLatentAudio (25 fps)
            from comfy.nested_tensor import NestedTensor
            audio = math.ceil(frames / 25 * LTX2_AUDIO_LATENTS_PER_SECOND)
            return NestedTensor((torch.zeros([batch, 128, ((frames - 1) // 8) + 1, height // 32, width // 32]),
                                 torch.zeros([batch, 8, audio, 16])))
        if name in ("flux2", "flux2-klein"):  # EmptyFlux2LatentImage
            return torch.zeros([batch, 128, height // 16, width // 16])
        if name in ("auraflow", "sd15", "sdxl"):  # EmptyLatentImage
            return torch.zeros([batch, 4, height // 8, width // 8])
        return torch.zeros([batch, 16, height // 8, width // 8])

    return make


def _init_rest(module: torch.nn.Module, seed: int) -> None:
    """Fill what `_init` leaves as torch.empty: norm scales get 1, other bare parameters N(0, 0.02).

    Many DiTs keep raw nn.Parameter(torch.empty(...)) outside Linear/Conv/Norm
    layers (Wan and LTXV modulation tables, AuraFlow positional table and
    register tokens, HiDream's MoE gate, Flux's RMSNorm.scale, ...): left
    uninitialised they hold garbage and the output is not finite.
    """
    covered = set()
    for sub in module.modules():
        if isinstance(sub, _INIT_TYPES):
            covered.update(id(p) for p in sub.parameters(recurse=False))
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for sub in module.modules():
            is_norm = "norm" in type(sub).__name__.lower()
            for param in sub.parameters(recurse=False):
                if id(param) in covered:
                    continue
                if is_norm:
                    param.copy_(torch.ones(param.shape))  # fill_ has no float8 kernel
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
                covered.add(id(param))


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, real: bool = False) -> TinyFamily:
    """Build the tiny model of one family (CPU) wrapped in a ModelPatcher, as load_diffusion_model does.

    `dtype` is the weights' dtype as ComfyUI's `--bf16-unet` / `--fp16-unet` set it (no manual cast):
    the dtype real checkpoints run in, which a float32 test would not exercise. float8 weights
    (`--fp8_e4m3fn-unet`, fp8 checkpoints) compute in bfloat16: ComfyUI's manual cast, per layer and call.
    `real`: the real model's config and text widths (REAL_UNET_CONFIGS; Flux with REAL_FLUX_BLOCKS), for GPUs.
    """
    configs = REAL_UNET_CONFIGS if real else UNET_CONFIGS
    if name not in configs:
        raise ValueError("unknown family %r; known: %s" % (name, ", ".join(
            configs if real else TEMPLATE_FAMILIES + UNET_FAMILIES)))
    _comfy()
    import comfy.model_management
    import comfy.model_patcher
    import comfy.supported_models

    config = dict(configs[name])
    if real and name == "flux":
        config.update(depth=REAL_FLUX_BLOCKS[0], depth_single_blocks=REAL_FLUX_BLOCKS[1])
    model_config = getattr(comfy.supported_models, _SUPPORTED[name])(config)
    manual_cast = torch.bfloat16 if dtype in _FLOAT8 else None
    model_config.set_inference_dtype(dtype, manual_cast)
    model = model_config.get_model({})
    diffusion_model = model.diffusion_model
    _init(diffusion_model, seed)
    _init_rest(diffusion_model, seed)
    pos_embed = getattr(diffusion_model, "pos_embed", None)
    if name == "sd3" and pos_embed is not None:  # a torch.empty buffer, not a parameter
        with torch.no_grad():
            pos_embed.copy_(torch.randn(pos_embed.shape, generator=torch.Generator().manual_seed(seed + 2)) * 0.02)
    model = model.to(comfy.model_management.unet_offload_device())
    patcher = comfy.model_patcher.ModelPatcher(
        model, load_device=comfy.model_management.get_torch_device(),
        offload_device=comfy.model_management.unet_offload_device())
    return TinyFamily(
        name=name, patcher=patcher, video=name in VIDEO_FAMILIES,
        latent_channels=model_config.latent_format.latent_channels,
        _latent=_latent_fn(name), _conditioning=_conditioning_fn(name, REAL_WIDTHS.get(name) if real else None))


def sample(family: TinyFamily, positive, negative, latent: torch.Tensor, steps: int = 2, cfg: float = 2.0,
           seed: int = 0, model: Any = None, callback: Optional[Callable[..., None]] = None) -> torch.Tensor:
    """Sample like KSampler (euler, simple) under inference_mode as ComfyUI's executor runs nodes.

    `model` samples another ModelPatcher of the family (a clone with a speedup node or patches) with the
    same inputs. `callback` is KSampler's per-step callback (step, x0, x, total_steps): the bench times
    steps with it. Returns the latent KSampler would output: the empty latent after
    `fix_empty_latent_channels` (so Qwen-Image's 4-D latent comes back 5-D).
    """
    _comfy()
    import comfy.sample

    with torch.inference_mode():
        model = family.patcher if model is None else model
        latent_image = comfy.sample.fix_empty_latent_channels(model, latent)
        noise = comfy.sample.prepare_noise(latent_image, seed)
        return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative,
                                   latent_image, denoise=1.0, disable_pbar=True, seed=seed,
                                   callback=callback)
