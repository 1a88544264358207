"""ComfyUI's transformer families served block by block (the compiler's block engine, ComfyUI's classes).

A family here says, for one of ComfyUI's diffusion model classes, which
modules are its repeated blocks, how latent pixels and frames become tokens
and how to make a call of the whole model at given sizes from the model's
own layers (so graphs are prepared, saved and warmed up before any image).
The engine is installed once on the shared diffusion model's blocks and is
`scoped`: blocks run from graphs only inside the APPLY_MODEL hook of a MODEL
that went through a KeepFast node, so clones without the node, other
workflows and ComfyUI's own previews run the blocks as ComfyUI wrote them.

Everything around the blocks (patch embedding, position tables, text and
time embedders, the final layer, and every ComfyUI patch that runs there:
block replacements, post-input patches, ControlNet additions) runs eager
with the real `transformer_options`. Inside a block only attention reads
`transformer_options`: a graph computes ComfyUI's own `attention_pytorch`
(one graph for every size), and a block call carrying an attention override
of its own runs eager with that reason, alone. So does a block whose weights
ComfyUI patches on the fly with a function the pack does not know, or keeps
on another device (offloaded): the rest of the model stays compiled.

GGUF models loaded by ComfyUI-GGUF serve from graphs that dequantise inside
(nodes/gguf.py): the family's `stored_weights` hands the engine the GGUF
forms of a block, whose quantisation types join its structure key. A block
low-VRAM mode patches per call with ComfyUI's LowVramPatch is served with
the patched weights bound for the call (nodes/lowvram.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import replace
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..compiler.blocks import BlockEngine, BlockFamily, BlockInstance, BlockOptions, Dims, Geometry
from ..compiler.blocks.family import generator_for, model_dtype_device
from ..compiler.blocks.quantised import PLAIN, CallTensors, StoredWeights
from ..compiler.keys.shapes import ShapeRange
from .attention import graph_attention
from .attention import graph_attention_options as _graph_attention_options
from .gguf import GGUFWeights, is_ggml_layer
from .lowvram import PATCHED_ON_THE_FLY, LowVramWeights
from .sizes import PROMPT_TOKENS, latent_range


def input_dtype(base_model: Any) -> Optional[torch.dtype]:
    """The dtype ComfyUI's BaseModel casts the diffusion model's inputs to: its manual-cast dtype, else the weights'.

    Not a parameter's dtype: some layers stay float32 in a bfloat16 model
    (Wan's patch embedding), and fp8 weights compute in the manual-cast dtype.
    Example calls (ahead of time, and the probes of the first image) must be
    what the sampler sends, or they fail where the sampler would not.
    """
    cast = getattr(base_model, "manual_cast_dtype", None)
    if cast is not None:
        return cast
    weights = getattr(base_model, "get_dtype", None)
    return weights() if weights is not None else None


def _in_features(layer: Any) -> int:
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


def _first_in(module: torch.nn.Module) -> int:
    """The input width of the first Linear inside `module` (an embedder's input)."""
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear):
            return _in_features(sub)
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
        return type(module).forward(module, *args, transformer_options=_graph_attention_options(), **kwargs)

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


class FluxFamily(ComfyFamily):
    name = "flux"
    model_classes = ("Flux",)
    block_classes = ("DoubleStreamBlock", "SingleStreamBlock")

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(getattr(model, "patch_size", 2))
        kwargs = {
            "x": self.latent(model, dims, randn, _in_features(model.img_in) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, _in_features(model.txt_in)),
        }
        if getattr(model, "vector_in", None) is not None:
            kwargs["y"] = randn(dims.batch, _in_features(model.vector_in.in_layer))
        if getattr(model.params, "guidance_embed", False):
            kwargs["guidance"] = torch.full((dims.batch,), 3.5, dtype=torch.float32, device=device)
        return kwargs


class Flux2Family(FluxFamily):
    """Flux 2: ComfyUI's Flux class with one modulation for all blocks of a kind, computed before
    them (its dataclasses are block inputs, as Chroma's), and a VAE of 32 channels at 1/8 whose latent is packed
    2x2 (EmptyFlux2LatentImage: 128 channels at 1/16), one latent pixel per token."""

    name = "flux2"
    geometry = Geometry(patch=1)
    spatial_multiple = 1
    latent_scale = 16

    def matches(self, model):
        # comfy.model_detection sets global_modulation for Flux 2 checkpoints only
        return bool(getattr(getattr(model, "params", None), "global_modulation", False))


class ChromaFamily(FluxFamily):
    name = "chroma"
    model_classes = ("Chroma",)

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(getattr(model, "patch_size", 2))
        return {
            "x": self.latent(model, dims, randn, _in_features(model.img_in) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, _in_features(model.txt_in)),
            "guidance": torch.zeros((dims.batch,), dtype=torch.float32, device=device),
        }


class SD3Family(ComfyFamily):
    name = "sd3"
    model_classes = ("OpenAISignatureMMDITWrapper",)
    block_classes = ("JointBlock",)

    # JointBlock.forward(*args, **kwargs) is called with (context, x) positionally: named here for the
    # graph's inputs, passed positionally again to the block.
    _POSITIONAL = ("context", "x")

    def block_inputs(self, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        args, kwargs = super().block_inputs(args, kwargs)
        if len(args) > len(self._POSITIONAL):
            return args, kwargs
        named = dict(zip(self._POSITIONAL, args))
        named.update(kwargs)
        return (), named

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        if not args and all(name in kwargs for name in self._POSITIONAL):
            args = tuple(kwargs.pop(name) for name in self._POSITIONAL)
        return super().block_forward(module, *args, **kwargs)

    def inputs(self, model, dims, randn, dtype, device):
        kwargs = {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.timesteps(dims, device, 500.0),
            "context": randn(dims.batch, dims.text, _in_features(model.context_embedder)),
        }
        if getattr(model, "y_embedder", None) is not None:
            kwargs["y"] = randn(dims.batch, _in_features(model.y_embedder.mlp[0]))
        return kwargs


class AuraFlowFamily(ComfyFamily):
    name = "auraflow"
    model_classes = ("MMDiT",)
    block_classes = ("MMDiTBlock", "DiTBlock")

    def inputs(self, model, dims, randn, dtype, device):
        patch = int(model.patch_size)
        return {
            "x": self.latent(model, dims, randn, _in_features(model.init_x_linear) // (patch * patch)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, _in_features(model.cond_seq_linear)),
        }


class WanFamily(ComfyFamily):
    name = "wan"
    model_classes = ("WanModel",)
    block_classes = ("WanAttentionBlock",)
    video = True
    frame_scale = 4  # Wan's VAE keeps the first frame and packs 4 per latent frame after it
    geometry = Geometry(patch=2, patch_frames=1, video=True, default_frames=(1, 21))
    spatial_multiple = 2

    def inputs(self, model, dims, randn, dtype, device):
        kwargs = {
            "x": self.latent(model, dims, randn, int(model.patch_embedding.in_channels)),
            "t": self.timesteps(dims, device, 500.0),
            "context": randn(dims.batch, dims.text, _in_features(model.text_embedding[0])),
        }
        if getattr(model, "img_emb", None) is not None:
            kwargs["clip_fea"] = randn(dims.batch, 257, 1280)
        return kwargs


class Wan22Family(WanFamily):
    """Wan 2.2 TI2V 5B: Wan's model on the 48-channel Wan 2.2 VAE at 1/16 (Wan22ImageToVideoLatent).

    With a start image ComfyUI gives each latent frame its own timestep (model_base.WAN22.process_timestep: the
    first frame, kept, at 0), so a block's modulation `e` is [batch, frames, 6, dim]; without one it is
    [batch, 1, 6, dim]. The block spreads `e` over its tokens with `repeat_e`, which branches on that axis (one
    value, or frames dividing the tokens). One graph serves both: its example calls take per-frame timesteps (the
    axis is then the `frames` role, 1 included), and what it computes spreads `e` over the tokens first with the
    same rows `repeat_e` picks (token i takes row i // ceil(tokens / rows)), a gather with no branch, after which
    the block's own `repeat_e` has one row per token and returns it as it is.
    """

    name = "wan22"
    latent_scale = 16

    def matches(self, model):
        return int(model.out_dim) == 48

    def inputs(self, model, dims, randn, dtype, device):
        kwargs = super().inputs(model, dims, randn, dtype, device)
        frames = self.geometry.frames(dims)
        kwargs["t"] = torch.full((dims.batch, frames), 500.0, dtype=torch.float32, device=device)
        return kwargs

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        x = args[0] if args else kwargs["x"]
        if "e" in kwargs:
            kwargs = dict(kwargs, e=_rows_per_token(kwargs["e"], x.shape[1]))
        else:
            args = (args[0], _rows_per_token(args[1], x.shape[1])) + tuple(args[2:])
        return super().block_forward(module, *args, **kwargs)


def _rows_per_token(e: torch.Tensor, tokens) -> torch.Tensor:
    """`e` [batch, rows, ...] spread to one row per token as comfy.ldm.wan.model.repeat_e spreads it: each row
    over ceil(tokens / rows) tokens (tokens / rows where they divide), a single row over all."""
    step = -(-tokens // e.shape[1])
    index = torch.arange(tokens, device=e.device) // step
    return e.index_select(1, index)


class QwenImageFamily(ComfyFamily):
    name = "qwen-image"
    model_classes = ("QwenImageTransformer2DModel",)
    block_classes = ("QwenImageTransformerBlock",)

    def inputs(self, model, dims, randn, dtype, device):
        channels = _in_features(model.img_in) // 4
        return {  # ComfyUI gives Qwen-Image its (Wan VAE) latent with a frame axis of 1
            "x": randn(dims.batch, channels, 1, dims.height, dims.width),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, _in_features(model.txt_in)),
        }


class HunyuanVideoFamily(ComfyFamily):
    name = "hunyuan-video"
    model_classes = ("HunyuanVideo",)
    block_classes = ("DoubleStreamBlock", "SingleStreamBlock")
    video = True
    frame_scale = 4
    geometry = Geometry(patch=2, patch_frames=1, video=True, default_frames=(1, 33))
    spatial_multiple = 2

    def inputs(self, model, dims, randn, dtype, device):
        kwargs = {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.timesteps(dims, device, 500.0),
            "context": randn(dims.batch, dims.text, _first_in(model.txt_in)),
        }
        if getattr(model, "vector_in", None) is not None:
            kwargs["y"] = randn(dims.batch, _in_features(model.vector_in.in_layer))
        if getattr(model, "guidance_in", None) is not None:
            kwargs["guidance"] = torch.full((dims.batch,), 6.0, dtype=torch.float32, device=device)
        return kwargs


class HunyuanVideo15Family(HunyuanVideoFamily):
    """HunyuanVideo 1.5: HunyuanVideo's class on a 32-channel VAE at 1/16 (EmptyHunyuanVideo15Latent), one latent
    pixel per token."""

    name = "hunyuan-video15"
    joined_text_tokens = 729  # image-to-video: the start image's SigLIP features (27 x 27) join the prompt's tokens
    geometry = Geometry(patch=1, patch_frames=1, video=True, default_frames=(1, 33))
    spatial_multiple = 1
    latent_scale = 16

    def matches(self, model):
        return list(model.patch_size) == [1, 1, 1] and int(model.out_channels) == 32


class HunyuanImage21Family(HunyuanVideoFamily):
    """HunyuanImage 2.1: HunyuanVideo's class on images (2-D patches of 1) from a 64-channel VAE at 1/32
    (EmptyHunyuanImageLatent)."""

    name = "hunyuan-image21"
    video = False
    frame_scale = 1
    geometry = Geometry(patch=1)
    spatial_multiple = 1
    latent_scale = 32

    def matches(self, model):
        return len(model.patch_size) == 2


LTX2_AUDIO_PER_SECOND = 25  # LTX-2's audio latents a second: 16 kHz, a mel hop of 160, 4 mel frames a latent
LTX2_SLOWEST_FRAME_RATE = 8  # the slowest video the audio range is sized for (frames a second)


class LTXVFamily(ComfyFamily):
    """LTXV. A text-to-video step has one timestep a sample; where an image or video guides frames
    (LTXVImgToVideo, LTXVAddGuide: a denoise mask), model_base.LTXV gives every token its own, and the block's
    modulation inputs have one row a token instead of one. The example calls send one a token, and what a graph
    computes spreads the rows it is given over the tokens (compiler/blocks/family.py `spread_rows`), so one graph
    serves both forms."""

    name = "ltxv"
    model_classes = ("LTXVModel",)
    block_classes = ("BasicTransformerBlock",)
    video = True
    latent_scale = 32  # LTXV's VAE: 32 pixels per latent pixel, 8 frames per latent frame after the first
    frame_scale = 8
    geometry = Geometry(patch=1, patch_frames=1, video=True, default_frames=(1, 13))
    spatial_multiple = 1
    timestep_rows = ("timestep",)

    def inputs(self, model, dims, randn, dtype, device):
        return {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.token_timesteps(dims, self.geometry.tokens(dims), device),
            "context": randn(dims.batch, dims.text, _first_in(model.caption_projection)),
            "attention_mask": torch.ones(dims.batch, dims.text, dtype=torch.long, device=device),
            "frame_rate": 25,
        }

    @staticmethod
    def token_timesteps(dims: Dims, tokens: int, device) -> torch.Tensor:
        """A timestep a token, as model_base.LTXV.process_timestep makes them under a denoise mask (varied: the
        rows must not be one value)."""
        return torch.linspace(0.2, 0.8, tokens, device=device).expand(dims.batch, tokens).contiguous()

    def row_tokens(self, arguments: Dict[str, Any]) -> Dict[str, int]:
        return {"timestep": arguments["x"].shape[1]}


class LTX2Family(LTXVFamily):
    """LTX-2 (ComfyUI's LTXAV): LTXV's video stream beside an audio stream, joined by cross-attention both ways in
    every block. The sampler's latent is a pair (video, audio); a block takes and returns both streams' tokens, so
    its graph has a fourth count, the audio tokens (25 a second of video: LTX-2's audio VAE), sized from the
    frames range at 8 frames a second or more."""

    name = "ltx2"
    model_classes = ("LTXAVModel",)
    block_classes = ("BasicAVTransformerBlock",)
    geometry = replace(LTXVFamily.geometry, audio_per_frame=LTXVFamily.frame_scale * LTX2_AUDIO_PER_SECOND
                       / LTX2_SLOWEST_FRAME_RATE)
    # What the block reads from transformer_options besides attention: stream switches (True unless a node says
    # otherwise) that skip a stream or a cross-attention. A graph computes all of them.
    STREAM_SWITCHES = ("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")
    # modulation inputs: the video's (v_) and the audio's (a_), a row per sample or per token of their stream
    timestep_rows = ("v_timestep", "a_timestep", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
                     "v_cross_gate_timestep", "a_cross_gate_timestep")

    def row_tokens(self, arguments):
        video, audio = arguments["x"]
        return {name: (video if name.startswith("v_") else audio).shape[1] for name in self.timestep_rows}

    def inputs(self, model, dims, randn, dtype, device):
        audio_channels = int(model.num_audio_channels)
        return {
            "x": [self.latent(model, dims, randn, int(model.in_channels)),
                  randn(dims.batch, audio_channels, dims.audio, int(model.audio_in_channels) // audio_channels)],
            # model_base.LTXAV.process_timestep: the video's and the audio's, a timestep a token of each
            "t": (self.token_timesteps(dims, self.geometry.tokens(dims), device),
                  self.token_timesteps(dims, dims.audio, device)),
            "context": randn(dims.batch, dims.text, 2 * _first_in(model.caption_projection)),  # video half, audio half
            "attention_mask": torch.ones(dims.batch, dims.text, dtype=torch.long, device=device),
            "frame_rate": 25,
        }

    def block_reason(self, args: tuple, kwargs: dict) -> Optional[str]:
        options = kwargs.get("transformer_options") or {}
        off = [key for key in self.STREAM_SWITCHES if not options.get(key, True)]
        if off:
            return (f"its transformer_options turn off {', '.join(off)} (a node skipping a stream), which its graph "
                    "computes")
        streams = args[0] if args else kwargs.get("x")
        if isinstance(streams, (tuple, list)) and len(streams) == 2 and streams[1].shape[1] == 0:
            return ("the call has no audio (LTX-2 making a video without sound): its graphs are built for video and "
                    "audio together")
        return None


class Kandinsky5Family(ComfyFamily):
    """Kandinsky 5: text blocks over the prompt, then visual blocks over the video's tokens with the prompt for
    cross-attention; HunyuanVideo's latents (16 channels at 1/8, 4 frames per latent frame). The image model takes
    one frame of the same class (not tested)."""

    name = "kandinsky5"
    model_classes = ("Kandinsky5",)
    block_classes = ("TransformerEncoderBlock", "TransformerDecoderBlock")
    video = True
    frame_scale = 4
    geometry = Geometry(patch=2, patch_frames=1, video=True, default_frames=(1, 31))

    def block_forward(self, module: torch.nn.Module, *args, **kwargs) -> Any:
        # Kandinsky's self-attention and feed-forward take a chunked path above 8192 tokens (less memory in eager:
        # the same per-token maths in pieces), a branch on the token count a graph would keep as a guard. The graph
        # computes the one-piece path at every size, so one graph serves all; eager keeps ComfyUI's own path.
        with _one_piece(module):
            return super().block_forward(module, *args, **kwargs)

    def inputs(self, model, dims, randn, dtype, device):
        return {
            "x": self.latent(model, dims, randn, int(model.visual_embed_dim) // math.prod(model.patch_size)),
            "t": self.timesteps(dims, device, 500.0),
            "context": randn(dims.batch, dims.text, _in_features(model.text_embeddings.in_layer)),
            "y": randn(dims.batch, _in_features(model.pooled_text_embeddings.in_layer)),
        }


@contextlib.contextmanager
def _one_piece(block: torch.nn.Module):
    """Within: the layers of `block` that choose between `_forward` and `_forward_chunked` by size run `_forward`
    (an attribute of these instances, put back after: nothing else sees it)."""
    layers = [m for m in block.modules() if {"forward", "_forward", "_forward_chunked"} <= set(vars(type(m)))]
    saved = [m.__dict__.get("forward") for m in layers]
    for layer in layers:
        layer.forward = layer._forward
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


class Lumina2Family(ComfyFamily):
    name = "lumina2"
    model_classes = ("NextDiT",)
    block_classes = ("JointTransformerBlock",)
    ignored_settings = ComfyFamily.ignored_settings | {"layer_id"}  # stored by every block, read by none
    split_stacks = True  # noise_refiner (image tokens) and layers (image and text tokens): one class, two ranges

    def inputs(self, model, dims, randn, dtype, device):
        return {
            "x": self.latent(model, dims, randn, int(model.in_channels)),
            "t": self.timesteps(dims, device),
            "context": randn(dims.batch, dims.text, _first_in(model.cap_embedder)),
            "num_tokens": dims.text,  # ComfyUI drops an all-ones mask and passes the token count
        }

    def model_geometry(self, model):
        # Z-Image pads caption and image tokens to a multiple of 32 (`pad_tokens_multiple`) before its
        # refiners: the blocks see only multiples of it, and the rotary table follows the padded count.
        multiple = getattr(model, "pad_tokens_multiple", None)
        return replace(self.geometry, token_multiple=int(multiple)) if multiple else self.geometry


class HiDreamFamily(ComfyFamily):
    name = "hidream"
    model_classes = ("HiDreamImageTransformer2DModel",)
    block_classes = ("HiDreamImageBlock",)

    def inputs(self, model, dims, randn, dtype, device):
        layers = max(model.llama_layers) + 1
        return {
            "x": self.latent(model, dims, randn, _first_in(model.x_embedder) // 4),
            "t": self.timesteps(dims, device),
            "y": randn(dims.batch, _first_in(model.p_embedder)),
            "context": randn(dims.batch, dims.text, _first_in(model.caption_projection[-1])),
            "encoder_hidden_states_llama3": randn(dims.batch, layers, dims.text, _first_in(model.caption_projection[0])),
        }


FAMILIES: Tuple[ComfyFamily, ...] = (  # a variant before the family whose class it shares
    Flux2Family(), FluxFamily(), ChromaFamily(), SD3Family(), AuraFlowFamily(), Wan22Family(), WanFamily(),
    QwenImageFamily(), HunyuanVideo15Family(), HunyuanImage21Family(), HunyuanVideoFamily(), LTXVFamily(),
    LTX2Family(), Kandinsky5Family(), Lumina2Family(), HiDreamFamily())
_BY_CLASS: Dict[str, Tuple[ComfyFamily, ...]] = {}
for _family in FAMILIES:  # variants first, as FAMILIES lists them
    for _name in _family.model_classes:
        _BY_CLASS[_name] = _BY_CLASS.get(_name, ()) + (_family,)


def family_of(module: torch.nn.Module) -> Optional[ComfyFamily]:
    """The block family of a ComfyUI diffusion model, or None (SD-style UNets: whole-model graphs)."""
    return next((f for f in _BY_CLASS.get(type(module).__name__, ()) if f.matches(module)), None)


def block_range(family: ComfyFamily, min_size: int, max_size: int, max_batch: int, max_frames: int) -> ShapeRange:
    """The node's range (pixels, images, video frames) in the family's latent units; text tokens up to 1024 for the
    prompt, plus what the family joins to it."""
    base = latent_range(min_size, max_size, max_batch, scale=family.latent_scale,
                        sequence=(1, PROMPT_TOKENS + family.joined_text_tokens))
    if family.video:
        base = ShapeRange(batch=base.batch, spatial=base.spatial, sequence=base.sequence,
                          frames=(1, family.latent_frames(max_frames)))
    return base


# -- per block: what makes one block call run eager ------------------------------------

class BlockPolicy:
    """The engine's block filter for ComfyUI calls; module walks are cached per instance."""

    def __init__(self):
        self._cast: Dict[int, List[torch.nn.Module]] = {}

    def _castable(self, instance: BlockInstance) -> List[torch.nn.Module]:
        found = self._cast.get(id(instance))
        if found is None:
            found = [m for m in instance.module.modules() if hasattr(m, "weight_function")]
            self._cast[id(instance)] = found
        return found

    def __call__(self, instance: BlockInstance, args: tuple, kwargs: dict) -> Optional[str]:
        options = kwargs.get("transformer_options") or {}
        override = options.get("optimized_attention_override")
        if override is not None and override is not graph_attention:
            return (f"its transformer_options carry an attention override "
                    f"({getattr(override, '__qualname__', type(override).__name__)}), which runs Python inside the "
                    "block")
        family = instance.server.engine.family
        block_reason = getattr(family, "block_reason", None)
        reason = block_reason(args, kwargs) if block_reason is not None else None
        if reason:
            return reason
        lowvram = getattr(family, "lowvram", None)
        if any(sub.weight_function or sub.bias_function for sub in self._castable(instance)):
            reason = lowvram.reason(instance.module) if lowvram is not None else PATCHED_ON_THE_FLY
            if reason:
                return reason
        gguf = getattr(family, "gguf", None)
        if gguf is not None:
            return gguf.patch_reason(instance.module)
        return None


# Weak both ways: the module's blocks hold its engine (each block's forward is the engine's), and an engine
# held strongly here would hold its module (the key), so neither would ever be freed: ComfyUI unloading a
# model must free it, and stop its background builds (the engine's finalizer).
_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[BlockEngine]]" = weakref.WeakKeyDictionary()


def _engine_of(module: torch.nn.Module) -> Optional[BlockEngine]:
    ref = _ENGINES.get(module)
    return ref() if ref is not None else None


def engine_for(module: torch.nn.Module, options: BlockOptions, registry,
               dtype: Optional[torch.dtype] = None) -> Optional[BlockEngine]:
    """The one block engine of this diffusion model module (installed on its blocks, scoped), or None.

    `dtype`: what the sampler casts the model's inputs to (`input_dtype`), for its example calls.
    """
    engine = _engine_of(module)
    if engine is not None:
        engine.options = options
        return engine
    family = family_of(module)
    if family is None:
        return None
    engine = BlockEngine(module, family.for_model(module, dtype), options, registry, scoped=True)
    engine.block_filter = BlockPolicy()
    engine.install_blocks()
    _ENGINES[module] = weakref.ref(engine)
    return engine


def existing_engine(module: torch.nn.Module) -> Optional[BlockEngine]:
    return _engine_of(module)
