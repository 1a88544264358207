"""The benchmark's transformers: real checkpoint configs, and what each profile changes in them.

A block structure's graph does not depend on how many blocks share it, so a
CPU compares cold compiles per block structure at the real widths with the
depth cut to the fewest blocks that still hold every structure
(`CPU_DEPTH`); a GPU runs the real depth; `--quick` narrows the widths too
(`QUICK_CHANGES`). No weights are downloaded: the configs are written out
here, each with where its values come from (this machine cannot reach the
Hugging Face hub, so each was read from diffusers' or ComfyUI's own source).

Imports neither torch nor diffusers (the CLI imports this module to build
its parser).
"""

from __future__ import annotations

from typing import Any, Dict

# The CLI's names (benchmarks/__init__.py checks `--models` against them) and diffusers' classes.
CLASSES: Dict[str, str] = {
    "flux": "FluxTransformer2DModel", "sd3": "SD3Transformer2DModel", "wan": "WanTransformer3DModel",
    "qwen-image": "QwenImageTransformer2DModel", "zimage": "ZImageTransformer2DModel",
}

# FLUX.1-dev's transformer config (19 double-stream and 38 single-stream blocks, 12B parameters).
FLUX = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
# Wan 2.1 text-to-video 1.3B's transformer config (30 blocks).
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
           text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Stable Diffusion 3.5 medium's transformer (24 blocks, 2.5B parameters), chosen over SD3 medium for its three
# block structures: blocks 0-12 with a second self-attention on the image tokens, plain blocks, and the last one,
# which drops the text stream's output (context_pre_only). Sources: 1536 wide (24 heads of 64; the caption
# projection is as wide) from diffusers' loaders/single_file_utils.py, which detects SD3 by a 9216 = 6 x 1536
# adaLN bias, and "sd35_medium" by a pos_embed of 147456 = 384^2 positions (pos_embed_max_size 384); 24 blocks
# from ComfyUI's comfy/model_detection.py (MMDiT depth = width / 64); dual attention in blocks 0-12 from the
# comment on `dual_attention_layers` in diffusers' transformer_sd3.py; the RMS query/key norms from both (the
# SD3.5 checkpoints carry ln_q/ln_k); the rest are SD3's defaults in transformer_sd3.py.
SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
# Qwen-Image's transformer (60 blocks, 20B parameters): the defaults in the docstring of diffusers'
# QwenImageTransformer2DModel, except out_channels: 16, as the checkpoint's config has it (QwenImagePipeline
# unpacks each output token as 16 latent channels x 2 x 2, so proj_out's patch^2 x out_channels is 64).
QWEN_IMAGE = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
# Z-Image Turbo's transformer (30 blocks after 2 noise-refiner and 2 context-refiner blocks, 6B parameters): the
# defaults of diffusers' ZImageTransformer2DModel (ZImagePipeline's example loads Z-Image-Turbo), which
# ComfyUI's model_detection.py repeats for a 3840-wide checkpoint (30 heads, axes 32/48/48, rope theta 256); the
# rotary table's lengths as ComfyUI has them (1536 caption positions; diffusers' default 1024: no weight
# depends on it).
Z_IMAGE_TURBO = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                     n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560,
                     rope_theta=256.0, t_scale=1000.0, axes_dims=(32, 48, 48), axes_lens=(1536, 512, 512))

REAL: Dict[str, Dict[str, Any]] = {"flux": FLUX, "sd3": SD35_MEDIUM, "wan": WAN, "qwen-image": QWEN_IMAGE,
                                   "zimage": Z_IMAGE_TURBO}
TITLES: Dict[str, str] = {
    "flux": "Flux-shaped transformer (FLUX.1-dev layout)",
    "sd3": "SD3-shaped transformer (SD3.5 medium layout)",
    "wan": "Wan-shaped transformer (Wan 2.1 T2V 1.3B layout)",
    "qwen-image": "Qwen-Image-shaped transformer (Qwen-Image 20B layout)",
    "zimage": "Z-Image-shaped transformer (Z-Image Turbo layout)",
}

# Full profile on a CPU: the real widths, the fewest blocks that hold every block structure.
CPU_DEPTH: Dict[str, Dict[str, Any]] = {
    "flux": dict(num_layers=1, num_single_layers=1),  # a double-stream and a single-stream block
    "sd3": dict(num_layers=3, dual_attention_layers=(0,)),  # dual attention, plain, last (context_pre_only)
    "wan": dict(num_layers=1),
    "qwen-image": dict(num_layers=1),
    "zimage": dict(n_layers=1, n_refiner_layers=1),  # noise refiner, context refiner, main layer
}

# --quick: the real block classes and patching at a sixth of the depth (Flux 3 + 6 blocks, SD3.5 4, Wan 6,
# Qwen-Image 10, Z-Image 5 after its 2 + 2 refiners) and narrow widths (4 heads of 32); text and pooled widths
# shrunk with them.
QUICK_CHANGES: Dict[str, Dict[str, Any]] = {
    "flux": dict(num_layers=3, num_single_layers=6, attention_head_dim=32, num_attention_heads=4,
                 joint_attention_dim=128, pooled_projection_dim=64, axes_dims_rope=(8, 12, 12)),
    "sd3": dict(num_layers=4, dual_attention_layers=(0, 1), attention_head_dim=32, num_attention_heads=4,
                joint_attention_dim=128, caption_projection_dim=128, pooled_projection_dim=64),
    "wan": dict(num_layers=6, num_attention_heads=4, attention_head_dim=32, text_dim=128, ffn_dim=256),
    "qwen-image": dict(num_layers=10, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=128,
                       axes_dims_rope=(8, 12, 12)),
    "zimage": dict(n_layers=5, dim=128, n_heads=4, n_kv_heads=4, cap_feat_dim=128, axes_dims=(8, 12, 12)),
}

# Text tokens their pipelines pass: Flux and Wan pad T5 to 512; SD3 joins 77 CLIP and 256 T5 tokens; Qwen-Image
# and Z-Image pass each prompt unpadded, up to max_sequence_length (512 by default): the longest is used.
TEXT_TOKENS: Dict[str, int] = {"flux": 512, "sd3": 77 + 256, "wan": 512, "qwen-image": 512, "zimage": 512}
QUICK_TEXT_TOKENS = 64

# --check (a GPU, docs/gpu.md): Flux's real width (24 heads of 128, 4096-wide text) with 1 double-stream and 2
# single-stream blocks: what a block costs to compile and run, without 12B parameters; the others real.
CHECK_CHANGES: Dict[str, Dict[str, Any]] = {"flux": dict(num_layers=1, num_single_layers=2)}
