"""A model's tensors collected once and re-checked per call (compiler/tracing/module_snapshot.py): on this 2-core CPU the
real-depth SD1.5 UNet's calls spent 4.5-4.9 ms outside the runner walking the module twice, 2.2-2.3 ms with the
snapshot. Whatever changes between calls -- a weight replaced (ComfyUI's LoRA patching), moved (`.to()`,
`.data =`), a module added -- is seen on the next call, and the graph serves the new weights."""

from __future__ import annotations

import copy
import gc
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from compiler import CompileOptions, GraphRegistry, ShapeRange, compile_module
from compiler.tracing import module_snapshot
from compiler.tracing.flat_module import module_tensors


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def test_the_tensors_are_the_module_s_and_a_change_of_any_kind_is_seen():
    model = _model()
    expected = {"m." + name: t for name, t in model.named_parameters()}
    assert module_tensors(model) == expected
    first = module_snapshot.snapshot_of(model).token
    assert module_snapshot.snapshot_of(model).token == first  # nothing changed: not collected again
    model[0].weight = torch.nn.Parameter(torch.randn(16, 8))  # replaced, as ComfyUI's patching does
    assert module_tensors(model)["m.0.weight"] is model[0].weight
    second = module_snapshot.snapshot_of(model).token
    assert second != first
    model[2].weight.data = torch.randn(4, 16)  # same Parameter, new storage
    assert module_snapshot.snapshot_of(model).token != second
    third = module_snapshot.snapshot_of(model).token
    model.add_module("extra", torch.nn.Linear(4, 2))  # a module added: its tensors join
    assert "m.extra.weight" in module_tensors(model) and module_snapshot.snapshot_of(model).token != third
    model.register_buffer("scale", torch.ones(1))
    assert "m.scale" in module_tensors(model)


def test_a_snapshot_keeps_no_replaced_weight_alive():
    model = _model()
    module_snapshot.snapshot_of(model)
    old = weakref.ref(model[0].weight)
    model[0].weight = torch.nn.Parameter(torch.randn(16, 8))
    gc.collect()
    assert old() is None  # ComfyUI frees GPU memory by swapping weights: nothing here may hold the old ones


def test_a_model_let_go_or_a_module_taken_out_leaves_nothing_held():
    """The snapshot reads each submodule's own dicts (held as they are, for a fast check per call): a model let go
    frees its weights, and a submodule taken out is let go at the next check."""
    model = _model()
    module_snapshot.snapshot_of(model)
    weight = weakref.ref(model[0].weight)
    del model
    gc.collect()
    assert weight() is None
    model = _model()
    first = module_snapshot.snapshot_of(model).token
    removed = weakref.ref(model[2].weight)
    del model[2]  # taken out of the model
    assert module_snapshot.snapshot_of(model).token != first and "m.2.weight" not in module_tensors(model)
    gc.collect()
    assert removed() is None
    model.register_module("gap", None)  # a module slot holding None, as some models register
    model.register_buffer("unset", None)
    before = module_snapshot.snapshot_of(model).token
    assert module_snapshot.snapshot_of(model).token == before  # checked again, the same
    model.unset = torch.zeros(2)  # the empty buffer now holds a tensor
    assert module_snapshot.snapshot_of(model).token != before and "m.unset" in module_tensors(model)


def test_one_call_checks_the_module_once(monkeypatch):
    model = _model()
    module_snapshot.snapshot_of(model)
    checks = []
    real = module_snapshot.ModuleSnapshot.fresh
    monkeypatch.setattr(module_snapshot.ModuleSnapshot, "fresh", lambda self: checks.append(1) or real(self))
    with module_snapshot.one_check_per_call():
        module_snapshot.snapshot_of(model)
        module_snapshot.snapshot_of(model)
    assert len(checks) == 1
    module_snapshot.snapshot_of(model)
    assert len(checks) == 2  # outside a call: checked each time


def compiled_model():
    """(the small model compiled for batches 1-4, an uncompiled twin with the same weights, the registry)."""
    model = _model()
    twin = copy.deepcopy(model)
    registry = GraphRegistry()
    compile_module(model, CompileOptions(shape_range=ShapeRange(batch=(1, 4))), registry)
    return model, twin, registry


def test_a_compiled_model_serves_its_new_weights_after_each_kind_of_change():
    model, twin, registry = compiled_model()
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.allclose(model(x), twin(x), atol=1e-5)
        bound = StorageWeakRef(model[0].weight.untyped_storage())  # bound to the graph by the first call
        new = torch.randn(16, 8)
        model[0].weight = torch.nn.Parameter(new.clone())  # replaced
        twin[0].weight = torch.nn.Parameter(new.clone())
        assert torch.allclose(model(x), twin(x), atol=1e-5)
        gc.collect()
        # the runner holds no replaced weight: torch's user-managed constants kept every one for good (ComfyUI's
        # LoRA patching replaces Parameters; backends/borrowed_weights.py)
        assert bound.expired()
        for _ in range(3):  # patched and unpatched again: each weight let go is freed
            bound = StorageWeakRef(model[0].weight.untyped_storage())
            model[0].weight = torch.nn.Parameter(torch.randn(16, 8))
            twin[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())
            assert torch.allclose(model(x), twin(x), atol=1e-5)
            gc.collect()
            assert bound.expired()
        data = torch.randn(4, 16)
        model[2].weight.data = data.clone()  # new storage under the same Parameter
        twin[2].weight.data = data.clone()
        assert torch.allclose(model(x), twin(x), atol=1e-5)
        model[2].bias.add_(1.0)  # in place: the bound pointer sees it
        twin[2].bias.add_(1.0)
        assert torch.allclose(model(x), twin(x), atol=1e-5)
    assert len(registry.compiles) == 1
