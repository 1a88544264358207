"""ComfyUI's video VAEs through VAE Speedup; run by test_comfyui_video_vae.py.

    python kf_video_vae.py PACK_DIR BASE_DIR first|restart|background wan|wan22|ltxv

wan: a tiny Wan 2.1 VAE (ComfyUI's own `comfy.sd.VAE`, detected from a state
dict of `comfy.ldm.wan.vae.WanVAE` with 8 base channels, random weights),
which decodes one latent frame at a time with a feature cache. wan22: Wan 2.2's
VAE (`comfy.ldm.wan.vae2_2`: residual blocks, 2x2 patches, 48 latent channels,
16x spatial), detected and set up by ComfyUI's own loader branch; that branch
fixes the widths (160 and 256 base channels, 705 M parameters, too slow for
this CPU), so the class it builds is ComfyUI's with both cut to WAN22_WIDTH
(`_NarrowWan22`). ltxv: LTX-Video's
causal VideoVAE (comfy_models' LTXV_VAE_CONFIG, read from the file's metadata
as VAELoader reads it), which decodes a whole video in one pass.
`first` (an empty graphs folder): VAE Speedup, then Save Graph before any
video (the chunk graphs of an example video), then decodes and encodes at two
frame counts and two sizes, each against the same VAE
without the node. `restart` (a new process, other weights, the graphs folder
`first` wrote): Load Graph, then other frame counts and sizes. `background`
(an empty graphs folder): VAE Speedup with its default `build` (in the
background), a first decode while the chunk graphs build, one more while
they may still build, then (builds done) the decodes of `first`. Prints one
JSON object of findings after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import os
import sys
import time

from kf_inprocess import BLOCKING_BUILD, load_pack  # noqa: E402  (this script's folder is on sys.path)

SPEEDUP = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, backend="aot",
               build=BLOCKING_BUILD)
# (op, width, height, batch, frames): latent frames to decode, pixel frames to encode (Wan: 1 + 4k); decodes of
# 2 videos as Qwen-Image decodes 2 images (one-frame videos), served a video at a time by the batch-1 chunk graphs.
# LTX-Video: 32x spatial, 8x temporal (video frames 1 + 8k); decode takes latent frames, encode video frames.
LTXV_FIRST = [("decode", 128, 128, 1, 2), ("decode", 192, 128, 1, 3), ("decode", 128, 96, 1, 1),
              ("decode", 128, 128, 2, 2), ("encode", 128, 128, 1, 9), ("encode", 96, 128, 1, 17)]
LTXV_RESTART = [("decode", 160, 128, 1, 4), ("decode", 96, 96, 2, 1), ("encode", 160, 96, 1, 25)]
FIRST = [("decode", 128, 128, 1, 3), ("decode", 192, 128, 1, 5), ("decode", 128, 192, 1, 2),
         ("decode", 128, 128, 2, 1), ("decode", 192, 128, 2, 3),
         ("encode", 128, 128, 1, 9), ("encode", 192, 128, 1, 5), ("encode", 128, 192, 1, 13)]
RESTART = [("decode", 160, 128, 1, 4), ("decode", 128, 128, 1, 1), ("decode", 160, 128, 2, 1),
           ("encode", 160, 128, 1, 9)]
# Wan 2.2: 16x spatial (sizes multiples of 16), 48 latent channels; frames as Wan 2.1's.
WAN22_FIRST = [("decode", 128, 128, 1, 3), ("decode", 192, 128, 1, 5), ("decode", 128, 128, 2, 2),
               ("encode", 128, 128, 1, 9), ("encode", 192, 128, 1, 5)]
WAN22_RESTART = [("decode", 160, 128, 1, 4), ("decode", 128, 128, 2, 1), ("encode", 160, 128, 1, 9)]


WAN22_WIDTH = 16


class _NarrowWan22:
    """While open, ComfyUI's loader builds its Wan 2.2 VAE class with WAN22_WIDTH base channels (same class name)."""

    def __enter__(self):
        import comfy.ldm.wan.vae2_2 as wan22

        self.module, self.original = wan22, wan22.WanVAE

        class WanVAE(self.original):
            def __init__(self, dim=160, dec_dim=256, **config):
                super().__init__(dim=WAN22_WIDTH, dec_dim=WAN22_WIDTH, **config)

        wan22.WanVAE = WanVAE
        return WanVAE

    def __exit__(self, *exc):
        self.module.WanVAE = self.original


