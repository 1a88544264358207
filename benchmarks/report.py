"""Turn the per-process results into bench.json, bench.md and bench.png.

Pure functions of the job results (no torch), so the format is testable
without running a benchmark.

Ratios are "how many times faster": above 1 means the variant named first is
faster. Steady-state ratios against eager use the eager calls timed in the
same process, alternating with the compiled ones, so load on the machine
that drifts between processes cancels; "vs torch.compile" divides two such
ratios.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from .phases import with_call_profile

HEADLINE_MODEL = "sd15"
HEADLINE_OURS = "ours_aot_load"  # the default backend, as a user runs it after graphs are saved
COMPILED = ("torch_compile", "ours_inductor", "ours_aot_load", "ours_aot_load_cg", "ours_oneflow", "torch_compile_blocks", "ours_blocks",
            "ours_blocks_load")
OURS = ("ours_inductor", "ours_aot_cold", "ours_aot_load", "ours_aot_load_cg", "ours_aot_fresh", "ours_oneflow", "ours_blocks",
        "ours_blocks_load")
LABELS = {
    "eager": "eager",
    "torch_compile": "torch.compile (as TorchCompileModel)",
    "torch_compile_warm": "torch.compile, restart with its warm Inductor cache",
    "ours_inductor": "ours, inductor backend",
    "ours_aot_cold": "ours, aot backend, cold compile",
    "ours_aot_load": "ours, aot backend, loaded from disk in a fresh process",
    "ours_aot_load_cg": "ours, aot backend, loaded, replaying CUDA graphs of repeated shapes",
    "ours_aot_fresh": "ours, aot backend, loaded in a fresh process on a fresh machine (empty TMPDIR and "
                      "Inductor cache, no C++ compiler)",
    "ours_oneflow": "ours, oneflow backend (graphs per shape, warmed up)",
    "torch_compile_blocks": "torch.compile of the repeated blocks (diffusers compile_repeated_blocks, as KJNodes)",
    "ours_blocks": "ours, block graphs (aot), cold compile",
    "ours_blocks_load": "ours, block graphs loaded from disk in a fresh process",
}
SHORT = {"torch_compile": "torch.compile", "ours_inductor": "ours (inductor)", "ours_aot_cold": "ours (aot, cold)",
         "ours_aot_load": "ours (aot, loaded)", "ours_aot_load_cg": "ours (aot, loaded, CUDA graphs)",
         "ours_oneflow": "ours (oneflow)", "torch_compile_blocks": "torch.compile of blocks",
         "ours_blocks": "ours (blocks, cold)", "ours_blocks_load": "ours (blocks, loaded)"}
# Per transformer model: ours = block graphs.
TRANSFORMER_TARGETS = {
    "cold_compile_ratio_vs_torch_compile": ("cold compile at most 1/5 of whole-model torch.compile's", "<=", 0.2),
    "cold_compile_ratio_vs_torch_compile_blocks": ("cold compile at most torch.compile's of the repeated blocks "
                                                   "(the same block structures)", "<=", 1.0),
    "sweep_compiles_ours": ("zero compiles over the sweep", "==", 0),
    "steady_ratio_vs_torch_compile": ("steady state at least whole-model torch.compile's", ">=", 1.0),
}
TARGETS = {
    "cold_compile_ratio_vs_torch_compile": ("cold compile at most torch.compile's first call (SD1.5-shaped UNet)",
                                            "<=", 1.0),
    "steady_ratio_vs_torch_compile": ("steady state at least as fast as plain torch.compile (SD1.5-shaped UNet)",
                                      ">=", 1.0),
    "steady_ratio_vs_eager": ("steady state at least 1.2x eager (SD1.5-shaped UNet)", ">=", 1.2),
    "restart_vs_cold_compile_ratio": ("restart-to-first-result with saved graphs at most 10% of plain "
                                      "torch.compile's cold compile (SD1.5-shaped UNet)", "<=", 0.10),
    "sweep_compiles_ours_all": ("zero compiles over the sweep after the declared range is compiled "
                                "(every model, every one of our variants)", "==", 0),
    "restart_fresh_vs_cold_compile_ratio": ("restart-to-first-result on a fresh machine (empty TMPDIR and "
                                            "Inductor cache, no compiler) at most 10% of plain torch.compile's "
                                            "cold compile (SD1.5-shaped UNet)", "<=", 0.10),
    "restart_fresh_process_over_eager_s": ("process start to first result on a fresh machine at most eager's "
                                           "plus 2 s (SD1.5-shaped UNet)", "<=", 2.0),
    "restart_fresh_compiler_calls": ("no C++ compiler called while loading and running saved graphs on a fresh "
                                     "machine (SD1.5-shaped UNet)", "==", 0),
}


def geomean(values: Iterable[float]) -> Optional[float]:
    values = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not values:
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _ok(job: Optional[dict]) -> bool:
    return bool(job) and "error" not in job and "skipped" not in job


def _round(value, digits: int = 4):
    if value is None:
        return None
    if isinstance(value, float):
        return round(value, digits) if math.isfinite(value) else None
    return value


def model_summary(name: str, jobs: Dict[str, dict], spec: Optional[dict] = None) -> Dict[str, Any]:
    """Everything the tables show for one model, from its jobs by variant."""
    ok = {variant: job for variant, job in jobs.items() if _ok(job)}
    out: Dict[str, Any] = {"model": name, "spec": spec or {}, "variants_run": sorted(ok),
                           "variants_failed": {v: (j.get("error") or j.get("skipped")) for v, j in jobs.items()
                                               if not _ok(j)}}
    params = next((j.get("parameters") for j in ok.values() if j.get("parameters")), None)
    out["parameters_m"] = _round(params / 1e6, 2) if params else None

    # -- steady state
    shapes: List[str] = []
    for variant in COMPILED:
        for key in (ok.get(variant, {}).get("steady") or {}):
            if key not in shapes:
                shapes.append(key)
    steady: Dict[str, Any] = {}
    for key in shapes:
        row: Dict[str, Any] = {"eager_s": None}
        eagers = []
        for variant in COMPILED:
            cell = (ok.get(variant, {}).get("steady") or {}).get(key)
            if not cell:
                continue
            eagers.append(cell["eager_median_s"])
            row[f"{variant}_s"] = cell["compiled_median_s"]
            row[f"{variant}_eager_s"] = cell["eager_median_s"]
            row[f"{variant}_vs_eager"] = cell["eager_median_s"] / cell["compiled_median_s"]
            row[f"{variant}_compiles_during"] = cell.get("compiles_during", 0)
            process = cell.get("process") or {}
            if process.get("wall_s"):  # above 1: other threads of the process were busy while the pairs ran
                row[f"{variant}_cpu_per_wall"] = process["cpu_s"] / process["wall_s"]
            if process.get("machine_cores_busy") is not None:  # the whole machine meanwhile (another lane's compile)
                row[f"{variant}_machine_cores_busy"] = process["machine_cores_busy"]
            if cell.get("eager_min_s") and cell.get("compiled_min_s"):
                row[f"{variant}_vs_eager_fastest"] = cell["eager_min_s"] / cell["compiled_min_s"]
        row["eager_s"] = statistics.median(eagers) if eagers else None
        if len(eagers) > 1 and min(eagers) > 0:
            row["eager_spread"] = max(eagers) / min(eagers)  # the same eager calls, one process against another
        for variant in OURS:
            if f"{variant}_vs_eager" in row and "torch_compile_vs_eager" in row:
                row[f"{variant}_vs_torch_compile"] = row[f"{variant}_vs_eager"] / row["torch_compile_vs_eager"]
                # the ratio of ratios holds where the two processes' eager calls took alike (pair_spread)
                row[f"{variant}_eager_spread_vs_torch_compile"] = pair_spread(
                    row[f"{variant}_eager_s"], row["torch_compile_eager_s"])
        steady[key] = {k: _round(v, 5) for k, v in row.items()}
    out["steady"] = steady
    static = (ok.get("torch_compile", {}).get("steady_static") or {})
    out["torch_compile_static"] = {
        key: {"eager_s": _round(c["eager_median_s"], 5), "compiled_s": _round(c["compiled_median_s"], 5),
              "vs_eager": _round(c["eager_median_s"] / c["compiled_median_s"])}
        for key, c in static.items()
    }
    ratios = {}
    for variant in COMPILED:
        value = geomean(row.get(f"{variant}_vs_eager") for row in steady.values())
        ratios[variant] = {"vs_eager": _round(value), "vs_eager_fastest": _round(
            geomean(row.get(f"{variant}_vs_eager_fastest") for row in steady.values()))}
        if variant != "torch_compile":
            ratios[variant]["vs_torch_compile"] = _round(
                geomean(row.get(f"{variant}_vs_torch_compile") for row in steady.values()))
    out["steady_ratios"] = ratios

    # -- first call / restart
    first = {variant: _round(job.get("first_call_s"), 3) for variant, job in ok.items()}
    out["first_call_s"] = first
    out["first_call_compiles"] = {variant: job.get("first_call_compiles") for variant, job in ok.items()}
    out["process_to_first_result_s"] = {variant: _round(job.get("process_to_first_result_s"), 3)
                                        for variant, job in ok.items() if job.get("process_to_first_result_s")}
    cold = first.get("torch_compile")
    # Cold compile: ours (whole models: aot; transformers: block graphs) against torch.compile's first call of
    # the same module (transformers: of its repeated blocks, per block structure as ours), with their phases.
    ours_cold = first.get("ours_aot_cold") if "ours_aot_cold" in first else first.get("ours_blocks")
    peer = first.get("torch_compile_blocks") if "ours_blocks" in first else cold
    out["cold_compile"] = {
        "ours_s": ours_cold, "torch_compile_s": peer,
        "ratio": _round(ours_cold / peer) if ours_cold and peer else None,
        "phases": {variant: with_call_profile(job["first_call_phases"], job.get("first_call_profile"))
                   for variant, job in ok.items() if job.get("first_call_phases")},
        "main_thread": {variant: {"build": job.get("first_call_build_main_thread") or [],
                                  "call": (job.get("first_call_profile") or {}).get("main_thread") or []}
                        for variant, job in ok.items() if job.get("first_call_phases")},
    }
    restart = first.get("ours_aot_load")
    out["restart_vs_cold_compile_ratio"] = _round(restart / cold) if cold and restart is not None else None
    warm = first.get("torch_compile_warm")
    out["torch_compile_warm_restart_vs_cold_ratio"] = _round(warm / cold) if cold and warm is not None else None
    process = out["process_to_first_result_s"]
    if process.get("ours_aot_load") and process.get("torch_compile"):
        out["process_restart_vs_cold_ratio"] = _round(process["ours_aot_load"] / process["torch_compile"])
    out["ours_aot_loads_on_first_call"] = ok.get("ours_aot_load", {}).get("first_call_loads")
    fresh_job = ok.get("ours_aot_fresh")
    if fresh_job:
        fresh = first.get("ours_aot_fresh")
        out["restart_fresh_machine_s"] = fresh
        out["restart_fresh_vs_cold_compile_ratio"] = _round(fresh / cold) if cold and fresh is not None else None
        out["restart_fresh_process_to_first_result_s"] = process.get("ours_aot_fresh")
        if process.get("ours_aot_fresh") and process.get("eager"):
            out["restart_fresh_process_over_eager_s"] = _round(process["ours_aot_fresh"] - process["eager"], 3)
        out["restart_fresh_compiler_calls"] = len(fresh_job.get("compiler_calls") or [])
        out["restart_fresh_compiler_call_lines"] = (fresh_job.get("compiler_calls") or [])[:10]
        out["restart_fresh_tmpdir_left_after_exit"] = fresh_job.get("tmpdir_left_after_exit")
        out["restart_fresh_loads"] = fresh_job.get("first_call_loads")

    # -- sweep
    out["sweep_compiles"] = {variant: job.get("sweep_compiles") for variant, job in ok.items() if "sweep" in job}
    out["sweep_wall_s"] = {variant: _round(job.get("sweep_wall_s"), 2) for variant, job in ok.items() if "sweep" in job}
    out["sweep_shapes"] = len(next((j["sweep"] for j in ok.values() if j.get("sweep")), []))
    out["warmup"] = {variant: {"s": _round(job["warmup_s"], 2), "compiles": job.get("warmup_compiles")}
                     for variant, job in ok.items() if "warmup_s" in job}
    tc = ok.get("torch_compile", {})
    out["torch_compile_graphs_total"] = tc.get("compiles_total")
    out["torch_compile_recompile_limit_hit"] = tc.get("recompile_limit_hit") or []
    out["ours_fallbacks"] = {variant: ok[variant].get("fallbacks") for variant in OURS if variant in ok}
    out["graphs_saved"] = ok.get("ours_aot_cold", {}).get("graphs_saved")
    out["graphs_saved_mb"] = _round(ok.get("ours_aot_cold", {}).get("graphs_saved_mb"), 2)
    # the first-use check: one eager call per new shape, and the graph's output held while it runs
    out["first_use_check"] = {
        variant: {"checks": cost["checks"], "mismatches": cost["mismatches"], "extra_s": _round(cost["extra_s"], 3),
                  "share_of_sweep": _round(cost["extra_s"] / cost["sweep_s"], 3) if cost["sweep_s"] else None,
                  "held_mb_max": _round(cost["held_mb_max"], 2)}
        for variant, job in ok.items() for cost in [job.get("first_use_check")] if cost}

    if (spec or {}).get("kind") == "transformer":
        out.update(transformer_summary(ok, out))

    # -- memory
    out["peak_rss_mb"] = {variant: _round(job.get("peak_rss_mb"), 1) for variant, job in ok.items()}
    cuda = {variant: _round(job.get("cuda_max_memory_allocated_mb"), 1) for variant, job in ok.items()
            if job.get("cuda_max_memory_allocated_mb") is not None}
    if cuda:
        out["cuda_max_memory_allocated_mb"] = cuda
    return out


def transformer_summary(ok: Dict[str, dict], out: Dict[str, Any]) -> Dict[str, Any]:
    """The block-graph comparison of one transformer: cold compiles, sweep compiles, steady ratios, targets."""
    first, sweeps, ratios = out["first_call_s"], out["sweep_compiles"], out["steady_ratios"]
    cold = {v: first[v] for v in ("torch_compile", "torch_compile_blocks", "ours_blocks") if first.get(v) is not None}
    whole = cold.get("torch_compile")

    def vs_whole(variant):
        return _round(cold[variant] / whole) if whole and variant in cold else None

    ours = "ours_blocks_load" if (ratios.get("ours_blocks_load") or {}).get("vs_eager") else "ours_blocks"
    ours_eager = (ratios.get(ours) or {}).get("vs_eager")
    blocks_eager = (ratios.get("torch_compile_blocks") or {}).get("vs_eager")
    summary = {
        "cold_compile_s": cold,
        "cold_compile_ratio_vs_torch_compile": vs_whole("ours_blocks"),
        "cold_compile_ratio_torch_compile_blocks_vs_torch_compile": vs_whole("torch_compile_blocks"),
        "cold_compile_ratio_vs_torch_compile_blocks": _round(cold["ours_blocks"] / cold["torch_compile_blocks"])
        if cold.get("ours_blocks") and cold.get("torch_compile_blocks") else None,
        "sweep_compiles_ours": sweeps.get("ours_blocks"),
        "sweep_compiles_ours_loaded": sweeps.get("ours_blocks_load"),
        "sweep_compiles_torch_compile": sweeps.get("torch_compile"),
        "sweep_compiles_torch_compile_blocks": sweeps.get("torch_compile_blocks"),
        "steady_ours_variant": ours,
        "steady_ratio_vs_eager": ours_eager,
        "steady_ratio_vs_torch_compile": (ratios.get(ours) or {}).get("vs_torch_compile"),
        "steady_ratio_vs_torch_compile_blocks": _round(ours_eager / blocks_eager) if ours_eager and blocks_eager else None,
        "restart_first_result_s": first.get("ours_blocks_load"),
        "block_report": (ok.get("ours_blocks") or ok.get("ours_blocks_load") or {}).get("block_report"),
    }
    summary["targets"] = {key: {"target": text, "rule": f"{op} {bound}", "value": summary.get(key),
                                "met": _check(summary.get(key), op, bound)}
                          for key, (text, op, bound) in TRANSFORMER_TARGETS.items()}
    return summary


def _check(value, op: str, bound) -> Optional[bool]:
    if value is None:
        return None
    return {">=": value >= bound, "<=": value <= bound, "==": value == bound}[op]


def summarise(jobs: List[dict], meta: Dict[str, Any], specs: Optional[Dict[str, dict]] = None,
              comfy: Optional[dict] = None, weights: Optional[dict] = None) -> Dict[str, Any]:
    """bench.json's content: headline ratios, targets, per-model summaries, raw job results; `weights` is
    weights.py's raw result (bench.json: models.flux.weights.<kind>, the raw part under `weights_raw`)."""
    from . import session, weights_report

    session_runs = [job for job in jobs if job.get("kind") == "session" or (job.get("job") or {}).get("kind") == "session"]
    jobs = [job for job in jobs if job not in session_runs]
    by_model: Dict[str, Dict[str, dict]] = {}
    for job in jobs:
        by_model.setdefault(job.get("model", "?"), {})[job.get("variant", "?")] = job
    models = {name: model_summary(name, variants, (specs or {}).get(name)) for name, variants in by_model.items()}
    headline = HEADLINE_MODEL if HEADLINE_MODEL in models else next(iter(models), None)
    head = models.get(headline, {}) if headline else {}
    ours = (head.get("steady_ratios") or {}).get(HEADLINE_OURS, {})
    sweeps_ours = {name: {v: m["sweep_compiles"].get(v) for v in OURS if m["sweep_compiles"].get(v) is not None}
                   for name, m in models.items()}
    all_ours = [n for per in sweeps_ours.values() for n in per.values()]
    summary: Dict[str, Any] = {
        **meta,
        "headline_model": headline,
        "headline_ours_variant": HEADLINE_OURS,
        "steady_ratio_vs_eager": ours.get("vs_eager"),
        "steady_ratio_vs_torch_compile": ours.get("vs_torch_compile"),
        "steady_ratio_vs_eager_torch_compile": (head.get("steady_ratios") or {}).get("torch_compile", {}).get("vs_eager"),
        "steady_ratio_vs_eager_ours_inductor": (head.get("steady_ratios") or {}).get("ours_inductor", {}).get("vs_eager"),
        "restart_vs_cold_compile_ratio": head.get("restart_vs_cold_compile_ratio"),
        "cold_compile_torch_compile_s": (head.get("first_call_s") or {}).get("torch_compile"),
        "restart_first_result_ours_s": (head.get("first_call_s") or {}).get("ours_aot_load"),
        "restart_fresh_machine_s": head.get("restart_fresh_machine_s"),
        "restart_fresh_vs_cold_compile_ratio": head.get("restart_fresh_vs_cold_compile_ratio"),
        "restart_fresh_process_to_first_result_s": head.get("restart_fresh_process_to_first_result_s"),
        "restart_fresh_process_over_eager_s": head.get("restart_fresh_process_over_eager_s"),
        "restart_fresh_compiler_calls": head.get("restart_fresh_compiler_calls"),
        "cold_compile_ours_aot_s": (head.get("first_call_s") or {}).get("ours_aot_cold"),
        "cold_compile_ratio_vs_torch_compile": (head.get("cold_compile") or {}).get("ratio"),
        "cold_compile_ratio_by_model": {name: (m.get("cold_compile") or {}).get("ratio") for name, m in models.items()},
        "sweep_compiles_ours": (head.get("sweep_compiles") or {}).get("ours_aot_cold"),
        "sweep_compiles_torch_compile": (head.get("sweep_compiles") or {}).get("torch_compile"),
        "sweep_compiles_ours_by_model": sweeps_ours,
        "sweep_compiles_ours_all": sum(all_ours) if all_ours else None,
        "sweep_compiles_torch_compile_by_model": {name: m["sweep_compiles"].get("torch_compile")
                                                  for name, m in models.items()},
    }
    summary["targets"] = {}
    for key, (text, op, bound) in TARGETS.items():
        value = summary.get(key)
        summary["targets"][key] = {"target": text, "rule": f"{op} {bound}", "value": value,
                                   "met": _check(value, op, bound)}
    headline = summary.get("headline_ours_variant") or "ours_aot_load"
    spread = max((row.get(f"{headline}_eager_spread_vs_torch_compile") or 0
                  for row in (head.get("steady") or {}).values()), default=0)
    if spread > EAGER_SPREAD_LIMIT and "steady_ratio_vs_torch_compile" in summary["targets"]:
        summary["targets"]["steady_ratio_vs_torch_compile"].update(
            met=None, note=f"not measured: eager differed {spread:.2f}x between our process and torch.compile's")
    summary["transformer_targets"] = {name: m["targets"] for name, m in models.items() if "targets" in m}
    sessions = session.summarise(session_runs)
    for name, entry in sessions.items():  # bench.json: models.<name>.first_image_vs_eager_ratio, ...
        models.setdefault(name, {}).update(session=entry["variants"],
                                           first_image_vs_eager_ratio=entry["first_image_vs_eager_ratio"],
                                           session_ratio_vs_best_peer=entry["session_ratio_vs_best_peer"])
    summary["sessions"] = sessions
    if weights:
        models.setdefault(weights.get("model", "flux"), {})["weights"] = weights_report.summarise(weights)
        summary["weights_raw"] = weights
    summary["models"] = models
    summary["comfyui"] = comfy or {"run": False, "why": "not requested"}
    modes = {m.get("mode"): m for m in (comfy or {}).get("modes", []) if not m.get("error")}
    for mode in ("none", "torch_compile", "ours_restart", "ours_fresh"):
        if modes.get(mode, {}).get("start_to_first_image_s") is not None:
            summary[f"comfyui_{mode}_start_to_first_image_s"] = _round(modes[mode]["start_to_first_image_s"], 2)
    summary["jobs"] = jobs + session_runs
    return summary


