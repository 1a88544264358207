"""Calls whose floating inputs the model casts anyway reach a graph without a new compile (input_casts.py).

A bfloat16 SDXL pipeline driven with float32 pooled embeddings passes `text_embeds` in float32 beside bfloat16
latents; the UNet casts them itself. Its graph was saved before the first image from an all-bfloat16 example
call (as Save Graph and save_pipe do): the pipeline's calls are served by that graph with the embeddings cast,
in the process that saved it and after a restart, with no compile and within bfloat16's tolerance of the
model's own output. An input the model does NOT cast is caught by the first-use check: that graph gives way
and the call gets a graph of its own.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compiler import CompileOptions, ShapeRange
from compiler.diffusers_api import compile_module
from compiler.serving.input_casts import cast_plan
from compiler.store.registry import GraphRegistry

ROOT = Path(__file__).resolve().parents[2]
BF16_TOLERANCE = 4e-2  # the first-use check's relative L2 for bfloat16


def _check(graphs: Path, *extra: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.support.cast_check", str(graphs), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    graphs = tmp_path_factory.mktemp("cast-graphs")
    return _check(graphs, "save"), _check(graphs)


def test_saved_before_the_first_image_then_called_with_float32_embeddings_compiles_nothing(runs):
    saved, _ = runs
    assert saved["saved_compiles"] == 1 and saved["compiles_after"] == 0, saved
    assert saved["eager"] == [] and saved["mismatches"] == 0 and saved["relative_l2"] < BF16_TOLERANCE, saved


def test_after_a_restart_the_saved_graph_serves_them_with_no_compile(runs):
    _, restarted = runs
    assert restarted["saved_compiles"] == 0 and restarted["compiles_after"] == 0 and restarted["loads"] == 1, restarted
    assert restarted["eager"] == [] and restarted["mismatches"] == 0, restarted
    assert restarted["relative_l2"] < BF16_TOLERANCE, restarted


def test_only_floating_dtypes_are_bridged():
    base = {"tree": "t", "constants": [], "tensors": [{"path": "x", "dtype": "bfloat16", "dims": ["batch", 4]},
                                                      {"path": "y", "dtype": "float32", "dims": ["batch"]}]}
    other = json.loads(json.dumps(base))
    other["tensors"][1]["dtype"] = "bfloat16"
    assert cast_plan(base, other) == ((1, "bfloat16"),)
    other["tensors"][1]["dtype"] = "int64"
    assert cast_plan(base, other) is None  # an integer input is another input, not a cast
    other["tensors"][1] = {"path": "y", "dtype": "bfloat16", "dims": ["batch", 2]}
    assert cast_plan(base, other) is None  # another shape
    assert cast_plan(base, base) is None  # nothing to cast


class ScalesInFloat32(torch.nn.Module):
    """Uses its float32 `scale` in float32 (no cast of its own), by how far it is from 1: a bfloat16 copy of a
    scale of 1 + 2**-10 is 1, and the output changes entirely."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1).to(torch.bfloat16)

    def forward(self, sample, scale):
        return (self.conv(sample).float() * ((scale - 1.0) * 1024 + 0.5)[:, None, None, None]).to(torch.bfloat16)


def test_an_input_the_model_does_not_cast_gets_a_graph_of_its_own():
    module = ScalesInFloat32().eval()
    twin = copy.deepcopy(module)
    registry = GraphRegistry()
    forward = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 2), spatial=(4, 8))), registry)
    sample = torch.randn(2, 4, 8, 8).to(torch.bfloat16)
    forward.warmup([((sample, torch.full((2,), 1.0, dtype=torch.bfloat16)), {})])  # a graph taking bfloat16 scales
    scale = torch.full((2,), 1.0 + 2 ** -10)  # float32: bfloat16 rounds it to 1.0
    with torch.no_grad():
        first = module(sample, scale)
        assert torch.equal(first, twin(sample, scale))  # the check gave the model's own output
        (mismatch,) = registry.mismatches  # the graph with the scale cast to bfloat16 disagreed, and said so
        assert "-cast-" in mismatch.graph_id, mismatch
        second = module(sample, scale)
    assert torch.equal(second, twin(sample, scale)) and not forward.last.eager, forward.last.reason
    assert len(registry.compiles) == 2  # the warmup's, then this input structure's own
