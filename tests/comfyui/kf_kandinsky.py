"""Kandinsky 5 past 8192 tokens with Model Speedup, in ComfyUI's own Python; run by test_comfyui_kandinsky.py.

    python kf_kandinsky.py PACK_DIR BASE_DIR

Kandinsky 5's self-attention and feed-forward switch to a chunked path above 8192 tokens (comfy/ldm/kandinsky5):
a block graph traced on the other path kept that branch as a guard, and every larger video ran its visual blocks
eager ("shape guard visual_embed.shape[1] <= 8192 does not hold"). The graph now computes the one-piece path at
every size. A 128-pixel, 5-frame call compiles; a 1024x768, 9-frame one (12288 tokens) is served by the same
graphs; both against the model without the node. Prints one JSON object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import sys

from kf_inprocess import BLOCKING_BUILD, family_in_comfy, served_calls  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=1024, max_batch_size=1, compile=True, save_compiled=False,
             backend="aot", max_frames=9, build=BLOCKING_BUILD)
CALLS = [(128, 128, 1, 7, 5), (1024, 768, 1, 7, 9)]  # (width, height, batch, text tokens, video frames)


def main(pack: str, base: str) -> dict:
    env = family_in_comfy(pack, base, "kandinsky5")
    fast = env.nodes["KeepFastModelSpeedup"].execute(model=env.family.patcher, **RANGE).args[0]
    rows = []
    for call in CALLS:
        before, mark = served_calls(env.name, env.module), len(env.registry.events)
        got = env.sample(fast, *call)
        after = served_calls(env.name, env.module)
        want = env.sample(env.family.patcher, *call)
        rows.append({"call": call, "diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                     "events": {k: after[k] - before[k] for k in after},
                     "fallbacks": [e.reason for e in env.registry.events[mark:] if e.kind == "fallback"]})
    report = env.blocks.existing_engine(env.module).report()
    return {"family": "kandinsky5", "blocks": env.block_count(), "rows": rows,
            "structures": {s["class"]: {"status": s["status"], "notes": s["notes"]} for s in report["structures"]}}


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:3])))
