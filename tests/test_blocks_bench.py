"""The benchmark's transformer models (Flux-, Wan-shaped) and their report: specs and numbers, no run."""

from __future__ import annotations

import json

import pytest

from compiler.testing.bench import models as M
from compiler.testing.bench import report


@pytest.mark.parametrize("profile", M.PROFILES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_transformer_sweep_is_5_sizes_by_3_batches_inside_the_declared_range(name, profile, device):
    spec = M.transformer_spec(name, profile, device)
    sweep = spec.sweep()
    assert len(set(sweep)) == 15 and len({s[1:] for s in sweep}) == 5 and len({s[0] for s in sweep}) == 3
    assert set(spec.steady_shapes) <= set(sweep)
    rng = spec.shape_range()
    for batch, height, width, frames in sweep:
        assert rng.batch[0] <= batch <= rng.batch[1]
        assert rng.spatial[0] <= height <= rng.spatial[1] and rng.spatial[0] <= width <= rng.spatial[1]
        assert height % 2 == 0 and width % 2 == 0
        assert spec.range_frames[0] <= frames <= spec.range_frames[1]
    if name == "wan":
        assert len({s[3] for s in sweep}) >= 2  # video: frame counts change over the sweep
        assert rng.frames == spec.range_frames
    # scaled down: --quick, and Flux in the device check (its full width, 1 double + 2 single blocks)
    assert (profile == "quick" or (profile == "check" and name == "flux")) == bool(spec.changes)
    assert spec.describe()["kind"] == "transformer"


def test_transformers_run_as_blocks_and_unets_whole():
    assert set(M.variants_for("flux")) == {"eager", "torch_compile", "torch_compile_blocks", "ours_blocks",
                                           "ours_blocks_load"}
    assert "ours_blocks" not in M.variants_for("sd15") and "ours_aot_cold" in M.variants_for("sd15")
    real = M.transformer_spec("flux", "full")
    assert real.config["num_layers"] == 19 and real.config["num_single_layers"] == 38  # FLUX.1-dev


def _steady(eager: float, compiled: float) -> dict:
    return {"1x32x32x1": {"shape": [1, 32, 32, 1], "eager": [eager], "compiled": [compiled],
                          "eager_median_s": eager, "compiled_median_s": compiled, "compiles_during": 0}}


def _jobs():
    common = {"model": "flux", "parameters": 3_000_000, "peak_rss_mb": 500.0, "sweep_wall_s": 2.0,
              "sweep": [{"shape": [1, 16, 16, 1], "s": 0.1, "compiles": 0}]}
    return [
        {**common, "variant": "eager", "first_call_s": 0.5, "sweep_compiles": 0},
        {**common, "variant": "torch_compile", "first_call_s": 200.0, "sweep_compiles": 2,
         "steady": _steady(1.0, 0.8)},
        {**common, "variant": "torch_compile_blocks", "first_call_s": 60.0, "sweep_compiles": 4,
         "steady": _steady(1.0, 0.85)},
        {**common, "variant": "ours_blocks", "first_call_s": 30.0, "sweep_compiles": 0, "fallbacks": 0,
         "block_report": {"blocks": 9, "blocks_compiled": 9, "structures": [
             {"class": "FluxTransformerBlock", "instances": 3, "status": "compiled graph", "compile_s": 14.0}]}},
        {**common, "variant": "ours_blocks_load", "first_call_s": 2.0, "sweep_compiles": 0, "fallbacks": 0,
         "steady": _steady(1.0, 0.75)},
    ]


def test_transformer_summary_has_the_issue_keys():
    meta = {"profile": "quick", "device": "cpu", "dtype": "fp32"}
    summary = report.summarise(_jobs(), meta, {"flux": M.transformer_spec("flux", "quick").describe()})
    flux = summary["models"]["flux"]
    assert flux["cold_compile_s"] == {"torch_compile": 200.0, "torch_compile_blocks": 60.0, "ours_blocks": 30.0}
    assert flux["cold_compile_ratio_vs_torch_compile"] == pytest.approx(0.15)
    assert flux["cold_compile_ratio_torch_compile_blocks_vs_torch_compile"] == pytest.approx(0.3)
    assert flux["sweep_compiles_ours"] == 0 and flux["sweep_compiles_torch_compile"] == 2
    assert flux["steady_ours_variant"] == "ours_blocks_load"
    assert flux["steady_ratio_vs_eager"] == pytest.approx(1 / 0.75, rel=1e-3)
    assert flux["steady_ratio_vs_torch_compile"] == pytest.approx(0.8 / 0.75, rel=1e-3)
    targets = summary["transformer_targets"]["flux"]
    assert targets["cold_compile_ratio_vs_torch_compile"]["met"] is True
    assert targets["sweep_compiles_ours"]["met"] is True
    assert targets["steady_ratio_vs_torch_compile"]["met"] is True
    assert summary["sweep_compiles_ours_all"] == 0
    text = report.markdown(summary)
    assert "torch.compile of the repeated blocks" in text and "Block graphs: 9 of 9 blocks compiled" in text
    json.dumps(summary)


def test_a_slow_cold_compile_is_reported_as_not_met():
    jobs = _jobs()
    jobs[3] = {**jobs[3], "first_call_s": 100.0}
    summary = report.summarise(jobs, {}, {"flux": M.transformer_spec("flux", "quick").describe()})
    target = summary["transformer_targets"]["flux"]["cold_compile_ratio_vs_torch_compile"]
    assert target["value"] == pytest.approx(0.5) and target["met"] is False
    assert "NOT met" in report.markdown(summary)
