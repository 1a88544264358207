"""Every graph's output equals the model's own, in the orders of calls users make (diffusers models).

The matrix (tests/support/matrix.py): SD and SDXL (text_time) UNets, the VAE's decoder and encoder,
and Flux, SD3 and Wan transformers served block by block; each compiled from a first call at a model
batch of 1 (and, separately, of 2 where the graph is traced from that call: FIRST_BATCHES); then 1, 2 and 3 images x CFG off and on x two sizes x two prompt
lengths (Wan: x two frame counts) in a seeded order, every output compared with eager's and every
call required to reach a graph; then a new process with other weights loads the saved graphs and runs
the matrix in another order. The graphs are tested on their own here (the first-use check is off);
with it on, a graph made to give a wrong answer is caught. Before KeepFast 0.2.0 a graph compiled
from a batch-1 call gave every larger batch a wrong output (0.97 off for a UNet, NaN for a VAE) with
nothing said: the batch-1 cases here fail on that code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from compiler import GraphRegistry
from compiler.serving.compiled_forward import CompiledForward
from tests.support import matrix as M

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Compiled:
    kind: str
    first: int
    subject: M.Subject
    registry: GraphRegistry
    graphs: Path
    first_compiles: int
    first_difference: float
    first_served: int


_COMPILED: dict = {}


def _compiled(kind: str, first: int, tmp_path_factory) -> Compiled:
    """One compile per (kind, first batch), shared by the tests of that case."""
    key = (kind, first)
    if key not in _COMPILED:
        registry = GraphRegistry()
        graphs = tmp_path_factory.mktemp(f"matrix-{kind}-{first}") / "graphs"
        subject = M.Subject(kind, seed=0, registry=registry, graphs=graphs)
        got, want, served = subject.run(M.first_call(kind, first))
        _COMPILED[key] = Compiled(kind, first, subject, registry, graphs, len(registry.compiles),
                                  M.relative_difference(got, want), served)
    return _COMPILED[key]


# The first call's batch matters where a graph is traced from it: the SD UNet's and the VAE's whole-model
# graphs (traced at 1 widened to 2, or at 2 then serving 1). SDXL's UNet is the SD UNet with text_time
# embeddings, and blocks are traced at probe sizes >= 2 whatever the first call: a first batch of 1 for those.
# A first batch of 2 then serving 1 is the real-depth tests' order for the SD UNet and the VAE decoder
# (tests/serving/test_real_depth.py: the first call at batch 2, then batches 1 and 3, each against eager); here for the
# encoder, which no other test compiles from a batch of 2.
FIRST_BATCHES = {"sd-unet": (1,), "vae-decoder": (1,), "vae-encoder": (1, 2)}
CASES = [(kind, first) for kind in M.KINDS for first in FIRST_BATCHES.get(kind, (1,))]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: f"{p[0]}-first-batch-{p[1]}")
def compiled(request, tmp_path_factory) -> Compiled:
    return _compiled(*request.param, tmp_path_factory)


def test_the_first_call_compiles_and_equals_eager(compiled):
    assert compiled.first_compiles >= 1, [e.reason for e in compiled.registry.fallbacks]
    assert compiled.first_served >= 1
    assert compiled.first_difference < M.TOLERANCE


def test_every_later_call_is_served_by_a_graph_and_equals_eager(compiled):
    registry = compiled.registry
    compiles, fallbacks = len(registry.compiles), len(registry.fallbacks)
    for call in M.later_calls(compiled.kind, seed=compiled.first):
        got, want, served = compiled.subject.run(call)
        assert served >= 1, (call, [e.reason for e in registry.fallbacks])
        difference = M.relative_difference(got, want)
        assert difference < M.TOLERANCE, (call, difference)
    assert len(registry.compiles) == compiles, [e.reason for e in registry.compiles[compiles:]]
    assert len(registry.fallbacks) == fallbacks, [e.reason for e in registry.fallbacks[fallbacks:]]


def test_a_restart_with_other_weights_compiles_nothing_and_equals_eager(compiled):
    result = subprocess.run([sys.executable, "-m", "tests.support.matrix", compiled.kind, str(compiled.graphs)],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiles"] == 0 and report["loads"] >= 1, report
    assert report["fallbacks"] == [] and report["problems"] == [], report
    for row in report["rows"]:
        assert row["graph_calls"] >= 1 and row["difference"] < M.TOLERANCE, row


def test_the_first_use_check_catches_a_wrong_graph_and_returns_eager_s_output(tmp_path_factory, monkeypatch):
    """A test-only fault: the graph adds 0.5 to its output at batch 2. With the check on (the default),
    eager's output comes back, the difference is recorded once, and the shape then runs eager, unchecked."""
    case = _compiled("sd-unet", 1, tmp_path_factory)
    subject, registry = case.subject, case.registry
    eager_runs = []

    def counted_forward(module, *args, **kwargs):
        eager_runs.append(1)
        return type(module).forward(module, *args, **kwargs)

    checked = CompiledForward(subject.module, subject.served.options.with_(verify=True, autosave=False),
                              registry, forward_fn=counted_forward)
    from compiler.backends import aot

    graph_runs = []
    original = aot.AotGraph.run

    def perturbed(self, module, call, replay=False):
        graph_runs.append(call.shapes[0][0])
        output = original(self, module, call, replay=replay)
        if call.shapes[0][0] == 2:
            output = pytree.tree_map_only(torch.Tensor, lambda t: t + 0.5, output)
        return output

    monkeypatch.setattr(aot.AotGraph, "run", perturbed)
    compiles = len(registry.compiles)

    def serve(call):
        args, kwargs = subject.inputs(call)
        with torch.no_grad():
            served = checked.serve(args, kwargs)
            return served, M.relative_difference(served.output[0], counted_forward(subject.module, *args, **kwargs)[0])

    one, two, three = M.Call(1, False, (16, 16)), M.Call(2, False, (16, 16)), M.Call(3, False, (16, 16))
    served, difference = serve(one)  # a right graph: checked once against eager, then trusted
    assert not served.eager and difference < M.TOLERANCE
    runs = len(eager_runs)
    served, _ = serve(one)
    assert not served.eager and len(eager_runs) == runs + 1  # only the test's own reference ran eager
    served, difference = serve(two)  # the wrong graph: caught, eager's output returned
    assert served.eager and difference == 0.0
    assert "disagrees with eager" in served.reason and "relative difference" in served.reason
    mismatches = registry.mismatches
    assert len(mismatches) == 1 and mismatches[0].detail["shapes"][0][0] == 2
    graphs_before = len(graph_runs)
    served, difference = serve(two)  # later calls at that shape: eager, without running or checking the graph
    assert served.eager and difference == 0.0 and len(graph_runs) == graphs_before
    assert len(registry.mismatches) == 1
    served, difference = serve(three)  # other shapes keep the graph
    assert not served.eager and difference < M.TOLERANCE
    assert len(registry.compiles) == compiles
    assert registry.stats()["mismatches"][0]["graph_id"] == served.graph_id
