"""Run in a fresh process: one order of API calls over saved graphs, then one image; report counts as JSON.

Usage: python -m tests.support.api_sequence GRAPHS_DIR SEQUENCE PIPE

The pipeline is built with other weights than the one whose graphs were
saved (graphs hold no weights), the image is generated through the
pipeline's own calls (positional UNet inputs, keyword VAE inputs), and the
same image is generated again with every module uncompiled to compare.
"""

from __future__ import annotations

import json
import sys

import torch

from compiler import GraphRegistry, ShapeRange, compile_pipe, load_pipe, save_pipe, uncompile_module
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import pooled_embeds, prompt_embeds, tiny_sd_pipeline, tiny_sdxl_pipeline

RANGE = ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160))
IGNORES = {
    "sd": ("vae.encoder",),
    "sdxl": ("vae.decoder", "vae.encoder"),
    "fp16_vae": ("unet", "vae.encoder"),
    # a float32 VAE in a half-precision img2img pipeline: the VAE's dtypes are what is tested
    "img2img_bfloat16": ("unet",),
    "img2img_float16": ("unet",),
}
SEQUENCES = {
    # the OneDiff flow: compile, then load into the compiled pipe
    "compile_then_load": lambda pipe, graphs, ignores, registry: (
        compile_pipe(pipe, shape_range=RANGE, ignores=ignores, graphs_dir=graphs, registry=registry),
        load_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry)),
    "load_alone": lambda pipe, graphs, ignores, registry: (
        load_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry),),
    "compile_save_load": lambda pipe, graphs, ignores, registry: (
        compile_pipe(pipe, shape_range=RANGE, ignores=ignores, graphs_dir=graphs, registry=registry),
        save_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry),
        load_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry)),
    "save_then_load": lambda pipe, graphs, ignores, registry: (
        save_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry),
        load_pipe(pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry)),
}


def build(kind: str, seed: int):
    if kind.startswith("img2img_"):
        from diffusers import StableDiffusionXLImg2ImgPipeline

        dtype = getattr(torch, kind.partition("_")[2])
        pipe = StableDiffusionXLImg2ImgPipeline(**tiny_sdxl_pipeline(seed, dtype=dtype, vae_dtype=torch.float32).components)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    if kind == "sdxl":
        return tiny_sdxl_pipeline(seed)
    if kind == "fp16_vae":
        return tiny_sdxl_pipeline(seed, vae_dtype=torch.float16)
    return tiny_sd_pipeline(seed)


def image(pipe, kind: str) -> torch.Tensor:
    if kind.startswith("img2img_"):
        # The pattern: no CFG, two images of one prompt; the VAE encodes upcast (float32) and decodes in
        # the pipeline's dtype (img2img casts the VAE to it) or upcast again (float16 with force_upcast).
        dtype = pipe.unet.dtype
        picture = torch.rand(1, 3, 16, 24, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            return pipe(image=picture, prompt_embeds=prompt_embeds(1, seed=1, dtype=dtype),
                        pooled_prompt_embeds=pooled_embeds(1, seed=3, dtype=dtype), num_inference_steps=2,
                        strength=0.6, guidance_scale=1.0, num_images_per_prompt=2, output_type="pt",
                        generator=torch.Generator().manual_seed(42)).images
    extra = {}
    if kind in ("sdxl", "fp16_vae"):
        extra = {"pooled_prompt_embeds": pooled_embeds(1, seed=3), "negative_pooled_prompt_embeds": pooled_embeds(1, seed=4)}
    with torch.no_grad():
        return pipe(prompt_embeds=prompt_embeds(1, seed=1), negative_prompt_embeds=prompt_embeds(1, seed=2),
                    height=32, width=40, num_inference_steps=2, guidance_scale=5.0, output_type="pt",
                    generator=torch.Generator().manual_seed(42), **extra).images


def main(graphs: str, sequence: str, kind: str) -> None:
    registry = GraphRegistry()
    pipe = build(kind, seed=7)
    reports = SEQUENCES[sequence](pipe, graphs, IGNORES[kind], registry)
    compiled = image(pipe, kind)
    parts = compiled_parts(pipe)
    served = {target: part.graph_calls for target, part in parts.items()}
    for target in parts:
        module = pipe
        for name in target.split("."):
            module = getattr(module, name)
        uncompile_module(module)
    eager = image(pipe, kind)
    print(json.dumps({
        "compiles": [e.reason for e in registry.compiles],
        "loads": len(registry.loads),
        "fallbacks": [e.reason for e in registry.fallbacks],
        "problems": [p for report in reports for p in getattr(report, "problems", [])],
        "graph_calls": served,
        "max_diff": float((compiled.float() - eager.float()).abs().max()),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
