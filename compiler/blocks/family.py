"""What the block engine needs to know about a model family, and nothing of where the model comes from.

A family says how pixels and frames become tokens (`geometry`), which latent
sizes are valid (`spatial_multiple`), which classes are its blocks, and how to
make a call of the whole model at given sizes from the model's config
(`example_call`): the engine runs two such calls to learn what each block
input dimension is, and the same calls let graphs be saved before any image
was generated. diffusers' families are in `diffusers_families`; the ComfyUI
adapter defines its own for ComfyUI's classes (the compiler never imports
ComfyUI).
"""

from __future__ import annotations

import inspect
from typing import Any, ContextManager, Dict, Optional, Sequence, Tuple

import torch

from ..keys.structure import module_device, module_dtype
from .quantised import PLAIN, CallTensors, StoredWeights
from .tokens import Dims, Geometry


class BlockFamily:
    name: str = "generic"
    geometry: Geometry = Geometry()
    spatial_multiple: int = 2  # latent pixels; a valid latent side is a multiple of it
    block_classes: Optional[Sequence[str]] = None  # None: the model's `_repeated_blocks`, else found by structure
    ignored_settings: frozenset = frozenset()  # block attributes its forward never reads (a layer index)
    split_stacks: bool = False  # one structure in several stacks called on different tokens: apart
    latent_scale: int = 8  # image pixels per latent pixel (what a node's pixel range is divided by)
    frame_scale: int = 1  # video frames per latent frame after the first (Wan, HunyuanVideo: 4; LTXV: 8)
    # Block inputs that hold a timestep either once per sample or once per token (dim 1): named from example calls
    # that send one per token, served in both forms by one graph (`rows_spread`, in every `block_forward`).
    timestep_rows: Tuple[str, ...] = ()

    def example_call(self, model: torch.nn.Module, dims: Dims) -> Tuple[tuple, dict]:
        """A call of the whole model at `dims`, built from its config (random inputs)."""
        raise NotImplementedError

    def why_not_compiled(self, block: torch.nn.Module) -> Optional[str]:
        """Why this block structure cannot be served by a graph, said before trying; None: try it."""
        return self.stored_weights(block).why_not(block)

    # -- weights stored in a form the block converts per call (quantised.py) -----------------
    def stored_weights(self, block: torch.nn.Module) -> StoredWeights:
        """Who knows this block's stored weight forms (quantised checkpoints); the plain one by default."""
        return PLAIN

    def storage_key(self, block: torch.nn.Module) -> str:
        return self.stored_weights(block).storage_key(block)

    def tracing(self, block: torch.nn.Module) -> ContextManager:
        """Entered around tracing `block` (its stored weights traced as the graph needs them)."""
        return self.stored_weights(block).tracing(block)

    def call_tensors(self, module: torch.nn.Module,
                     device: Optional[torch.device] = None) -> Optional[CallTensors]:
        """Tensors bound for a call of `module` on `device` besides or instead of its own (per-call LoRA deltas), or
        None."""
        return self.stored_weights(module).call_tensors(module, device)

    def block_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """A block call's inputs without bookkeeping a graph does not take (ComfyUI's
        `transformer_options`); the block's eager forward still gets the call as made."""
        return args, kwargs

    def row_tokens(self, arguments: Dict[str, Any]) -> Dict[str, int]:
        """For each of `timestep_rows` in a block call (its arguments by name), the tokens its rows cover."""
        return {}

    def rows_spread(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """A block call with each of its `timestep_rows` inputs spread over its tokens (`spread_rows`): what a
        graph computes from either form."""
        if not self.timestep_rows:
            return args, kwargs
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
        for name, tokens in self.row_tokens(bound.arguments).items():
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = spread_rows(bound.arguments[name], tokens)
        return bound.args[1:], bound.kwargs

    def reference_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """A call rebuilt from a graph's inputs (`block_inputs` dropped its side inputs) as the block's eager
        forward takes it for a reference output: the side inputs a plain call has given back."""
        return args, kwargs

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        """What a block graph computes for a call of `module` (traced once per block structure).

        The block's own forward by default; an adapter whose blocks take
        side inputs the graph drops (ComfyUI's `transformer_options`) gives
        the traced call the ones it must see (an attention that traces once
        for every size).
        """
        args, kwargs = self.rows_spread(module, args, kwargs)
        return type(module).forward(module, *args, **kwargs)

    def latent_frames(self, video_frames: int) -> int:
        """Latent frames of `video_frames` frames (the first frame is kept, the rest packed)."""
        if self.frame_scale <= 1:
            return max(1, video_frames)
        return 1 + max(0, video_frames - 1) // self.frame_scale

    def describe(self) -> str:
        return self.name


def spread_rows(timestep: torch.Tensor, tokens: int) -> torch.Tensor:
    """[batch, rows, ...] -> [batch, tokens, ...], token i taking row i * rows // tokens: one row for all tokens, or
    each token its own, with a gather and no branch on which (Inductor folds it into the kernels that read it)."""
    rows = torch.div(torch.arange(tokens, device=timestep.device) * timestep.shape[1], tokens, rounding_mode="floor")
    return timestep.index_select(1, rows)


def _randn(shape, like: Tuple[torch.dtype, torch.device], generator: torch.Generator) -> torch.Tensor:
    dtype, device = like
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def model_dtype_device(model: torch.nn.Module) -> Tuple[torch.dtype, torch.device]:
    """The dtype a model's caller casts its inputs to, and the device its weights are on.

    The model's own `dtype` where it has one (diffusers' ModelMixin, which
    pipelines cast latents to; ComfyUI's diffusion models), not the first
    parameter's: a bfloat16 Wan keeps `scale_shift_table` and its norms in
    float32, and float32 example inputs would fail where the pipeline's do not.
    """
    declared = getattr(model, "dtype", None)
    if not (isinstance(declared, torch.dtype) and declared.is_floating_point):
        declared = module_dtype(model)
    return declared, module_device(model)


def generator_for(dims: Dims, seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 7919 * dims.batch + 104729 * dims.text + dims.height * 31 + dims.width)


def config_value(model: torch.nn.Module, name: str, default: Any = None) -> Any:
    config = getattr(model, "config", None)
    if config is None:
        return default
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get"):
        value = config.get(name, None)
    return default if value is None else value
