"""Record what torch.export says about input sizes for real models, as test data (JSON text).

The guard tests (tests/keys/test_guard_forms.py) check the pack's guard printing
and interpreter against sympy on these records, so guards from a torch or a
ComfyUI the test machine does not have are still checked. Run it again after
a torch or ComfyUI upgrade and commit the new files:

    # the pack's own tiny diffusers UNet (SDPA attention), in the main venv:
    python tests/guard_data/capture.py diffusers-unet tests/guard_data/NAME.json
    # ComfyUI's UNetModel (comfy.supported_models.SD15, tiny config) or Flux, in ComfyUI's Python,
    # under the attention ComfyUI would pick with these flags (default: none, i.e. ComfyUI's choice):
    COMFYUI_PATH=/path/to/ComfyUI python tests/guard_data/capture.py comfy-sd15 OUT.json --attention split
    COMFYUI_PATH=/path/to/ComfyUI python tests/guard_data/capture.py comfy-flux OUT.json

Each record holds the example call, every input dimension (a size, or a
sympy expression as `srepr`), each symbol's range, and torch's guard text with
the sympy expression it was printed from (`guard_code`/`guard_exprs`, in
torch's own order and filter) and the input size each guard symbol reads
(`sources`). The export itself goes through the aot
backend's `export_program`, the way the pack exports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ATTENTION_FLAGS = {
    "default": [],
    "split": ["--use-split-cross-attention"],
    "quad": ["--use-quad-cross-attention"],
    "pytorch": ["--use-pytorch-cross-attention"],
}
SD15_CONFIG = {
    "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 32, "num_res_blocks": [1, 1],
    "channel_mult": [1, 2], "transformer_depth": [1, 1], "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1, "use_spatial_transformer": True, "context_dim": 32,
    "use_linear_in_transformer": False, "num_heads": 4, "num_head_channels": -1, "legacy": False,
    "adm_in_channels": None, "use_temporal_resblock": False, "use_temporal_attention": False,
}
FLUX_CONFIG = {
    "image_model": "flux", "guidance_embed": True, "in_channels": 16, "out_channels": 16, "patch_size": 2,
    "vec_in_dim": 32, "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 1,
    "depth_single_blocks": 1, "axes_dim": [8, 12, 12], "theta": 10000, "qkv_bias": True, "txt_ids_dims": [],
}


def _comfy(attention: str):
    """Import ComfyUI with the attention flags applied, as main.py would parse them."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        sys.exit("COMFYUI_PATH is not set")
    sys.path.insert(0, path)
    import comfy.cli_args

    args = comfy.cli_args.args
    args.cpu = True
    args.use_split_cross_attention = attention == "split"
    args.use_quad_cross_attention = attention == "quad"
    args.use_pytorch_cross_attention = attention == "pytorch"
    import comfy.ldm.modules.attention as attention_module
    import comfy.supported_models

    return comfy.supported_models, attention_module.optimized_attention.__name__


def _init(module, seed: int = 0) -> None:
    import torch

    torch.manual_seed(seed)
    for sub in module.modules():
        for base in (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.Embedding):
            if isinstance(sub, base):
                base.reset_parameters(sub)
                break


def _comfy_forward(module, **kwargs):
    return module._forward(transformer_options={}, **kwargs)


def build(model: str, attention: str, batch: int, size: int):
    """(module, forward_fn, args, kwargs, description, attention function name)."""
    import torch

    if model == "diffusers-unet":
        sys.path.insert(0, str(REPO))
        from compiler.demo.tiny_models import prompt_embeds, tiny_unet

        unet = tiny_unet()
        kwargs = {"encoder_hidden_states": prompt_embeds(batch, 77, 32), "return_dict": False}
        args = (torch.randn(batch, 4, size, size), torch.full((batch,), 10.0))
        return unet, type(unet).forward, args, kwargs, "compiler.demo.tiny_models.tiny_unet", "diffusers SDPA"
    models, chosen = _comfy(attention)
    if model == "comfy-sd15":
        module = models.SD15(dict(SD15_CONFIG)).get_model({}).diffusion_model.float()
        kwargs = {"context": torch.randn(batch, 77, 32), "timesteps": torch.full((batch,), 500.0),
                  "x": torch.randn(batch, 4, size, size)}
        what = "comfy.supported_models.SD15 UNetModel, tiny config"
    elif model == "comfy-flux":
        module = models.Flux(dict(FLUX_CONFIG)).get_model({}).diffusion_model.float()
        kwargs = {"context": torch.randn(batch, 77, 32), "guidance": torch.full((batch,), 3.5),
                  "timestep": torch.full((batch,), 0.5), "x": torch.randn(batch, 16, size, size),
                  "y": torch.randn(batch, 32)}
        what = "comfy.supported_models.Flux, tiny config"
    else:
        sys.exit(f"unknown model {model}")
    _init(module)
    return module, _comfy_forward, (), kwargs, what, chosen


