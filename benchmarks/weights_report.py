"""bench.json's `models.flux.weights` and bench.md's quantised-weights table, from weights.py's raw results.

Ratios follow the rest of the bench: "times faster" (above 1: ours is
faster). A compiled variant's ratio against eager uses the eager steps timed
in turns with it in the same process, so load that drifts between processes
cancels out; "ours vs torch.compile" divides those two ratios. The absolute
medians are kept beside them.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .weights import VARIANT_LABELS, VARIANTS, WEIGHT_LABELS


def _r(value, digits: int = 4):
    return None if value is None else round(float(value), digits)


def _ratio(numerator, denominator) -> Optional[float]:
    return numerator / denominator if numerator and denominator else None


def variant_summary(result: Dict[str, Any]) -> Dict[str, Any]:
    """The figures of one (weights, variant) process that bench.md shows; the raw result stays in `raw`."""
    if "error" in result or "skipped" in result:
        return {"error": result.get("error"), "skipped": result.get("skipped")}
    steady = result.get("steady") or {}
    return {
        "step_s_median": _r(steady.get("step_s_median")),
        "eager_step_s_median_same_process": _r(steady.get("eager_step_s_median")),
        "vs_eager": _r(steady.get("vs_eager"), 3),
        "step_s_min": _r(steady.get("step_s_min")),
        "eager_step_s_min_same_process": _r(steady.get("eager_step_s_min", steady.get("step_s_min"))),
        "vs_eager_fastest": _r(_ratio(steady.get("eager_step_s_min", steady.get("step_s_min")),
                                      steady.get("step_s_min")), 3),
        "steady_shape": steady.get("shape"),
        "first_image_s": _r(result.get("first_image_s"), 2),
        "compiles_first_image": result.get("compiles_first_image"),
        "compiles_after_first_image": result.get("compiles_after_first_image"),
        "compiles_lora_rows": result.get("compiles_lora_rows"),
        "compiles_steady": (steady.get("compiles_warmup") or 0) + (steady.get("compiles_timed") or 0)
        if steady else None,
        "sweep_s": _r(result.get("sweep_s"), 2),
        "max_abs_diff_vs_eager": result.get("max_abs_diff_vs_eager"),
        "output_scale": _r(result.get("output_scale"), 3),
        "lora_changed_output_by": _r(result.get("lora_changed_output_by"), 3),
        "blocks": result.get("blocks"),
        "fallback_reasons": result.get("fallback_reasons") or [],
        "peak_rss_mb": _r(result.get("peak_rss_mb"), 0),
        "weight_class": result.get("weight_class"),
        "threads": result.get("threads"),
    }


def summarise(raw: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Per weights kind: per variant figures, and ours against eager and against torch.compile."""
    if not raw:
        return {}
    out: Dict[str, Any] = {}
    for kind, entry in (raw.get("results") or {}).items():
        if "skipped" in entry:
            out[kind] = {"skipped": entry["skipped"]}
            continue
        variants = {v: variant_summary(r) for v, r in (entry.get("variants") or {}).items()}
        ours, compiled = variants.get("ours") or {}, variants.get("torch_compile") or {}
        out[kind] = {"variants": variants, "ours_vs_eager": ours.get("vs_eager"),
                     "ours_vs_torch_compile": _r(_ratio(ours.get("vs_eager"), compiled.get("vs_eager")), 3),
                     # the fastest step of each kind: less sensitive to load bursts on a shared machine
                     "ours_vs_eager_fastest": ours.get("vs_eager_fastest"),
                     "ours_vs_torch_compile_fastest": _r(_ratio(ours.get("vs_eager_fastest"),
                                                                compiled.get("vs_eager_fastest")), 3),
                     "compiles_after_first_image": {v: s.get("compiles_after_first_image")
                                                    for v, s in variants.items() if v != "eager"}}
    return out


def _cell(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2e}" if value and abs(value) < 10 ** -digits else f"{value:.{digits}f}"
    return str(value)


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _threads(summary: Dict[str, Any]) -> str:
    seen = sorted({s.get("threads") for e in summary.values() for s in (e.get("variants") or {}).values()
                   if s.get("threads")})
    return ", ".join(map(str, seen)) or "?"


