"""The VAE side: a copy of the VAE whose decode and encode are served by graphs.

comfy.sd.VAE has no clone() and no wrapper hooks, and every decode path
(batched, tiled on out-of-memory, VAEDecodeTiled) calls
`vae.first_stage_model.decode(latent)` and every encode path
`first_stage_model.encode(pixels)`. So the node returns a shallow copy of the
VAE object holding a shallow copy of `first_stage_model` (the same
submodules and weights, loaded and offloaded by the same patcher) whose
`decode` and `encode` go through CompiledForwards. The input VAE is untouched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from ..compiler import (BATCH, FRAMES, SPATIAL, ChunkServer, CompiledForward, CompileOptions, FamilyKey, ShapeRange,
                        architecture_name, chunk_server, chunk_step, default_roles, example_frames, portable_forward,
                        takes_feature_cache)
from . import runtime
from .attention import graph_vae_attention
from .sizes import clamp
from .unet import Settings

RUNNER_ATTRIBUTE = "_keepfast_runner"
OPS = ("decode", "encode")
# Video VAEs that run chunk by chunk with a feature cache (Wan 2.1/2.2, Qwen-Image): the submodule each op
# calls per chunk, served by compiler/serving/cached_steps.py.
CHUNK_MODULES = {"decode": "decoder", "encode": "encoder"}
# Video VAEs that decode and encode a whole video in one pass whose ops follow the frame count (LTX-Video's
# causal VideoVAE): one graph per operation with the frames as their own dynamic axis. Other video VAEs run
# eager with the reason: HunyuanVideo's decodes in a Python loop of 2-frame chunks whose count follows the
# frames, so a graph of it would serve one frame count.
WHOLE_VIDEO_VAES = ("VideoVAE",)


def video_roles(path: str, tensor: torch.Tensor) -> Dict[int, str]:
    """A video VAE's latents and pixels are [batch, channels, frames, height, width]: frames are their own axis."""
    if tensor.dim() == 5:
        return {0: BATCH, 2: FRAMES, 3: SPATIAL, 4: SPATIAL}
    return default_roles(tensor.dim())


@portable_forward
def _vae_forward(module, op, sample):
    """What a graph computes: the autoencoder's own decode or encode of one tensor.

    `module` is the VAE's own first_stage_model (the runner's, never the copy
    whose decode/encode route here), or the oneflow backend's OneFlow copy of it.
    Split attention is traced as pytorch attention: one graph for every size.
    """
    if op not in OPS:
        raise ValueError(f"unknown VAE operation {op!r}")
    with graph_vae_attention(module):
        return getattr(module, op)(sample)


def _vae_chunk(module, x, cached, state, **options):
    """What a chunk graph of a video VAE computes: the chunk with split attention traced as pytorch attention."""
    with graph_vae_attention(module):
        return chunk_step(module, x, cached, state, **options)


