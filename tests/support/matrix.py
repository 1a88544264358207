"""The correctness matrix's models and calls, shared by tests/serving/test_correctness_matrix.py and its restart.

Kinds: diffusers' UNet2DConditionModel as SD and as SDXL (text_time) builds it, the AutoencoderKL's
decoder and encoder, and Flux, SD3 and Wan transformers (served block by block), all tiny with random
weights. Calls are shaped as the pipelines make them: without CFG one prompt is repeated for every
image and the latents differ; with CFG the latents are doubled and the text is [negative; prompt].

    python -m tests.support.matrix KIND GRAPHS_DIR   # a restart: other weights, load_pipe, the matrix

prints one JSON object: compiles, loads, fallbacks and, per call, the difference from eager.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from compiler import GraphRegistry, ShapeRange, compile_pipe, load_pipe
from compiler.blocks.tokens import Dims
from compiler.diffusers_api import compiled_parts
from compiler.demo.tiny_models import SDXL_POOLED, tiny_unet, tiny_vae

# latents 8-48 (the tiny VAE's encoder sees pixels up to 48), up to 3 images with CFG (6 rows), two CLIP chunks
RANGE = ShapeRange(batch=(1, 6), spatial=(8, 48), sequence=(1, 160), frames=(1, 5))
KINDS = ("sd-unet", "sdxl-unet", "vae-decoder", "vae-encoder", "flux", "sd3", "wan")
TARGET = {"sd-unet": "unet", "sdxl-unet": "unet", "vae-decoder": "vae.decoder", "vae-encoder": "vae.encoder",
          "flux": "transformer", "sd3": "transformer", "wan": "transformer"}
SIZES = {"vae-encoder": ((32, 32), (32, 48))}  # (height, width): pixels for the encoder, latents for the rest
LATENT_SIZES = ((16, 16), (16, 24))
TOKENS = {"sd-unet": (77, 154), "sdxl-unet": (77, 154)}
BLOCK_TOKENS = (5, 33)
WAN_FRAMES = (1, 3)  # latent frames: an image and a short video
TEXT = ("encoder_hidden_states", "pooled_projections", "text_embeds")  # one row per prompt
BATCHED = TEXT + ("sample", "hidden_states", "timestep", "time_ids", "guidance")  # one row per model batch row
TOLERANCE = 1e-4  # float32: graphs differ from eager by ~1e-6 relative to the output's scale


@dataclass(frozen=True)
class Call:
    images: int
    cfg: bool
    size: Tuple[int, int]  # (height, width)
    tokens: int = 77
    frames: int = 1

    @property
    def batch(self) -> int:
        """Rows the model sees: CFG batches the negative prompt with the prompt."""
        return self.images * (2 if self.cfg else 1)


def is_vae(kind: str) -> bool:
    return kind.startswith("vae")


def first_call(kind: str, batch: int) -> Call:
    """The call that compiles: a model batch of 1 (one image, no CFG) or 2 (one image with CFG; a VAE: 2 images)."""
    size = SIZES.get(kind, LATENT_SIZES)[0]
    if is_vae(kind):
        return Call(batch, False, size)
    return Call(1, batch == 2, size, TOKENS.get(kind, BLOCK_TOKENS)[0], WAN_FRAMES[0] if kind == "wan" else 1)


def later_calls(kind: str, seed: int) -> List[Call]:
    """1, 2 and 3 images x CFG off and on x two sizes x two prompt lengths (Wan: x two frame counts), shuffled."""
    sizes = SIZES.get(kind, LATENT_SIZES)
    if is_vae(kind):
        calls = [Call(images, False, size) for images, size in itertools.product((1, 2, 3), sizes)]
    else:
        frames = WAN_FRAMES if kind == "wan" else (1,)
        calls = [Call(*values) for values in itertools.product((1, 2, 3), (False, True), sizes,
                                                                TOKENS.get(kind, BLOCK_TOKENS), frames)]
    random.Random(seed).shuffle(calls)
    return calls


class Subject:
    """One kind's model behind compile_pipe (or load_pipe), and its calls with and without the graphs."""

    def __init__(self, kind: str, seed: int, registry: GraphRegistry, graphs, *, load: bool = False,
                 verify: bool = False):
        self.kind, self.registry = kind, registry
        self.module, self.pipe = _build(kind, seed)
        target = TARGET[kind]
        ignores = [t for t in ("unet", "vae.decoder", "vae.encoder") if t != target]
        if load:
            self.report = load_pipe(self.pipe, graphs, shape_range=RANGE, ignores=ignores, registry=registry,
                                    verify=verify)
        else:
            compile_pipe(self.pipe, shape_range=RANGE, ignores=ignores, graphs_dir=graphs, autosave=True,
                         registry=registry, verify=verify)
            self.report = None
        self.served = compiled_parts(self.pipe)[target]

    @property
    def graph_calls(self) -> int:
        return self.served.graph_calls

    def inputs(self, call: Call, seed: int = 0) -> Tuple[tuple, dict]:
        generator = torch.Generator().manual_seed(seed + 1000 * call.images + call.size[1] + call.tokens)
        if self.kind in ("flux", "sd3", "wan"):
            dims = Dims(call.images, call.size[0], call.size[1], call.frames, call.tokens)
            args, kwargs = self.served.family.example_call(self.module, dims)
        else:
            args, kwargs = (), _model_inputs(self.kind, self.module, call, generator)
        return args, _as_pipelines_call(kwargs, call, generator)

    def run(self, call: Call, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, int]:
        """(output through the pack, eager output, calls a graph served)."""
        args, kwargs = self.inputs(call, seed)
        before = self.graph_calls
        with torch.no_grad():
            got = _first(self.module(*args, **kwargs))
            served = self.graph_calls - before
            want = _first(self.served.eager(*args, **kwargs))
        return got, want, served


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def _build(kind: str, seed: int) -> Tuple[torch.nn.Module, Any]:
    if kind == "sd-unet":
        module = tiny_unet(seed)
        return module, SimpleNamespace(unet=module)
    if kind == "sdxl-unet":
        from compiler.demo.tiny_models import tiny_sdxl_pipeline

        module = tiny_sdxl_pipeline(seed).unet
        return module, SimpleNamespace(unet=module)
    if is_vae(kind):
        vae = tiny_vae(seed)
        return (vae.decoder if kind == "vae-decoder" else vae.encoder), SimpleNamespace(vae=vae)
    from tests.support import tiny_transformers as tt

    module = tt.build(kind, seed)
    return module, tt.pipe_of(module)


