"""Run in a fresh process: a tiny SD UNet served from graphs in GRAPHS_DIR (compiled there, in parts, when none
is stored), over sizes, batches and prompt lengths; prints counts and the largest difference from eager as JSON.

Usage: KEEPFAST_GRAPH_PARTS=2 python -m tests.support.parts_check GRAPHS_DIR SEED
"""

from __future__ import annotations

import copy
import json
import sys

import torch

from compiler import CompileOptions, GraphStore, ShapeRange
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import unet_call

RANGE = ShapeRange(batch=(1, 2), spatial=(8, 16), sequence=(1, 77))
CALLS = ((2, 16, 77), (1, 8, 20), (2, 12, 5), (1, 16, 77), (2, 8, 1))


def main(graphs: str, seed: int) -> None:
    unet = tiny_unet(seed=seed)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, store=GraphStore(graphs), autosave=True),
                             registry)
    diffs, eager = [], []
    for batch, side, length in CALLS:
        args, kwargs = unet_call(batch, side, length)
        with torch.no_grad():
            diffs.append(float((unet(*args, **kwargs)[0] - twin(*args, **kwargs)[0]).abs().max()))
        if forward.last.eager:
            eager.append(forward.last.reason)
    print(json.dumps({"compiles": len(registry.compiles), "loads": len(registry.loads), "max_diff": max(diffs),
                      "eager": eager, "parts": [e.detail.get("phase_s", {}).get("parts") for e in registry.compiles],
                      "mismatches": len(registry.mismatches)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
