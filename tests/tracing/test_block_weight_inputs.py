"""Block graphs take their weights as inputs (compiler/tracing/weight_inputs.py): nothing is bound per call.

Bound as constants, every tensor an instance handed the runner before its call left a handle torch's runtime never
frees (3.5 kB a call for the tiny Flux here, torch 2.13). Checked: the lifted program's inputs, its package against
eager in torch's own loader; the engine serving every instance and a replaced weight with no binding at all and
no compile; the manifest's format; a graph saved with its weights as constants (before format 4) still served by
binding; a program that writes a buffer keeps its constants.
"""

from __future__ import annotations

import json
import weakref

import pytest
import torch

from compiler import GraphRegistry, compile_pipe
from compiler.tracing import weight_inputs
from compiler.diffusers_api import compiled_parts
from compiler.store.manifest import Manifest
from tests.support import tiny_transformers as tt

TOLERANCE = 1e-4


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.n = torch.nn.LayerNorm(32)
        self.b = torch.nn.Linear(32, 16)
        self.register_buffer("scale", torch.full((16,), 0.5), persistent=False)
        self.register_buffer("shift", torch.full((16,), 0.25))

    def forward(self, x, y):
        return self.b(torch.nn.functional.gelu(self.n(self.a(x)))) * self.scale + self.shift + x + y.mean()


class _Flat(torch.nn.Module):
    def __init__(self, module):
        super().__init__()
        self.m = module

    def forward(self, flat):
        return (self.m(*flat),)


def _exported(module, x, y):
    from torch.export import Dim

    with torch.no_grad():
        return torch.export.export(_Flat(module), ([x, y],), strict=False, dynamic_shapes=(
            [{0: Dim.AUTO(min=1, max=8), 1: Dim.AUTO(min=1, max=64)}, None],))


def _tensors(module):
    return {"m." + name: t for name, t in list(module.named_parameters()) + list(module.named_buffers())}


def test_a_lifted_program_takes_every_weight_after_the_call_and_its_package_computes_as_eager(tmp_path):
    from torch.export.graph_signature import InputKind

    torch.manual_seed(0)
    blocks = [_Block().eval() for _ in range(2)]
    y = torch.randn(3)
    program, names = weight_inputs.lift_weights(_exported(blocks[0], torch.randn(2, 7, 16), y))
    assert names == ["m.a.weight", "m.a.bias", "m.n.weight", "m.n.bias", "m.b.weight", "m.b.bias", "m.scale",
                     "m.shift"]
    assert [spec.kind for spec in program.graph_signature.input_specs] == [InputKind.USER_INPUT] * 10
    assert dict(program.state_dict) == {} and dict(program.constants) == {}
    assert weight_inputs.takes_weights(program)
    torch.export.save(program, str(tmp_path / "program.pt2"))  # as a build process is sent it
    loaded = torch.export.load(str(tmp_path / "program.pt2"))
    assert len(loaded.graph_signature.user_inputs) == 10
    package = torch._inductor.aoti_compile_and_package(loaded, package_path=str(tmp_path / "graph.pt2"))
    runner = torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)
    assert runner.get_constant_fqns() == []  # nothing to bind
    worst = 0.0
    with torch.no_grad():
        for block in blocks:  # one package, each instance's own weights passed
            for shape in [(2, 7, 16), (1, 3, 16), (5, 40, 16)]:
                x = torch.randn(shape)
                got = runner.boxed_run(weight_inputs.with_weights([x, y], _tensors(block), names))[0]
                worst = max(worst, float((got - block(x, y)).abs().max()))
    assert worst < 1e-5


def test_a_program_that_writes_a_weight_keeps_its_weights_as_constants():
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    with torch.no_grad():
        program = torch.export.export(Counting(), (torch.randn(2),), strict=False)
    with pytest.raises(weight_inputs.CannotLift, match="writes its tensor calls"):
        weight_inputs.lift_weights(program)

    class WritingThroughAView(Counting):
        def forward(self, x):
            self.calls[0:1].copy_(x[:1])
            return x * 2

    with torch.no_grad():
        program = torch.export.export(WritingThroughAView(), (torch.randn(2),), strict=False)
    with pytest.raises(weight_inputs.CannotLift, match="writes its tensor calls"):
        weight_inputs.lift_weights(program)

    class WritingItsOwn(Counting):  # an in-place write to a value of its own (Wan's blocks have one)
        def forward(self, x):
            y = x * 2 + self.calls
            y[0:1].copy_(x[:1])
            return y

    with torch.no_grad():
        program = torch.export.export(WritingItsOwn(), (torch.randn(2),), strict=False)
    assert weight_inputs.lift_weights(program)[1] == ["calls"]