def markdown(summary: Dict[str, Any], raw: Optional[Dict[str, Any]]) -> List[str]:
    """bench.md's section: the ratios side by side, then every variant's figures, then what was skipped."""
    if not raw:
        return []
    config = raw.get("config") or {}
    steady = (config.get("steady") or {}).get("label", "?")
    lines = ["## Flux with quantised weights, in ComfyUI (`--weights`)", "",
             f"The tiny Flux of benchmarks/comfy/quantised.py (256 wide, 2 double + 2 single blocks, random "
             f"weights) loaded in ComfyUI's Python with each kind of weights; each variant in its own process with "
             f"an empty Inductor cache. Sweep after the first image: "
             f"{', '.join(r['label'] for r in (config.get('rows') or [])[1:])} ({config.get('steps')} steps, "
             f"cfg {config.get('cfg')}). Step time: median interval between KSampler's step callbacks at {steady} "
             f"({config.get('steady_steps')} steps x {config.get('reps')} samples), the compiled variants in turns "
             f"with the eager model in the same process. Ratios: times faster, from the median step (and from "
             f"the fastest step of each kind, less sensitive to load bursts). Torch threads per process: "
             f"{_threads(summary)}.", "",
             "| weights | ours vs eager (median / fastest) | ours vs torch.compile | torch.compile vs eager | "
             "compiles after the first image (incl. LoRA 1.0 / 0.5 / off): ours / torch.compile | median step s: "
             "eager / torch.compile / ours |",
             "|---|---|---|---|---|---|"]
    details: List[str] = []
    for kind, entry in summary.items():
        label = WEIGHT_LABELS.get(kind, kind)
        if "skipped" in entry:
            lines.append(f"| {label} | skipped: {entry['skipped']} | | | | |")
            continue
        variants = entry["variants"]
        after = entry["compiles_after_first_image"]
        steps = " / ".join(_cell(variants.get(v, {}).get("step_s_median"), 4) for v in VARIANTS)
        compiled = variants.get("torch_compile") or {}
        lines.append(f"| {label} | {_x(entry['ours_vs_eager'])} / {_x(entry.get('ours_vs_eager_fastest'))} "
                     f"| {_x(entry['ours_vs_torch_compile'])} / {_x(entry.get('ours_vs_torch_compile_fastest'))} "
                     f"| {_x(compiled.get('vs_eager'))} / {_x(compiled.get('vs_eager_fastest'))} "
                     f"| {_cell(after.get('ours'))} / {_cell(after.get('torch_compile'))} | {steps} |")
        for variant in VARIANTS:
            s = variants.get(variant)
            if s is None:
                continue
            if s.get("error") or s.get("skipped"):
                why = str(s.get("error") or s.get("skipped")).strip().splitlines()[-1][:200]
                details.append(f"| {label} | {VARIANT_LABELS[variant]} | failed: {why} | | | | | | | |")
                continue
            blocks = s.get("blocks") or {}
            note = (f"{blocks.get('blocks_compiled')}/{blocks.get('blocks')} blocks compiled" if blocks else "")
            if s.get("fallback_reasons"):
                note += "; eager: " + "; ".join(s["fallback_reasons"])[:200]
            details.append(
                f"| {label} | {VARIANT_LABELS[variant]} | {_cell(s['first_image_s'], 2)} "
                f"| {_cell(s['compiles_first_image'])} | {_cell(s['compiles_after_first_image'])} "
                f"({_cell(s['compiles_lora_rows'])} in the LoRA rows) | {_cell(s['step_s_median'], 4)} "
                f"/ {_cell(s['eager_step_s_median_same_process'], 4)} | {_x(s['vs_eager'])} "
                f"| {_cell(s['max_abs_diff_vs_eager'])} (scale {_cell(s['output_scale'], 1)}) "
                f"| {_cell(s['peak_rss_mb'], 0)} | {note} |")
    if details:
        lines += ["", "| weights | variant | first image, s | compiles in it | compiles after it | step s / eager "
                  "step s, same process | vs eager | max abs diff vs eager's output | peak RSS, MB | notes |",
                  "|---|---|---|---|---|---|---|---|---|---|"] + details
    return lines + [""]


__all__ = ["summarise", "markdown", "variant_summary"]
