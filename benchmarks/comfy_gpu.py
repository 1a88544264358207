"""ComfyUI on a GPU: the pack loaded as ComfyUI loads it, the real SD1.5 UNet and Flux (full
width) in ComfyUI's own classes with random weights, sampled through `comfy.sample` with and without the Model
Speedup node; then the same under ComfyUI's partial loading (a reserved VRAM size that leaves room for about half
the model's weights: the rest stay in CPU memory and move in per call).

Run in ComfyUI's Python (COMFYUI_PATH set), one process:

    python -m benchmarks.comfy_gpu --out DIR [--device cuda|cpu] [--models sd15,flux] [--tiny]

Writes DIR/comfy_gpu.json, a row per model and mode (full, partial): eager's and ours' per-step milliseconds (the
median of a second, timed sample), the first sample's seconds with the compile, the largest difference of the
final latent from eager's (and its scale), compiles, loads and fallbacks with their reasons, graph and eager calls,
and under partial loading the layers ComfyUI left in CPU memory. SD1.5's whole row also has `cuda_graphs`: the
same sampled through the node with CUDA graph replays on. `--tiny` (the tests' tiny configs) and
`--device cpu` rehearse it on a CPU, where ComfyUI never loads a model partly (that row says so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .comfy.pack import comfy_with_pack
from . import gpu_memory, step_profile

REPOSITORY = Path(__file__).resolve().parents[1]
BLOCKING_BUILD = "before the first image"  # the node's build choice that compiles before the first image
# (width, height, batch, text tokens, the node's minimum and maximum resolution) per model: the sizes in
# ranges a user sets; --tiny: small ones, SD1.5's a fixed size (minimum = maximum: a Dim torch.export refuses,
# alignment.spatial_multiples)
SIZES = {"sd15": (512, 512, 2, 77, 256, 1024), "flux": (1024, 1024, 1, 256, 512, 1024)}
TINY_SIZES = {"sd15": (64, 64, 2, 77, 64, 64), "flux": (128, 128, 1, 32, 64, 256)}
DTYPES = {"sd15": "float16", "flux": "bfloat16"}
PARTIAL_SHARE = 0.5  # the share of the model's weights the reserved VRAM leaves room for
WHOLE_MODELS = ("sd15",)  # served by one whole-model graph, so CUDA graph replays apply (blocks have none)


class _StepTimer:
    """KSampler's per-step callback: the wall time of each step (the device synchronised first)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.allocated_mb = cuda, [], []

    def __call__(self, step, x0, x, total) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.allocated_mb.append(gpu_memory.allocated_mb())  # memory that grows step after step is held
        self.marks.append(time.perf_counter())

    def step_ms(self) -> Optional[float]:
        gaps = [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return round(statistics.median(gaps), 2) if gaps else None


def _timed_sample(F, family, model, inputs: dict, steps: int, cuda: bool, steps_mb: Optional[list] = None):
    """(final latent, seconds, median step ms) of one sample like KSampler's; `steps_mb`, where given, gets the
    allocated memory after each step."""
    timer = _StepTimer(cuda)
    started = time.perf_counter()
    out = F.sample(family, inputs["positive"], inputs["negative"], inputs["latent"], steps=steps, seed=3,
                   model=model, callback=timer)
    if cuda:
        import torch

        torch.cuda.synchronize()
    if steps_mb is not None:
        steps_mb.extend(timer.allocated_mb)
    return out, round(time.perf_counter() - started, 3), timer.step_ms()


def _two_samples(F, family, model, inputs: dict, steps: int, cuda: bool, memory: dict, who: str,
                 history: bool = False):
    """A first sample (its compile, if any) and a timed second one, with what they held: the peak of the two
    (MB), the allocated memory after each step, what ComfyUI had loaded after the first, and with `history` the
    allocations live after the first by the line that made them (gpu_memory.py).

    The history covers the first sample only: recording it keeps a Python stack for every allocation, and a partly
    loaded model allocates for every weight it moves in. On an H200 (torch 2.11+cu130) ours' second sample timed under it
    against eager's without (SD1.5 partly loaded, ours running eager by design: 102.95 ms a step against 77.87)."""
    import torch

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    steps_mb: list = []
    recorder = gpu_memory.allocation_history() if history and cuda else contextlib.nullcontext({})
    with recorder as live:
        first, first_s, _ = _timed_sample(F, family, model, inputs, steps, cuda, steps_mb)
    memory["loaded_mb_after_first"][who] = round(model.loaded_size() / 2 ** 20)
    # weights ComfyUI left in CPU memory move in per call: pinned, asynchronously; else through pageable memory
    import comfy.model_management as mm

    memory.setdefault("pinned_mb_after_first", {})[who] = round(getattr(mm, "TOTAL_PINNED_MEMORY", 0) / 2 ** 20)
    out, _, ms = _timed_sample(F, family, model, inputs, steps, cuda, steps_mb)
    if cuda:
        memory["peak_mb"][who] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
        memory["allocated_mb_by_step"][who] = steps_mb
    if live:
        memory["live_after"] = {**memory.get("live_after", {}), who: live}
    return first, first_s, out, ms


def _served(name: str, nodes_unet, blocks, fast, diffusion_model) -> Dict[str, int]:
    """Calls served by graphs and eager so far: the UNet's CompiledForward, or the block engine's."""
    if name == "sd15":
        runner = nodes_unet.runner_of(fast)
        forward = runner.forward_for(diffusion_model) if runner is not None else None
        return {"graph_calls": getattr(forward, "graph_calls", 0), "eager_calls": getattr(forward, "eager_calls", 0)}
    engine = blocks.existing_engine(diffusion_model)
    return {"graph_calls": engine.graph_calls if engine else 0, "eager_calls": engine.eager_calls if engine else 0}


def _offloaded_layers(diffusion_model) -> int:
    """Layers whose weights ComfyUI left off the compute device (cast in per call)."""
    return sum(1 for m in diffusion_model.modules() if getattr(m, "comfy_cast_weights", False)
               and getattr(getattr(m, "weight", None), "device", None) is not None and m.weight.device.type == "cpu")


def _free_mb(mm) -> int:
    """ComfyUI's free memory on its compute device (MB): what a model's partial load is fitted to."""
    return round(mm.get_free_memory(mm.get_torch_device()) / 2 ** 20)


def _replayed(F, family, nodes: dict, registry, inputs: dict, steps: int, cuda: bool, want, eager_ms,
              node_inputs: dict) -> Dict[str, Any]:
    """The whole model sampled again through a second Model Speedup with CUDA graph replays on (its graph from
    this process's registry: no compile): the step time against eager's and ours' without replays, the difference
    from eager's final latent, the replays' captures and reasons (on an H200, torch 2.11+cu130: ComfyUI's SD1.5 step took
    25.25 ms of wall time for 15.33 ms of kernels, 929 launches; replays in the device check 11.73 ms against 13.02)."""
    import torch

    from compiler.store.registry import NOTE

    mark, counts = len(registry.events), dict(registry.log.counts)
    with torch.inference_mode():
        replaying = nodes["KeepFastModelSpeedup"].execute(model=family.patcher, **node_inputs,
                                                          cuda_graphs=True).args[0]
    memory = {"loaded_mb_after_first": {}, "peak_mb": {}, "allocated_mb_by_step": {}}
    _, first_s, got, ms = _two_samples(F, family, replaying, inputs, steps, cuda, memory, "ours_cg")
    events = registry.events[mark:]
    result = {"step_ms": ms, "first_sample_s": first_s, "speedup": round(eager_ms / ms, 3) if eager_ms and ms else None,
              "max_abs_diff": float((got.float() - want.float()).abs().max()), "finite": bool(torch.isfinite(got).all()),
              "events": {k: registry.log.counts.get(k, 0) - counts.get(k, 0) for k in
                         ("compile", "load", "fallback", "mismatch", NOTE)},
              "notes": [e.reason[:400] for e in events if e.kind in (NOTE, "fallback", "mismatch")][:8],
              "replays": {g.key.id: g.replay_state() for g in registry.graphs() if hasattr(g, "replay_state")},
              "peak_mb": memory["peak_mb"].get("ours_cg")}
    if cuda:
        result["step_profile"] = step_profile.profile(
            lambda: F.sample(family, inputs["positive"], inputs["negative"], inputs["latent"], steps=steps, seed=3,
                             model=replaying), steps, cuda)
    return result


def run_model(name: str, package: str, nodes: dict, device: str, tiny: bool, steps: int) -> List[Dict[str, Any]]:
    """The model sampled eager and through the node, whole on the device, then partly loaded."""
    import torch

    import comfy.model_management as mm

    from .comfy import families as F

    runtime = sys.modules[package + ".nodes.runtime"]
    nodes_unet = sys.modules[package + ".nodes.unet"]
    blocks = sys.modules[package + ".nodes.blocks"]
    registry = runtime.registry()
    cuda = device.startswith("cuda")
    dtype = getattr(torch, DTYPES[name]) if cuda else torch.float32
    started = time.perf_counter()
    family = F.build(name, seed=0, dtype=dtype, real=not tiny)
    width, height, batch, tokens, low, high = (TINY_SIZES if tiny else SIZES)[name]
    inputs = {"positive": family.conditioning(tokens, seed=1), "negative": family.conditioning(tokens, seed=2),
              "latent": family.latent(width, height, batch=batch)}
    built_s = round(time.perf_counter() - started, 1)
    diffusion_model = family.patcher.model.diffusion_model
    weights_mb = sum(p.numel() * p.element_size() for p in diffusion_model.parameters()) / 2 ** 20
    node_inputs = dict(min_resolution=low, max_resolution=high, max_batch_size=batch, compile=True,
                       save_compiled=False, backend="aot", build=BLOCKING_BUILD)
    with torch.inference_mode():
        fast = nodes["KeepFastModelSpeedup"].execute(model=family.patcher, **node_inputs).args[0]
    rows, reserved = [], mm.EXTRA_RESERVED_VRAM
    for mode in ("full", "partial"):
        row: Dict[str, Any] = {"model": name, "mode": mode, "device": device, "dtype": str(dtype),
                               "size": [width, height, batch, tokens], "range": [low, high], "steps": steps, "built_s": built_s,
                               "weights_mb": round(weights_mb)}
        if mode == "partial":
            if not cuda:
                row["skipped"] = "ComfyUI loads a model partly on a GPU only (on a CPU its VRAM state is DISABLED)"
                rows.append(row)
                break
            mm.unload_all_models()
            # ComfyUI loads what fits in the free memory less its inference reserve (which this raises): the share
            # it loaded is read back below (loaded_share)
            free = mm.get_free_memory(mm.get_torch_device())
            mm.EXTRA_RESERVED_VRAM = max(0, int(free - weights_mb * 2 ** 20 * PARTIAL_SHARE
                                                - mm.minimum_inference_memory()))
            row["reserved_vram_mb"] = round(mm.EXTRA_RESERVED_VRAM / 2 ** 20)
        mark, counts = len(registry.events), dict(registry.log.counts)
        # What ComfyUI saw before each one's samples (free memory: what its partial load fits in) and what it
        # loaded: both must be loaded alike for their step times to compare. Each one's own peak, and under partial
        # loading what ours left allocated (on an H200: a peak of 11396 MB for both together, and none
        # of the model loaded for ours by the end).
        memory = {"free_mb_before": {}, "loaded_mb": {}, "loaded_mb_after_first": {}, "peak_mb": {},
                  "allocated_mb_by_step": {}}
        memory["free_mb_before"]["eager"] = _free_mb(mm)
        eager_first, eager_first_s, want, eager_ms = _two_samples(F, family, family.patcher, inputs, steps, cuda,
                                                                   memory, "eager")
        row["eager_offloaded_layers"] = _offloaded_layers(diffusion_model)
        memory["loaded_mb"]["eager"] = round(family.patcher.loaded_size() / 2 ** 20)
        served = _served(name, nodes_unet, blocks, fast, diffusion_model)
        if mode == "partial":
            # Loaded afresh, as eager was: a clone taking over from another's partial load is given the free
            # memory less what the other loaded, and counted that again (comfy/model_management.py
            # load_models_gpu; on an H200, 26 layers were left out for ours against eager's 15 without it)
            mm.unload_all_models()
        memory["free_mb_before"]["ours"] = _free_mb(mm)
        got_first, first_s, got, ours_ms = _two_samples(F, family, fast, inputs, steps, cuda, memory, "ours",
                                                        history=mode == "partial")
        row["ours_offloaded_layers"] = _offloaded_layers(diffusion_model)
        memory["loaded_mb"]["ours"] = round(fast.loaded_size() / 2 ** 20)
        memory["loaded_models"] = [type(m.model.model).__name__ if hasattr(m.model, "model") else str(m)
                                   for m in mm.current_loaded_models]
        row["memory"] = memory
        row["loaded_share"] = round(fast.loaded_size() / max(1, fast.model_size()), 3)
        after = _served(name, nodes_unet, blocks, fast, diffusion_model)
        events = registry.events[mark:]
        row.update(
            eager_first_sample_s=eager_first_s, eager_step_ms=eager_ms, ours_first_sample_s=first_s,
            ours_step_ms=ours_ms, speedup=round(eager_ms / ours_ms, 3) if eager_ms and ours_ms else None,
            max_abs_diff=float((got.float() - want.float()).abs().max()),
            first_max_abs_diff=float((got_first.float() - eager_first.float()).abs().max()),
            scale=float(want.float().abs().max()), finite=bool(torch.isfinite(got).all()),
            events={k: registry.log.counts.get(k, 0) - counts.get(k, 0) for k in
                    ("compile", "load", "fallback", "refused", "mismatch")},
            reasons=[f"{e.kind}: {e.reason}"[:400] for e in events if e.kind in ("compile", "fallback", "refused",
                                                                                    "mismatch")][:12],
            graph_calls=after["graph_calls"] - served["graph_calls"],
            eager_calls=after["eager_calls"] - served["eager_calls"])
        # where each compile's time went, as the device check reports its builds (phases.py, build_profile.py)
        row["compile_phases"] = [{**(e.detail.get("phase_s") or {}), "main_thread": e.detail.get("main_thread", [])}
                                 for e in events if e.kind == "compile"]
        if cuda and mode == "full":
            # where each one's step time goes: the kernels' time against the wall time, a profiled sample each
            # (step_profile.py; on an H200: Flux's blocks 0.94x eager here, 1.26x in the device check)
            row["step_profile"] = {
                who: step_profile.profile(lambda m=m: F.sample(family, inputs["positive"], inputs["negative"],
                                                               inputs["latent"], steps=steps, seed=3, model=m),
                                          steps, cuda)
                for who, m in (("ours", fast), ("eager", family.patcher))}
        if mode == "full" and name in WHOLE_MODELS:
            row["cuda_graphs"] = _replayed(F, family, nodes, registry, inputs, steps, cuda, want, eager_ms,
                                           node_inputs)
        if mode == "partial":
            # eager again, after ours and loaded afresh: whether eager's own step time depends on what ran before
            # (on an H200: SD1.5's ours ran eager, by design, at 127.97 ms a step against eager's 69.73)
            mm.unload_all_models()
            _, _, _, row["eager_again_step_ms"] = _two_samples(F, family, family.patcher, inputs, steps, cuda,
                                                               memory, "eager_again")
        if cuda:
            row["peak_gpu_mb"] = max(memory["peak_mb"].values())
        rows.append(row)
        print(json.dumps(row), flush=True)
    mm.EXTRA_RESERVED_VRAM = reserved
    mm.unload_all_models()
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.comfy_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="sd15,flux")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny configs (a CPU rehearsal)")
    options = parser.parse_args(argv)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    base = tempfile.mkdtemp(prefix="keepfast-comfy-gpu-")
    package, nodes = comfy_with_pack(str(REPOSITORY), base, gpu=options.device != "cpu")
    report: Dict[str, Any] = {"device": options.device, "tiny": options.tiny, "rows": []}
    for name in [m for m in options.models.split(",") if m]:
        try:
            report["rows"] += run_model(name, package, nodes, options.device, options.tiny, options.steps)
        except Exception as error:  # noqa: BLE001 - the next model still runs; the report says what failed
            import traceback

            report["rows"].append({"model": name, "error": f"{type(error).__name__}: {error}"[:1500],
                                   "stack": traceback.format_exc()[-3000:]})
        (out / "comfy_gpu.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
