"""The benchmark's report format and plumbing (no benchmark runs here; nothing about timings is asserted)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks import models as M
from benchmarks import report
from benchmarks.comfy_e2e import prompt, run_comfy


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


def test_a_ratio_against_torch_compile_through_eagers_that_differ_between_processes_is_not_called_met():
    """On an H200: eager 50.91 ms in our process, 28.85 ms in torch.compile's; the ratio of ratios said 1.22x
    while ours took 22.53 ms against torch.compile's 15.62."""
    jobs = _jobs()
    loaded = next(job for job in jobs if job["variant"] == "ours_aot_load")
    loaded["steady"] = _steady([(2, 32, 32), (1, 24, 24)], 3.0, 1.5)  # its eager 1.5x torch.compile's
    loaded["steady"]["2x32x32"]["process"] = {"wall_s": 2.0, "cpu_s": 3.0, "threads": ["busy"], "loadavg": None}
    summary = report.summarise(jobs, META)
    target = summary["targets"]["steady_ratio_vs_torch_compile"]
    assert summary["steady_ratio_vs_torch_compile"] == pytest.approx(1.6) and target["met"] is None
    assert target["note"] == "not measured: eager differed 1.50x between our process and torch.compile's"
    text = report.markdown(summary)
    assert "not measured: eager differed 1.50x between our process and torch.compile's" in text
    assert "(within 1.25x; not: ours (aot, loaded))" in text
    assert "the compiled medians side by side, ms: torch.compile 1600.00 (its eager 2000.00)" in text
    assert "ours (aot, loaded) 1500.00 (its eager 3000.00, process CPU 1.50x its wall time)" in text
    assert summary["targets"]["steady_ratio_vs_eager"]["met"] is not None  # a ratio within one process stands
    same = report.summarise(_jobs(), META)
    assert same["targets"]["steady_ratio_vs_torch_compile"]["met"] is True
    assert "note" not in same["targets"]["steady_ratio_vs_torch_compile"]


def test_a_third_process_whose_eager_differed_leaves_the_pair_that_agreed_measured():
    """On an H200: eager 45.64 ms in our loaded graph's process and 46.24 in torch.compile's, 29.72 in the
    CUDA graph replays' process; ours against torch.compile (21.85 against 21.30 ms) is a measure, NOT met."""
    jobs = _jobs()
    for job in jobs:
        if job["variant"] == "ours_aot_load":
            job["steady"] = _steady([(2, 32, 32), (1, 24, 24)], 2.05, 2.1)  # ours 2.1 s, its eager 2.05 s
    replays = next(job for job in jobs if job["variant"] == "ours_aot_load")
    jobs.append({**replays, "variant": "ours_aot_load_cg", "steady": _steady([(2, 32, 32), (1, 24, 24)], 1.3, 0.8)})
    summary = report.summarise(jobs, META)
    target = summary["targets"]["steady_ratio_vs_torch_compile"]
    assert summary["models"]["sd15"]["steady"]["2x32x32"]["eager_spread"] > report.EAGER_SPREAD_LIMIT
    assert target["met"] is False and "note" not in target, target
    text = report.markdown(summary)
    assert "(within 1.25x; not: ours (aot, loaded, CUDA graphs))" in text, text


def test_the_machine_s_busy_cores_while_the_pairs_ran_are_reported_per_process():
    """Two lanes share one machine: a process timing its pairs while the other lane compiles sees a busy CPU, and
    a GPU step's kernel launches wait for it. The report names how busy the machine was for each process."""
    from benchmarks import worker

    jobs = _jobs()
    loaded = next(job for job in jobs if job["variant"] == "ours_aot_load")
    loaded["steady"]["2x32x32"]["process"] = {"wall_s": 2.0, "cpu_s": 2.0, "machine_cores_busy": 11.4}
    tc = next(job for job in jobs if job["variant"] == "torch_compile")
    tc["steady"]["2x32x32"]["process"] = {"wall_s": 2.0, "cpu_s": 2.0, "machine_cores_busy": 1.2}
    summary = report.summarise(jobs, META)
    row = summary["models"]["sd15"]["steady"]["2x32x32"]
    assert row["ours_aot_load_machine_cores_busy"] == 11.4 and row["torch_compile_machine_cores_busy"] == 1.2
    text = report.markdown(summary)
    assert "torch.compile 1.2, ours (aot, loaded) 11.4." in text, text
    before = worker.machine_busy_seconds()
    _spin(0.3)
    state = worker._process_state(0.3, 0.3, before)
    assert 0.5 <= state["machine_cores_busy"] <= (os.cpu_count() or 1) + 0.5, state  # this process's spin at least


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


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
    if profile in M.QUICK_PROFILES:
        assert spec.changes  # the output says what was scaled down
    assert spec.describe()["changed_from_real_config"] == {k: list(v) if isinstance(v, tuple) else v
                                                           for k, v in spec.changes.items()}