def _model_inputs(kind: str, module: torch.nn.Module, call: Call, generator: torch.Generator) -> dict:
    n, (height, width) = call.images, call.size
    if kind == "vae-decoder":
        return {"sample": torch.randn(n, 4, height, width, generator=generator)}
    if kind == "vae-encoder":
        return {"sample": torch.rand(n, 3, height, width, generator=generator) * 2 - 1}
    config = module.config
    kwargs = {
        "sample": torch.randn(n, config.in_channels, height, width, generator=generator),
        "timestep": torch.tensor(500.0),  # pipelines pass one timestep for the whole batch
        "encoder_hidden_states": torch.randn(n, call.tokens, config.cross_attention_dim, generator=generator),
        "return_dict": False,
    }
    if kind == "sdxl-unet":
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(n, SDXL_POOLED, generator=generator),
                                       "time_ids": torch.tensor([[float(height * 8), float(width * 8), 0, 0,
                                                                  float(height * 8), float(width * 8)]]).repeat(n, 1)}
    return kwargs


def _as_pipelines_call(kwargs: dict, call: Call, generator: torch.Generator) -> dict:
    """Per-image inputs turned into the model batch a pipeline sends (see the module docstring)."""
    def shape(path, value):
        name = str(getattr(path[-1], "key", getattr(path[-1], "idx", "")))
        if not isinstance(value, torch.Tensor) or name not in BATCHED or value.dim() == 0:
            return value
        if value.shape[0] != call.images:
            return value
        if name in TEXT:
            prompt = value[:1].repeat(call.images, *([1] * (value.dim() - 1)))  # one prompt for every image
            if not call.cfg:
                return prompt
            negative = torch.randn(prompt[:1].shape, generator=generator).repeat(call.images, *([1] * (value.dim() - 1)))
            return torch.cat([negative, prompt])
        return torch.cat([value, value]) if call.cfg else value
    return pytree.tree_map_with_path(shape, kwargs)


def _first(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


def restart(kind: str, graphs: str) -> dict:
    """A new process with other weights: load_pipe, then the matrix in another order."""
    registry = GraphRegistry()
    subject = Subject(kind, seed=7, registry=registry, graphs=graphs, load=True)
    rows = []
    for call in later_calls(kind, seed=99):
        got, want, served = subject.run(call, seed=99)
        rows.append({"call": [call.images, call.cfg, list(call.size), call.tokens, call.frames],
                     "difference": relative_difference(got, want), "graph_calls": served})
    return {"compiles": len(registry.compiles), "loads": len(registry.loads),
            "fallbacks": [e.reason for e in registry.fallbacks], "problems": subject.report.problems, "rows": rows}


def main(argv: Optional[List[str]] = None) -> None:
    kind, graphs = (argv or sys.argv[1:])[:2]
    print(json.dumps(restart(kind, graphs)))


if __name__ == "__main__":
    main()
