"""The check's measure of weights a graph keeps after its model let them go (benchmarks/
weight_release.py): a compiled model keeps none over patch-and-unpatch rounds, with no compile; a stand-in that
holds what it was called with is caught."""

from __future__ import annotations

import torch

from benchmarks import weight_release
from tests.tracing.test_module_snapshot import _model, compiled_model


def test_a_compiled_model_keeps_no_replaced_weight_and_compiles_nothing():
    model, twin, registry = compiled_model()
    x = torch.randn(2, 8)
    outputs = []

    def call():
        outputs.append(model(x))

    with torch.no_grad():
        call()
        result = weight_release.measure(model, call, compiles=lambda: len(registry.compiles))
        want = twin(x)
    assert result == {"rounds": 3, "weights": 4, "replaced": 12, "kept": 0, "compiles": 0}
    assert len(registry.compiles) == 1
    assert all(torch.allclose(got, want, atol=1e-5) for got in outputs)  # copies and originals: the same values


def test_a_runner_that_holds_its_weights_is_caught():
    model = _model()
    held = []

    def call():  # what torch's user-managed constants did: every weight bound, kept for good
        held.extend(p for p in model.parameters())

    result = weight_release.measure(model, call)
    assert result["replaced"] == 12 and result["kept"] == 12


def test_the_check_lists_what_each_graph_kept():
    from benchmarks import check
    from tests.benchmarks.test_bench_check import _ran

    jobs = check.plan(models=["sd15"])
    results = {(j.model, j.variant): _ran(j.model, j.variant) for j in jobs}
    results[("sd15", "ours_aot_load")]["weight_release"] = {
        "rounds": 3, "weights": 686, "replaced": 2058, "kept": 0, "compiles": 0,
        "allocated_mb_before": 1750.2, "allocated_mb_after": 1750.4}
    text = "\n".join(check.markdown(check.summarise(jobs, results, check.BUDGET_S, 3)))
    assert ("- sd15 ours_aot_load: 0 of 2058 copies kept (3 rounds of 686 weights), 1750 MB allocated before, "
            "1750 MB after") in text, text