def test_cli_has_the_bench_command():
    from compiler.cli import build_parser

    args = build_parser().parse_args(["bench", "--out", "somewhere", "--quick", "--models", "sd15,vae"])
    assert args.command == "bench" and args.quick and args.models == ["sd15", "vae"]
    transformers = build_parser().parse_args(["bench", "--out", "x", "--models", "sd3,qwen-image,zimage"])
    assert transformers.models == ["sd3", "qwen-image", "zimage"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--out", "x", "--models", "sd4"])


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
    from benchmarks.comfy_e2e import ATTENTION_FLAGS, Server, picked_attention
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
    from benchmarks import session as S

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


def test_session_variants_pick_the_session_jobs():
    """--session-variants eager,ours_background: the first image ratio's two variants only, each with its restart
    where it has one; without a torch.compile variant the session ratio is not given (never a made-up one)."""
    from compiler.cli import build_parser
    from benchmarks import session as S

    args = build_parser().parse_args(["bench", "--out", "o", "--session-variants", "eager,ours_background"])
    assert args.session_variants == ["eager", "ours_background"]
    assert build_parser().parse_args(["bench", "--out", "o"]).session_variants == list(S.SESSION_VARIANTS)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--out", "o", "--session-variants", "ours_sometimes"])
    jobs = S.session_jobs("flux", "transformer", args.session_variants)
    assert [j["variant"] for j in jobs] == [S.job_name("eager"), S.job_name("ours_background"), S.job_name("ours_background", True)]
    summary = S.summarise([{"kind": "session", "model": "flux", "variant": S.job_name("eager"), "first_image_s": 4.0,
                            "session_s": 30.0, "compiles_in_session": 0},
                           {"kind": "session", "model": "flux", "variant": S.job_name("ours_background"),
                            "first_image_s": 5.0, "session_s": 40.0, "compiles_in_session": 2}])
    assert summary["flux"]["first_image_vs_eager_ratio"] == 1.25 and summary["flux"]["session_ratio_vs_best_peer"] is None


def test_a_session_runs_from_process_start_in_its_own_process(tmp_path):
    """A real (eager) session job through the runner: its figures count from the process's start."""
    import os

    from benchmarks import runner
    from benchmarks import session as S

    (job,) = [j for j in S.session_jobs("sd15", "unet") if j["session_variant"] == "eager"]
    job.update(profile="quick", device="cpu", dtype="fp32", images=3, steps=2, graphs_dir=str(tmp_path / "g"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = runner.run_job(job, tmp_path, env, timeout=600)
    assert "error" not in result, result
    assert len(result["image_s"]) == 3 and result["compiles_in_session"] == 0
    assert 0 < result["first_image_s"] <= result["session_s"] <= result["process_wall_s"]


# -- quantised weights (--weights): no ComfyUI here; what is parsed, summarised, written and skipped ------------

def _weights_result(variant, vs_eager, step, compiles_after, first_compiles, diff=1e-5):
    """One (weights, variant) process's raw result as weights_worker.py writes it."""
    eager_step = step * vs_eager
    return {"weights": "gguf-q8", "variant": variant, "first_image_s": 30.0 if first_compiles else 1.0,
            "compiles_first_image": first_compiles, "compiles_after_first_image": compiles_after,
            "compiles_lora_rows": compiles_after, "sweep_s": 10.0, "max_abs_diff_vs_eager": diff,
            "output_scale": 14.0, "lora_changed_output_by": 1.3, "peak_rss_mb": 1500.0, "threads": 1,
            "weight_class": "GGMLTensor", "fallback_reasons": [],
            "steady": {"shape": "256x256 b1 t20", "step_s_median": step, "eager_step_s_median": eager_step,
                       "vs_eager": vs_eager, "step_s_min": step / 2, "eager_step_s_min": eager_step / 4,
                       "compiles_warmup": 0, "compiles_timed": 0}}


def _weights_raw():
    from benchmarks import weights as W

    return {"model": "flux", "config": W.settings(True), "results": {
        "gguf-q8": {"variants": {
            "eager": _weights_result("eager", 1.0, 0.2, 0, 0, diff=0.0),
            "torch_compile": _weights_result("torch_compile", 1.25, 0.16, 5, 1),
            "ours": {**_weights_result("ours", 2.0, 0.1, 0, 2),
                     "blocks": {"blocks": 4, "blocks_compiled": 4, "graph_calls": 40, "eager_calls": 0}}}},
        "gguf-q4": {"skipped": "KEEPFAST_GGUF_PATH is not set (point it at a ComfyUI-GGUF checkout)"},
        "fp8": {"variants": {"eager": _weights_result("eager", 1.0, 0.2, 0, 0, diff=0.0),
                             "ours": {"error": "Traceback ...\nRuntimeError: boom"}}}}}


def test_cli_parses_the_weights_options_and_passes_them_on(monkeypatch):
    from compiler.cli import build_parser
    from benchmarks import runner

    args = build_parser().parse_args(["bench", "--out", "o", "--quick", "--models", "flux",
                                      "--weights", "gguf-q8,gguf-q4,fp8", "--weights-only"])
    assert args.weights == ["gguf-q8", "gguf-q4", "fp8"] and args.weights_variants == ["eager", "torch_compile", "ours"]
    seen = {}
    monkeypatch.setattr(runner, "run_bench", lambda out, **kwargs: seen.update(kwargs) or 0)
    assert args.run(args) == 0
    assert seen["weights"] == ["gguf-q8", "gguf-q4", "fp8"]
    assert not seen["steady"] and not seen["sessions"] and not seen["comfy"]  # --weights-only
    plain = build_parser().parse_args(["bench", "--out", "o", "--models", "flux", "--weights", "fp8",
                                       "--weights-variants", "eager,ours"])
    assert plain.weights_variants == ["eager", "ours"] and not plain.weights_only
    assert build_parser().parse_args(["bench", "--out", "o"]).weights == []  # off unless asked for
    for wrong in (["--weights", "gguf-q5"], ["--weights-variants", "torch_compile_blocks"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["bench", "--out", "o"] + wrong)


@pytest.mark.parametrize("quick", [True, False])
def test_the_weights_sweep_changes_the_lora_strength_inside_the_declared_range(quick):
    from benchmarks import weights as W

    config = W.settings(quick)
    rows = config["rows"]
    assert rows[0]["lora"] is None  # the first image, plain
    strengths = [row["lora"] for row in rows]
    on = [s for s in strengths if s is not None]
    assert on == sorted(on, reverse=True) and set(on) == {1.0, 0.5}  # 1.0, then 0.5
    assert strengths[-1] is None and "LoRA off" in rows[-1]["label"] and strengths.index(1.0) < len(rows) - 1
    assert len({(r["width"], r["height"], r["batch"], r["text"]) for r in rows}) >= 4  # sizes, batches, prompts
    assert len({row["label"] for row in rows}) == len(rows)  # the outputs are compared by label
    speedup = config["speedup"]
    for row in rows + [config["steady"]]:
        assert speedup["min_resolution"] <= min(row["width"], row["height"])
        assert max(row["width"], row["height"]) <= speedup["max_resolution"]
        assert row["batch"] <= speedup["max_batch_size"]
    assert speedup["build"] == "before the first image"  # compiles land in the first image, not the sweep


def test_weights_summary_puts_ours_beside_eager_and_torch_compile():
    summary = report.summarise([], META, {}, None, _weights_raw())
    q8 = summary["models"]["flux"]["weights"]["gguf-q8"]
    assert q8["ours_vs_eager"] == 2.0
    assert q8["ours_vs_torch_compile"] == pytest.approx(1.6)  # 2.0 / 1.25: each against its own process's eager
    assert q8["compiles_after_first_image"] == {"torch_compile": 5, "ours": 0}
    assert q8["ours_vs_eager_fastest"] == 1.0  # eager's fastest step 0.2/4, ours' 0.1/2
    assert q8["ours_vs_torch_compile_fastest"] == pytest.approx(1.6)  # 1.0 / (0.04 / 0.08 * 1.25)
    assert q8["variants"]["ours"]["compiles_first_image"] == 2
    assert summary["models"]["flux"]["weights"]["gguf-q4"]["skipped"].startswith("KEEPFAST_GGUF_PATH")
    assert "boom" in summary["models"]["flux"]["weights"]["fp8"]["variants"]["ours"]["error"]
    assert summary["weights_raw"]["results"]["gguf-q8"]["variants"]["ours"]["steady"]["step_s_median"] == 0.1
    json.dumps(summary)


def test_weights_table_in_bench_md(tmp_path):
    summary = report.summarise([], META, {}, {"run": False, "why": "--weights-only was given"}, _weights_raw())
    paths = report.write_all(tmp_path, summary)
    text = (tmp_path / "bench.md").read_text()
    assert "## Flux with quantised weights, in ComfyUI (`--weights`)" in text
    assert "| GGUF Q8_0 (ComfyUI-GGUF) | 2.00x / 1.00x | 1.60x / 1.60x | 1.25x / 0.62x | 0 / 5 " \
           "| 0.2000 / 0.1600 / 0.1000 |" in text
    assert "| GGUF Q4_K (ComfyUI-GGUF) | skipped: KEEPFAST_GGUF_PATH is not set" in text
    assert "| KeepFastModelSpeedup (block graphs) | failed: RuntimeError: boom |" in text
    assert "| GGUF Q8_0 (ComfyUI-GGUF) | KeepFastModelSpeedup (block graphs) | 30.00 | 2 | 0 (0 in the LoRA rows) " \
           "| 0.1000 / 0.2000 | 2.00x | 1.00e-05 (scale 14.0) | 1500 | 4/4 blocks compiled |" in text
    assert "Torch threads per process: 1." in text
    assert "png" not in paths and "quantised weights" in summary["chart"]  # nothing for the steady charts


def test_weights_kinds_that_cannot_run_are_skipped_with_the_reason(tmp_path, capsys):
    from benchmarks import runner
    from benchmarks import weights as W

    result = W.run_weights(tmp_path / "w", ["gguf-q8", "fp8"], quick=True, env={"PATH": "/usr/bin"})
    for kind in ("gguf-q8", "fp8"):
        assert "COMFYUI_PATH is not set" in result["results"][kind]["skipped"]
    comfy = tmp_path / "ComfyUI"
    comfy.mkdir()
    (comfy / "main.py").write_text("")
    result = W.run_weights(tmp_path / "w", ["gguf-q4"], quick=True, env={"COMFYUI_PATH": str(comfy)})
    assert W.GGUF_ENV in result["results"]["gguf-q4"]["skipped"]
    assert W.skip_reason("gguf-q4", {"COMFYUI_PATH": str(comfy), W.GGUF_ENV: str(tmp_path)}).endswith(
        "is no ComfyUI-GGUF checkout (no nodes.py)")
    assert W.skip_reason("fp8", {"COMFYUI_PATH": str(comfy)}) is None  # fp8 needs ComfyUI only
    assert "flux/gguf-q4: skipped: KEEPFAST_GGUF_PATH is not set" in capsys.readouterr().out
    skipped = runner._run_weights(tmp_path, ["sd15"], ["fp8"], True, W.VARIANTS, 10.0)
    assert "leaves it out" in skipped["results"]["fp8"]["skipped"]
    assert not list((tmp_path / "w").glob("*.job.json"))  # no process was started for any of them


def test_steady_pairs_alternate_and_say_what_else_the_process_ran():
    from benchmarks import worker

    calls = []
    out = worker._steady(lambda fn, shape: fn() or 0.01, lambda: calls.append("eager"),
                         lambda: calls.append("compiled"), [(1, 8, 8)], 4, lambda: 0)
    assert calls == ["eager", "compiled"] + ["eager", "compiled", "compiled", "eager"] * 2
    process = out["1x8x8"]["process"]
    assert process["wall_s"] >= 0 and process["cpu_s"] >= 0 and isinstance(process["threads"], list)
