"""The `inductor` backend: torch.compile that neither recompiles nor silently goes eager."""

from __future__ import annotations

import pytest
import torch

from compiler import CompileOptions, GraphRegistry, compile_module
from compiler.demo.tiny_models import tiny_unet
from tests.support.inputs import UNET_SWEEP, unet_inputs, unet_sweep_worst_difference

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def inductor_unet(test_range):
    registry = GraphRegistry()
    unet = tiny_unet(seed=0)
    compiled = compile_module(unet, CompileOptions(backend="inductor", shape_range=test_range), registry)
    args, kwargs = unet_inputs(*UNET_SWEEP[0])
    with torch.no_grad():
        unet(*args, **kwargs)  # the first call compiles (and covers the range's corners)
    return unet, compiled, registry


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_first_call_compiles_with_reasons(inductor_unet):
    _, compiled, registry = inductor_unet
    reasons = [e.reason for e in registry.compiles]
    assert reasons and "first call" in reasons[0]
    # On CPU, convolutions guard on batch > 1: the batch-1 corner gets its own graph now.
    assert all("first call" in r or "range corner" in r for r in reasons), reasons
    assert compiled.last_status == "compiled graph"


def test_sweep_after_first_call_compiles_nothing(inductor_unet):
    unet, compiled, registry = inductor_unet
    compiles, graphs_before, fallbacks = len(registry.compiles), _unique_graphs(), len(registry.fallbacks)
    worst = unet_sweep_worst_difference(unet, compiled.eager)
    assert len(registry.compiles) == compiles
    assert _unique_graphs() == graphs_before  # torch's own count of compiled graphs
    assert len(registry.fallbacks) == fallbacks, [e.reason for e in registry.fallbacks]
    assert worst < TOLERANCE


def test_other_weights_and_in_place_changes_share_the_graphs(inductor_unet, test_range):
    _, _, registry = inductor_unet
    other = tiny_unet(seed=11)
    compiled = compile_module(other, CompileOptions(backend="inductor", shape_range=test_range), registry)
    compiles, graphs_before = len(registry.compiles), _unique_graphs()
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        first = other(*args, **kwargs)[0]
        assert float((first - compiled.eager(*args, **kwargs)[0]).abs().max()) < TOLERANCE
        other.conv_in.weight.mul_(1.3)
        second = other(*args, **kwargs)[0]
        assert float((second - compiled.eager(*args, **kwargs)[0]).abs().max()) < TOLERANCE
    assert float((second - first).abs().max()) > 1e-3
    assert len(registry.compiles) == compiles and _unique_graphs() == graphs_before


def test_covering_a_large_range_reads_guards_and_never_runs_its_corners(monkeypatch):
    """The range's corners are checked against torch.compile's guards, not run: a 2048 px corner of a
    UNet would take minutes on a CPU (the first ComfyUI run with this backend once took 18 minutes)."""
    from compiler import ShapeRange
    from compiler.backends.base import GraphMismatch
    from compiler.backends.inductor import InductorGraph

    runs = []
    real_run = InductorGraph.run

    def counted(self, module, call, replay=False):
        latent = next(tuple(shape) for shape in call.shapes if len(shape) == 4)
        runs.append(latent)
        if max(latent[-2:]) > 16:  # recorded for the assertion below, not run (it would take minutes)
            raise GraphMismatch("a large corner was run")
        return real_run(self, module, call, replay)

    monkeypatch.setattr(InductorGraph, "run", counted)
    registry = GraphRegistry()
    unet = tiny_unet(seed=3)
    huge = ShapeRange(batch=(1, 8), spatial=(8, 2048), sequence=(1, 160))
    compile_module(unet, CompileOptions(backend="inductor", shape_range=huge), registry)
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        unet(*args, **kwargs)
    # Runs: the first call, and one per graph compiled for a corner (small ones: batch 1 on CPU convolutions).
    # Runs: one per compile (torch.compile builds on a run) and the first call's own; none at a corner
    # no graph was compiled for, and none at the large corners.
    assert len(runs) == len(registry.compiles) + 1, runs
    assert all(shape[-1] <= 16 and shape[-2] <= 16 for shape in runs), runs
    corner_compiles = [e.reason for e in registry.compiles if "range corner" in e.reason]
    assert all("torch.compile would recompile" in reason for reason in corner_compiles), corner_compiles