# -- markdown ---------------------------------------------------------------------

def _fmt(value, digits: int = 3, suffix: str = "") -> str:
    if value is None:
        return "not run"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.2e}{suffix}"
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _ratio(value) -> str:
    return "not run" if value is None else f"{value:.2f}x"


def markdown(summary: Dict[str, Any]) -> str:
    lines: List[str] = []
    add = lines.append
    add("# KeepFast benchmark: eager vs plain torch.compile vs KeepFast")
    add("")
    add(f"- profile: **{summary.get('profile', '?')}** — {summary.get('profile_text', '')}")
    add(f"- device: {summary.get('device', '?')}, dtype {summary.get('dtype', '?')}, torch {summary.get('torch', '?')}, "
        f"{summary.get('cpu_count', '?')} CPUs ({summary.get('cpu_model', '?')})")
    add(f"- machine load (1/5/15 min): at start {summary.get('loadavg_start')}, at end {summary.get('loadavg_end')}; "
        f"`uptime` at start: `{summary.get('uptime_start', '')}`")
    add(f"- started {summary.get('started', '?')}, took {_fmt(summary.get('duration_s'), 0, ' s')}")
    add("- ratios are \"times faster\" (above 1: the first-named is faster); steady state is the median of "
        "alternating eager/compiled calls in the same process")
    add("")
    if summary.get("check"):
        from . import check

        lines.extend(check.markdown(summary["check"]))
    if summary.get("headline_model"):  # none with --sessions-only
        add(f"## Targets ({summary.get('headline_model')}; ours = {summary.get('headline_ours_variant')})")
        add("")
        add("| target | value | status |")
        add("|---|---|---|")
        for key, target in (summary.get("targets") or {}).items():
            met = target.get("met")
            status = target.get("note") or ("not measured" if met is None else ("met" if met else "NOT met"))
            add(f"| {target['target']} (`{key}` {target['rule']}) | {_fmt(target.get('value'), 3)} | {status} |")
        add("")
    for name, model in (summary.get("models") or {}).items():
        if "spec" not in model:
            continue  # sessions only (--sessions-only): their table follows
        spec = model.get("spec") or {}
        if spec.get("kind") == "transformer":
            lines.extend(transformer_markdown(name, model))
            continue
        add(f"## {spec.get('title', name)} (`{name}`, {_fmt(model.get('parameters_m'), 1)}M parameters)")
        add("")
        if spec.get("changed_from_real_config"):
            add(f"Scaled down from the real config: `{json.dumps(spec['changed_from_real_config'])}`.")
            add("")
        if model.get("variants_failed"):
            for variant, why in model["variants_failed"].items():
                add(f"- {variant}: not run or failed: {str(why).splitlines()[0][:300]}")
            add("")
        add("Steady state, seconds per call, each variant's median next to the median of the eager calls "
            "alternating with it in the same process (ratio = times faster):")
        add("")
        add("| batch x h x w (latent) | torch.compile / eager | ours inductor / eager | ours aot (loaded) / eager "
            "| torch.compile vs eager | ours aot vs eager | ours aot vs torch.compile | ours inductor vs eager "
            "| ours inductor vs torch.compile |")
        add("|---|---|---|---|---|---|---|---|---|")

        def pair(row, variant):
            if row.get(f"{variant}_s") is None:
                return "not run"
            return f"{row[f'{variant}_s']:.4f} / {row[f'{variant}_eager_s']:.4f}"

        for key, row in (model.get("steady") or {}).items():
            add(f"| {key} | {pair(row, 'torch_compile')} | {pair(row, 'ours_inductor')} | {pair(row, 'ours_aot_load')} "
                f"| {_ratio(row.get('torch_compile_vs_eager'))} | {_ratio(row.get('ours_aot_load_vs_eager'))} "
                f"| {_ratio(row.get('ours_aot_load_vs_torch_compile'))} | {_ratio(row.get('ours_inductor_vs_eager'))} "
                f"| {_ratio(row.get('ours_inductor_vs_torch_compile'))} |")
        ratios = model.get("steady_ratios") or {}
        add(f"| geometric mean | | | | {_ratio(ratios.get('torch_compile', {}).get('vs_eager'))} "
            f"| {_ratio(ratios.get('ours_aot_load', {}).get('vs_eager'))} "
            f"| {_ratio(ratios.get('ours_aot_load', {}).get('vs_torch_compile'))} "
            f"| {_ratio(ratios.get('ours_inductor', {}).get('vs_eager'))} "
            f"| {_ratio(ratios.get('ours_inductor', {}).get('vs_torch_compile'))} |")
        for key, row in (model.get("steady") or {}).items():
            if (row.get("eager_spread") or 0) > EAGER_SPREAD_LIMIT:
                apart = [SHORT[v] for v in OURS
                         if (row.get(f"{v}_eager_spread_vs_torch_compile") or 0) > EAGER_SPREAD_LIMIT]
                add("")
                add(f"{key}: eager's median differed {row['eager_spread']:.2f}x between the processes; a ratio "
                    "against torch.compile through each process's eager is shown only where that process's eager "
                    f"and torch.compile's took alike (within {EAGER_SPREAD_LIMIT}x; not: "
                    f"{', '.join(apart) or 'none'}); the compiled medians side by side, ms: " + ", ".join(
                        f"{SHORT[v]} {row[f'{v}_s'] * 1000:.2f} (its eager {row[f'{v}_eager_s'] * 1000:.2f}"
                        + (f", process CPU {row[f'{v}_cpu_per_wall']:.2f}x its wall time"
                           if row.get(f"{v}_cpu_per_wall") is not None else "") + ")"
                        for v in COMPILED if row.get(f"{v}_s") is not None) + ".")
            busy = {v: row[f"{v}_machine_cores_busy"] for v in COMPILED
                    if row.get(f"{v}_machine_cores_busy") is not None}
            if busy:
                add("")
                add(f"{key}: cores the whole machine kept busy while each process timed its pairs (another "
                    "lane's compile takes many; a step's kernel launches wait for a busy CPU): "
                    + ", ".join(f"{SHORT[v]} {cores:.1f}" for v, cores in busy.items()) + ".")
        fastest = {v: ratios.get(v, {}).get("vs_eager_fastest") for v in COMPILED}
        if any(fastest.values()):
            add("")
            add("From the fastest timed call of each kind instead of the median (less sensitive to load spikes): "
                + ", ".join(f"{SHORT[v]} {_ratio(fastest[v])} vs eager" for v in COMPILED) + ".")
        for key, cell in (model.get("torch_compile_static") or {}).items():
            add("")
            add(f"torch.compile before any other shape (graph specialised to {key}): {_fmt(cell['compiled_s'], 4)} s "
                f"vs eager {_fmt(cell['eager_s'], 4)} s ({_ratio(cell['vs_eager'])}).")
        add("")
        add("First call (after the model is built) and restart:")
        add("")
        add("| | first call, s | compiles in it | process start to first result, s |")
        add("|---|---|---|---|")
        first, compiles, process = model.get("first_call_s") or {}, model.get("first_call_compiles") or {}, \
            model.get("process_to_first_result_s") or {}
        for variant in ("eager", "torch_compile", "torch_compile_warm", "ours_inductor", "ours_aot_cold",
                        "ours_aot_load", "ours_aot_fresh", "ours_oneflow"):
            if variant in first:
                add(f"| {LABELS[variant]} | {_fmt(first[variant], 2)} | {_fmt(compiles.get(variant))} "
                    f"| {_fmt(process.get(variant), 2)} |")
        add("")
        lines.extend(cold_compile_markdown(model))
        add(f"Restart with saved graphs / torch.compile cold compile: **{_fmt(model.get('restart_vs_cold_compile_ratio'), 3)}** "
            f"(torch.compile's own warm-cache restart / its cold compile: "
            f"{_fmt(model.get('torch_compile_warm_restart_vs_cold_ratio'), 3)}). "
            f"Graphs saved: {_fmt(model.get('graphs_saved'))} ({_fmt(model.get('graphs_saved_mb'), 2)} MB, no weights).")
        if "restart_fresh_machine_s" in model:
            add("")
            add(f"On a fresh machine (empty TMPDIR and Inductor cache, no C++ compiler): restart / cold compile "
                f"**{_fmt(model.get('restart_fresh_vs_cold_compile_ratio'), 3)}**; process start to first result "
                f"{_fmt(model.get('restart_fresh_process_to_first_result_s'), 2)} s, "
                f"{_fmt(model.get('restart_fresh_process_over_eager_s'), 2)} s more than eager's; compiler calls "
                f"{_fmt(model.get('restart_fresh_compiler_calls'))}; left in TMPDIR after exit: "
                f"{len(model.get('restart_fresh_tmpdir_left_after_exit') or [])} files.")
        add("")
        add(f"Sweep over {model.get('sweep_shapes')} shapes (5 resolutions x 3 batch sizes), one call each, after the "
            "first call:")
        add("")
        add("| | compiles in the sweep | sweep wall time, s | peak RSS of the process, MB |")
        add("|---|---|---|---|")
        rss = model.get("peak_rss_mb") or {}
        for variant in ("eager", "torch_compile", "ours_inductor", "ours_aot_cold", "ours_aot_load", "ours_oneflow"):
            if variant in (model.get("sweep_compiles") or {}):
                add(f"| {LABELS[variant]} | {_fmt(model['sweep_compiles'][variant])} "
                    f"| {_fmt(model['sweep_wall_s'].get(variant), 1)} | {_fmt(rss.get(variant), 0)} |")
        if "torch_compile_warm" in rss:
            add(f"| {LABELS['torch_compile_warm']} (first call only) | | | {_fmt(rss['torch_compile_warm'], 0)} |")
        checks = model.get("first_use_check") or {}
        if checks:
            add("")
            add("The first-use check (each shape's first call also runs eager once; the sweep visited again, checked):")
            add("")
            add("| | checks | mismatches | extra seconds over the sweep | share of the sweep | output held, MB |")
            add("|---|---|---|---|---|---|")
            for variant, cost in checks.items():
                add(f"| {LABELS.get(variant, variant)} | {_fmt(cost['checks'])} | {_fmt(cost['mismatches'])} "
                    f"| {_fmt(cost['extra_s'], 2)} | {_fmt(cost['share_of_sweep'], 3)} | {_fmt(cost['held_mb_max'], 2)} |")
        for variant, warmup in (model.get("warmup") or {}).items():
            add("")
            add(f"{LABELS[variant]}: the sweep's and steady shapes were warmed up before the sweep: "
                f"{_fmt(warmup['compiles'])} graph builds in {_fmt(warmup['s'], 1)} s.")
        if model.get("cuda_max_memory_allocated_mb"):
            add("")
            add("CUDA max memory allocated (MB): " + ", ".join(
                f"{v} {m}" for v, m in model["cuda_max_memory_allocated_mb"].items()))
        if model.get("torch_compile_recompile_limit_hit"):
            add("")
            add("torch.compile hit its recompile limit (later shapes ran eager, silently): "
                + "; ".join(model["torch_compile_recompile_limit_hit"][:2]))
        add("")
    from . import session, weights_report

    lines.extend(session.markdown(summary.get("sessions") or {}))
    add("")
    for name, model in (summary.get("models") or {}).items():
        if model.get("weights"):
            lines.extend(weights_report.markdown(model["weights"], summary.get("weights_raw")))
    add(comfy_markdown(summary.get("comfyui") or {}))
    return "\n".join(lines) + "\n"


