"""A ComfyUI SD1.5 diffusion model traced in a spawned process, in ComfyUI's Python (test_comfyui_spawned_trace.py);
prints one JSON object of findings.

    python kf_spawned_trace.py PACK_DIR BASE_DIR CHECKPOINT_PATH

The pack is loaded as ComfyUI loads it (a package named by its path), the checkpoint by ComfyUI's loader; the
diffusion model is pickled without its weights (compiler/tracing/spawned_trace.py), traced in a spawned process
that loads the pack under the same name, and its program and guards are compared with a trace here.
"""

from __future__ import annotations

import functools
import importlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (this pack): benchmarks.comfy
from benchmarks.comfy.pack import comfy_with_pack  # noqa: E402


def main(pack: str, base: str, checkpoint: str) -> dict:
    name, _ = comfy_with_pack(pack, base)
    import torch
    import comfy.sd

    def of(module: str):
        return importlib.import_module(f"{name}.{module}")

    aot_export, aot_build = of("compiler.backends.aot_export"), of("compiler.backends.aot_build")
    spawned, job_folder = of("compiler.tracing.spawned_trace"), of("compiler.builds.job_folder")
    unet, sizes, vae_nodes = of("nodes.unet"), of("nodes.sizes"), of("nodes.vae")
    compiled_forward, registry = of("compiler.serving.compiled_forward"), of("compiler.store.registry")
    patcher, _, vae = comfy.sd.load_checkpoint_guess_config(checkpoint, output_vae=True, output_clip=False)[:3]
    model = patcher.model.diffusion_model
    dtype = next(model.parameters()).dtype
    shape_range = sizes.latent_range(64, 128, 1, sequence=(77, 77))
    forward = compiled_forward.CompiledForward(model, compiled_forward.CompileOptions(shape_range=shape_range),
                                               registry.GraphRegistry(), forward_fn=unet._traced_forward_fn,
                                               binder=unet.call_binder(model))
    args, kwargs = unet.unet_example_call(4, 768, None, 1, 8, 8, 77, dtype, "cpu")
    call = forward.flatten(args, kwargs)
    trace = functools.partial(aot_export.trace_for_build, model, unet._traced_forward_fn, call, shape_range)
    folder = Path(tempfile.mkdtemp(prefix="build-"))
    work = functools.partial(job_folder.trace_job, trace, dict(aot_build.PACKAGE_CONFIG), True, folder)
    payload, packages = spawned.weightless_pickle(work, call.tensors)
    vae_payload, _ = spawned.weightless_pickle(functools.partial(vae_nodes._vae_forward, vae.first_stage_model,
                                                                 "decode"), [])
    out = {"model_class": f"{type(model).__module__}.{type(model).__qualname__}",
           "operations": sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()
                                 if type(m).__module__.startswith("comfy.ops")}),
           "payload_bytes": len(payload), "weight_bytes": sum(p.nbytes for p in model.parameters()),
           "vae_payload_bytes": len(vae_payload),
           "vae_weight_bytes": sum(p.nbytes for p in vae.first_stage_model.parameters()),
           "packages": sorted(packages), "pack_name": name}
    tracer = spawned.SpawnedTrace(work, call.tensors, folder)
    tracer.wait()
    failure = tracer.failure()
    out["failure"] = failure.message if failure else None
    out["output_tail"] = tracer.output_tail()
    out["files"] = sorted(p.name for p in folder.iterdir())
    if failure is None:
        here, found = trace()
        traced = json.loads((folder / job_folder.TRACED).read_text())
        out["same_guards"] = traced["guards"] == found["guards"] and bool(found["guards"])
        out["same_out_spec"] = traced["out_spec"] == found["out_spec"]
        torch.export.save(job_folder.weightless(here)[0], str(folder / "here.pt2"))
        theirs, ours = torch.export.load(str(folder / "program.pt2")), torch.export.load(str(folder / "here.pt2"))
        out["same_code"] = theirs.graph_module.code == ours.graph_module.code
        out["same_layout"] = json.loads((folder / "job.json").read_text())["weights"] == job_folder.weightless(here)[1]
    return out


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:4])), flush=True)
