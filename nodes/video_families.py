"""ComfyUI's video transformer families served block by block: Wan (2.1, 2.2), HunyuanVideo (and 1.5), LTXV,
LTX-2, Kandinsky 5. Their latents have a frame axis, a range of video frames in latent frames (`frame_scale`
video frames a latent frame after the first). See comfy_family.py for what a family says."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import Any, Dict, Optional

import torch

from ..compiler import Dims, Geometry
from .comfy_family import ComfyFamily, first_in, in_features


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
            "context": randn(dims.batch, dims.text, in_features(model.text_embedding[0])),
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
            "context": randn(dims.batch, dims.text, first_in(model.txt_in)),
        }
        if getattr(model, "vector_in", None) is not None:
            kwargs["y"] = randn(dims.batch, in_features(model.vector_in.in_layer))
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
            "context": randn(dims.batch, dims.text, first_in(model.caption_projection)),
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
            "context": randn(dims.batch, dims.text, 2 * first_in(model.caption_projection)),  # video half, audio half
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
            "context": randn(dims.batch, dims.text, in_features(model.text_embeddings.in_layer)),
            "y": randn(dims.batch, in_features(model.pooled_text_embeddings.in_layer)),
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
