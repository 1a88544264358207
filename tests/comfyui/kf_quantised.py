"""A tiny model written as GGUF, loaded by ComfyUI-GGUF, through the nodes in ComfyUI's Python; run by
test_comfyui_quantised.py.

    python kf_quantised.py PACK_DIR BASE_DIR FAMILY QTYPE[:COMPUTE_DTYPE] first|restart|lowvram

`first` (an empty graphs folder): the model written as GGUF (QTYPE: Q8_0,
Q4_K) and loaded with ComfyUI-GGUF's loader, or (QTYPE fp8_scaled) as an
fp8-scaled checkpoint loaded as comfy.sd loads one (no GGUF); Model Speedup, then Save Graph
before any image; a sweep of resolutions, batch sizes and prompt lengths
sampled through comfy.sample against the same GGUF model without the node;
then a LoRA loaded by ComfyUI's LoraLoader path (`load_lora_for_models`: on a
GGUF model ComfyUI-GGUF hangs it on the quantised weights and applies it per
call) at two strengths and off; then a `set` patch, which is no weight delta
(those blocks eager, with the reason). `restart` (a new process, the graphs
folder `first` wrote, the same file): Load Graph, then a sweep. `lowvram`
(QTYPE float32): the unquantised model partly loaded by ComfyUI's own
partial unloading with a LoRA, see `low_vram`. Prints one JSON object of
findings after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import gc
import json
import os
import sys

from kf_inprocess import comfy_with_pack  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
             backend="aot", max_frames=17)
SWEEP = [(128, 128, 1, 7, 5), (192, 128, 2, 20, 9), (128, 256, 1, 40, 9)]
RESTART_SWEEP = [(160, 160, 1, 11, 5), (128, 192, 2, 45, 9)]
FP8_SCALED = "fp8_scaled"  # QTYPE for an fp8-scaled checkpoint (weights float8_e4m3fn, per-tensor scales)


def main(pack: str, base: str, family_name: str, qtype: str, phase: str) -> dict:
    name, nodes = comfy_with_pack(pack, base)
    import torch

    runtime = sys.modules[name + ".nodes.runtime"]
    blocks = sys.modules[name + ".nodes.blocks"]
    import comfy.sd
    from benchmarks.comfy import quantised as G
    from benchmarks.comfy import families as F

    out = {"family": family_name, "qtype": qtype, "phase": phase}
    qtype, _, compute = qtype.partition(":")  # "Q4_K:bfloat16": the model computes in bfloat16 (a GPU's usual)
    dtype = getattr(torch, compute or "float32")
    if phase == "lowvram":
        return low_vram(nodes, runtime, blocks, G, F, family_name, out)
    gguf_nodes = G.import_gguf_nodes(G.gguf_path()) if qtype != FP8_SCALED else None
    registry = runtime.registry()
    path = os.path.join(base, f"{family_name}-{qtype}.gguf")
    if qtype == FP8_SCALED:  # the same weights in both phases (seed 0), loaded as ComfyUI's loader runs: inference mode
        state = G.scaled_fp8_state(G.build_float(family_name, seed=0))
        out["stored"] = {"float8_e4m3fn": sum(1 for t in state.values() if t.dtype == torch.float8_e4m3fn and t.numel())}
        with torch.inference_mode():
            patcher = G.load_scaled_fp8(family_name, state)
    else:
        if phase == "first":
            out["q4_k_roundtrip"] = G.check_q4_k()
            out["stored"] = G.write_gguf(G.build_float(family_name, seed=0), path, qtype, family_name)
        patcher = G.load_gguf(family_name, path, gguf_nodes, dtype=dtype)
    family = F.TinyFamily(name=family_name, patcher=patcher, video=family_name == "wan", latent_channels=16,
                          _latent=F._latent_fn(family_name), _conditioning=F._conditioning_fn(family_name))
    diffusion_model = patcher.model.diffusion_model
    out["weight_class"] = type(diffusion_model.double_blocks[0].img_attn.qkv.weight).__name__ \
        if family_name == "flux" else type(diffusion_model.blocks[0].self_attn.q.weight).__name__

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "refused", "mismatch")}

    def delta(before: dict) -> dict:
        now = counts()
        return {k: now[k] - before[k] for k in now}

    def sample(model, width, height, batch, text, frames, seed=3):
        latent = family.latent(width, height, batch=batch, frames=frames)
        positive, negative = family.conditioning(text, seed=1), family.conditioning(text, seed=2)
        return F.sample(family, positive, negative, latent, seed=seed, model=model)

    def row(got, want, before, **extra) -> dict:
        return {"diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                "finite": bool(torch.isfinite(got).all()), "events": delta(before), **extra}

    def compare(model, reference_model, sweep) -> list:
        rows = []
        for width, height, batch, text, frames in sweep:
            before = counts()
            got = sample(model, width, height, batch, text, frames)
            want = sample(reference_model, width, height, batch, text, frames)
            rows.append(row(got, want, before, call=[width, height, batch, text, frames]))
        return rows

    def reasons_since(mark: int, kind: str = "fallback") -> list:
        return [e.reason for e in registry.events[mark:] if e.kind == kind]

    # ComfyUI's executor runs every node under inference mode: the loaders' weights are inference tensors, and
    # the graphs are made (Save Graph) and loaded (Load Graph) there too.
    inference = torch.inference_mode
    if phase == "first":
        before = counts()
        with inference():
            fast = nodes["KeepFastModelSpeedup"].execute(model=patcher, **RANGE).args[0]
        engine = blocks.existing_engine(diffusion_model)
        out["engine"] = engine is not None
        if engine is None:
            return out
        out["structures"] = [[g.class_name, len(g.instances), g.structure] for g in engine.groups]
        with inference():
            saved = nodes["KeepFastSaveGraph"].execute(name=f"{family_name}-{qtype}", model=fast).args
        out["save_report"] = saved[2]
        out["save_events"] = delta(before)
        out["report"] = engine.report()
        mark = len(registry.events)
        out["sweep"] = compare(fast, patcher, SWEEP)
        out["sweep_fallbacks"] = reasons_since(mark)
        out["block_calls"] = [engine.graph_calls, engine.eager_calls]

        # A LoRA as LoraLoader applies it: GGUFModelPatcher hangs it on the quantised weights.
        lora = G.lora_state(patcher)
        plain = sample(fast, *SWEEP[0])
        rows = []
        for strength in (1.0, 0.5):
            with inference():  # LoraLoader
                patched_fast = comfy.sd.load_lora_for_models(fast, None, lora, strength, 0)[0]
                patched_ref = comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)[0]
            for call in (SWEEP[0], SWEEP[1]):
                before, mark = counts(), len(registry.events)
                got, want = sample(patched_fast, *call), sample(patched_ref, *call)
                rows.append(row(got, want, before, strength=strength, call=list(call),
                                changed=float((got - plain).abs().max()) if call == SWEEP[0] else None,
                                fallbacks=reasons_since(mark)))
        before = counts()
        off = sample(fast, *SWEEP[0])
        rows.append({"strength": 0.0, "diff": float((off - plain).abs().max()), "events": delta(before)})
        out["lora"] = rows
        out["lora_keys"] = len(lora) // 3

        # A `set` patch replaces the weight: no delta a graph could bind. Its blocks run eager, saying why.
        layer = "double_blocks.0.img_attn.proj" if family_name == "flux" else "blocks.0.self_attn.o"
        key = f"diffusion_model.{layer}.weight"
        module = diffusion_model.get_submodule(layer)
        replacement = torch.randn(tuple(module.weight.shape), generator=torch.Generator().manual_seed(5)) * 0.2
        set_fast, set_ref = fast.clone(), patcher.clone()
        set_fast.add_patches({key: ("set", (replacement,))}, 1.0)
        set_ref.add_patches({key: ("set", (replacement,))}, 1.0)
        before, mark = counts(), len(registry.events)
        calls = (engine.graph_calls, engine.eager_calls)
        got, want = sample(set_fast, *SWEEP[0]), sample(set_ref, *SWEEP[0])
        out["set_patch"] = row(got, want, before, changed=float((got - plain).abs().max()),
                               fallbacks=reasons_since(mark), graph_calls=engine.graph_calls - calls[0],
                               eager_calls=engine.eager_calls - calls[1], block=layer.rsplit(".", 2)[0])
    else:
        before = counts()
        with inference():
            loaded = nodes["KeepFastLoadGraph"].execute(graph="(every stored graph that fits)",
                                                        compile_if_missing=False, trust_graph=False, model=patcher).args
        out["load_report"] = loaded[2]
        out["load_events"] = delta(before)
        mark = len(registry.events)
        out["sweep"] = compare(loaded[0], patcher, RESTART_SWEEP)
        out["sweep_fallbacks"] = reasons_since(mark)
    out["counts"] = counts()
    return out


def low_vram(nodes, runtime, blocks, G, F, family_name: str, out: dict) -> dict:
    """ComfyUI's own partial loading on the unquantised model with a LoRA: blocks low-VRAM mode patches per call.

    On a CPU ComfyUI never loads a model partly (`load_models_gpu` sets VRAMState.DISABLED, so every sample
    loads it whole again), so the sampler cannot be used: the LoRA'd patcher is loaded by load_models_gpu and
    then partly unloaded by its own `partially_unload`, which puts the stored weights back and sets
    LowVramPatch weight functions, as when memory runs out on a GPU. The diffusion model is then called
    directly at two sizes with its blocks served (the node's scope) and eager, and without the LoRA.
    """
    import comfy.model_management as mm
    import comfy.sd
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from compiler.blocks.tokens import Dims

    registry = runtime.registry()

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "refused", "mismatch")}

    # every weight patched for one call, watched: once its call is over nothing may keep it (torch's user-managed
    # constants kept each one bound to a graph for good; compiler/backends/borrowed_weights.py)
    lowvram = sys.modules[runtime.__name__.rsplit(".", 1)[0] + ".lowvram"]
    made_for_a_call = []
    call_tensors = lowvram.LowVramWeights.call_tensors

    def watched(self, module, device=None):
        found = call_tensors(self, module, device)
        for tensor in (found[0].values() if found else ()):
            made_for_a_call.append(StorageWeakRef(tensor.untyped_storage()))
        return found

    lowvram.LowVramWeights.call_tensors = watched
    patcher = G.load_float(family_name, G.build_float(family_name, seed=0))
    with torch.inference_mode():
        fast = nodes["KeepFastModelSpeedup"].execute(model=patcher, **RANGE).args[0]
        nodes["KeepFastSaveGraph"].execute(name=f"{family_name}-float", model=fast)
    model = patcher.model.diffusion_model
    engine = blocks.existing_engine(model)
    out["report"] = engine.report()
    lora = G.lora_state(patcher)
    rows, first_want = [], None
    for strength in (1.0, 0.5):
        with torch.inference_mode():
            patched = comfy.sd.load_lora_for_models(fast, None, lora, strength, 0)[0]
            mm.load_models_gpu([patched])
            patched.partially_unload(patched.offload_device, memory_to_free=1 << 40)
        lowvram_layers = sum(1 for m in model.modules() if getattr(m, "weight_function", None))
        for dims in (Dims(batch=1, height=16, width=16, text=7), Dims(batch=2, height=24, width=16, text=20)):
            args, kwargs = engine.family.example_call(model, dims)
            before, mark = counts(), len(registry.events)
            calls = (engine.graph_calls, engine.eager_calls)
            with torch.inference_mode():
                with engine.serving():
                    got = model(*args, **kwargs)
                with engine.eager_scope():
                    want = model(*args, **kwargs)
            now = counts()
            first_want = want if first_want is None else first_want
            rows.append({"strength": strength, "dims": dims.describe(), "lowvram_layers": lowvram_layers,
                         "diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                         "finite": bool(torch.isfinite(got).all()), "events": {k: now[k] - before[k] for k in now},
                         "graph_calls": engine.graph_calls - calls[0], "eager_calls": engine.eager_calls - calls[1],
                         "fallbacks": [e.reason for e in registry.events[mark:] if e.kind == "fallback"]})
        with torch.inference_mode():
            mm.unload_all_models()
    args, kwargs = engine.family.example_call(model, Dims(batch=1, height=16, width=16, text=7))
    with torch.inference_mode(), engine.eager_scope():
        plain = model(*args, **kwargs)
    out["changed_by_lora"] = float((first_want - plain).abs().max())
    gc.collect()
    out["per_call_tensors"] = len(made_for_a_call)
    out["per_call_tensors_kept"] = sum(1 for ref in made_for_a_call if not ref.expired())
    out["lowvram"] = rows
    out["counts"] = counts()
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:6])
    print("KEEPFAST-RESULT " + json.dumps(result))
