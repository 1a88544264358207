"""Checks that need ComfyUI in the same process but no compile; run in ComfyUI's Python by
test_comfyui_inprocess.py, prints one JSON object of findings.

    python kf_inprocess.py PACK_DIR BASE_DIR CHECKPOINT_NAME

The pack is loaded the way ComfyUI's loader does it (a package named by its
path, imported from its __init__.py, then comfy_entrypoint()).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (this pack): benchmarks.comfy
from benchmarks.comfy.pack import comfy_with_pack, load_pack  # noqa: E402  (the kf_*.py scripts import them from here)

# The Speedup nodes' `build` choice that compiles before the first image: the tests that count a first image's
# compiles use it (the default builds in the background; test_comfyui_background.py and the server's
# queue-twice test cover that).
BLOCKING_BUILD = "before the first image"
__all__ = ["BLOCKING_BUILD", "comfy_with_pack", "load_pack", "capture_server", "family_in_comfy", "served_calls",
           "main"]


def family_in_comfy(pack: str, base: str, family_name: str):
    """ComfyUI with the pack loaded as ComfyUI loads it and one tiny family built in ComfyUI's classes
    (benchmarks.comfy.families): the pack's name and node classes, its block module, the family, its
    diffusion model, the number of its blocks once an engine serves it, and `sample(model, width, height, batch,
    text, frames=1, steps=2)`, KSampler's latent for those inputs."""
    import types

    name, nodes = comfy_with_pack(pack, base)
    from benchmarks.comfy import families as F

    family = F.build(family_name, seed=0)
    blocks = sys.modules[name + ".nodes.blocks"]
    module = family.patcher.get_model_object("diffusion_model")

    def sample(model, width, height, batch, text, frames=1, steps=2):
        latent = family.latent(width, height, batch=batch, frames=frames)
        positive, negative = family.conditioning(text, seed=1), family.conditioning(text, seed=2)
        return F.sample(family, positive, negative, latent, steps=steps, seed=3, model=model)

    def block_count() -> int:
        engine = blocks.existing_engine(module)
        return sum(len(group.instances) for group in engine.groups) if engine else 0

    return types.SimpleNamespace(name=name, nodes=nodes, blocks=blocks, family=family, module=module, sample=sample,
                                 block_count=block_count, registry=sys.modules[name + ".nodes.runtime"].registry())


def served_calls(pack_name: str, module) -> dict:
    """The pack's counts so far for one diffusion model: compiles, fallbacks, refusals and notes, and its calls
    served from graphs and eagerly (whole-model, and block by block where it has a block engine)."""
    runtime, blocks = sys.modules[pack_name + ".nodes.runtime"], sys.modules[pack_name + ".nodes.blocks"]
    counts, engine = runtime.stats()["counts"], blocks.existing_engine(module)
    found = {k: runtime.registry().log.counts.get(k, 0) for k in ("compile", "fallback", "refused", "note")}
    found.update(graph_calls=counts["unet_graph_calls"], eager_calls=counts["unet_eager_calls"],
                 block_graph_calls=engine.graph_calls if engine else 0,
                 block_eager_calls=engine.eager_calls if engine else 0)
    return found


def capture_server(utils, runtime):
    """Record ProgressBar updates and send_sync events while a compile's progress event is recorded.

    A stand-in `server` module with a PromptServer.instance (ComfyUI's own needs the whole app).
    """
    import types

    progress, sent = [], []
    utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: progress.append([value, total]))
    server = types.ModuleType("server")
    server.PromptServer = type("PromptServer", (), {})
    server.PromptServer.instance = types.SimpleNamespace(
        client_id="test", send_sync=lambda event, data, sid=None: sent.append([event, data.get("kind"), sid]))
    previous = sys.modules.get("server")
    sys.modules["server"] = server
    try:
        registry = runtime.registry()
        registry.record("progress", "-", "unet: compiling with AOTInductor", detail={"fraction": 0.3})
        registry.record("progress", "-", "unet: compiled", detail={"fraction": 1.0})
        registry.record("compile", "-", "unet: first call", seconds=1.5)
    finally:
        if previous is None:
            sys.modules.pop("server", None)
        else:
            sys.modules["server"] = previous
        utils.set_progress_bar_global_hook(None)
    return progress, sent


