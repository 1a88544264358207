"""ComfyUI's TorchCompileModel on the same model as Model Speedup, in ComfyUI's own Python; run by
test_comfyui_other_compilers.py.

    python kf_other_compilers.py PACK_DIR BASE_DIR FAMILY

A workflow may carry both nodes. Two compilers cannot both serve the model: the pack's graphs serve it and
TorchCompileModel's wrapper is skipped with a note (nodes/other_compilers.py), in either node order. FAMILY is
`sd15` (a whole-model graph) or `flux` (block graphs). Each order samples twice (two sizes) against the model
without either node; TorchCompileModel's wrapper is wrapped in a counter to show it never ran. Prints one JSON
object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import sys

from kf_inprocess import BLOCKING_BUILD, family_in_comfy, served_calls  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
             backend="aot", build=BLOCKING_BUILD)
CALLS = [(128, 128, 1, 7), (192, 128, 2, 11)]  # (width, height, batch, text tokens)


def main(pack: str, base: str, family_name: str) -> dict:
    env = family_in_comfy(pack, base, family_name)
    from comfy.patcher_extension import WrappersMP
    from comfy_extras import nodes_torch_compile

    torch_compile_calls = [0]

    def counted(wrapper):
        def counting(executor, *args, **kwargs):
            torch_compile_calls[0] += 1
            return wrapper(executor, *args, **kwargs)
        return counting

    def torch_compile_model(model):
        compiled = nodes_torch_compile.TorchCompileModel.execute(model=model, backend="inductor").args[0]
        entries = compiled.wrappers[WrappersMP.APPLY_MODEL]["torch.compile"]
        entries[:] = [counted(wrapper) for wrapper in entries]
        return compiled

    def speedup(model):
        return env.nodes["KeepFastModelSpeedup"].execute(model=model, **RANGE).args[0]

    def served() -> dict:
        return {**served_calls(env.name, env.module), "torch_compile_calls": torch_compile_calls[0]}

    rows = []
    for order in ("torch.compile, then speedup", "speedup, then torch.compile"):
        patcher = env.family.patcher
        model = (speedup(torch_compile_model(patcher)) if order.startswith("torch.compile")
                 else torch_compile_model(speedup(patcher)))
        for call in CALLS:
            before = served()
            got = env.sample(model, *call)
            want = env.sample(patcher, *call)
            now = served()
            rows.append({"order": order, "call": list(call), "diff": float((got - want).abs().max()),
                         "scale": float(want.abs().max()), "events": {k: now[k] - before[k] for k in now}})
    events = env.registry.events
    return {"family": family_name, "rows": rows, "blocks": env.block_count(),
            "notes": [e.reason for e in events if e.kind == "note"],
            "fallbacks": [e.reason for e in events if e.kind == "fallback"]}


if __name__ == "__main__":
    result = main(*sys.argv[1:4])
    print("KEEPFAST-RESULT " + json.dumps(result))