# Eager's median for one shape in two processes of one run differing by more than this (on an H200:
# 50.91 ms in one, 28.85-30.25 in the others) makes a ratio of ratios against torch.compile unreliable.
EAGER_SPREAD_LIMIT = 1.25


def pair_spread(one: Optional[float], other: Optional[float]) -> Optional[float]:
    """How far apart two processes' eager medians of one shape are (>= 1), None where one is missing."""
    if not one or not other:
        return None
    return max(one, other) / min(one, other)


def cold_compile_markdown(model: Dict[str, Any]) -> List[str]:
    """The cold compile against torch.compile's first call, and where each one's time went."""
    from .phases import ROWS

    cold = model.get("cold_compile") or {}
    table = cold.get("phases") or {}
    lines = [f"Cold compile (first call) ours / torch.compile: **{_fmt(cold.get('ratio'), 3)}** "
             f"({_fmt(cold.get('ours_s'), 1)} s / {_fmt(cold.get('torch_compile_s'), 1)} s)."]
    if table:
        variants = list(table)
        lines += ["", "Where the first call's compile time went, s (build phases; ours built in a build process, "
                  "several parts side by side where `parts` says so; torch.compile's from its own timers):", "",
                  "| phase | " + " | ".join(SHORT.get(v, v) for v in variants) + " |",
                  "|---|" + "---|" * len(variants)]
        for key, text in ROWS:
            if any(key in table[v] for v in variants):
                lines.append(f"| {text} | " + " | ".join(_fmt(table[v].get(key), 1) for v in variants) + " |")
    lines += main_thread_markdown(cold.get("main_thread") or {})
    return lines + [""]


