"""One model family through the nodes in ComfyUI's own Python; run by test_comfyui_families.py.

    python kf_families.py PACK_DIR BASE_DIR FAMILY first|restart [float32|bfloat16|float16]

`first` (an empty graphs folder): Model Speedup, then Save Graph before any
image (block graphs compiled from the model's own layers), then a sweep of
resolutions, batch sizes, prompt lengths (and frame counts for video) sampled
through comfy.sample, each against the same model without the node; then
LoRA-style weight patches at two strengths and off; then one block whose
weights ComfyUI patches on the fly. `restart` (a new process, the graphs
folder `first` wrote, other weights): Load Graph, then two samples. Prints
one JSON object of findings after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import gc
import json
import os
import sys

from kf_inprocess import BLOCKING_BUILD, comfy_with_pack  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
             backend="aot", max_frames=17, build=BLOCKING_BUILD)
# (width, height, batch, text tokens, video frames): three resolutions, batch 1 and 2, prompt lengths on both
# sides of 32 (Z-Image pads text to a multiple of 32), two
# frame counts, and a size whose latent is no multiple of 4 (HunyuanVideo takes multiples of 16 pixels only).
SWEEP = [(128, 128, 1, 7, 5), (192, 128, 2, 20, 9), (128, 256, 1, 40, 9), (208, 144, 2, 7, 5)]
RESTART_SWEEP = [(160, 160, 1, 11, 5), (128, 192, 2, 45, 9)]


def main(pack: str, base: str, family_name: str, phase: str, dtype: str = "float32") -> dict:
    name, nodes = comfy_with_pack(pack, base)
    import comfy.utils
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    runtime = sys.modules[name + ".nodes.runtime"]
    blocks = sys.modules[name + ".nodes.blocks"]
    from benchmarks.comfy import families as F

    registry = runtime.registry()
    family = F.build(family_name, seed=0 if phase == "first" else 5, dtype=getattr(torch, dtype))
    out = {"family": family_name, "phase": phase, "dtype": dtype}

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "refused")}

    def delta(before: dict) -> dict:
        now = counts()
        return {k: now[k] - before[k] for k in now}

    def sample(model, width, height, batch, text, frames, seed=3):
        latent = family.latent(width, height, batch=batch, frames=frames)
        positive, negative = family.conditioning(text, seed=1), family.conditioning(text, seed=2)
        return F.sample(family, positive, negative, latent, seed=seed, model=model)

    def compare(model, reference_model, sweep) -> list:
        rows = []
        for width, height, batch, text, frames in sweep:
            before = counts()
            got = sample(model, width, height, batch, text, frames)
            want = sample(reference_model, width, height, batch, text, frames)
            rows.append({"call": [width, height, batch, text, frames], "diff": difference(got, want),
                         "scale": max(float(t.abs().max()) for t in parts(want)),
                         "finite": all(bool(torch.isfinite(t).all()) for t in parts(got)), "events": delta(before)})
        return rows

    def parts(latent) -> list:
        """A latent's tensors: one, or LTX-2's video and audio (ComfyUI's NestedTensor)."""
        return list(latent.unbind()) if getattr(latent, "is_nested", False) else [latent]

    def difference(got, want) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(parts(got), parts(want)))

    def fallbacks_since(mark: int) -> list:
        return [e.reason for e in registry.events[mark:] if e.kind == "fallback"]

    if phase == "first":
        fast = nodes["KeepFastModelSpeedup"].execute(model=family.patcher, **RANGE).args[0]
        engine = blocks.existing_engine(family.patcher.get_model_object("diffusion_model"))
        out["engine"] = engine is not None
        if engine is None:
            return out
        out["structures"] = [[g.class_name, len(g.instances)] for g in engine.groups]
        before = counts()
        saved = nodes["KeepFastSaveGraph"].execute(name=family_name, model=fast).args
        out["save_report"] = saved[2]
        out["save_events"] = delta(before)
        out["files"] = sorted(os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base)
                              for f in fs if f.endswith(".json") and "graphs" in d)
        out["report"] = engine.report()
        mark = len(registry.events)
        out["sweep"] = compare(fast, family.patcher, SWEEP)
        out["sweep_fallbacks"] = fallbacks_since(mark)
        out["block_calls"] = [engine.graph_calls, engine.eager_calls]

        # LoRA-style patches on every block's first Linear weight: applied by ComfyUI when it loads the model; the
        # graphs bind the patched weights, at any strength, with no compile.
        keys = [f"diffusion_model.{path}.{next(n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear))}"
                ".weight" for group in engine.groups for path, module in group.instances]
        generator = torch.Generator().manual_seed(11)
        state = family.patcher.model_state_dict()
        patches = {k: (0.2 * torch.randn(state[k].shape, generator=generator),) for k in keys}
        lora, bound_patched = [], []
        plain = sample(fast, *SWEEP[0])
        for strength in (1.0, 0.5):
            patched_fast, patched_ref = fast.clone(), family.patcher.clone()
            patched_fast.add_patches({k: ("diff", v) for k, v in patches.items()}, strength)
            patched_ref.add_patches({k: ("diff", v) for k, v in patches.items()}, strength)
            before = counts()
            got = sample(patched_fast, *SWEEP[0])
            # the patched weights the graphs were bound to: freed once ComfyUI unpatches (torch's user-managed
            # constants kept them for good; compiler/backends/borrowed_weights.py)
            bound_patched.extend(StorageWeakRef(comfy.utils.get_attr(fast.model, k).untyped_storage()) for k in keys)
            want = sample(patched_ref, *SWEEP[0])
            lora.append({"strength": strength, "diff": difference(got, want), "changed": difference(got, plain),
                         "events": delta(before)})
        before = counts()
        off = sample(fast, *SWEEP[0])
        lora.append({"strength": 0.0, "diff": difference(off, plain), "changed": 0.0,
                     "events": delta(before)})
        out["lora"] = lora
        out["lora_patched_keys"] = len(keys)
        gc.collect()
        out["lora_patched_bound"] = len(bound_patched)
        out["lora_patched_kept"] = sum(1 for ref in bound_patched if not ref.expired())

        # One block whose weights ComfyUI patches per call (low-VRAM mode): that block eager, the rest compiled.
        path, module = engine.groups[-1].instances[0]
        linear = next(m for m in module.modules() if hasattr(m, "weight_function"))
        linear.weight_function = [lambda weight, **kwargs: weight * 1.05]
        try:
            mark = len(registry.events)
            calls = (engine.graph_calls, engine.eager_calls)
            rows = compare(fast, family.patcher, SWEEP[:1])
            out["on_the_fly"] = {"rows": rows, "fallbacks": fallbacks_since(mark), "block": path,
                                 "graph_calls": engine.graph_calls - calls[0],
                                 "eager_calls": engine.eager_calls - calls[1]}
        finally:
            linear.weight_function = []
    else:
        before = counts()
        loaded = nodes["KeepFastLoadGraph"].execute(graph="(every stored graph that fits)", compile_if_missing=False,
                                                    trust_graph=False, model=family.patcher).args
        out["load_report"] = loaded[2]
        out["load_events"] = delta(before)
        mark = len(registry.events)
        out["sweep"] = compare(loaded[0], family.patcher, RESTART_SWEEP)
        out["sweep_fallbacks"] = fallbacks_since(mark)
    out["counts"] = counts()
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:6])
    print("KEEPFAST-RESULT " + json.dumps(result))
