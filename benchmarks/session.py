"""The bench's session figures: what a user waits for, from process start, over a session of images.

Per model (sd15, sdxl, flux, wan) and variant -- eager, whole-model
torch.compile, torch.compile of the repeated blocks (transformers), ours with
the build before the first image (`ours_blocking`) and ours building in the
background (`ours_background`) -- one process runs `IMAGES` images of
`STEPS` model calls each, over the sweep's sizes and batches in order:

- `first_image_s`: process start to the first image's last step (imports,
  model build, compiles the first image waits for);
- `session_s`: process start to the last image;
- `compiles_in_session`: graphs compiled (Dynamo's unique graphs; ours: the
  registry's compiles, background builds landed in the session included).

Then a second process, the restart, runs the same session again: ours from the
graphs the first saved (ours_background waits for its builds after its last
image, outside the timed session, and saves them), torch.compile with its
Inductor cache warm: `restart_session_s`, `restart_compiles`.

Each job runs in its own process (runner.run_job); nothing here is timed in a test.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional

IMAGES = 20
STEPS = 4
SESSION_MODELS = ("sd15", "sdxl", "flux", "wan")
SESSION_VARIANTS = ("eager", "torch_compile", "torch_compile_blocks", "ours_blocking", "ours_background")
PEERS = ("torch_compile", "torch_compile_blocks")
PREFIX = "session:"


def variants_for(model_kind: str) -> List[str]:
    """torch.compile of the repeated blocks is diffusers' for transformers only."""
    return [v for v in SESSION_VARIANTS if model_kind == "transformer" or v != "torch_compile_blocks"]


def job_name(variant: str, restart: bool = False) -> str:
    return PREFIX + variant + (":restart" if restart else "")


# -- in the worker process ------------------------------------------------------------

