"""Run in a fresh process: load saved graphs, serve a call, then wait to be stopped.

Usage: python -m tests.support.serve_and_wait GRAPHS_DIR

Prints one JSON line ({"run_folder", "loads", "compiles", "max_diff"}) once the
graphs are loaded and have served; then each line read from stdin serves the
UNet once more and prints {"max_diff"} (so a test can check the process still
works after another process swept the pack's folder). It is meant to be
stopped with SIGTERM or SIGKILL, the way services and containers are stopped.
"""

from __future__ import annotations

import json
import sys

import torch

from compiler import GraphRegistry, ShapeRange, load_pipe
from compiler.store import extraction
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import tiny_sd_pipeline
from tests.support.inputs import unet_inputs


def _unet_diff(pipe) -> float:
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        out = pipe.unet(*args, **kwargs)[0]
        ref = compiled_parts(pipe)["unet"].eager(*args, **kwargs)[0]
    return float((out - ref).abs().max())


def main(graphs: str) -> None:
    registry = GraphRegistry()
    pipe = tiny_sd_pipeline(seed=0)
    load_pipe(pipe, graphs, shape_range=ShapeRange(batch=(1, 4), spatial=(8, 24), sequence=(1, 160)),
              ignores=("vae.encoder",), registry=registry)
    diff = _unet_diff(pipe)
    print(json.dumps({"run_folder": str(extraction.run_folder()), "loads": len(registry.loads),
                      "compiles": len(registry.compiles), "max_diff": diff}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"max_diff": _unet_diff(pipe), "compiles": len(registry.compiles)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
