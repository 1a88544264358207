"""compiler/build_process/gpu_reductions.py: no persistent reduction over a dynamic size, Inductor's own decision
for any other, in the build's thread only.

Why: on the H200 the SD1.5 UNet's persistent reductions over dynamic sizes took 332 of its 422 kernel build seconds
(one kernel 80 s; torch 2.11+cu130); a reduction over a fixed size (a layer norm over channels)
builds as fast as torch.compile's and is what Inductor found fastest, so only the first kind is left out.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import sympy

from compiler.build_process import gpu_reductions
from tests.support.triton_python import triton_python

ROOT = Path(__file__).resolve().parents[2]


class _Features:
    """What the decision reads of a kernel: its reduction size."""

    def __init__(self, numel):
        self.reduction_numel = numel


def test_a_reduction_over_a_dynamic_size_is_never_persistent_and_any_other_is_inductors_call(monkeypatch):
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    asked = []

    def inductors(features, cooperative_reduction, *args, **kwargs):
        asked.append(features.reduction_numel)
        return True

    monkeypatch.setattr(InductorChoices, "should_use_persistent_reduction", staticmethod(inductors))
    before = V.choices
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    with gpu_reductions.fixed_size_persistent_reductions(True):
        assert V.choices is not before
        assert V.choices.should_use_persistent_reduction(_Features(sympy.Integer(320)), False) is True
        assert V.choices.should_use_persistent_reduction(_Features(64), False) is True
        assert V.choices.should_use_persistent_reduction(_Features(32 * s0), False) is False
        assert V.choices.should_use_persistent_reduction(_Features(s0 * s0 * 10), True) is False
        # every other heuristic is Inductor's own
        assert type(V.choices).__mro__[1] is InductorChoices
    assert asked == [sympy.Integer(320), 64]  # the dynamic ones never reached Inductor's decision
    assert V.choices is before  # the thread's heuristics as they were
    with gpu_reductions.fixed_size_persistent_reductions(False):
        assert V.choices is before
    with pytest.raises(RuntimeError), gpu_reductions.fixed_size_persistent_reductions(True):
        raise RuntimeError("a failed build")
    assert V.choices is before


def test_another_heuristics_class_is_left_alone_and_the_program_falls_back_to_the_whole_switch(monkeypatch):
    import torch
    from torch._inductor import config
    from torch._inductor.virtualized import V

    module = torch.nn.LayerNorm(16)
    dynamic = torch.export.export(module, (torch.randn(4, 16),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=2, max=64)},))
    monkeypatch.delenv(gpu_reductions.ENV, raising=False)
    assert gpu_reductions.per_kernel(dynamic) and gpu_reductions.gpu_settings(dynamic) == {}
    with config.patch({"inductor_choices_class": lambda: None}):  # a user's own heuristics
        assert not gpu_reductions.per_kernel(dynamic)
        assert gpu_reductions.gpu_settings(dynamic) == {"triton.persistent_reductions": False}
        before = V.choices
        with gpu_reductions.fixed_size_persistent_reductions(True):
            assert V.choices is before


def test_inductor_writes_a_looped_reduction_for_the_dynamic_size_and_keeps_the_fixed_one_persistent():
    """Inductor's real code generation for an sm_90 target (tests/support/reduction_kinds.py): a layer norm over 64
    channels and a softmax over a size bounded at 512 are both persistent by default; with the decision, the
    softmax loops and the layer norm stays persistent."""
    python = triton_python()
    if python is None:
        pytest.skip("Triton is not importable in this interpreter (and KEEPFAST_TRITON_PYTHON is not set): "
                    "Inductor writes no Triton kernels here")
    run = subprocess.run([python, "-m", "tests.support.reduction_kinds"], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-3000:]
    kinds = json.loads(run.stdout.strip().splitlines()[-1])
    assert kinds["default"] == {"persistent_reduction": 2, "reduction": 0, "pointwise": 0}, kinds
    assert kinds["fixed_only"] == {"persistent_reduction": 1, "reduction": 1, "pointwise": 0}, kinds
