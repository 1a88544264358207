"""Model Speedup with build "in the background", in ComfyUI's own Python; run by test_comfyui_background.py.

    python kf_background.py PACK_DIR BASE_DIR FAMILY

A tiny family (comfy_families: sd15 is served as one UNet graph, flux block by block) sampled through
comfy.sample as a queued workflow samples it, the node with its default `build` (in the background): the
first image runs while its graphs are traced in forked processes and build in child processes (what Graph
Stats and the stats route say then is kept; torch.export calls in ComfyUI's process are counted), then (builds done) the next image takes them in and runs from graphs, then one more at another
size and batch; each image against the same model without the node. Then the same family in bfloat16
(another graph) starts its build and is dropped, as ComfyUI drops a model no workflow uses any more: its
build must stop, leaving nothing. Prints one JSON object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import gc
import json
import sys
import time

from kf_inprocess import comfy_with_pack  # noqa: E402  (this script's folder is on sys.path)

SETTINGS = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
                backend="aot", max_frames=17)  # `build` left at its default: in the background
CALLS = [(128, 128, 1, 7, 5), (192, 128, 2, 20, 5), (128, 192, 1, 40, 5)]  # width, height, batch, text, frames


def main(pack: str, base: str, family_name: str) -> dict:
    name, nodes = comfy_with_pack(pack, base)
    import torch

    runtime = sys.modules[name + ".nodes.runtime"]
    builds = sys.modules[name + ".compiler.builds.package_builds"]
    from benchmarks.comfy import families as F

    registry = runtime.registry()
    family = F.build(family_name, seed=0)

    def counts() -> dict:
        return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "mismatch")}

    def image(model, width, height, batch, text, frames, of=None):
        of = of or family
        latent = of.latent(width, height, batch=batch, frames=frames)
        return F.sample(of, of.conditioning(text, seed=1), of.conditioning(text, seed=2), latent, seed=3,
                        model=model)

    def run(fast, call) -> dict:
        before, mark = counts(), len(registry.events)
        got, want = image(fast, *call), image(family.patcher, *call)
        now = counts()
        return {"call": list(call), "diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
                "events": {k: now[k] - before[k] for k in now}, "live": builds.live_builds(),
                "waiting": builds.waiting_builds(),
                "compiles": [e.reason for e in registry.events[mark:] if e.kind == "compile"],
                "fallbacks": [e.reason for e in registry.events[mark:] if e.kind == "fallback"]}

    output = nodes["KeepFastModelSpeedup"].execute(model=family.patcher, **SETTINGS)
    fast = output.args[0]
    out = {"family": family_name, "report": output.ui["text"][0] if output.ui else "", "rows": []}
    # torch.export in this process during the first image (a trace in a forked process counts in the fork's copy).
    forked_trace = sys.modules[name + ".compiler.tracing.forked_trace"]
    exports, export = [], torch.export.export
    torch.export.export = lambda *a, **k: exports.append(1) or export(*a, **k)
    try:
        out["rows"].append(run(fast, CALLS[0]))  # the first image: builds start, it runs uncompiled
    finally:
        torch.export.export = export
    out["exports_in_first_image"] = len(exports)
    out["fork_unavailable"] = forked_trace.unavailable([])
    out["background_during"] = runtime.stats()["background"]
    out["stats_during"] = nodes["KeepFastGraphStats"].execute().args[0]
    started = time.monotonic()
    while builds.live_builds() or builds.waiting_builds():
        time.sleep(0.2)
    out["build_wait_s"] = round(time.monotonic() - started, 1)
    out["rows"].append(run(fast, CALLS[1]))  # takes the graphs in
    out["rows"].append(run(fast, CALLS[2]))  # from graphs only
    out["counts"] = counts()
    out["leftover_build_folders"] = sorted(p.name for p in builds.extraction.run_folder().glob("build-*"))

    other = F.build(family_name, seed=0, dtype=torch.bfloat16)  # another graph: its build starts
    other_fast = nodes["KeepFastModelSpeedup"].execute(model=other.patcher, **SETTINGS).args[0]
    image(other_fast, *CALLS[0], of=other)
    unload = {"live": builds.live_builds() + builds.waiting_builds(), "background": runtime.stats()["background"]}
    del other, other_fast
    import comfy.model_management

    comfy.model_management.cleanup_models_gc()
    gc.collect()
    unload.update(after=builds.live_builds() + builds.waiting_builds(),
                  folders=sorted(p.name for p in builds.extraction.run_folder().glob("build-*")))
    out["unload"] = unload
    return out


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:4])))
