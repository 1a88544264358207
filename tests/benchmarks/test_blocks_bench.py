"""The benchmark's transformer models and their report: specs, their builds and calls, numbers; no run."""

from __future__ import annotations

import json

import pytest
import torch

from compiler.blocks.diffusers_families import diffusers_family
from compiler.blocks.finder import find_blocks
from benchmarks import models as M
from benchmarks import report
from benchmarks import transformer_configs as C


@pytest.mark.parametrize("profile", M.PROFILES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_transformer_sweep_is_5_sizes_by_the_batches_inside_the_declared_range(name, profile, device):
    spec = M.transformer_spec(name, profile, device)
    sweep = spec.sweep()
    batches = len(spec.sweep_batches)
    assert batches >= 2 and len(set(sweep)) == 5 * batches
    assert len({s[1:] for s in sweep}) == 5 and len({s[0] for s in sweep}) == batches
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
    if profile == "full" and device == "cpu":  # what a 2-core CPU runs at the real widths
        assert spec.sweep_batches == [1, 2] and rng.spatial == (16, 32)
        assert any("2-core CPU" in note for note in spec.notes)
    # scaled down: --quick, the full profile on a CPU (a block per structure), and Flux in the device check (its
    # full width, 1 double + 2 single blocks)
    scaled = profile in M.QUICK_PROFILES or (profile == "full" and device == "cpu") or (profile == "check" and name == "flux")
    assert scaled == bool(spec.changes)
    assert spec.describe()["kind"] == "transformer"


def test_transformers_run_as_blocks_and_unets_whole():
    assert set(M.variants_for("flux")) == {"eager", "torch_compile", "torch_compile_blocks", "ours_blocks",
                                           "ours_blocks_load"}
    assert "ours_blocks" not in M.variants_for("sd15") and "ours_aot_cold" in M.variants_for("sd15")
    real = M.transformer_spec("flux", "full", "cuda")
    assert real.config["num_layers"] == 19 and real.config["num_single_layers"] == 38  # FLUX.1-dev


@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_the_cpu_profile_keeps_the_real_widths_and_cuts_only_the_depth(name):
    cpu, gpu = M.transformer_spec(name, "full", "cpu"), M.transformer_spec(name, "full", "cuda")
    assert gpu.config == C.REAL[name] and gpu.changes == {}
    assert cpu.config == {**C.REAL[name], **C.CPU_DEPTH[name]} and set(cpu.changes) == set(C.CPU_DEPTH[name])
    assert cpu.text == gpu.text == C.TEXT_TOKENS[name]


def _structures(name: str, depth: dict) -> list:
    """The block structures of the model at the quick widths and this depth: (class, structure, stack) each."""
    spec = M.transformer_spec(name, "quick")
    torch.manual_seed(0)
    import diffusers

    model = getattr(diffusers, C.CLASSES[name])(**{**spec.config, **depth})
    family = diffusers_family(model)
    groups = find_blocks(model, family.block_classes, family.ignored_settings, family.split_stacks)
    return [(g.class_name, g.structure, g.paths[0].rsplit(".", 1)[0] if family.split_stacks else None,
             len(g.instances)) for g in groups]


@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_the_cpu_depth_holds_every_block_structure_of_the_real_depth_once(name):
    """Built narrow (a block's structure does not depend on its width), the CPU's cut depth has each block
    structure of the real depth, one block each: the fewest blocks that compile what the real model does."""
    real = _structures(name, {key: C.REAL[name][key] for key in C.CPU_DEPTH[name]})
    cut = _structures(name, C.CPU_DEPTH[name])
    assert [s[:3] for s in cut] == [s[:3] for s in real]
    assert all(count == 1 for *_, count in cut)
    assert len(cut) == {"flux": 2, "sd3": 3, "wan": 1, "qwen-image": 1, "zimage": 3}[name]


@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_each_spec_builds_at_the_quick_sizes_and_runs_its_pipelines_call(name):
    spec = M.transformer_spec(name, "quick")
    model = spec.build(seed=0)
    sweep = spec.sweep()
    for shape in (sweep[0], sweep[-1]):  # the smallest and the largest batch, two latent sizes
        args, kwargs = spec.inputs(shape, "cpu", torch.float32, model=model)
        with torch.no_grad():
            out = model(*args, **kwargs)[0]
        out = torch.stack(out) if isinstance(out, list) else out  # Z-Image: one output per sample
        batch, height, width, frames = shape
        assert out.shape[0] == batch
        assert out.numel() == batch * 16 * height * width * frames  # 16 latent channels, however packed
        assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", M.TRANSFORMERS)
def test_torch_compile_blocks_compiles_every_block_even_where_diffusers_names_none(name):
    """The torch_compile_blocks variant is diffusers' compile_repeated_blocks(); SD3Transformer2DModel declares no
    `_repeated_blocks` (diffusers would raise), so its family's block class is named, on the instance only."""
    spec = M.transformer_spec(name, "quick")
    model = spec.build(seed=0)
    cls = type(model)
    declared = getattr(cls, "_repeated_blocks", None)
    spec.compile_repeated_blocks(model)  # lazy: torch.compile wraps each block, nothing compiles until a call
    blocks = [m for m in model.modules() if type(m).__name__ in spec.family(model).block_classes]
    assert blocks and all(getattr(m, "_compiled_call_impl", None) is not None for m in blocks)
    assert getattr(cls, "_repeated_blocks", None) == declared
    assert bool(declared) == (name != "sd3")


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
