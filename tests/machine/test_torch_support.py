"""The torch versions the pack compiles with: an older torch is refused whole, with the reason, before any trace."""

from __future__ import annotations

import copy

import pytest
import torch

from compiler import CompileOptions, ShapeRange
from compiler.machine import torch_support
from compiler.backends import aot, inductor
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry


@pytest.mark.parametrize("version, refused", [("2.10.1+cu128", True), ("2.5.1", True), ("2.11.0+cu130", False),
                                              ("2.13.0+cpu", False), ("2.14.1", False), ("2.16.0.dev20270101", False)])
def test_a_torch_older_than_the_oldest_tested_is_refused_with_the_versions_named(version, refused):
    reason = torch_support.refusal(version)
    assert (reason is not None) == refused
    if refused:
        assert version in reason and "2.11" in reason and "uncompiled" in reason


def test_a_torch_newer_than_the_newest_tested_is_used_with_a_note():
    assert torch_support.untested_note("2.16.0") and "2.14" in torch_support.untested_note("2.16.0")
    assert torch_support.untested_note("2.14.1") is None and torch_support.untested_note("2.5.0") is None


def test_this_torch_is_served():
    assert torch_support.refusal() is None, torch.__version__


def test_under_a_refused_torch_every_call_runs_the_model_as_it_is_with_the_reason(monkeypatch):
    """No backend is half-used: both torch backends refuse, nothing is traced, the output is the model's own."""
    monkeypatch.setattr(torch, "__version__", "2.9.0")
    assert aot.AotBackend().unavailable_reason() == inductor.InductorBackend().unavailable_reason() \
        == torch_support.refusal("2.9.0")
    monkeypatch.setattr("compiler.backends._INSTANCES", {})  # backends are checked when first asked for
    module = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1))
    twin = copy.deepcopy(module)
    registry = GraphRegistry()
    forward = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 2), spatial=(8, 16))), registry)
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        assert torch.equal(module(x), twin(x))
    assert registry.compiles == [] and forward.last.eager and "older than 2.11" in forward.last.reason
