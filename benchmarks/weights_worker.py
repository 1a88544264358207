"""One quantised-weights configuration, run as a script in ComfyUI's own Python by weights.py.

    python benchmarks/weights_worker.py JOB.json RESULT.json

The tiny Flux (benchmarks/comfy/quantised.py) is loaded with the job's
weights (GGUF through ComfyUI-GGUF's own loader, or an fp8-scaled checkpoint
as comfy.sd loads one), the job's variant applied as its node does (none,
TorchCompileModel, KeepFastModelSpeedup), and sampled through comfy.sample
as KSampler samples. Everything ComfyUI is imported inside `run`, after the
pack is loaded the way ComfyUI loads it (comfy_pack), so this file can sit in
`compiler/` (which never imports ComfyUI at module level).

Measured: the first image (seconds, compiles), each sweep call (seconds,
compiles, outputs), the steady step time (intervals between KSampler's step
callbacks; the compiled variants alternate with the eager model in the same
process), peak RSS. Compiles are the pack's registry count for ours and
Dynamo's graph count for torch.compile (both are read for every variant).
"""

from __future__ import annotations

import importlib.util
import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
_T0 = time.perf_counter()


def _say(text: str) -> None:
    """Progress into the job's log (weights.py keeps it in the work folder)."""
    print(f"[{time.perf_counter() - _T0:8.1f} s] {text}", file=sys.stderr, flush=True)


def _load(job: Dict[str, Any], Q, torch) -> Any:
    """The job's weights as a ModelPatcher (GGUF: the file is written once, by the first process that needs it)."""
    if job["qtype"] == "fp8_scaled":
        state = Q.scaled_fp8_state(Q.build_float("flux", seed=0))
        with torch.inference_mode():  # ComfyUI's loaders run inside its executor's inference mode
            return Q.load_scaled_fp8("flux", state)
    gguf_nodes = Q.import_gguf_nodes(job["gguf_path"])
    path = Path(job["model_file"])
    if not path.exists():
        partial = path.with_suffix(".partial")
        Q.write_gguf(Q.build_float("flux", seed=0), str(partial), job["qtype"], "flux")
        partial.replace(path)
    return Q.load_gguf("flux", str(path), gguf_nodes)


def _apply_variant(variant: str, patcher, nodes: Dict[str, type], speedup: Dict[str, Any], torch):
    """The model a workflow's sampler gets: as loaded, through TorchCompileModel, or through Model Speedup."""
    if variant == "eager":
        return patcher
    with torch.inference_mode():
        if variant == "torch_compile":
            from comfy_extras.nodes_torch_compile import TorchCompileModel

            return TorchCompileModel.execute(model=patcher, backend="inductor").args[0]
        return nodes["KeepFastModelSpeedup"].execute(model=patcher, **speedup).args[0]


