"""What every ComfyUI transformer family served block by block shares: `ComfyFamily` (nodes/blocks.py).

A family says, for one of ComfyUI's diffusion model classes, which modules
are its repeated blocks, how latent pixels and frames become tokens and how
to make a call of the whole model at given sizes from the model's own layers
(the families: image_families.py, video_families.py). A block's graph runs
the block's own forward with ComfyUI's `attention_pytorch` in its
`transformer_options` (nodes/attention.py) and binds the block's weights as
stored, as ComfyUI-GGUF stores them (nodes/gguf.py) or as low-VRAM mode
patches them per call (nodes/lowvram.py).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..compiler import PLAIN, BlockFamily, CallTensors, Dims, Geometry, StoredWeights, generator_for, model_dtype_device
from .attention import graph_attention_options
from .gguf import GGUFWeights, is_ggml_layer
from .lowvram import LowVramWeights


def in_features(layer: Any) -> int:
    """The input width of a Linear (ComfyUI's ops keep torch's attribute)."""
    return int(getattr(layer, "in_features", None) or layer.weight.shape[1])


_REGISTERED: set = set()


def _register_dataclasses(*values: Any) -> None:
    """Dataclasses among block inputs (Chroma's modulation outputs) become pytree nodes, so their
    tensors are graph inputs and the block still gets the dataclass (torch.export's own registration)."""
    stack = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(v for k, v in value.items() if k != "transformer_options")
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            if cls not in _REGISTERED:
                _REGISTERED.add(cls)
                try:
                    torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
                except ValueError:
                    pass  # registered already (by another copy of the pack, or torch itself)
            stack.extend(getattr(value, f.name) for f in dataclasses.fields(value))


def first_in(module: torch.nn.Module) -> int:
    """The input width of the first Linear inside `module` (an embedder's input)."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            return in_features(sub)
    raise ValueError(f"{type(module).__name__} has no Linear layer")


class ComfyFamily(BlockFamily):
    """A ComfyUI diffusion model class: its block classes, geometry and example call."""

    # Tokens the model joins to the prompt's before its blocks (image features), which the text range must hold
    # besides the prompt's PROMPT_TOKENS.
    joined_text_tokens = 0

    model_classes: Tuple[str, ...] = ()
    block_classes = ()
    video = False
    geometry = Geometry(patch=2)  # 2x2 latent pixels per token: every image family here
    spatial_multiple = 2
    inputs_dtype: Optional[torch.dtype] = None  # set per model by engine_for (`input_dtype`)
    # ComfyUI-GGUF marks the layer holding the file's largest tensor (`largest_layer`, for its memory estimate):
    # the block computes the same, so it must not make that block a structure of its own.
    ignored_settings = frozenset({"largest_layer"})
    gguf: Optional[GGUFWeights] = None  # set per model by for_model
    lowvram: Optional[LowVramWeights] = None  # set per model by for_model

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether this family describes `model`: a variant sharing a class with another family (whose VAE or
        patching differs) is listed before it in FAMILIES and says here which models are its own."""
        return True

    def for_model(self, model: torch.nn.Module, dtype: Optional[torch.dtype]) -> "ComfyFamily":
        """This family for one model whose sampler sends `dtype` inputs (the shared instance stays as is)."""
        own = copy.copy(self)
        own.inputs_dtype = dtype
        own.geometry = self.model_geometry(model)
        own.gguf = GGUFWeights(dtype) if any(is_ggml_layer(m) for m in model.modules()) else None
        own.lowvram = LowVramWeights(dtype)
        return own

    def call_tensors(self, module: torch.nn.Module,
                     device: Optional[torch.device] = None) -> Optional[CallTensors]:
        """GGUF's per-call deltas and low-VRAM mode's per-call weights (patched, or moved in from CPU memory:
        nodes/lowvram.py), together."""
        found = [c for c in (super().call_tensors(module, device),
                             self.lowvram.call_tensors(module, device) if self.lowvram is not None else None) if c]
        if len(found) < 2:
            return found[0] if found else None
        return {**found[0][0], **found[1][0]}, found[0][1] or found[1][1]

    def stored_weights(self, block: torch.nn.Module) -> StoredWeights:
        """ComfyUI-GGUF's forms where the model was loaded by it (nodes/gguf.py), else plain weights."""
        return self.gguf if self.gguf is not None else PLAIN

    def model_geometry(self, model: torch.nn.Module) -> Geometry:
        """How this model's latents become tokens (a model's config may change the family's default)."""
        return self.geometry

    def block_reason(self, args: tuple, kwargs: dict) -> Optional[str]:
        """Why this block call must run eager for what only this family's blocks read, or None."""
        return None

    def block_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        _register_dataclasses(args, kwargs)
        if "transformer_options" not in kwargs:
            return args, kwargs
        rest = dict(kwargs)
        del rest["transformer_options"]
        return args, rest

    def reference_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        # an empty transformer_options, as a call outside any sampler has (LTX-2's block reads it unconditionally)
        return args, {"transformer_options": {}, **kwargs}

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        args, kwargs = self.rows_spread(module, args, kwargs)
        return type(module).forward(module, *args, transformer_options=graph_attention_options(), **kwargs)

    def example_call(self, model: torch.nn.Module, dims: Dims) -> Tuple[tuple, dict]:
        declared, device = model_dtype_device(model)
        dtype = self.inputs_dtype or declared
        generator = generator_for(dims)

        def randn(*shape) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

        kwargs = self.inputs(model, dims, randn, dtype, device)
        kwargs["transformer_options"] = {}
        # as ComfyUI's BaseModel._apply_model calls it: latent and timestep positional, the rest by name
        return (kwargs.pop("x"), kwargs.pop("t")), kwargs

    def inputs(self, model, dims: Dims, randn: Callable[..., torch.Tensor], dtype, device) -> Dict[str, Any]:
        """The diffusion model's inputs at `dims` as ComfyUI's model_base passes them ("x" the latent,
        "t" the timesteps, the rest under the forward's own names)."""
        raise NotImplementedError

    @staticmethod
    def timesteps(dims: Dims, device, value: float = 0.5) -> torch.Tensor:
        return torch.full((dims.batch,), value, dtype=torch.float32, device=device)

    def latent(self, model, dims: Dims, randn, channels: int) -> torch.Tensor:
        if self.video:
            return randn(dims.batch, channels, dims.frames, dims.height, dims.width)
        return randn(dims.batch, channels, dims.height, dims.width)
