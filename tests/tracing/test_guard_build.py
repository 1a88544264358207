"""Guards at build time: division guards cover the range, unreadable ones refuse the graph.

ComfyUI's sub-quadratic attention picks its chunking from the free memory
and the token count, so its export carries guards such as
`mem / (4.0 * batch) >= height * width`: inside that region the graph is
right, outside it the model takes another branch. The tiny module here has
the same kind of branch, with visibly different results on each side, so a
graph used outside its region would give a wrong image, not a slow one.
"""

from __future__ import annotations

import pytest
import torch

from compiler import CompiledForward, CompileOptions, GraphRegistry, ShapeRange
from compiler.tracing import export_guards


class MemoryChunked(torch.nn.Module):
    """Branches on a float computed from the batch, like ComfyUI's attention_sub_quad."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        tokens = x.shape[2] * x.shape[3]
        if 60000.0 / (4.0 * x.shape[0]) >= tokens:  # fits in one chunk
            return self.conv(x) * 2.0
        return self.conv(x) - 1.0


RANGE = ShapeRange(batch=(1, 8), spatial=(8, 128), sequence=(1, 16))


@pytest.fixture(scope="module")
def chunked():
    registry = GraphRegistry()
    torch.manual_seed(0)
    module = MemoryChunked().eval()
    forward = CompiledForward(module, CompileOptions(backend="aot", shape_range=RANGE), registry)
    with torch.no_grad():
        forward(torch.randn(1, 4, 8, 8))  # compiles, then the corners the graph does not serve
    return module, forward, registry


def test_corners_outside_a_division_guard_are_compiled_at_build_time(chunked):
    _, _, registry = chunked
    reasons = [event.reason for event in registry.compiles]
    assert len(reasons) == 2, reasons
    assert "first call" in reasons[0]
    # 128x128 breaks 60000 / (4.0 * batch) >= height * width at every batch: compiled now, not in a later run
    assert "range corner batch 1, latent 128x128" in reasons[1] and " / " in reasons[1], reasons[1]


@pytest.mark.parametrize("batch, height, width", [(8, 128, 128), (8, 96, 96), (1, 8, 8), (2, 120, 64), (8, 8, 8)])
def test_each_side_of_the_guard_is_served_by_its_own_graph(chunked, batch, height, width):
    module, forward, registry = chunked
    compiles, fallbacks = len(registry.compiles), len(registry.fallbacks)
    x = torch.randn(batch, 4, height, width)
    with torch.no_grad():
        out = forward(x)
        expected = forward.eager(x)
    assert len(registry.compiles) == compiles and len(registry.fallbacks) == fallbacks, forward.last_status
    assert forward.last_status == "compiled graph"
    assert float((out - expected).abs().max()) < 1e-5


def test_a_guard_the_pack_cannot_check_refuses_the_graph_when_building(monkeypatch):
    """Refused at compile time with the reason (before AOTInductor runs); every call still runs, eagerly."""
    real = export_guards._guard_code
    monkeypatch.setattr(export_guards, "_guard_code",
                        lambda ep: real(ep) + ["L['flat'][0].stride()[0] == 256"])
    registry = GraphRegistry()
    torch.manual_seed(0)
    module = MemoryChunked().eval()
    forward = CompiledForward(module, CompileOptions(backend="aot", shape_range=RANGE), registry)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        out = forward(x)
        again = forward(torch.randn(2, 4, 16, 16))
    assert not registry.compiles
    assert out.shape == x.shape and again.shape == (2, 4, 16, 16)
    with torch.no_grad():
        assert float((out - module(x)).abs().max()) == 0.0
    reasons = [event.reason for event in registry.fallbacks]
    assert reasons and "cannot check" in reasons[0] and "stride" in reasons[0], reasons
    assert "L['flat'][0].stride()[0] == 256" in reasons[0]