def main_thread_markdown(samples: Dict[str, Dict[str, list]]) -> List[str]:
    """Where each first call's main thread was, and its slowest build's (build_profile.py): the commonest
    innermost frames with their share of the samples."""
    lines: List[str] = []
    for variant, where in samples.items():
        for whose, top in (("build process", where.get("build")), ("first call's process", where.get("call"))):
            if top:
                shares = "; ".join(f"{share:.0%} `{signature}`" for signature, share in top[:5])
                lines.append(f"- {SHORT.get(variant, variant)}, {whose}'s main thread: {shares}")
    if lines:
        lines = ["", "Where the main thread was (sampled every 0.25 s; innermost frames first):", ""] + lines
    return lines


def transformer_markdown(name: str, model: Dict[str, Any]) -> List[str]:
    spec = model.get("spec") or {}
    lines = [f"## {spec.get('title', name)} (`{name}`, {_fmt(model.get('parameters_m'), 1)}M parameters)", ""]
    if spec.get("changed_from_real_config"):
        lines += [f"Scaled down from the real config: `{json.dumps(spec['changed_from_real_config'])}`.", ""]
    for variant, why in (model.get("variants_failed") or {}).items():
        lines.append(f"- {variant}: not run or failed: {str(why).splitlines()[0][:300]}")
    lines += ["| | cold compile (first call), s | compiles in the sweep | steady vs eager | steady vs whole-model "
              "torch.compile |", "|---|---|---|---|---|"]
    first, sweeps, ratios = model.get("first_call_s") or {}, model.get("sweep_compiles") or {}, \
        model.get("steady_ratios") or {}
    for variant in ("eager", "torch_compile", "torch_compile_blocks", "ours_blocks", "ours_blocks_load"):
        if variant not in first:
            continue
        ratio = ratios.get(variant) or {}
        lines.append(f"| {LABELS[variant]} | {_fmt(first[variant], 2)} | {_fmt(sweeps.get(variant))} "
                     f"| {_ratio(ratio.get('vs_eager'))} | {_ratio(ratio.get('vs_torch_compile'))} |")
    lines += [""] + cold_compile_markdown(model)
    lines += ["| target | value | status |", "|---|---|---|"]
    for key, target in (model.get("targets") or {}).items():
        met = target.get("met")
        status = "not measured" if met is None else ("met" if met else "NOT met")
        lines.append(f"| {target['target']} (`{key}` {target['rule']}) | {_fmt(target.get('value'), 3)} | {status} |")
    blocks = model.get("block_report") or {}
    if blocks:
        lines += ["", f"Block graphs: {blocks.get('blocks_compiled')} of {blocks.get('blocks')} blocks compiled; "
                  + "; ".join(f"{s['class']} x{s['instances']}: {s['status']} ({_fmt(s.get('compile_s'), 1)} s)"
                              for s in blocks.get("structures", [])) + "; glue eager."]
    return lines + [""]


