"""Run in a fresh process: load saved graphs, run the sweeps, report counts as JSON.

Usage: python -m tests.support.load_check GRAPHS_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from compiler import GraphRegistry, ShapeRange, load_pipe
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import tiny_sd_pipeline
from tests.support.inputs import UNET_SWEEP, VAE_SWEEP, latents, unet_inputs


def main(graphs: str) -> None:
    registry = GraphRegistry()
    pipe = tiny_sd_pipeline(seed=0)
    report = load_pipe(pipe, graphs, shape_range=ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160)),
                       ignores=("vae.encoder",), registry=registry)
    parts = compiled_parts(pipe)
    diffs = []
    with torch.no_grad():
        for shape in UNET_SWEEP:
            args, kwargs = unet_inputs(*shape)
            out = pipe.unet(*args, **kwargs)[0]
            ref = parts["unet"].eager(*args, **kwargs)[0]
            diffs.append(float((out - ref).abs().max()))
        for shape in VAE_SWEEP:
            z = latents(*shape)
            out = pipe.vae.decode(z).sample
            decoder = parts["vae.decoder"]
            ref = decoder.eager(pipe.vae.post_quant_conv(z))
            diffs.append(float((out - ref).abs().max()))
    print(json.dumps({
        "compiles": len(registry.compiles),
        "loads": len(registry.loads),
        "fallbacks": [e.reason for e in registry.fallbacks],
        "problems": report.problems,
        "max_diff": max(diffs),
        "hits": registry.hits,
    }))


if __name__ == "__main__":
    main(sys.argv[1])
