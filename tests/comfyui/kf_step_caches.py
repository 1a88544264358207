"""ComfyUI's step caches (EasyCache, LazyCache) with Model Speedup, in ComfyUI's own Python; run by
test_comfyui_step_caches.py.

    python kf_step_caches.py PACK_DIR BASE_DIR FAMILY

Users ask for a caching accelerator and a compiler together (peers.md: ComfyUI #14795, WaveSpeed #131). The
caches are ComfyUI's own nodes (comfy_extras/nodes_easycache.py): EasyCache wraps the diffusion model's call
(the same DIFFUSION_MODEL hook the pack's node uses), LazyCache the sampler's noise prediction. A step they
skip never calls the model; a step they run must be served by the pack's graphs, whichever node comes first in
the workflow. FAMILY is an SD-style UNet (`sd15`: one whole-model graph) or a transformer (`flux`: block
graphs). For each cache and each order, a 10-step sample is compared with the same cache on the model without
the pack's node: the latent, the steps each skipped (ComfyUI's log line), the compiles, fallbacks and the calls
the pack served from graphs and eagerly. Prints one JSON object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import logging
import re
import sys

from kf_inprocess import BLOCKING_BUILD, family_in_comfy, served_calls  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
             backend="aot", build=BLOCKING_BUILD)
STEPS = 10
# (width, height, batch, text tokens): the warm-up's call, then the caches' (another size: served, not compiled).
WARM = (128, 128, 1, 7)
CALL = (192, 128, 1, 7)
# The most a cache node takes: on random weights the change rates are not a real model's, and a high threshold
# makes each cache skip steps (the test asserts it did, so a cache that skipped nothing cannot pass unnoticed).
CACHE = dict(reuse_threshold=3.0, start_percent=0.15, end_percent=0.95, verbose=False)
SKIPPED = re.compile(r"(EasyCache|LazyCache) - skipped (\d+)/(\d+) steps")


class _SkipLog(logging.Handler):
    """ComfyUI's own summary of each sample: 'EasyCache - skipped 4/10 steps (1.67x speedup).'"""

    def __init__(self):
        super().__init__()
        self.skipped: list = []

    def emit(self, record: logging.LogRecord) -> None:
        match = SKIPPED.search(record.getMessage())
        if match:
            self.skipped.append(int(match.group(2)))


def main(pack: str, base: str, family_name: str) -> dict:
    env = family_in_comfy(pack, base, family_name)
    from comfy_extras import nodes_easycache

    skips = _SkipLog()
    logging.getLogger().addHandler(skips)
    logging.getLogger().setLevel(logging.INFO)
    out = {"family": family_name}

    def served() -> dict:
        return served_calls(env.name, env.module)

    def delta(before: dict) -> dict:
        now = served()
        return {k: now[k] - before[k] for k in now}

    def sample(model, call):
        return env.sample(model, *call, steps=STEPS)

    cache_nodes = {"EasyCache": nodes_easycache.EasyCacheNode, "LazyCache": nodes_easycache.LazyCacheNode}

    def cached(cache: str, model):
        return cache_nodes[cache].execute(model=model, **CACHE).args[0]

    patcher, speedup = env.family.patcher, env.nodes["KeepFastModelSpeedup"]
    fast = speedup.execute(model=patcher, **RANGE).args[0]
    before = served()
    sample(fast, WARM)
    out["warm"] = delta(before)
    out["blocks"] = env.block_count()

    rows = []
    for cache in cache_nodes:
        before, skips.skipped = served(), []
        want = sample(cached(cache, patcher), CALL)
        reference = {"skipped": list(skips.skipped), "events": delta(before)}
        for order in ("cache, then speedup", "speedup, then cache"):
            if order == "cache, then speedup":
                model = speedup.execute(model=cached(cache, patcher), **RANGE).args[0]
            else:
                model = cached(cache, fast)
            before, skips.skipped = served(), []
            got = sample(model, CALL)
            rows.append({"cache": cache, "order": order, "diff": float((got - want).abs().max()),
                         "scale": float(want.abs().max()), "skipped": list(skips.skipped),
                         "reference": reference, "events": delta(before)})
    out["rows"] = rows
    out["fallbacks"] = [e.reason for e in env.registry.events if e.kind == "fallback"]
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:4])
    print("KEEPFAST-RESULT " + json.dumps(result))