class VaeRunner:
    def __init__(self, vae, settings: Settings):
        self.settings = settings
        self.module: torch.nn.Module = vae.first_stage_model
        self.scale = _spatial_scale(vae)
        self.latent_channels = int(getattr(vae, "latent_channels", 4))
        self.image_channels = int(getattr(vae, "output_channels", 3))
        self.dtype = vae.vae_dtype
        self.device = vae.device
        self.latent_dim = getattr(vae, "latent_dim", 2)
        self.whole_video = self.latent_dim == 3 and type(self.module).__name__ in WHOLE_VIDEO_VAES
        self.temporal = _temporal_ratio(vae) if self.whole_video else None
        self.unserved: Optional[str] = None  # why every call runs eager (a video VAE served neither way)
        self.chunks: Dict[str, ChunkServer] = {}
        self._states_built: set = set()  # chunk ops whose every cache state's build has been started
        for op, name in CHUNK_MODULES.items():
            part = getattr(self.module, name, None)
            if takes_feature_cache(part):
                self.chunks[op] = chunk_server(part, self.options(op).with_(
                    label=f"VAE {op} chunk ({architecture_name(self.module)})"), runtime.registry(), traced=_vae_chunk)
        if self.latent_dim == 3 and not self.whole_video and not self.chunks:
            self.unserved = (f"{type(self.module).__name__} is a video VAE that KeepFast does not serve yet (it "
                             "serves Wan's chunk by chunk and LTX-Video's whole; this one decodes in a loop whose "
                             "length follows the frames)")
        self.forwards: Dict[str, CompiledForward] = {
            op: self.chunks[op].forward if op in self.chunks else
            CompiledForward(self.module, self.options(op), runtime.registry(), forward_fn=_vae_forward)
            for op in OPS
        }

    def shape_range(self, op: str) -> ShapeRange:
        s = self.settings
        latent = ShapeRange(batch=(1, max(1, s.max_batch)),
                            spatial=(max(1, -(-s.min_size // self.scale)), max(1, s.max_size // self.scale)))
        frames = None
        if self.whole_video:  # latent frames for decode, video frames for encode
            frames = (1, max(1, self.temporal(s.max_frames))) if op == "decode" else (1, max(1, s.max_frames))
        if op == "decode":  # a decoder only upsamples: latent sizes free (compiler/keys/alignment.py counts the encoder's)
            return dataclasses.replace(latent, frames=frames, spatial_multiple=1)
        return ShapeRange(batch=latent.batch, spatial=(latent.spatial[0] * self.scale, latent.spatial[1] * self.scale),
                          frames=frames)

    def options(self, op: str) -> CompileOptions:
        s = self.settings
        return CompileOptions(
            backend=s.backend, shape_range=self.shape_range(op), compile_on_miss=s.compile_on_miss,
            store=runtime.store(), autosave=s.autosave, cover_range=s.cover_range,
            label=f"VAE {op} ({architecture_name(self.module)})", counter="vae", device=str(self.device),
            verify=s.verify, role_policy=video_roles if self.whole_video else None,
            samples_independent=True,  # each image (or video) alone: one graph serves every batch size
            background=s.background,
        )

    def run(self, op: str, sample: torch.Tensor, **options):
        """Serve one decode or encode; the autoencoder's own method is what runs when no graph can."""
        method = getattr(self.module, op)
        if op in self.chunks:  # the autoencoder's own loop over chunks, each chunk served by a graph
            if self.settings.background and op not in self._states_built and isinstance(sample, torch.Tensor):
                # Every cache state the frame range meets, building from the first video: a short first video
                # meets only its own states, and the first longer one would otherwise start the rest then.
                self._states_built.add(op)
                height, width = sample.shape[-2:]
                scale = self.scale if op == "decode" else 1
                self.chunks[op].forward.start_builds(self._chunk_calls(op, [(width * scale, height * scale)], [1]))
            with self.chunks[op].active():
                return method(sample, **options)
        reason = self.unserved
        if reason is None and options:
            reason = f"{op} was called with options {sorted(options)}"
        elif reason is None and not isinstance(sample, torch.Tensor):
            reason = f"{op} was called with a {type(sample).__name__}"
        served = self.forwards[op].serve((op, sample), {}, eager=lambda _op, latent: method(latent, **options),
                                         eager_reason=reason)
        return served.output

    def example_calls(self, op: str, sizes: List[Tuple[int, int]], batches: List[int]) -> List[Tuple[tuple, dict]]:
        if op in self.chunks:
            return self._chunk_calls(op, sizes, batches)
        if self.latent_dim != 2 and not self.whole_video:
            return []
        shape_range = self.shape_range(op)
        frames = self._example_frames(op) if self.whole_video else ()
        calls = []
        for width, height in sizes:
            for batch in batches:
                b = clamp(batch, shape_range.batch)
                h, w = max(1, height // self.scale), max(1, width // self.scale)
                if op == "decode":
                    shape = (b, self.latent_channels, *frames, h, w)
                else:
                    shape = (b, self.image_channels, *frames, h * self.scale, w * self.scale)
                calls.append(((op, torch.randn(shape, dtype=self.dtype, device=self.device)), {}))
        return calls

    def _example_frames(self, op: str) -> Tuple[int]:
        """Frames of an example video for a whole-video VAE: the fewest video frames that make 2 latent frames
        (LTX-Video: 9), so no frame count of 1 is traced; as latent frames for decode."""
        video = next((f for f in range(2, 257) if self.temporal(f) >= 2), 2)
        return (self.temporal(video),) if op == "decode" else (video,)

    def _chunk_calls(self, op: str, sizes: List[Tuple[int, int]], batches: List[int]) -> List[Tuple[tuple, dict]]:
        """The chunk calls an example video makes (one per cache state and shape), from one eager run each."""
        shape_range = self.shape_range(op)
        frames = example_frames(op == "decode")
        calls: List[Tuple[tuple, dict]] = []
        for width, height in sizes:
            for batch in batches:
                b = clamp(batch, shape_range.batch)
                h, w = max(1, height // self.scale), max(1, width // self.scale)
                if op == "decode":
                    shape = (b, self.latent_channels, frames, h, w)
                else:
                    shape = (b, self.image_channels, frames, h * self.scale, w * self.scale)
                sample = torch.randn(shape, dtype=self.dtype, device=self.device)
                with torch.no_grad(), self.chunks[op].capturing() as found:
                    getattr(self.module, op)(sample)
                calls += found
        return calls

    def family_here(self, signature: str, op: str = "decode") -> FamilyKey:
        """The key a graph needs to serve this VAE's `op`: the forward's own key path."""
        return self.forwards[op].expected_family(signature)


def _temporal_ratio(vae):
    """Video frames -> latent frames, as ComfyUI's VAE computes them (LTX-Video: 1 + 8k frames -> 1 + k)."""
    ratio = getattr(vae, "downscale_ratio", None)
    if isinstance(ratio, tuple) and ratio and callable(ratio[0]):
        return lambda frames: int(ratio[0](frames))
    return lambda frames: frames


def _spatial_scale(vae) -> int:
    try:
        value = vae.spacial_compression_decode()
    except Exception:
        value = 8
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 8


class _Method:
    """Bound to a runner and an op; what the copied first_stage_model's decode/encode is."""

    def __init__(self, runner: VaeRunner, op: str):
        self.runner = runner
        self.op = op

    def __call__(self, sample, *args, **kwargs):
        if args:
            return getattr(self.runner.module, self.op)(sample, *args, **kwargs)
        return self.runner.run(self.op, sample, **kwargs)


def runner_of(vae) -> Optional[VaeRunner]:
    runner = getattr(vae, RUNNER_ATTRIBUTE, None)
    return runner if isinstance(runner, VaeRunner) else None


def original_module(vae) -> torch.nn.Module:
    runner = runner_of(vae)
    return runner.module if runner is not None else vae.first_stage_model


def speed_up(vae, settings: Settings):
    """A copy of `vae` whose decode and encode go through graphs; `vae` itself is not changed."""
    if getattr(vae, "first_stage_model", None) is None:
        raise ValueError("this VAE has no model (the checkpoint has no VAE weights)")
    source = copy.copy(vae)
    source.first_stage_model = original_module(vae)
    runner = VaeRunner(source, settings)
    proxy = copy.copy(runner.module)  # shares submodules, parameters and buffers
    object.__setattr__(proxy, "decode", _Method(runner, "decode"))
    object.__setattr__(proxy, "encode", _Method(runner, "encode"))
    faster = copy.copy(vae)
    faster.first_stage_model = proxy
    setattr(faster, RUNNER_ATTRIBUTE, runner)
    return faster, runner


def load_to_device(vae) -> None:
    import comfy.model_management

    comfy.model_management.load_models_gpu([vae.patcher])