def run_session(job: Dict[str, Any]) -> Dict[str, Any]:
    """One session (or its restart) of one variant; returns the figures (wall-clock stamps for the parent)."""
    import torch

    from .models import any_spec, dtype_from_flag

    variant, restart = job["session_variant"], bool(job.get("restart"))
    device = job.get("device", "cpu")
    dtype = dtype_from_flag(job.get("dtype", "fp32"))
    spec = any_spec(job["model"], job["profile"], device)
    images, steps = int(job.get("images", IMAGES)), int(job.get("steps", STEPS))
    module = spec.build(seed=0).to(device=device, dtype=dtype)
    sweep = spec.sweep()
    shapes = [sweep[i % len(sweep)] for i in range(images)]
    if spec.kind == "transformer":
        inputs = {shape: spec.inputs(shape, device, dtype, model=module) for shape in set(shapes)}
    else:
        inputs = {shape: spec.inputs(shape, device, dtype) for shape in set(shapes)}
    fn, count, after = _variant(variant, restart, module, spec, job)
    result: Dict[str, Any] = {"model": spec.name, "variant": job["variant"], "session_variant": variant,
                              "restart": restart, "images": images, "steps": steps, "image_s": [],
                              "torch": torch.__version__}
    for index, shape in enumerate(shapes):
        args, kwargs = inputs[shape]
        started = time.perf_counter()
        with torch.no_grad():
            for _ in range(steps):
                fn(*args, **kwargs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        result["image_s"].append(round(time.perf_counter() - started, 4))
        if index == 0:
            result["first_image_at"] = time.time()
    result["last_image_at"] = time.time()
    result["compiles_in_session"] = count()
    result.update(after())
    return result


def _variant(variant: str, restart: bool, module, spec, job) -> tuple:
    """(the callable, compiles so far, what runs after the timed session -> extra figures)."""
    import torch

    nothing: Callable[[], dict] = dict
    if variant == "eager":
        return module, lambda: 0, nothing
    if variant in PEERS:
        from torch._dynamo.utils import counters

        if variant == "torch_compile":
            fn = torch.compile(module)  # as ComfyUI's TorchCompileModel
        else:
            spec.compile_repeated_blocks(module)  # diffusers' compile_repeated_blocks()
            fn = module
        return fn, lambda: int(counters["stats"]["unique_graphs"]), nothing
    from compiler.store.registry import GraphRegistry
    from compiler.store.graph_store import GraphStore

    registry = GraphRegistry()
    store = GraphStore(job["graphs_dir"])
    background = variant == "ours_background" and not restart
    if spec.kind == "transformer":
        from compiler.blocks import BlockOptions, compile_blocks

        owner = compile_blocks(module, BlockOptions(shape_range=spec.shape_range(), label=spec.name, store=store,
                                                    autosave=not restart, background=background), registry)
        save = lambda: owner.save(store)  # noqa: E731
    else:
        from compiler.serving.compiled_forward import CompileOptions
        from compiler.diffusers_api import compile_module

        owner = compile_module(module, CompileOptions(shape_range=spec.shape_range(), label=spec.name, store=store,
                                                      autosave=not restart, background=background), registry)
        save = lambda: None  # noqa: E731 - autosave writes each graph as it lands

    def after() -> dict:
        out = {"loads": len(registry.loads)}
        if background:
            started = time.perf_counter()
            pending = owner.builds_pending
            owner.wait_for_builds()
            save()
            peaks = [(e.detail or {}).get("peak_rss_mb") for e in registry.compiles]
            compilers = [(e.detail or {}).get("compiler_peak_rss_mb") for e in registry.compiles]
            out.update(builds_pending_at_last_image=pending,
                       builds_after_session_s=round(time.perf_counter() - started, 2),
                       compiles_after_session=len(registry.compiles),
                       build_peak_rss_mb=max([p for p in peaks if p] or [None], key=lambda v: v or 0),
                       build_compiler_peak_rss_mb=max([p for p in compilers if p] or [None], key=lambda v: v or 0))
        return out

    return module, lambda: len(registry.compiles), after


# -- in the parent ----------------------------------------------------------------------

def session_jobs(model: str, kind: str, variants=SESSION_VARIANTS) -> List[Dict[str, Any]]:
    """The jobs of one model, in order (each restart right after its session); `variants`: those asked for."""
    jobs = []
    for variant in (v for v in variants_for(kind) if v in variants):
        for restart in (False, True):
            if variant == "eager" and restart:
                continue  # nothing to restart from
            jobs.append({"model": model, "variant": job_name(variant, restart), "kind": "session",
                         "session_variant": variant, "restart": restart})
    return jobs


def line(result: Dict[str, Any]) -> str:
    """One printed line per session job."""
    head = f"  {result.get('model')}/{result.get('variant')}: "
    if "error" in result:
        return head + "FAILED: " + str(result["error"]).splitlines()[0][:200]
    extra = (f"; builds pending at the last image {result['builds_pending_at_last_image']}, done "
             f"{result['builds_after_session_s']:.1f} s later; build process peak "
             f"{result.get('build_peak_rss_mb')} MB, its compilers' {result.get('build_compiler_peak_rss_mb')} MB"
             if "builds_after_session_s" in result else "")
    return (head + f"first image {result.get('first_image_s', 0):.1f} s, session {result.get('session_s', 0):.1f} s "
            f"from process start, {result.get('compiles_in_session')} compiles, {result.get('loads', 0)} loads"
            + extra)


def _seconds(job: Optional[dict], key: str) -> Optional[float]:
    if not job or "error" in job or "skipped" in job:
        return None
    return job.get(key)


def summarise(jobs: List[dict]) -> Dict[str, Dict[str, Any]]:
    """Per model: each variant's figures, and the two ratios bench.json names."""
    by_model: Dict[str, Dict[str, dict]] = {}
    for job in jobs:
        by_model.setdefault(job["model"], {})[job["variant"]] = job
    out: Dict[str, Dict[str, Any]] = {}
    for model, runs in by_model.items():
        rows = {}
        for variant in SESSION_VARIANTS:
            cold, warm = runs.get(job_name(variant)), runs.get(job_name(variant, True))
            if cold is None:
                continue
            rows[variant] = {
                "first_image_s": _round(_seconds(cold, "first_image_s")),
                "session_s": _round(_seconds(cold, "session_s")),
                "compiles_in_session": _seconds(cold, "compiles_in_session"),
                "restart_session_s": _round(_seconds(warm, "session_s")),
                "restart_compiles": _seconds(warm, "compiles_in_session"),
                "builds_after_session_s": _seconds(cold, "builds_after_session_s"),
                "error": (cold.get("error") or (warm or {}).get("error") or "")[:300] or None,
            }
        entry: Dict[str, Any] = {"variants": rows}
        eager = (rows.get("eager") or {}).get("first_image_s")
        ours = rows.get("ours_background") or {}
        peers = [rows[p]["session_s"] for p in PEERS if p in rows and rows[p]["session_s"]]
        entry["first_image_vs_eager_ratio"] = _round(ours.get("first_image_s") / eager) \
            if ours.get("first_image_s") and eager else None
        entry["session_ratio_vs_best_peer"] = _round(ours.get("session_s") / min(peers)) \
            if ours.get("session_s") and peers else None
        out[model] = entry
    return out


def _round(value, digits: int = 3):
    return None if value is None else round(float(value), digits)


def markdown(sessions: Dict[str, Dict[str, Any]]) -> List[str]:
    if not sessions:
        return []
    lines = ["", f"## Sessions: {IMAGES} images of {STEPS} steps from process start (python -m compiler bench)", "",
             "| model | variant | first image s | session s | compiles | restart session s | restart compiles |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model, entry in sessions.items():
        for variant, row in entry["variants"].items():
            if row["error"]:
                lines.append(f"| {model} | {variant} | failed: {row['error'][:80]} | | | | |")
                continue
            lines.append("| {} | {} | {} | {} | {} | {} | {} |".format(
                model, variant, _cell(row["first_image_s"]), _cell(row["session_s"]), _cell(row["compiles_in_session"]),
                _cell(row["restart_session_s"]), _cell(row["restart_compiles"])))
        lines.append(f"| {model} | **ratios** | first image ours background / eager: "
                     f"{_cell(entry['first_image_vs_eager_ratio'])} | session ours background / best torch.compile: "
                     f"{_cell(entry['session_ratio_vs_best_peer'])} | | | |")
    return lines


def _cell(value) -> str:
    return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))
