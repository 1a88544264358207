"""ComfyUI's context windows with Model Speedup, in ComfyUI's own Python; run by test_comfyui_context_windows.py.

    python kf_context_windows.py PACK_DIR BASE_DIR FAMILY

ComfyUI's Context Windows nodes (comfy_extras/nodes_context_windows.py, comfy/context_windows.py) sample a long
latent as overlapping windows: the model is called on each window (a shorter batch for an SD-style UNet, fewer
frames for Wan) and the results are fused. The pack's graphs must serve each window's call with no compile (a
window is one more size in the node's range), in either node order, with the latent the context windows give on
the model without the pack's node. FAMILY: `sd15` (ContextWindowsManual over the batch, AnimateDiff-style; one
whole-model graph) or `wan` (WanContextWindowsManual over frames; block graphs). Prints one JSON object after
"KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import sys

from kf_inprocess import BLOCKING_BUILD, family_in_comfy, served_calls  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=4, compile=True, save_compiled=False,
             backend="aot", max_frames=17, build=BLOCKING_BUILD)
STEPS = 2
# (width, height, batch, text tokens, frames) sampled whole for the warm-up, then in windows.
CALL = {"sd15": (128, 128, 4, 7, 1), "wan": (128, 128, 1, 7, 17)}
# Windows of 2 of the 4 latents (overlap 1: three windows); Wan: 9 of 17 frames (3 of 5 latent frames, overlap 1).
WINDOWS = {"sd15": ("ContextWindowsManual", dict(context_length=2, context_overlap=1, dim=0)),
           "wan": ("WanContextWindowsManual", dict(context_length=9, context_overlap=4))}
COMMON = dict(context_schedule="standard_static", context_stride=1, closed_loop=False, fuse_method="pyramid",
              freenoise=False)


def main(pack: str, base: str, family_name: str) -> dict:
    env = family_in_comfy(pack, base, family_name)
    from comfy_extras import nodes_context_windows

    patcher, module = env.family.patcher, env.module
    node_name, settings = WINDOWS[family_name]
    window_node = {"ContextWindowsManual": nodes_context_windows.ContextWindowsManualNode,
                   "WanContextWindowsManual": nodes_context_windows.WanContextWindowsManualNode}[node_name]
    batches = []  # the batch (SD) or latent frames (Wan) of each model call
    module.register_forward_pre_hook(
        lambda _module, args, kwargs: batches.append(list((args[0] if args else kwargs["x"]).shape)),
        with_kwargs=True)

    def windowed(model):
        return window_node.execute(model=model, **settings, **COMMON).args[0]

    def speedup(model):
        return env.nodes["KeepFastModelSpeedup"].execute(model=model, **RANGE).args[0]

    def sample(model):
        return env.sample(model, *CALL[family_name], steps=STEPS)

    def delta(before: dict) -> dict:
        now = served_calls(env.name, module)
        return {k: now[k] - before[k] for k in now}

    fast = speedup(patcher)
    before = served_calls(env.name, module)
    sample(fast)
    out = {"family": family_name, "warm": delta(before)}
    out["blocks"] = env.block_count()

    batches.clear()
    want = sample(windowed(patcher))
    out["window_calls"] = list(batches)
    rows = []
    for order in ("windows, then speedup", "speedup, then windows"):
        model = speedup(windowed(patcher)) if order.startswith("windows") else windowed(fast)
        before = served_calls(env.name, module)
        got = sample(model)
        rows.append({"order": order, "diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                     "events": delta(before)})
    out["rows"] = rows
    out["fallbacks"] = [e.reason for e in env.registry.events if e.kind == "fallback"]
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:4])
    print("KEEPFAST-RESULT " + json.dumps(result))