def _vae(kind: str, seed: int):
    """(ComfyUI's VAE of the kind, its latent channels, spatial scale), as VAELoader would give it."""
    import comfy.sd
    import torch

    torch.manual_seed(seed)
    if kind == "ltxv":
        import json as _json

        from benchmarks.comfy.models import LTXV_VAE_CONFIG
        from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

        source = VideoVAE(config=LTXV_VAE_CONFIG)
        for parameter in source.parameters():
            parameter.data.normal_(0.0, 0.02)
        for name, buffer in source.named_buffers():
            buffer.fill_(1.0 if "std" in name else 0.0)
        return comfy.sd.VAE(sd=source.state_dict(), metadata={"config": _json.dumps({"vae": LTXV_VAE_CONFIG})}), 128, 32
    if kind == "wan22":
        with _NarrowWan22() as narrow:
            source = narrow(z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                            temperal_downsample=[False, True, True])
            for parameter in source.parameters():
                parameter.data.normal_(0.0, 0.05)
            return comfy.sd.VAE(sd=source.state_dict()), 48, 16
    import comfy.ldm.wan.vae

    source = comfy.ldm.wan.vae.WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                      temperal_downsample=[False, True, True])
    for parameter in source.parameters():  # random weights with outputs of a useful size
        parameter.data.normal_(0.0, 0.05)
    return comfy.sd.VAE(sd=source.state_dict()), 16, 8


def main(pack: str, base: str, phase: str, kind: str = "wan") -> dict:
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.base_directory = base
    import torch

    name, nodes = load_pack(pack)
    runtime = sys.modules[name + ".nodes.runtime"]
    sys.path.insert(0, pack)  # benchmarks.comfy, for the LTX-Video config
    vae, channels, scale = _vae(kind, 0 if phase == "first" else 5)
    first_calls, restart_calls = {"ltxv": (LTXV_FIRST, LTXV_RESTART), "wan22": (WAN22_FIRST, WAN22_RESTART)}.get(
        kind, (FIRST, RESTART))
    registry = runtime.registry()

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "refused", "mismatch")}

    def delta(before: dict) -> dict:
        now = counts()
        return {k: now[k] - before[k] for k in now}

    def sweep(fast, calls) -> list:
        rows = []
        for op, width, height, batch, frames in calls:
            torch.manual_seed(width + height + batch + frames)
            if op == "decode":
                sample = torch.randn(batch, channels, frames, height // scale, width // scale)
            else:  # ComfyUI's IMAGE: the frames of one video (VAE Encode takes one video at a time)
                sample = torch.rand(frames, height, width, 3)
            before = counts()
            mark = len(registry.events)
            got = getattr(fast, op)(sample)
            want = getattr(vae, op)(sample)
            rows.append({"op": op, "call": [width, height, batch, frames], "shape": list(got.shape),
                         "want_shape": list(want.shape), "diff": float((got - want).abs().max()),
                         "scale": float(want.abs().max()), "events": delta(before),
                         "reasons": [e.reason for e in registry.events[mark:] if e.kind in ("compile", "fallback")]})
        return rows

    out = {"phase": phase, "latent_dim": vae.latent_dim, "model": type(vae.first_stage_model).__name__}
    if phase == "background":
        builds = sys.modules[name + ".compiler.builds.package_builds"]
        settings = {k: v for k, v in SPEEDUP.items() if k != "build"}  # the node's default: in the background
        fast = nodes["KeepFastVAESpeedup"].execute(vae=vae, **settings).args[0]
        decodes = [row for row in first_calls if row[0] == "decode"]
        out["first_rows"] = sweep(fast, decodes[:1])
        # Builds started: those not yet taken in, and those a later chunk of the same decode took in.
        out["started_by_first"] = len(builds.snapshot()[0]) + out["first_rows"][0]["events"]["compile"]
        out["second_rows"] = sweep(fast, decodes[:1])  # chunk states met later start their builds too
        deadline = time.monotonic() + 1800
        while builds.live_builds() + builds.waiting_builds() and time.monotonic() < deadline:
            time.sleep(1)
        out["building_at_end"] = builds.live_builds() + builds.waiting_builds()
        out["landing_rows"] = sweep(fast, decodes[:1])  # takes the finished builds in
        out["rows"] = sweep(fast, decodes)
        out["counts"] = counts()
        return out
    if phase == "first":
        fast = nodes["KeepFastVAESpeedup"].execute(vae=vae, **SPEEDUP).args[0]
        before = counts()
        saved = nodes["KeepFastSaveGraph"].execute(name=f"{kind}-vae", vae=fast).args
        out["save_report"] = saved[2]
        out["save_events"] = delta(before)
        out["files"] = sorted(os.path.relpath(os.path.join(d, f), base) for d, _, fs in os.walk(base)
                              for f in fs if f.endswith(".json") and "graphs" in d)
        out["rows"] = sweep(fast, first_calls)
    else:
        before = counts()
        loaded = nodes["KeepFastLoadGraph"].execute(graph="(every stored graph that fits)", compile_if_missing=False,
                                                    trust_graph=False, vae=vae).args
        out["load_report"] = loaded[2]
        out["load_events"] = delta(before)
        out["rows"] = sweep(loaded[1], restart_calls)
    out["counts"] = counts()
    return out


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:5])))
