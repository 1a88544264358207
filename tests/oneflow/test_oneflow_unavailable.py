"""Where oneflow does not import (the main CI environment): the backend says why, plainly.

Skipped where oneflow imports (test_oneflow_backend.py covers that case).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from compiler import CompileOptions, GraphRegistry, unavailable_reason
from compiler.backends import BackendUnavailable, get_backend
from compiler.backends.oneflow_support import oneflow_unavailable_reason, persist_unavailable_reason
from compiler.serving.compiled_forward import CompiledForward

REASON = oneflow_unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is None, reason="oneflow imports here; test_oneflow_backend.py covers it")


def test_backend_says_why_it_is_unavailable():
    with pytest.raises(BackendUnavailable) as error:
        get_backend("oneflow")
    assert str(error.value) == REASON == unavailable_reason("oneflow")
    if importlib.util.find_spec("oneflow") is None:
        python = "%d.%d" % sys.version_info[:2]
        assert REASON.startswith("oneflow is not installed")
        assert "oneflow==0.9.0" in REASON and "Python 3.10" in REASON and f"Python {python}" in REASON


def test_persisting_says_why():
    assert persist_unavailable_reason() == REASON


def test_a_model_compiled_for_oneflow_runs_eager_with_the_reason():
    registry = GraphRegistry()
    module = torch.nn.Linear(4, 4).eval()
    compiled = CompiledForward(module, CompileOptions(backend="oneflow"), registry)
    x = torch.randn(2, 4)
    out = compiled(x)
    with torch.no_grad():
        assert torch.equal(out, module(x))
    assert compiled.last_status == "eager: " + REASON
    assert [e.reason for e in registry.fallbacks] == [f"{compiled.label}: {REASON}; running eager"]