def main(pack: str, base: str, checkpoint: str) -> dict:
    sys.path.insert(0, os.environ["COMFYUI_PATH"])
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.base_directory = base  # read by folder_paths at import, like --base-directory
    import folder_paths

    user_graphs = os.path.join(base, "user_graphs")
    folder_paths.add_model_folder_path("graphs", user_graphs, is_default=True)  # as extra_model_paths.yaml would

    name, nodes = load_pack(pack)
    runtime = sys.modules[name + ".nodes.runtime"]

    def model_speedup(model, **chosen):
        """The node with its defaults, by input name (as ComfyUI calls it)."""
        values = dict(min_resolution=64, max_resolution=2048, max_batch_size=4, compile=True, save_compiled=False,
                      backend="aot", build=BLOCKING_BUILD)
        return nodes["KeepFastModelSpeedup"].execute(model=model, **{**values, **chosen})

    def vae_speedup(vae, **chosen):
        values = dict(min_resolution=64, max_resolution=2048, max_batch_size=4, compile=True, backend="aot",
                      build=BLOCKING_BUILD)
        return nodes["KeepFastVAESpeedup"].execute(vae=vae, **{**values, **chosen})

    out = {"nodes": sorted(nodes)}
    paths, extensions = folder_paths.folder_names_and_paths["graphs"]
    out["graphs_paths"] = list(paths)
    out["graphs_extensions"] = sorted(extensions)

    import comfy.sd
    from comfy.patcher_extension import WrappersMP

    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(folder_paths.get_full_path("checkpoints", checkpoint))
    faster = model_speedup(model).args[0]
    faster_vae = vae_speedup(vae).args[0]
    out["model_is_clone"] = faster is not model and faster.model is model.model
    out["input_model_wrappers"] = sorted(model.wrappers.get(WrappersMP.DIFFUSION_MODEL, {}))
    out["output_model_wrappers"] = sorted(faster.wrappers.get(WrappersMP.DIFFUSION_MODEL, {}))
    out["vae_is_copy"] = faster_vae is not vae and faster_vae.patcher is vae.patcher
    out["input_vae_decode"] = type(vae.first_stage_model.decode).__name__
    out["output_vae_decode"] = type(faster_vae.first_stage_model.decode).__name__
    out["vae_weights_shared"] = all(
        a is b for a, b in zip(vae.first_stage_model.parameters(), faster_vae.first_stage_model.parameters()))
    again = model_speedup(faster, max_resolution=1024, max_batch_size=2).args[0]
    out["respeed_wrappers"] = [len(again.wrappers[WrappersMP.DIFFUSION_MODEL]["keepfast"]),
                               len(again.wrappers[WrappersMP.APPLY_MODEL]["keepfast"])]

    # Another pack's DIFFUSION_MODEL wrapper inside ours still runs; our call takes the model's place.
    import torch
    import nodes as comfy_nodes

    seen = []

    def other_wrapper(executor, *args, **kwargs):
        seen.append(type(executor.class_obj).__name__)
        return executor(*args, **kwargs)

    no_compile = model_speedup(model, compile=False).args[0]
    chained = no_compile.clone()
    chained.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "other_pack", other_wrapper)
    positive = clip.encode_from_tokens_scheduled(clip.tokenize("a cat"))
    negative = clip.encode_from_tokens_scheduled(clip.tokenize(""))
    before = runtime.stats()["counts"]
    with torch.inference_mode():
        comfy_nodes.common_ksampler(chained, 1, 1, 7.0, "euler", "normal", positive, negative,
                                    {"samples": torch.zeros(1, 4, 8, 8)})
    after = runtime.stats()["counts"]
    out["inner_wrapper_calls"] = seen
    out["chained_eager_calls"] = after["unet_eager_calls"] - before["unet_eager_calls"]
    out["chained_fallbacks"] = [m["reason"] for m in runtime.stats()["messages"] if m["kind"] == "fallback"]

    # A fault inside the pack (guard extraction after export raises a KeyError nobody expects) costs
    # speed, never the image: the sampler completes, eagerly, with the reason recorded.
    aot_export = sys.modules[name + ".compiler.backends.aot_export"]
    original_guards = aot_export._guards_from

    def broken_guards(*args):
        raise KeyError("injected fault")

    aot_export._guards_from = broken_guards
    try:
        faulty = model_speedup(model, max_resolution=256, max_batch_size=1).args[0]
        mark = time.time()
        with torch.inference_mode():
            (faulted,) = comfy_nodes.common_ksampler(faulty, 3, 1, 7.0, "euler", "normal", positive, negative,
                                                     {"samples": torch.zeros(1, 4, 8, 8)})
            (plain,) = comfy_nodes.common_ksampler(model, 3, 1, 7.0, "euler", "normal", positive, negative,
                                                   {"samples": torch.zeros(1, 4, 8, 8)})
    finally:
        aot_export._guards_from = original_guards
    out["fault_max_diff"] = float((faulted["samples"] - plain["samples"]).abs().max())
    out["fault_fallbacks"] = [e.reason for e in runtime.registry().log.since(mark) if e.kind == "fallback"]

    # Progress and messages reach ComfyUI's ProgressBar and the page.
    import comfy.utils

    out["progress"], out["sent"] = capture_server(comfy.utils, runtime)

    reason = importlib.import_module(name + ".compiler.machine.torch_support").refusal("2.5.1")
    # A backend that does not run here (OneFlow is not installed in ComfyUI's Python): offered or not, a
    # workflow naming it passes validation and the speedup nodes pass their input through with the reason.
    oneflow_reason = sys.modules[name + ".compiler"].unavailable_reason("oneflow")
    out["backend_choices"] = runtime.backend_choices()
    out["oneflow_reason"] = oneflow_reason
    out["backend_tooltip"] = runtime.backend_tooltip()
    out["backend_validation"] = [nodes["KeepFastModelSpeedup"].validate_inputs("oneflow"),
                                 nodes["KeepFastVAESpeedup"].validate_inputs("inductor"),
                                 nodes["KeepFastModelSpeedup"].validate_inputs("tensorrt")]
    if oneflow_reason is not None:
        result = model_speedup(model, backend="oneflow")
        vae_result = vae_speedup(vae, backend="oneflow")
        out["oneflow_passthrough"] = [result.args[0] is model, oneflow_reason in result.ui["text"][0],
                                      vae_result.args[0] is vae, oneflow_reason in vae_result.ui["text"][0]]
    chosen = model_speedup(model, backend="inductor").args[0]
    out["inductor_runner_backend"] = sys.modules[name + ".nodes.unet"].runner_of(chosen).settings.backend

    runtime.compile_unavailable = lambda backend="aot": reason
    passed = {}
    result = model_speedup(model)
    passed["model_speedup"] = [result.args[0] is model, reason in result.ui["text"][0]]
    result = vae_speedup(vae)
    passed["vae_speedup"] = [result.args[0] is vae, reason in result.ui["text"][0]]
    result = nodes["KeepFastSaveGraph"].execute("x", model=model, vae=vae)
    passed["save_graph"] = [result.args[0] is model and result.args[1] is vae, reason in result.args[2]]
    result = nodes["KeepFastLoadGraph"].execute("(every stored graph that fits)", True, False, model=model, vae=vae)
    passed["load_graph"] = [result.args[0] is model and result.args[1] is vae, reason in result.args[2]]
    result = nodes["KeepFastWarmupGraphs"].execute("512x512", "1", False, model=model, vae=vae)
    passed["warmup"] = [result.args[0] is model and result.args[1] is vae, reason in result.args[2]]
    out["unavailable_passthrough"] = passed
    warmup = nodes["KeepFastWarmupGraphs"]
    out["warmup_validation"] = [warmup.validate_inputs("512x512, 768x512", "1, 2"),
                                warmup.validate_inputs("512by512", "1"), warmup.validate_inputs("512", "two")]
    return out


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:4])))
