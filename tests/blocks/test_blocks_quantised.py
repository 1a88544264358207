"""Block graphs over weights stored in another form (compiler/blocks/quantised.py), without ComfyUI.

- A block whose code makes small tensors (ComfyUI-GGUF's dequantisation
  makes `torch.tensor([0, 4])` shift tables) compiles into a graph that
  needs no binding for them: they are rebuilt by ops (`inline_code_constants`).
- A block whose weight is a traceable tensor subclass (ComfyUI's fp8-scaled
  `QuantizedTensor`; torch's own `TwoTensor` here) is traced through the
  subclass and served with the subclass's parts bound per call: another
  instance's parts give that instance's result.
- Per-call tensors (`call_tensors`: a LoRA delta) are bound beside the
  module's own, released after a transient call, and a changed one rebinds.
- The block structure key changes with the stored form, and only then.
One compile per graph (two here, about a minute on 2 CPU cores).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from compiler.blocks.binding import InstanceWeights, SharedRunner
from compiler.blocks.export import export_block, trace_block
from compiler.blocks.quantised import StoredWeights, structure_key, subclass_parts, subclass_storage_key
from compiler.keys.graph_keys import FamilyKey, GraphKey
from compiler.keys.shapes import DEFAULT_RANGE
from compiler.keys.signature import FlatCall

TOLERANCE = 1e-5
BOUNDS = [{0: (1, 4), 1: (2, 64)}]  # x: [batch, tokens, 8]


class ShiftBlock(torch.nn.Module):
    """A Linear whose code makes small tensors, as dequantisation code does."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        shifts = torch.tensor([0, 4], device=x.device, dtype=torch.int32)  # an arithmetic progression
        table = torch.tensor([1.0, -2.0, 0.5, 3.0], device=x.device)  # not one
        bits = (torch.full((2,), 0x35, dtype=torch.int32, device=x.device) >> shifts) & 0x0F
        return self.linear(x) * table.repeat(2) + bits.to(x.dtype).sum()


class DeltaLinear(torch.nn.Module):
    """A Linear whose weight is stored as two parts and "dequantised" (their sum) per call, plus a delta bound
    per call (what a GGUF layer's LoRA delta is to its graph)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        stored = self.linear.weight
        return torch.nn.functional.linear(x, stored.a + stored.b + self.delta, self.linear.bias)


class DeltaWeights(StoredWeights):
    """Registers the delta only while traced; binds zeros, or the delta a test sets, per call."""

    def __init__(self):
        self.delta = None

    @contextlib.contextmanager
    def tracing(self, block):
        block.register_buffer("delta", torch.zeros(8, 8), persistent=False)
        try:
            yield
        finally:
            del block._buffers["delta"]

    def call_tensors(self, module, device=None):
        if self.delta is None:
            return {"m.delta": torch.zeros(8, 8)}, False
        return {"m.delta": self.delta}, True


def _call(x):
    return FlatCall((x,), {}, role_policy=lambda path, tensor: {0: "batch", 1: "tokens"})


def _key(name: str):
    return GraphKey(FamilyKey.here(name, "test", "sig", torch.float32, "cpu", "aot"), DEFAULT_RANGE)


def _run(graph, module, x, extra=None):
    weights = InstanceWeights(module, extra)
    return SharedRunner(graph).run(weights, [x], _call(x).rebuild), weights


def test_structure_key_changes_with_the_stored_form_only():
    assert structure_key("abc", "") == "abc"  # plain weights: the keys of stored graphs do not move
    q8, q4 = structure_key("abc", "w:Q8_0"), structure_key("abc", "w:Q4_K")
    assert q8 != q4 and q8.startswith("abc-") and q4.startswith("abc-")
    assert subclass_storage_key(torch.nn.Linear(4, 4)) == ""


def test_code_made_tensors_are_rebuilt_into_the_graph():
    torch.manual_seed(0)
    block, other = ShiftBlock(), ShiftBlock()
    x = torch.randn(2, 5, 8)
    traced = trace_block(block, _call(x), BOUNDS, _key("shift"))
    assert not [s for s in traced.program.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"]
    graph, _notes = export_block(block, _call(x), BOUNDS, _key("shift"))
    assert not [name for name in graph.weight_inputs if "_tensor_constant" in name], graph.weight_inputs
    with torch.no_grad():
        for module in (block, other):
            for shape in ((1, 3, 8), (3, 17, 8)):
                y = torch.randn(*shape)
                got, _ = _run(graph, module, y)
                assert float((got - module(y)).abs().max()) < TOLERANCE
                # the graph's own run (the path for other runners) passes the module's weights the same way
                assert float((graph.run(module, _call(y)) - module(y)).abs().max()) < TOLERANCE


def test_subclass_weights_bind_by_their_parts_and_per_call_tensors_beside_them():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    torch.manual_seed(1)

    def block_with_parts() -> DeltaLinear:
        block = DeltaLinear()
        weight = block.linear.weight.detach()
        parts = two_tensor.TwoTensor(weight * 0.75, weight * 0.25 + torch.randn(8, 8) * 0.01)
        block.linear.weight = torch.nn.Parameter(parts, requires_grad=False)
        return block

    block, other = block_with_parts(), block_with_parts()
    assert len(subclass_parts(block.linear.weight)) == 2
    assert "TwoTensor" in subclass_storage_key(block)
    stored = DeltaWeights()
    x = torch.randn(2, 5, 8)
    graph, _notes = export_block(block, _call(x), BOUNDS, _key("two"), tracing=stored.tracing)
    assert "delta" not in block._buffers  # the tracing context left the module as it was
    # its parts are the graph's inputs after the call's (nothing bound, backends/weight_inputs.py)
    assert any("parametrizations.weight.original" in name for name in graph.weight_inputs), graph.weight_inputs
    assert graph._names == []

    def eager(module, y, delta):
        stored = module.linear.weight
        return torch.nn.functional.linear(y, stored.a + stored.b + delta, module.linear.bias)

    with torch.no_grad():
        for module in (block, other):
            got, weights = _run(graph, module, x, stored.call_tensors)
            assert float((got - eager(module, x, 0)).abs().max()) < TOLERANCE
        runner = SharedRunner(graph)
        weights = InstanceWeights(other, stored.call_tensors)
        for _ in range(3):  # a delta of its own for each call, as ComfyUI's per-call LoRA patches
            stored.delta = torch.randn(8, 8) * 0.1
            got = runner.run(weights, [x], _call(x).rebuild)
            assert float((got - eager(other, x, stored.delta)).abs().max()) < TOLERANCE
            assert "m.delta" not in weights.tensors and not weights.transient  # released after the call
            delta = StorageWeakRef(stored.delta.untyped_storage())
            stored.delta = None
            gc.collect()
            # and freed: torch's user-managed constants kept each one for good (the H200's partly loaded Flux
            # kept the weights moved in for every step; backends/borrowed_weights.py)
            assert delta.expired()
        # one part replaced on its own (a new scale of an fp8 weight): bound again, the old part not kept
        part = StorageWeakRef(other.linear.weight.b.untyped_storage())
        other.linear.weight.b = other.linear.weight.b * 2.0
        got = runner.run(weights, [x], _call(x).rebuild)
        assert float((got - eager(other, x, 0)).abs().max()) < TOLERANCE
        gc.collect()
        assert part.expired()
