"""Run in a fresh process: serve a tiny transformer from saved block graphs, report counts as JSON.

Usage: python -m tests.support.blocks_load_check FAMILY GRAPHS_DIR
"""

from __future__ import annotations

import json
import sys

import torch

from compiler import GraphRegistry, load_pipe
from compiler.diffusers_api import compiled_parts
from tests.support import tiny_transformers as tt


def main(name: str, graphs: str) -> None:
    registry = GraphRegistry()
    model = tt.build(name, seed=0)
    pipe = tt.pipe_of(model)
    report = load_pipe(pipe, graphs, shape_range=tt.RANGE, compile_on_miss=False, registry=registry)
    engine = compiled_parts(pipe)["transformer"]
    diffs = []
    with torch.no_grad():
        for dims in tt.sweep(name)[::3]:
            diffs.append(float((tt.call(model, dims) - tt.reference(engine, dims)).abs().max()))
    print(json.dumps({
        "compiles": len(registry.compiles),
        "loads": len(registry.loads),
        "fallbacks": [e.reason for e in registry.fallbacks],
        "problems": report.problems,
        "loaded": report.loaded,
        "max_diff": max(diffs),
        "graph_calls": engine.graph_calls,
        "blocks": len(engine.instances),
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
