"""Whatever goes wrong with compiling, the caller gets the eager result and the reason."""

from __future__ import annotations

import torch

from compiler import CompileOptions, GraphRegistry, compile_module


class DataDependent(torch.nn.Module):
    """A branch on tensor values: torch.export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


def test_a_failed_compile_runs_eager_with_the_reason_and_is_not_retried(monkeypatch):
    exports = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or real_export(*a, **k))
    registry = GraphRegistry()
    model = DataDependent()
    compiled = compile_module(model, CompileOptions(backend="aot"), registry)
    for batch in (2, 3):
        x = torch.randn(batch, 4)
        with torch.no_grad():
            assert torch.equal(model(x), compiled.eager(x))
    assert registry.compiles == []
    reasons = [e.reason for e in registry.fallbacks]
    assert "compile failed: torch.export failed" in reasons[0] and "running eager" in reasons[0]
    assert "not retried" in reasons[-1]
    assert len(exports) == 1


def test_an_unknown_backend_runs_eager_naming_the_known_ones():
    registry = GraphRegistry()
    model = torch.nn.Linear(4, 4)
    compiled = compile_module(model, CompileOptions(backend="tensorrt"), registry)
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert torch.equal(model(x), compiled.eager(x))
    reason = registry.fallbacks[-1].reason
    assert "unknown backend 'tensorrt'" in reason and "aot" in reason


def test_an_input_a_graph_cannot_take_runs_eager_with_the_reason():
    registry = GraphRegistry()

    class TakesAFloat(torch.nn.Module):
        def forward(self, x, scale: float):
            return x * scale

    model = TakesAFloat()
    compile_module(model, CompileOptions(), registry)
    out = model(torch.ones(2), 0.5)
    assert torch.equal(out, torch.full((2,), 0.5))
    assert "Python float" in registry.fallbacks[-1].reason
