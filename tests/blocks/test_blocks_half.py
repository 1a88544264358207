"""Transformers in the dtypes pipelines load them in, served block by block.

Real checkpoints run in bfloat16, and `from_pretrained(torch_dtype=...)`
keeps some modules in float32 (Wan: `scale_shift_table`, its time embedder
and norms). Example inputs must take the dtype the pipeline casts latents to
(the model's `dtype`), not the first parameter's: with float32 inputs the
probes of a bfloat16 Wan failed and every block ran eager. One compile per
family (module scope); tolerance relative to the output's scale, for bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from compiler import GraphRegistry, compile_pipe
from compiler.blocks.family import model_dtype_device
from compiler.diffusers_api import compiled_parts
from tests.support import tiny_transformers as tt

RELATIVE_TOLERANCE = 2e-2  # bfloat16 keeps 8 bits of mantissa; seen here: below 1e-2

_SERVED: dict = {}


@pytest.fixture(scope="module", params=["wan", "flux"])
def served(request):
    name = request.param
    if name not in _SERVED:
        model = tt.build_as_loaded(name, torch.bfloat16)
        pipe = tt.pipe_of(model)
        registry = GraphRegistry()
        compile_pipe(pipe, shape_range=tt.RANGE, registry=registry)
        with torch.no_grad():
            tt.call(model, tt.FIRST)
        _SERVED[name] = (name, model, compiled_parts(pipe)["transformer"], registry)
    return _SERVED[name]


def test_example_inputs_take_the_dtype_the_pipeline_sends():
    model = tt.build_as_loaded("wan", torch.bfloat16)
    first = next(p for p in model.parameters() if p.is_floating_point())
    assert first.dtype == torch.float32  # kept in float32 by the class, and first
    assert model_dtype_device(model) == (torch.bfloat16, first.device)


def test_a_bfloat16_model_compiles_each_block_structure_and_serves_the_sweep(served):
    name, model, engine, registry = served
    assert len(registry.compiles) == tt.STRUCTURES[name], engine.report()
    report = engine.report()
    assert report["blocks_compiled"] == report["blocks"] == tt.BLOCKS[name], report
    assert all(structure["notes"] == [] for structure in report["structures"]), report  # sizes of 1 served
    compiles = len(registry.compiles)
    worst = 0.0
    with torch.no_grad():
        for dims in tt.sweep(name):
            before = engine.graph_calls
            out = tt.call(model, dims)
            assert engine.graph_calls - before == tt.BLOCKS[name], dims  # every block ran from its graph
            assert out.dtype == torch.bfloat16
            ref = tt.reference(engine, dims)
            worst = max(worst, float((out.float() - ref.float()).abs().max()) / float(ref.float().abs().max()))
    assert len(registry.compiles) == compiles
    assert registry.fallbacks == [], [e.reason for e in registry.fallbacks]
    assert worst < RELATIVE_TOLERANCE


def test_layerwise_casting_runs_the_blocks_eager_saying_what_to_do():
    """Hooks that cast each layer's float8 weights during the call: no graph can bind those; said before export."""
    models = [tt.build("flux", seed=3).to(torch.bfloat16) for _ in range(2)]
    for model in models:
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    model, reference = models
    pipe = tt.pipe_of(model)
    registry = GraphRegistry()
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry)
    with torch.no_grad():
        out = tt.call(model, tt.FIRST)
        want = tt.call(reference, tt.FIRST)
    assert torch.equal(out, want)
    assert registry.compiles == []
    reasons = [e.reason for e in registry.fallbacks]
    assert len(reasons) == tt.STRUCTURES["flux"], reasons
    assert all("enable_layerwise_casting" in r and "torch_dtype" in r for r in reasons), reasons
    report = compiled_parts(pipe)["transformer"].report()
    assert report["blocks_compiled"] == 0, report
