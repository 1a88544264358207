"""The check measures the pack's own work around a whole-model graph's run in a call (call_overhead.py): what comes
before the first kernel of each step, which set our SD1.5 step against torch.compile's on the H200."""

from __future__ import annotations

import time

import torch

from compiler import CompileOptions, GraphRegistry, ShapeRange, compile_module
from compiler.backends import aot
from benchmarks import call_overhead, check


def test_a_call_s_time_is_split_into_its_graph_s_run_and_the_rest():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    compile_module(model, CompileOptions(shape_range=ShapeRange(batch=(1, 4))), GraphRegistry())
    inputs = {(3,): torch.randn(3, 8)}

    def timed(fn, shape):
        started = time.perf_counter()
        with torch.no_grad():
            fn(inputs[shape])
        return time.perf_counter() - started

    timed(model, (3,))  # the compile
    real = aot.AotGraph.run
    figures = call_overhead.measure(timed, model, (3,), reps=5)
    assert aot.AotGraph.run is real  # put back
    assert figures["calls"] == 5 and figures["shape"] == [3]
    assert 0 < figures["graph_run_ms"] < figures["whole_ms"], figures
    assert abs(figures["whole_ms"] - figures["graph_run_ms"] - figures["outside_ms"]) < 0.5, figures
    assert call_overhead.measure(timed, torch.nn.Identity(), (3,)) is None  # no graph ran: nothing to split


def test_the_check_lists_each_graph_s_share_of_its_calls():
    from tests.benchmarks.test_bench_check import _ran

    jobs = check.plan(models=["sd15"])
    results = {(j.model, j.variant): _ran(j.model, j.variant) for j in jobs}
    results[("sd15", "ours_aot_load")]["call_overhead"] = {"shape": [2, 64, 64], "calls": 10, "whole_ms": 22.5,
                                                           "graph_run_ms": 21.3, "outside_ms": 1.2}
    text = "\n".join(check.markdown(check.summarise(jobs, results, check.BUDGET_S, 3)))
    assert "- sd15 ours_aot_load [2, 64, 64]: 1.20 ms of a 22.50 ms call (its graph's run 21.30 ms)" in text, text
