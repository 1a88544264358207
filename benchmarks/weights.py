"""`bench --models flux --weights gguf-q8,gguf-q4,fp8`: quantised Flux in ComfyUI, eager vs TorchCompileModel vs ours.

Quantised checkpoints are what most ComfyUI users run (GGUF through
ComfyUI-GGUF, fp8-scaled checkpoints through ComfyUI itself), and their
weights are not plain tensors: whether a compiler keeps them compiled, and
how fast a step is afterwards, has to be measured on those weights, not on a
float model. So this part loads a tiny Flux built with ComfyUI's own classes
(benchmarks/comfy/quantised.py) with each kind of weights and runs it,
in ComfyUI's own Python, three ways: `eager` (no node), `torch_compile`
(ComfyUI's TorchCompileModel node, inductor) and `ours`
(KeepFastModelSpeedup, block graphs, compiling before the first image).

Each (weights, variant) runs in its own process (weights_worker.py) with an
empty Inductor cache: a first image, then a sweep of sizes, batches and prompt
lengths that turns a LoRA on at strength 1.0, then 0.5, then off (compiles
counted after the first image), then the steady step time (the median time
between KSampler's step callbacks, alternating with the eager model in the
same process so machine load cancels out of the ratio). Every output of the
sweep is compared with the eager process's output for the same call.

A weights kind is skipped, with the reason printed and kept in bench.json,
when what it needs is missing: ComfyUI (COMFYUI_PATH), ComfyUI-GGUF
(KEEPFAST_GGUF_PATH) or its `gguf` package in ComfyUI's Python.
This module runs in the bench's Python and imports neither torch nor ComfyUI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from compiler.settings import GGUF_PATH, TRUST_FILE, gguf_path
from .comfy_e2e import comfyui_python

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "weights_worker.py"
WEIGHTS = ("gguf-q8", "gguf-q4", "fp8")
VARIANTS = ("eager", "torch_compile", "ours")
# What each weights kind is stored as (comfy_quantised's names: GGML types, or the fp8-scaled layout).
QTYPES = {"gguf-q8": "Q8_0", "gguf-q4": "Q4_K", "fp8": "fp8_scaled"}
WEIGHT_LABELS = {"gguf-q8": "GGUF Q8_0 (ComfyUI-GGUF)", "gguf-q4": "GGUF Q4_K (ComfyUI-GGUF)",
                 "fp8": "fp8 scaled (ComfyUI's mixed-precision ops)"}
VARIANT_LABELS = {"eager": "eager (no node)", "torch_compile": "TorchCompileModel (inductor)",
                  "ours": "KeepFastModelSpeedup (block graphs)"}
GGUF_ENV = GGUF_PATH.name
MODEL = "flux"  # the only model this part runs (comfy_quantised's 256-wide tiny Flux)


def _row(width: int, height: int, batch: int, text: int, lora: Optional[float] = None, label: str = "") -> dict:
    return {"width": width, "height": height, "batch": batch, "text": text, "lora": lora,
            "label": label or f"{width}x{height} b{batch} t{text}" + ("" if lora is None else f" LoRA {lora:g}")}


def settings(quick: bool) -> Dict[str, Any]:
    """The calls each process makes. --quick: smaller sizes and fewer timed steps, the same model and LoRA path.

    The sweep changes size, batch and prompt length first, then runs a LoRA at 1.0 (two sizes), at 0.5 (the
    same two) and off: what a user changing LoRA strength between images does. Its first row is the first
    image (the compile for the compiled variants), not counted in the sweep's compiles.
    """
    if quick:
        sizes = [(128, 128, 1, 7), (192, 128, 2, 20), (128, 256, 1, 40), (256, 256, 2, 20)]
        steady, steps, steady_steps, reps = (256, 256, 1, 20), 2, 4, 5
    else:
        sizes = [(256, 256, 1, 7), (384, 256, 2, 20), (256, 512, 1, 40), (512, 512, 2, 77)]
        steady, steps, steady_steps, reps = (512, 512, 1, 77), 4, 6, 9
    rows = [_row(*size) for size in sizes]
    first, second = sizes[0], sizes[1]
    for strength in (1.0, 0.5):
        rows += [_row(*first, lora=strength), _row(*second, lora=strength)]
    rows.append(_row(*first, label=f"{first[0]}x{first[1]} b{first[2]} t{first[3]} LoRA off"))
    sides = [v for row in rows + [_row(*steady)] for v in (row["width"], row["height"])]
    batches = [row["batch"] for row in rows + [_row(*steady)]]
    return {"rows": rows, "steps": steps, "steady": _row(*steady), "steady_steps": steady_steps, "reps": reps,
            "cfg": 2.0,
            "speedup": {"min_resolution": min(sides), "max_resolution": max(sides), "max_batch_size": max(batches),
                        "compile": True, "save_compiled": False, "backend": "aot",
                        "build": "before the first image"}}


def skip_reason(weights: str, env: Dict[str, str]) -> Optional[str]:
    """Why this weights kind cannot run here (None: it can); checked before any process starts."""
    root = env.get("COMFYUI_PATH", "")
    if not root:
        return "COMFYUI_PATH is not set (the weights variants run in ComfyUI's own Python, with its classes)"
    if not (Path(root) / "main.py").is_file():
        return f"COMFYUI_PATH={root} has no main.py"
    if weights.startswith("gguf"):
        path = gguf_path(env)
        if not path:
            return f"{GGUF_ENV} is not set (point it at a ComfyUI-GGUF checkout, github.com/city96/ComfyUI-GGUF)"
        if not (Path(path) / "nodes.py").is_file():
            return f"{GGUF_ENV}={path} is no ComfyUI-GGUF checkout (no nodes.py)"
    return None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_job(job: Dict[str, Any], work: Path, python: str, env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """One (weights, variant) in a fresh ComfyUI-Python process with its own empty Inductor cache."""
    tag = f"weights-{job['weights']}-{job['variant']}"
    job_path, result_path, log_path = work / f"{tag}.job.json", work / f"{tag}.result.json", work / f"{tag}.log"
    cache = work / f"{tag}-inductor-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    started = time.time()
    with open(log_path, "w") as log:
        try:
            code: Optional[int] = subprocess.run(
                [python, str(WORKER), str(job_path), str(result_path)], cwd=env["COMFYUI_PATH"], stdout=log,
                stderr=subprocess.STDOUT, timeout=timeout,
                env={**env, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            code = None
    result: Dict[str, Any] = json.loads(result_path.read_text()) if result_path.exists() else {}
    if code is None:
        result["error"] = f"timed out after {timeout:.0f} s: {_tail(log_path)}"
    elif not result:
        result["error"] = f"exited with {code}: {_tail(log_path)}"
    result.update(weights=job["weights"], variant=job["variant"], process_wall_s=round(time.time() - started, 2),
                  log=str(log_path))
    return result


def line(result: Dict[str, Any]) -> str:
    """One progress line per process for the console."""
    head = f"  {MODEL}/{result.get('weights')}/{result.get('variant')}: "
    if "skipped" in result:
        return head + "skipped: " + result["skipped"]
    if "error" in result:
        return head + "FAILED: " + str(result["error"]).strip().splitlines()[-1][:300]
    steady = result.get("steady") or {}
    return head + (f"first image {result.get('first_image_s', 0):.1f} s ({result.get('compiles_first_image')} "
                   f"compiles), {result.get('compiles_after_first_image')} compiles after it, step "
                   f"{steady.get('step_s_median') or 0:.4f} s (eager in the same process "
                   f"{steady.get('eager_step_s_median') or 0:.4f} s), max |diff| vs eager "
                   f"{result.get('max_abs_diff_vs_eager')}, process {result.get('process_wall_s', 0):.0f} s")


def run_weights(work: Path, weights: Sequence[str], quick: bool = False, variants: Sequence[str] = VARIANTS,
                timeout: float = 1800.0, env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run every asked weights kind and variant; returns bench.json's raw `weights` part (summarised by
    weights_report.summarise). The eager process runs first: the others compare their outputs with its."""
    env = dict(os.environ if env is None else env)
    config = settings(quick)
    out: Dict[str, Any] = {"model": MODEL, "profile": "quick" if quick else "full", "config": config,
                           "variants": list(variants), "results": {}}
    root = env.get("COMFYUI_PATH", "")
    python = comfyui_python(Path(root)) if root else None
    out["python"] = python
    order = [v for v in VARIANTS if v in variants]
    if order and order[0] != "eager":
        order = ["eager"] + order  # the reference for the outputs; it is cheap
    work.mkdir(parents=True, exist_ok=True)
    for kind in weights:
        why = skip_reason(kind, env)
        if why:
            print(f"  {MODEL}/{kind}: skipped: {why}", flush=True)
            out["results"][kind] = {"skipped": why}
            continue
        folder = work / f"weights-{kind}"
        (folder / "models" / "graphs").mkdir(parents=True, exist_ok=True)
        results: Dict[str, Any] = {}
        for variant in order:
            job = {"weights": kind, "qtype": QTYPES[kind], "variant": variant, "config": config,
                   "pack": str(REPO), "base": str(folder), "gguf_path": gguf_path(env),
                   "model_file": str(folder / f"{MODEL}-{QTYPES[kind]}.gguf"),
                   "reference": str(folder / "eager-outputs.pt")}
            job_env = {**env, TRUST_FILE.name: str(folder / "trusted.json")}
            result = run_job(job, work, python, job_env, timeout)
            if variant not in variants:
                result["reference_only"] = True  # run for its outputs; not asked for
            results[variant] = result
            print(line(result), flush=True)
            if variant == "eager" and "skipped" in result:  # e.g. no `gguf` package: nothing else can load it
                break
        if "skipped" in results.get("eager", {}):
            out["results"][kind] = {"skipped": results["eager"]["skipped"]}
        else:
            out["results"][kind] = {"variants": results}
    return out


__all__ = ["WEIGHTS", "VARIANTS", "settings", "skip_reason", "run_weights", "line"]
