"""Tiny diffusers transformers (real classes, small configs, random weights) and their sweeps.

Shared by tests/blocks/test_blocks.py and its fresh-process check
(`python -m tests.support.blocks_load_check FAMILY GRAPHS_DIR`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

import torch

from compiler import ShapeRange
from compiler.blocks.diffusers_families import diffusers_family
from compiler.blocks.tokens import Dims

# latent pixels 8-24, up to 3 images, prompts of 1-40 tokens, Wan: 1-5 latent frames
RANGE = ShapeRange(batch=(1, 3), spatial=(8, 24), sequence=(1, 40), frames=(1, 5))

CONFIGS: Dict[str, dict] = {
    "flux": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
                 guidance_embeds=True),
    "flux2": dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
                  axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True),
    "sd3": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16, num_attention_heads=2,
                joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
                pos_embed_max_size=16),
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                text_dim=32, freq_dim=32, ffn_dim=48, num_layers=3, rope_max_seq_len=64),
    "qwen": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)),
    "zimage": dict(in_channels=4, dim=32, n_layers=2, n_refiner_layers=2, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                   axes_dims=(4, 6, 6)),
}
CLASSES = {"flux": "FluxTransformer2DModel", "flux2": "Flux2Transformer2DModel", "sd3": "SD3Transformer2DModel", "wan": "WanTransformer3DModel",
           "qwen": "QwenImageTransformer2DModel", "zimage": "ZImageTransformer2DModel"}
# Distinct block structures: Flux double + single; SD3's last block drops the text output; Z-Image's noise
# refiner, context refiner and main layers (the first and last one structure on different tokens); Z-Image keeps
# its real 2 + 2 refiners.
STRUCTURES = {"flux": 2, "flux2": 2, "sd3": 2, "wan": 1, "qwen": 1, "zimage": 3}
BLOCKS = {"flux": 5, "flux2": 4, "sd3": 3, "wan": 3, "qwen": 3, "zimage": 6}

FIRST = Dims(batch=2, height=16, width=16, frames=3, text=12)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(seed)
    return getattr(diffusers, CLASSES[name])(**CONFIGS[name]).eval()


def build_as_loaded(name: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The model as `from_pretrained(..., torch_dtype=dtype)` loads it: `dtype` weights, except the modules the
    class keeps in float32 (Wan: its time embedder, norms and `scale_shift_table`, the first parameter)."""
    model = build(name, seed).to(dtype)
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if any(kept in parameter_name for kept in keep):
                parameter.data = parameter.data.float()
    return model


def pipe_of(model: torch.nn.Module) -> SimpleNamespace:
    """What compile_pipe needs of a pipeline: its `transformer` attribute."""
    return SimpleNamespace(transformer=model)


def sweep(name: str) -> List[Dims]:
    """Three resolutions (one not square) x batch 1 and 2 x two prompt lengths (x two frame counts for Wan)."""
    sizes = [(8, 8), (24, 24), (16, 24)]
    out = []
    for index, (height, width) in enumerate(sizes):
        for batch in (1, 2):
            for text in (5, 33):
                frames = 1
                if name == "wan":
                    frames = (2, 5)[(index + batch) % 2]
                out.append(Dims(batch, height, width, frames, text))
    if name == "wan":
        out.append(Dims(1, 16, 16, 1, 5))  # a single frame (an image)
    return out


def call(model: torch.nn.Module, dims: Dims) -> torch.Tensor:
    """The model's output at `dims`, with the input structure its pipeline uses."""
    args, kwargs = diffusers_family(model).example_call(model, dims)
    return _batched(model(*args, **kwargs)[0])


def reference(engine, dims: Dims) -> torch.Tensor:
    args, kwargs = engine.family.example_call(engine.module, dims)
    return _batched(engine.eager(*args, **kwargs)[0])


def _batched(output) -> torch.Tensor:
    """One tensor for the batch (Z-Image returns one tensor per sample, as its pipeline passes them)."""
    return torch.stack(output) if isinstance(output, (list, tuple)) else output