def _served(lift: bool, monkeypatch, graphs_dir=None) -> tuple:
    if not lift:
        def refuse(program):
            raise weight_inputs.CannotLift("kept as constants for this test")
        monkeypatch.setattr(weight_inputs, "lift_weights", refuse)
    model = tt.build("flux", seed=0)
    pipe = tt.pipe_of(model)
    registry = GraphRegistry()
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry, graphs_dir=graphs_dir, autosave=graphs_dir is not None)
    engine = compiled_parts(pipe)["transformer"]
    with torch.no_grad():
        tt.call(model, tt.FIRST)
    return model, engine, registry


def _count_binds(monkeypatch) -> list:
    from compiler.backends import borrowed_weights

    binds = []
    real = borrowed_weights.bind

    def counted(runner, weights, check_full_update):
        binds.append(len(weights))
        return real(runner, weights, check_full_update)

    monkeypatch.setattr("compiler.blocks.binding.bind", counted)
    monkeypatch.setattr("compiler.backends.aot.bind", counted)
    return binds


def _sweep_worst(model, engine) -> float:
    worst = 0.0
    with torch.no_grad():
        for dims in tt.sweep("flux")[:3]:
            worst = max(worst, float((tt.call(model, dims) - tt.reference(engine, dims)).abs().max()))
    return worst


def test_every_instance_runs_from_one_graph_with_nothing_bound(monkeypatch, tmp_path):
    model, engine, registry = _served(True, monkeypatch, tmp_path / "graphs")
    graphs = [server.runner.graph for server in engine.servers]
    assert len(graphs) == tt.STRUCTURES["flux"]
    assert all(g.weight_inputs and not g.info.constant_names for g in graphs)
    binds = _count_binds(monkeypatch)
    compiles = len(registry.compiles)
    calls = engine.graph_calls
    assert _sweep_worst(model, engine) < TOLERANCE
    assert engine.graph_calls - calls == 3 * tt.BLOCKS["flux"]  # every block of every call from its graph
    # a replaced weight (ComfyUI's LoRA patching) is passed as it is; the one it replaced is not kept
    block = model.transformer_blocks[1]
    old = block.attn.to_q.weight
    gone = weakref.ref(old)
    with torch.no_grad():
        before = tt.call(model, tt.FIRST)
        block.attn.to_q.weight = torch.nn.Parameter(old * 1.5)
        del old
        after = tt.call(model, tt.FIRST)
        assert float((after - tt.reference(engine, tt.FIRST)).abs().max()) < TOLERANCE
    assert float((after - before).abs().max()) > 1e-3  # the new weight was used
    assert gone() is None
    assert binds == []  # not one tensor handed to a runner: nothing for torch's runtime to keep
    assert len(registry.compiles) == compiles and registry.fallbacks == []
    # saved as format 4, which names the weights in input order; a pack that reads 3 at most refuses it
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "graphs").rglob("*.json")]
    assert len(manifests) == tt.STRUCTURES["flux"]
    assert sorted(m["weight_inputs"] for m in manifests) == sorted(g.weight_inputs for g in graphs)
    assert all(m["format_version"] == 4 and m["constant_names"] == [] for m in manifests)
    assert all(Manifest.from_json(m).info.weight_inputs == m["weight_inputs"] for m in manifests)


def test_a_graph_saved_with_its_weights_as_constants_is_still_served_by_binding(monkeypatch, tmp_path):
    model, engine, registry = _served(False, monkeypatch, tmp_path / "graphs")
    graphs = [server.runner.graph for server in engine.servers]
    assert len(graphs) == tt.STRUCTURES["flux"]
    assert all(not g.weight_inputs and g.info.constant_names for g in graphs)
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "graphs").rglob("*.json")]
    assert all(m["format_version"] == 2 and "weight_inputs" not in m for m in manifests)  # as packs wrote them
    binds = _count_binds(monkeypatch)
    assert _sweep_worst(model, engine) < TOLERANCE
    assert binds  # instances take turns on the runner: bound before their calls
    assert registry.fallbacks == []
