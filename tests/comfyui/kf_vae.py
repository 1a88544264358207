"""ComfyUI's AutoencoderKL with the attention ComfyUI picks at start, through VAE Speedup; run by
test_comfyui_vae_attention.py.

    python kf_vae.py PACK_DIR BASE_DIR [--use-pytorch-cross-attention]

A tiny AutoencoderKL (ComfyUI's own classes: `comfy.sd.VAE` from a config,
random weights, a mid-block AttnBlock) decodes and encodes four sizes (three
resolutions, batch 1 and 2) through the VAE Speedup node, each against the
same VAE without the node. Prints one JSON object of findings after
"KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import os
import sys

from kf_inprocess import BLOCKING_BUILD, load_pack  # noqa: E402  (this script's folder is on sys.path)

SPEEDUP = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, backend="aot",
               build=BLOCKING_BUILD)
SIZES = [(128, 128, 1), (192, 128, 2), (128, 256, 1), (208, 144, 2)]  # (width, height, batch)
TINY = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
        "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}


def main(pack: str, base: str, flags: list) -> dict:
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.base_directory = base
    comfy.cli_args.args.use_pytorch_cross_attention = "--use-pytorch-cross-attention" in flags
    import torch

    name, nodes = load_pack(pack)
    runtime = sys.modules[name + ".nodes.runtime"]
    import comfy.ldm.models.autoencoder
    import comfy.sd

    torch.manual_seed(0)
    source = comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig=TINY, embed_dim=4)
    for parameter in source.parameters():  # random weights with outputs of a useful size
        parameter.data.normal_(0.0, 0.2)
    vae = comfy.sd.VAE(sd=source.state_dict(), config={"params": {"ddconfig": TINY, "embed_dim": 4}})
    registry = runtime.registry()

    def attention() -> list:
        return sorted({m.optimized_attention.__name__ for m in vae.first_stage_model.modules()
                       if "optimized_attention" in m.__dict__})

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "refused")}

    out = {"attention": attention()}
    fast = nodes["KeepFastVAESpeedup"].execute(vae=vae, **SPEEDUP).args[0]
    rows = []
    for op in ("decode", "encode"):
        for width, height, batch in SIZES:
            torch.manual_seed(width + height + batch)
            if op == "decode":
                sample = torch.randn(batch, 4, height // 8, width // 8)
            else:
                sample = torch.rand(batch, height, width, 3)
            before = counts()
            mark = len(registry.events)
            got = getattr(fast, op)(sample)
            want = getattr(vae, op)(sample)
            now = counts()
            rows.append({"op": op, "call": [width, height, batch], "shape": list(got.shape),
                         "diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                         "events": {k: now[k] - before[k] for k in now},
                         "reasons": [e.reason for e in registry.events[mark:] if e.kind in ("compile", "fallback")]})
    out["rows"] = rows
    out["attention_after"] = attention()
    return out


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3:])))