def run(job: Dict[str, Any]) -> Dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from benchmarks.comfy.pack import comfy_with_pack

    name, nodes = comfy_with_pack(job["pack"], job["base"])
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.comfy import families as F
    from benchmarks.comfy import quantised as Q

    if job["qtype"] != "fp8_scaled" and importlib.util.find_spec("gguf") is None:  # ComfyUI-GGUF's loader needs it
        return {"skipped": f"ComfyUI's Python ({sys.executable}) has no `gguf` package; pip install gguf there"}
    import comfy.sd

    runtime = sys.modules[name + ".nodes.runtime"]
    blocks = sys.modules[name + ".nodes.blocks"]
    registry = runtime.registry()
    config, variant = job["config"], job["variant"]
    out: Dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__}

    started = time.perf_counter()
    patcher = _load(job, Q, torch)
    out["load_s"] = time.perf_counter() - started
    diffusion_model = patcher.model.diffusion_model
    out["weight_class"] = type(diffusion_model.double_blocks[0].img_attn.qkv.weight).__name__
    out["parameters_m"] = sum(p.numel() for p in diffusion_model.parameters()) / 1e6
    family = F.TinyFamily(name="flux", patcher=patcher, video=False, latent_channels=16,
                          _latent=F._latent_fn("flux"), _conditioning=F._conditioning_fn("flux"))
    model = _apply_variant(variant, patcher, nodes, config["speedup"], torch)
    _say(f"{job['weights']} / {variant}: loaded ({out['weight_class']}) in {out['load_s']:.1f} s")

    def compiles() -> Dict[str, int]:
        counts = registry.log.counts
        return {"keepfast": counts.get("compile", 0), "dynamo": int(counters["stats"].get("unique_graphs", 0)),
                "fallback": counts.get("fallback", 0), "mismatch": counts.get("mismatch", 0)}

    def own(delta: Dict[str, int]) -> int:
        """The compiles that are this variant's: the pack's for ours, Dynamo's for torch.compile, both for eager."""
        return {"ours": delta["keepfast"], "torch_compile": delta["dynamo"]}.get(variant,
                                                                               delta["keepfast"] + delta["dynamo"])

    def since(before: Dict[str, int]) -> Dict[str, int]:
        now = compiles()
        return {k: now[k] - before[k] for k in now}

    def sample(which, row: dict, steps: int, stamps: Optional[List[float]] = None):
        latent = family.latent(row["width"], row["height"], batch=row["batch"])
        positive, negative = family.conditioning(row["text"], seed=1), family.conditioning(row["text"], seed=2)
        callback: Optional[Callable[..., None]] = None
        if stamps is not None:
            callback = lambda *_: stamps.append(time.perf_counter())  # noqa: E731  (KSampler's step callback)
        return F.sample(family, positive, negative, latent, steps=steps, cfg=config["cfg"], seed=3, model=which,
                        callback=callback)

    lora = Q.lora_state(patcher)
    with_lora: Dict[float, Any] = {}
    rows, outputs = [], {}
    for index, row in enumerate(config["rows"]):
        strength = row["lora"]
        if strength is not None and strength not in with_lora:  # LoraLoader after the variant's node
            with torch.inference_mode():
                with_lora[strength] = comfy.sd.load_lora_for_models(model, None, lora, strength, 0)[0]
        which = model if strength is None else with_lora[strength]
        before, tick = compiles(), time.perf_counter()
        got = sample(which, row, config["steps"])
        seconds, delta = time.perf_counter() - tick, since(before)
        outputs[row["label"]] = got
        rows.append({**row, "s": seconds, "compiles": own(delta), "events": delta})
        _say(f"{row['label']}: {seconds:.2f} s, {own(delta)} compiles {delta}")
    first = rows[0]
    out["first_image_s"], out["compiles_first_image"] = first["s"], first["compiles"]
    out["compiles_after_first_image"] = sum(r["compiles"] for r in rows[1:])
    out["compiles_lora_rows"] = sum(r["compiles"] for r in rows if r["lora"] is not None or "LoRA" in r["label"])
    out["sweep_s"] = sum(r["s"] for r in rows[1:])
    out["lora_keys"] = len(lora) // 3
    plain = next((r for r in rows if r["label"].endswith("LoRA off")), None)
    on = next((r for r in rows if r["lora"] == 1.0), None)
    if plain and on:  # the LoRA took effect: strength 1.0 against off, same call
        out["lora_changed_output_by"] = float((outputs[on["label"]] - outputs[plain["label"]]).abs().max())
    _compare(job, variant, rows, outputs, out, torch)

    out["steady"] = _steady(sample, model, patcher, variant, config, compiles, since, own)
    engine = blocks.existing_engine(diffusion_model)
    if engine is not None:
        report = engine.report()
        out["blocks"] = {"blocks": report.get("blocks"), "blocks_compiled": report.get("blocks_compiled"),
                         "graph_calls": engine.graph_calls, "eager_calls": engine.eager_calls}
    out["fallback_reasons"] = sorted({e.reason for e in registry.events if e.kind == "fallback"})[:10]
    out["graph_breaks"] = int(sum(counters["graph_break"].values()))
    out["rows"] = rows
    out["counts_total"] = compiles()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _compare(job, variant: str, rows: List[dict], outputs: Dict[str, Any], out: Dict[str, Any], torch) -> None:
    """The eager process saves its outputs; every other process compares each call's output with them."""
    reference = Path(job["reference"])
    if variant == "eager":
        torch.save({k: v.clone() for k, v in outputs.items()}, reference)
        out["max_abs_diff_vs_eager"], out["output_scale"] = 0.0, max(float(v.abs().max()) for v in outputs.values())
        return
    if not reference.exists():
        out["max_abs_diff_vs_eager"] = None
        out["diff_why_not"] = "the eager process left no outputs (it failed or was not run)"
        return
    want = torch.load(reference)
    for row in rows:
        if row["label"] in want:
            got = outputs[row["label"]]
            row["diff"] = float((got - want[row["label"]]).abs().max())
            row["scale"] = float(want[row["label"]].abs().max())
            row["finite"] = bool(torch.isfinite(got).all())
    diffs = [r["diff"] for r in rows if "diff" in r]
    out["max_abs_diff_vs_eager"] = max(diffs) if diffs else None
    out["output_scale"] = max((r["scale"] for r in rows if "scale" in r), default=None)
    out["all_finite"] = all(r.get("finite", True) for r in rows)


def _steady(sample, model, patcher, variant: str, config: dict, compiles, since, own) -> Dict[str, Any]:
    """Median time between step callbacks at the steady shape; the compiled variants alternate with the eager
    model (the loader's patcher, which neither node changes) in this process, in turns, so a load change on
    the machine hits both alike. One untimed call of each first (a new shape for torch.compile)."""
    row, steps, reps = config["steady"], config["steady_steps"], config["reps"]
    kinds = [("variant", model)] + ([] if variant == "eager" else [("eager", patcher)])
    before = compiles()
    for _, which in kinds:
        sample(which, row, steps)
    warm = since(before)
    intervals: Dict[str, List[float]] = {kind: [] for kind, _ in kinds}
    before = compiles()
    for rep in range(reps):
        for kind, which in (kinds if rep % 2 == 0 else kinds[::-1]):
            stamps: List[float] = []
            sample(which, row, steps, stamps)
            intervals[kind] += [b - a for a, b in zip(stamps, stamps[1:])]
    timed = since(before)
    result = {"shape": row["label"], "steps_per_sample": steps, "samples": reps,
              "step_s_median": statistics.median(intervals["variant"]), "step_s_min": min(intervals["variant"]),
              "compiles_warmup": own(warm), "compiles_timed": own(timed), "intervals": intervals}
    if "eager" in intervals:
        result["eager_step_s_median"] = statistics.median(intervals["eager"])
        result["eager_step_s_min"] = min(intervals["eager"])
        result["vs_eager"] = result["eager_step_s_median"] / result["step_s_median"]
    else:
        result["eager_step_s_median"], result["vs_eager"] = result["step_s_median"], 1.0
    _say(f"steady {row['label']}: {result['step_s_median']:.4f} s per step (eager "
         f"{result['eager_step_s_median']:.4f} s), compiles warm-up {result['compiles_warmup']}, timed "
         f"{result['compiles_timed']}")
    return result


def main(argv: List[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    try:
        result = run(job)
    except Exception:  # the parent records it and goes on with the next configuration
        result = {"error": traceback.format_exc()[-4000:]}
    Path(argv[1]).write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