def record(ep, call, shape_range) -> dict:
    """The shape facts of `ep` in a form the tests read back with sympy."""
    import sympy
    import torch
    from torch.export.exported_program import _get_shape_env
    from torch.fx.experimental.symbolic_shapes import ShapeGuardPythonPrinter

    from compiler.tracing.export_guards import exported_shapes

    facts = exported_shapes(ep)
    shape_env = _get_shape_env(ep.graph_module)
    # torch's own filter and printer (ExportedProgram._guards_code), keeping each guard's expression.
    local = {var for var, sources in shape_env.var_to_sources.items()
             if all(not isinstance(s, torch._dynamo.source.ConstantSource) for s in sources)}
    printer = ShapeGuardPythonPrinter(shape_env.var_to_sources, lambda s: s.name, shape_env.var_to_sources)
    pairs, sources = [], {}
    for guard in shape_env.guards:
        if guard.expr.free_symbols.issubset(local):
            text = printer.doprint(guard.expr)
            if "L['self']" not in text:
                pairs.append((text, sympy.srepr(guard.expr)))
                for symbol in guard.expr.free_symbols:
                    where = re.fullmatch(r"L\['flat'\]\[(\d+)\]\.size\(\)\[(\d+)\]",
                                         printer.print_source(shape_env.var_to_sources[symbol][0]))
                    if where is None:
                        raise SystemExit(f"guard symbol {symbol} is not an input size; not recorded")
                    sources[sympy.srepr(symbol)] = [int(where.group(1)), int(where.group(2))]
    if [text for text, _ in pairs] != list(facts.guard_code):
        raise SystemExit("the shape environment's guards do not match ep._guards_code; not recorded")
    return {
        "paths": call.tensor_paths,
        "example": [list(s) for s in call.shapes],
        "shape_range": shape_range.to_json(),
        "dims": [[d if isinstance(d, int) else sympy.srepr(d) for d in dims] for dims in facts.dims],
        "ranges": {sympy.srepr(s): [low, high] for s, (low, high) in facts.ranges.items()},
        "guard_code": [text for text, _ in pairs],
        "guard_exprs": [expr for _, expr in pairs],
        "sources": sources,
    }


def dumps(data: dict) -> str:
    """JSON with one guard per line, so a diff after a torch upgrade shows what changed."""
    lines = []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            text = "[\n" + ",\n".join("  " + json.dumps(v) for v in value) + "\n ]"
        else:
            text = json.dumps(value)
        lines.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=["diffusers-unet", "comfy-sd15", "comfy-flux"])
    parser.add_argument("out")
    parser.add_argument("--attention", choices=sorted(ATTENTION_FLAGS), default="default")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=16, help="latent height and width of the example")
    options = parser.parse_args()
    sys.path.insert(0, str(REPO))
    module, forward_fn, args, kwargs, what, chosen = build(options.model, options.attention, options.batch,
                                                          options.size)
    import torch

    from compiler.backends.aot_export import export_program
    from compiler.keys.shapes import ShapeRange
    from compiler.keys.signature import FlatCall

    call = FlatCall(args, kwargs)
    shape_range = ShapeRange(batch=(1, 8), spatial=(8, 256), sequence=(1, 1024))
    ep, _ = export_program(module, forward_fn, call, shape_range)
    data = {
        "torch": torch.__version__,
        "model": what,
        "comfyui_flags": ATTENTION_FLAGS[options.attention] if options.model != "diffusers-unet" else None,
        "attention": chosen,
        **record(ep, call, shape_range),
    }
    Path(options.out).write_text(dumps(data))
    print(f"{options.out}: {len(data['guard_code'])} guards, attention {chosen}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
