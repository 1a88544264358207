"""The benchmark's report format and plumbing (no benchmark runs here; nothing about timings is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from compiler.testing.bench import models as M
from compiler.testing.bench import report
from compiler.testing.bench.comfy_e2e import prompt, run_comfy


def _steady(shapes, eager, compiled):
    return {"x".join(map(str, s)): {"shape": list(s), "eager": [eager], "compiled": [compiled],
                                    "eager_median_s": eager, "compiled_median_s": compiled, "compiles_during": 0}
            for s in shapes}


def _jobs(model="sd15"):
    shapes = [(2, 32, 32), (1, 24, 24)]
    sweep = [{"shape": [b, h, w], "s": 0.1, "compiles": 0} for b, h, w in [(1, 16, 16), (2, 16, 16)]]
    common = {"model": model, "parameters": 6_900_000, "peak_rss_mb": 900.0, "sweep": sweep, "sweep_wall_s": 3.0}
    return [
        {**common, "variant": "eager", "first_call_s": 1.0, "first_call_compiles": 0, "sweep_compiles": 0},
        {**common, "variant": "torch_compile", "first_call_s": 100.0, "first_call_compiles": 1,
         "sweep": sweep[:1], "sweep_compiles": 3, "compiles_total": 4, "steady": _steady(shapes, 2.0, 1.6),
         "steady_static": _steady(shapes[:1], 2.0, 1.5), "process_to_first_result_s": 110.0},
        {"model": model, "variant": "torch_compile_warm", "first_call_s": 20.0, "first_call_compiles": 1,
         "peak_rss_mb": 800.0},
        {**common, "variant": "ours_inductor", "first_call_s": 150.0, "first_call_compiles": 2, "sweep_compiles": 0,
         "steady": _steady(shapes, 2.0, 1.6), "fallbacks": 0},
        {**common, "variant": "ours_aot_cold", "first_call_s": 200.0, "first_call_compiles": 2, "sweep_compiles": 0,
         "graphs_saved": 2, "graphs_saved_mb": 8.0, "fallbacks": 0},
        {**common, "variant": "ours_aot_load", "first_call_s": 5.0, "first_call_compiles": 0, "first_call_loads": 1,
         "sweep_compiles": 0, "steady": _steady(shapes, 2.0, 1.0), "fallbacks": 0, "process_to_first_result_s": 12.0,
         "first_use_check": {"checks": 2, "mismatches": 0, "extra_s": 0.08, "sweep_s": 0.2, "held_mb_max": 0.5,
                             "rows": []}},
    ]


META = {"profile": "quick", "profile_text": "test", "device": "cpu", "dtype": "fp32", "torch": "x",
        "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [1.0, 1.0, 1.0]}


def test_summary_has_the_headline_keys_and_the_raw_times_behind_them():
    jobs = _jobs() + [{"model": "vae", "variant": "torch_compile", "error": "RuntimeError: boom"}]
    summary = report.summarise(jobs, META, {"sd15": M.spec("sd15", "quick").describe()})
    for key in ("steady_ratio_vs_eager", "steady_ratio_vs_torch_compile", "restart_vs_cold_compile_ratio",
                "sweep_compiles_ours", "sweep_compiles_torch_compile"):
        assert summary[key] is not None, key
    assert summary["headline_model"] == "sd15"
    assert summary["steady_ratio_vs_eager"] == pytest.approx(2.0)  # eager 2.0 s / ours 1.0 s, same process
    assert summary["steady_ratio_vs_torch_compile"] == pytest.approx(1.6)  # (2/1) / (2/1.6)
    assert summary["restart_vs_cold_compile_ratio"] == pytest.approx(0.05)  # 5 s load / 100 s cold
    assert summary["sweep_compiles_ours"] == 0 and summary["sweep_compiles_torch_compile"] == 3
    sd15 = summary["models"]["sd15"]
    assert sd15["first_call_s"]["torch_compile"] == 100.0 and sd15["first_call_s"]["ours_aot_load"] == 5.0
    assert sd15["steady"]["2x32x32"]["ours_aot_load_s"] == 1.0 and sd15["steady"]["2x32x32"]["eager_s"] == 2.0
    assert summary["targets"]["restart_vs_cold_compile_ratio"]["met"] is True
    assert summary["targets"]["sweep_compiles_ours_all"]["met"] is True
    assert "boom" in summary["models"]["vae"]["variants_failed"]["torch_compile"]
    assert len(summary["jobs"]) == len(jobs)  # the raw results travel with the summary
    json.dumps(summary)


def test_missing_measurements_read_as_not_run():
    summary = report.summarise([{"model": "sd15", "variant": "eager", "first_call_s": 1.0}], META)
    assert summary["steady_ratio_vs_eager"] is None
    assert summary["targets"]["steady_ratio_vs_eager"]["met"] is None
    text = report.markdown(summary)
    assert "not measured" in text and "not run" in text


def test_written_files(tmp_path):
    summary = report.summarise(_jobs(), META, comfy={"run": False, "why": "COMFYUI_PATH is not set"})
    paths = report.write_all(tmp_path, summary)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["steady_ratio_vs_eager"] == pytest.approx(2.0)
    text = (tmp_path / "bench.md").read_text()
    assert "| target | value | status |" in text
    assert "ours aot vs torch.compile" in text and "2.00x" in text
    assert "Not run: COMFYUI_PATH is not set" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "png" not in paths and "matplotlib" in data["chart"]
    else:
        assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("profile", M.PROFILES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", M.MODELS)
def test_sweep_is_5_resolutions_by_3_batches_inside_the_declared_range(name, profile, device):
    spec = M.spec(name, profile, device)
    sweep = spec.sweep()
    assert len(set(sweep)) == 15 and len({(h, w) for _, h, w in sweep}) == 5 and len({b for b, _, _ in sweep}) == 3
    assert set(spec.steady_shapes) <= set(sweep)  # timed after the sweep: no compile left for torch.compile
    low, high = spec.range_spatial
    assert all(spec.range_batch[0] <= b <= spec.range_batch[1] and low <= h <= high and low <= w <= high
               for b, h, w in sweep)
    if profile == "quick":
        assert spec.changes  # the output says what was scaled down
    assert spec.describe()["changed_from_real_config"] == {k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in spec.changes.items()}


def test_cli_has_the_bench_command():
    from compiler.cli import build_parser

    args = build_parser().parse_args(["bench", "--out", "somewhere", "--quick", "--models", "sd15,vae"])
    assert args.command == "bench" and args.quick and args.models == ["sd15", "vae"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--out", "x", "--models", "sd3"])


def test_comfyui_part_says_why_it_did_not_run(monkeypatch, tmp_path):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    result = run_comfy(tmp_path, quick=True)
    assert result["run"] is False and "COMFYUI_PATH" in result["why"]


@pytest.mark.parametrize("mode,node", [("none", None), ("torch_compile", "TorchCompileModel"),
                                       ("ours_cold", "KeepFastModelSpeedup")])
def test_comfyui_workflow_puts_the_mode_node_before_the_sampler(mode, node):
    nodes = prompt(mode, 256, 192, 2, 4, 7, {"min_resolution": 128, "max_resolution": 256, "max_batch_size": 3,
                                             "compile": True, "save_compiled": False})
    sampler = nodes["7"]["inputs"]
    assert nodes["6"]["inputs"] == {"width": 256, "height": 192, "batch_size": 2}
    if node is None:
        assert sampler["model"] == ["1", 0] and "2" not in nodes
    else:
        assert nodes["2"]["class_type"] == node and sampler["model"] == ["2", 0]


def test_comfyui_part_runs_comfyuis_default_attention_and_reads_which_it_used(tmp_path):
    """No attention flag unless asked (ComfyUI picks: sub-quadratic on a CPU); bench.md names what its log says."""
    from compiler.testing.bench.comfy_e2e import ATTENTION_FLAGS, Server, picked_attention
    from compiler.cli import build_parser

    assert Server("python", tmp_path, tmp_path, {}, "log").attention_args == []
    assert Server("python", tmp_path, tmp_path, {}, "log", "split").attention_args == ["--use-split-cross-attention"]
    assert build_parser().parse_args(["bench", "--out", "x"]).comfy_attention == "default"
    assert set(ATTENTION_FLAGS) == {"default", "pytorch", "split", "quad"}
    log = ("Set vram state to: DISABLED\nDevice: cpu\nUsing sub quadratic optimization for attention, if you have "
           "memory or speed issues try using: --use-split-cross-attention\nPython version: 3.11\n")
    assert picked_attention(log) == "sub quadratic"
    assert picked_attention("Using split optimization for attention\n") == "split"
    assert picked_attention("Using pytorch attention\n") == "pytorch"
    assert picked_attention("Device: cpu\n") is None


def test_the_first_use_check_cost_is_reported_next_to_the_sweep():
    summary = report.summarise(_jobs(), META)
    cost = summary["models"]["sd15"]["first_use_check"]["ours_aot_load"]
    assert cost == {"checks": 2, "mismatches": 0, "extra_s": 0.08, "share_of_sweep": 0.4, "held_mb_max": 0.5}
    text = report.markdown(summary)
    assert "The first-use check" in text and "| 2 | 0 | 0.08 | 0.400 | 0.50 |" in text


def test_session_figures_and_their_ratios():
    """bench.json's session part: per model and variant, and ours-background's two ratios."""
    from compiler.testing.bench import session as S

    def run(variant, restart, first, total, compiles, **extra):
        return {"kind": "session", "model": "sd15", "variant": S.job_name(variant, restart), "first_image_s": first,
                "session_s": total, "compiles_in_session": compiles, **extra}

    jobs = [run("eager", False, 4.0, 30.0, 0), run("torch_compile", False, 90.0, 200.0, 3),
            run("torch_compile", True, 40.0, 120.0, 3), run("ours_background", False, 5.0, 60.0, 1),
            run("ours_background", True, 6.0, 20.0, 0),
            {"kind": "session", "model": "sd15", "variant": S.job_name("ours_blocking"), "error": "boom"}]
    summary = report.summarise(jobs, {"profile": "quick"}, {}, None)
    entry = summary["models"]["sd15"]
    assert entry["first_image_vs_eager_ratio"] == 1.25 and entry["session_ratio_vs_best_peer"] == 0.3
    assert entry["session"]["torch_compile"]["restart_session_s"] == 120.0
    assert entry["session"]["ours_background"]["restart_compiles"] == 0
    assert entry["session"]["ours_blocking"]["error"] == "boom"
    text = report.markdown(summary)
    assert "| sd15 | ours_background | 5.00 | 60.00 | 1 | 20.00 | 0 |" in text
    assert "| sd15 | ours_blocking | failed: boom |" in text


def test_a_session_runs_from_process_start_in_its_own_process(tmp_path):
    """A real (eager) session job through the runner: its figures count from the process's start."""
    import os

    from compiler.testing.bench import runner
    from compiler.testing.bench import session as S

    (job,) = [j for j in S.session_jobs("sd15", "unet") if j["session_variant"] == "eager"]
    job.update(profile="quick", device="cpu", dtype="fp32", images=3, steps=2, graphs_dir=str(tmp_path / "g"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = runner.run_job(job, tmp_path, env, timeout=600)
    assert "error" not in result, result
    assert len(result["image_s"]) == 3 and result["compiles_in_session"] == 0
    assert 0 < result["first_image_s"] <= result["session_s"] <= result["process_wall_s"]
