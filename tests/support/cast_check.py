"""Run in a fresh process: a bfloat16 tiny SDXL UNet served from GRAPHS_DIR, called as a diffusers pipeline driven
with float32 pooled embeddings calls it (`text_embeds` float32 beside bfloat16 latents); prints counts as JSON.

Usage: python -m tests.support.cast_check GRAPHS_DIR [save]   (save: first compile and save, before any image,
from an example call with every input in bfloat16, as Save Graph and save_pipe make it)
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from compiler import CompileOptions, GraphStore, ShapeRange
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import pooled_embeds, prompt_embeds, tiny_sdxl_pipeline

RANGE = ShapeRange(batch=(1, 2), spatial=(8, 16), sequence=(1, 77))
DTYPE = torch.bfloat16


def call(batch: int, side: int, pooled_dtype: torch.dtype):
    generator = torch.Generator().manual_seed(batch * 100 + side)
    latents = torch.randn(batch, 4, side, side, generator=generator).to(DTYPE)
    added = {"text_embeds": pooled_embeds(batch, seed=side).to(pooled_dtype),
             "time_ids": torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]] * batch).to(DTYPE)}
    return (latents, torch.tensor(500.0)), {"encoder_hidden_states": prompt_embeds(batch, 77, dtype=DTYPE),
                                            "added_cond_kwargs": added, "return_dict": False}


def main(graphs: str, save: bool) -> None:
    unet = tiny_sdxl_pipeline(seed=0, dtype=DTYPE).unet
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, store=GraphStore(graphs), autosave=True),
                             registry)
    if save:
        forward.warmup([call(2, 16, DTYPE)])
    saved_compiles = len(registry.compiles)
    worst, eager = 0.0, []
    for batch, side in ((2, 16), (1, 8), (2, 12)):
        args, kwargs = call(batch, side, torch.float32)  # what the pipeline passes
        with torch.no_grad():
            out, ref = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
        worst = max(worst, float((out.float() - ref.float()).norm() / ref.float().norm()))
        if forward.last.eager:
            eager.append(forward.last.reason)
    print(json.dumps({"saved_compiles": saved_compiles, "compiles_after": len(registry.compiles) - saved_compiles,
                      "loads": len(registry.loads), "relative_l2": worst, "eager": eager,
                      "mismatches": len(registry.mismatches)}))


if __name__ == "__main__":
    main(sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "save")