def comfy_markdown(comfy: Dict[str, Any]) -> str:
    lines = ["## ComfyUI end to end", ""]
    if not comfy.get("run"):
        lines.append(f"Not run: {comfy.get('why', 'not requested')}")
        return "\n".join(lines) + "\n"
    lines.append(comfy.get("description", ""))
    lines.append("")
    lines.append("| mode | server start to first image, s | first prompt, s | sweep wall, s | compiles (whole run) "
                 "| compiles in the sweep after the first image | steady it/s | eager it/s, same server | "
                 "vs eager, same server | peak RSS, MB | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in comfy.get("modes", []):
        lines.append(
            f"| {mode.get('label', mode.get('mode'))} | {_fmt(mode.get('start_to_first_image_s'), 1)} "
            f"| {_fmt(mode.get('first_prompt_s'), 1)} | {_fmt(mode.get('sweep_wall_s'), 1)} "
            f"| {_fmt(mode.get('compiles'))} | {_fmt(mode.get('compiles_sweep_after_first'))} "
            f"| {_fmt(mode.get('steady_it_s'), 2)} | {_fmt(mode.get('eager_it_s_same_server'), 2)} "
            f"| {_ratio(mode.get('steady_vs_eager_same_server'))} "
            f"| {_fmt(mode.get('peak_rss_mb'), 0)} | {mode.get('error') or mode.get('note') or ''} |")
    return "\n".join(lines) + "\n"


# -- chart ------------------------------------------------------------------------

def chart(summary: Dict[str, Any], path: Path) -> Optional[str]:
    """bench.png; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not installed ({error}); pip install matplotlib"
    models = {name: model for name, model in (summary.get("models") or {}).items()
              if model.get("first_call_s") or model.get("steady_ratios")}
    if not models:  # --sessions-only, --weights-only: their tables say it all
        return "no steady-state or first-call figures to chart (only sessions or quantised weights were run)"
    names = list(models)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))

    ax = axes[0]
    shown = [v for v in COMPILED if any((models[n].get("steady_ratios") or {}).get(v, {}).get("vs_eager")
                                        for n in names)] or list(COMPILED[:3])
    width = 0.8 / len(shown)
    for index, variant in enumerate(shown):
        values = [(models[n].get("steady_ratios") or {}).get(variant, {}).get("vs_eager") or 0 for n in names]
        bars = ax.bar([i + (index - (len(shown) - 1) / 2) * width for i in range(len(names))], values, width,
                      label=SHORT[variant])
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.2, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, max([ax.get_ylim()[1], 1.3]) * 1.15)
    ax.set_xticks(range(len(names)), names)
    ax.set_title("steady state: times faster than eager")
    ax.legend(fontsize=7)

    ax = axes[1]
    variants = [("torch_compile", "torch.compile cold"), ("torch_compile_warm", "torch.compile warm cache"),
                ("ours_aot_cold", "ours cold (range)"), ("ours_aot_load", "ours restart (load)"),
                ("ours_aot_fresh", "ours restart, fresh machine"),
                ("torch_compile_blocks", "torch.compile of blocks cold"), ("ours_blocks", "ours blocks cold"),
                ("ours_blocks_load", "ours blocks restart (load)")]
    variants = [(v, label) for v, label in variants
                if any((models[n].get("first_call_s") or {}).get(v) for n in names)] or variants[:4]
    step = 0.8 / len(variants)
    for index, (variant, label) in enumerate(variants):
        values = [(models[n].get("first_call_s") or {}).get(variant) or 0 for n in names]
        bars = ax.bar([i + (index - (len(variants) - 1) / 2) * step for i in range(len(names))], values, step,
                      label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_yscale("symlog", linthresh=1)
    top = max([(models[n].get("first_call_s") or {}).get(v) or 0 for n in names for v, _ in variants] + [1])
    ax.set_ylim(0, top * 12)
    ax.set_xticks(range(len(names)), names)
    ax.set_title("first call after the model is built (s)")
    ax.legend(fontsize=7)

    ax = axes[2]
    swept = ("torch_compile", "ours_aot_cold", "ours_aot_load", "torch_compile_blocks", "ours_blocks")
    swept = [v for v in swept if any(v in (models[n].get("sweep_compiles") or {}) for n in names)] or list(swept[:3])
    width = 0.8 / len(swept)
    for index, variant in enumerate(swept):
        values = [(models[n].get("sweep_compiles") or {}).get(variant) or 0 for n in names]
        bars = ax.bar([i + (index - (len(swept) - 1) / 2) * width for i in range(len(names))], values, width,
                      label=SHORT[variant])
        ax.bar_label(bars, fmt="%d", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.set_title("compiles over the 5x3 sweep (after the first call)")
    ax.set_ylim(0, max(ax.get_ylim()[1], 1) * 1.25)
    ax.legend(fontsize=7)

    fig.suptitle(f"KeepFast bench ({summary.get('profile')}, {summary.get('device')} {summary.get('dtype')}, "
                 f"load avg {summary.get('loadavg_start')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def write_all(out: Path, summary: Dict[str, Any], chart_too: bool = True,
              no_chart: str = "not drawn yet (the run goes on)") -> Dict[str, Path]:
    """bench.json, bench.md and (`chart_too`, with matplotlib) bench.png; the paths written. Without the chart,
    bench.json says why (`no_chart`)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "md": out / "bench.md", "png": out / "bench.png"}
    why = chart(summary, paths["png"]) if chart_too else no_chart
    if why:
        summary["chart"] = why
        paths.pop("png")
    paths["json"].write_text(json.dumps(summary, indent=1, default=str))
    paths["md"].write_text(markdown(summary))
    return paths
