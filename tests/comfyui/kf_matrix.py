"""The correctness matrix through the nodes in ComfyUI's own Python; run by test_comfyui_matrix.py.

    python kf_matrix.py PACK_DIR BASE_DIR GRAPHS_DIR KIND PHASE [--use-pytorch-cross-attention]

KIND: sd15 | sdxl (ComfyUI's UNetModel, whole-model graphs), flux | sd3 | wan (block graphs), vae (ComfyUI's
AutoencoderKL, decode and encode). PHASE:
- `first1` / `first2`: an empty GRAPHS_DIR; the speedup node, then the first call at a model batch of 1
  (one image, cfg 1.0) or 2 (one image, cfg 2.0: ComfyUI batches the prompt and the negative prompt),
  which compiles; then every later call of the matrix in a seeded order: 1, 2 and 3 images x cfg off
  (1.0) and on (2.0) x two sizes x two prompt lengths (Wan: x two frame counts); then Save Graph.
- `restart`: a new process with other weights and the same speedup node (the workflow run again after a
  restart: its first call finds the graphs in GRAPHS_DIR), the matrix again in another order.
- `fault` (sd15): Load Graph, then a graph made to add 0.5 to its output at batch 2 (a test-only fault):
  the first-use check must return eager's output, record the mismatch, and run that shape eager after.

Every call is sampled twice, with the node and with the same model without it; the rows carry the
difference and the pack's events during the call. Prints one JSON object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys

from kf_inprocess import BLOCKING_BUILD, load_pack  # noqa: E402  (this script's folder is on sys.path)

SPEEDUP = dict(min_resolution=64, max_resolution=256, max_batch_size=3, compile=True, save_compiled=False,
               backend="aot", max_frames=9, build=BLOCKING_BUILD)
VAE_SPEEDUP = dict(min_resolution=64, max_resolution=256, max_batch_size=3, compile=True, backend="aot",
                   build=BLOCKING_BUILD)
SIZES = [(128, 128), (192, 128)]  # (width, height) in pixels
TOKENS = {"sd15": (77, 154), "sdxl": (77, 154)}  # CLIP's 77-token chunks; the DiT families take any length
DIT_TOKENS = (7, 20)
FRAMES = (5, 9)  # Wan: video frames (2 and 3 latent frames)
TINY_VAE = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
            "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
COUNTED = ("compile", "load", "fallback", "refused", "mismatch", "unet.graph", "unet.eager", "blocks.graph",
           "blocks.eager", "vae.graph", "vae.eager")


def matrix(kind: str, seed: int) -> list:
    """Every later call, in a seeded order: (images, cfg, (width, height), tokens, frames) or (op, batch, size)."""
    if kind == "vae":
        calls = list(itertools.product(("decode", "encode"), (1, 2, 3), SIZES))
    else:
        tokens = TOKENS.get(kind, DIT_TOKENS)
        frames = FRAMES if kind == "wan" else (1,)
        calls = list(itertools.product((1, 2, 3), (1.0, 2.0), SIZES, tokens, frames))
    random.Random(seed).shuffle(calls)
    return calls


def main(pack: str, base: str, graphs: str, kind: str, phase: str, flags: list) -> dict:
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.base_directory = base
    comfy.cli_args.args.use_pytorch_cross_attention = "--use-pytorch-cross-attention" in flags
    import folder_paths
    import torch

    folder_paths.add_model_folder_path("graphs", graphs, is_default=True)
    name, nodes = load_pack(pack)
    runtime = sys.modules[name + ".nodes.runtime"]
    registry = runtime.registry()
    sys.path.insert(0, pack)
    from benchmarks.comfy import families as F

    seed = 0 if phase.startswith("first") else 5  # a restart runs other weights than the saved ones
    out = {"kind": kind, "phase": phase}

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in COUNTED}

    def delta(before: dict) -> dict:
        now = counts()
        return {k: now[k] - before[k] for k in now}

    def row(call, got, want, before) -> dict:
        return {"call": list(call), "diff": float((got.float() - want.float()).abs().max()),
                "scale": float(want.float().abs().max()), "finite": bool(torch.isfinite(got).all()),
                "shape": list(got.shape), "events": delta(before)}

    if kind == "vae":
        import comfy.ldm.models.autoencoder
        import comfy.sd

        torch.manual_seed(seed)
        source = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=TINY_VAE, embed_dim=4)
        for parameter in source.parameters():  # random weights with outputs of a useful size
            parameter.data.normal_(0.0, 0.2)
        reference = comfy.sd.VAE(sd=source.state_dict(), config={"params": {"ddconfig": TINY_VAE, "embed_dim": 4}})

        def speedup():
            return nodes["KeepFastVAESpeedup"].execute(vae=reference, **VAE_SPEEDUP).args[0]

        def run(vae, call):
            op, batch, (width, height) = call
            generator = torch.Generator().manual_seed(width * 7 + height * 3 + batch)
            with torch.inference_mode():
                if op == "decode":
                    return vae.decode(torch.randn(batch, 4, height // 8, width // 8, generator=generator))
                return vae.encode(torch.rand(batch, height, width, 3, generator=generator))

        first_calls = [("decode", int(phase[-1]), SIZES[0]), ("encode", int(phase[-1]), SIZES[0])] \
            if phase.startswith("first") else []
        load_inputs = {"vae": reference}
    else:
        family = F.build(kind, seed=seed)
        reference = family.patcher

        def speedup():
            return nodes["KeepFastModelSpeedup"].execute(model=reference, **SPEEDUP).args[0]

        def run(model, call):
            images, cfg, (width, height), tokens, frames = call
            latent = family.latent(width, height, batch=images, frames=frames)
            positive, negative = family.conditioning(tokens, seed=1), family.conditioning(tokens, seed=2)
            return F.sample(family, positive, negative, latent, cfg=cfg, seed=3, model=model)

        first_calls = [(1, 1.0 if phase == "first1" else 2.0, SIZES[0], TOKENS.get(kind, DIT_TOKENS)[0],
                        FRAMES[0] if kind == "wan" else 1)] if phase.startswith("first") else []
        load_inputs = {"model": reference}

    if phase.startswith("first"):
        fast = speedup()
        before = counts()
        out["first"] = [row(call, run(fast, call), run(reference, call), counts()) for call in first_calls]
        out["first_events"] = delta(before)
        out["rows"] = []
        for call in matrix(kind, seed=int(phase[-1])):
            before = counts()
            out["rows"].append(row(call, run(fast, call), run(reference, call), before))
        before = counts()
        key = "vae" if kind == "vae" else "model"
        saved = nodes["KeepFastSaveGraph"].execute(name=f"{kind}-{phase}", **{key: fast}).args
        out["save_report"] = saved[2]
        out["save_events"] = delta(before)
    elif phase == "restart":
        fast = speedup()
        out["rows"] = []
        for call in matrix(kind, seed=99):
            before = counts()
            out["rows"].append(row(call, run(fast, call), run(reference, call), before))
    else:  # fault: Load Graph, then a graph that adds 0.5 at batch 2
        loaded = nodes["KeepFastLoadGraph"].execute(graph="(every stored graph that fits)", compile_if_missing=True,
                                                    trust_graph=False, **load_inputs).args
        fast = loaded[1] if kind == "vae" else loaded[0]
        out["load_report"] = loaded[2]
        import torch.utils._pytree as pytree

        aot = sys.modules[name + ".compiler.backends.aot"]
        original = aot.AotGraph.run

        def perturbed(self, module, call, replay=False):
            output = original(self, module, call, replay)
            if call.shapes[0][0] == 2:
                output = pytree.tree_map_only(torch.Tensor, lambda t: t + 0.5, output)
            return output

        aot.AotGraph.run = perturbed
        try:
            out["rows"] = []
            for call in [(1, 1.0, SIZES[0], 77, 1), (1, 2.0, SIZES[0], 77, 1), (1, 2.0, SIZES[0], 77, 1),
                         (2, 1.0, SIZES[1], 77, 1)]:
                before = counts()
                out["rows"].append(row(call, run(fast, call), run(reference, call), before))
        finally:
            aot.AotGraph.run = original
        stats = runtime.stats()
        out["stats_mismatches"] = stats["counts"]["mismatches"]
        out["mismatch_reasons"] = [m["reason"] for m in stats["messages"] if m["kind"] == "mismatch"]
        out["stats_text"] = sys.modules[name + ".nodes.reports"].stats_text()
    out["counts"] = counts()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    positional = [a for a in args if not a.startswith("--")]
    result = main(*positional[:5], flags=[a for a in args if a.startswith("--")])
    print("KEEPFAST-RESULT " + json.dumps(result))
