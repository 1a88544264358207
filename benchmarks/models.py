"""What the benchmark runs: model configs, input shapes and the declared range, per profile.

UNets and the VAE decoder are compiled whole; the transformers (`flux`, `sd3`,
`wan`, `qwen-image`, `zimage`: diffusers' classes, configs and their sources in
transformer_configs.py) are compared as whole-model torch.compile,
torch.compile of the repeated blocks (diffusers' `compile_repeated_blocks`,
what KJNodes does) and ours (block graphs, `compiler.blocks`).

Four profiles:
- "full": the real diffusers configs of SD1.5's UNet, SDXL's UNet and the
  SD VAE decoder (random weights), at latent sizes a CPU can sweep; the
  transformers' real configs on a GPU, and on a CPU their real widths with
  one block per block structure (what a cold compile is made of);
- "check": the full profile as the device check (`--check`, check.py) runs it
  on a GPU: Flux at full width cut to 1 double and 2 single blocks, and one
  steady shape per model (the first), so every configuration fits a few minutes;
- "rehearsal": the quick profile's models and sizes with the check's one
  steady shape: `--check --rehearse`, the check's jobs on a CPU (check.py);
- "quick": the same block types, attention placement and conditioning sizes
  (768-wide text for SD1.5, 2048-wide text plus the pooled/time embeddings
  for SDXL) at two levels and narrow widths, so a run takes tens of minutes,
  not hours, on a small CPU: compile time follows depth, not width. Narrow
  models are dominated by per-op overhead, so their compiled/eager ratios
  are not those of the real widths.

Imports torch and diffusers only inside functions (the CLI imports this
module to build its parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from .transformer_configs import CHECK_CHANGES, CLASSES, CPU_DEPTH, QUICK_TEXT_TOKENS, REAL, TEXT_TOKENS, TITLES
from .transformer_configs import QUICK_CHANGES as QUICK_TRANSFORMER_CHANGES

Shape = Tuple[int, int, int]  # (batch, latent height, latent width)

MODELS = ("sd15", "sdxl", "vae")
TRANSFORMERS = tuple(CLASSES)  # flux, sd3, wan, qwen-image, zimage
ALL_MODELS = MODELS + TRANSFORMERS
VARIANTS = ("eager", "torch_compile", "torch_compile_warm", "ours_inductor", "ours_aot_cold", "ours_aot_load",
            "ours_aot_load_cg", "ours_aot_fresh", "ours_oneflow", "torch_compile_blocks", "ours_blocks", "ours_blocks_load")
# ours_oneflow runs only where OneFlow imports (a Python 3.10 environment), ours_aot_load_cg replays only on a GPU
# (the device check runs it): both asked for by name.
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v not in ("ours_oneflow", "ours_aot_load_cg"))
# What each kind of model is run as (a variant asked for that does not apply is left out).
BLOCK_VARIANTS = ("eager", "torch_compile", "torch_compile_blocks", "ours_blocks", "ours_blocks_load")
WHOLE_VARIANTS = tuple(v for v in VARIANTS if v not in ("torch_compile_blocks", "ours_blocks", "ours_blocks_load"))


def variants_for(name: str):
    return BLOCK_VARIANTS if name in TRANSFORMERS else WHOLE_VARIANTS
PROFILES = ("quick", "full", "check", "rehearsal")
QUICK_PROFILES = ("quick", "rehearsal")  # the narrow two-level models and a CPU's small sizes
ONE_STEADY_SHAPE = ("check", "rehearsal")  # the device check times the first steady shape only
COMFY_MODES = ("none", "torch_compile", "ours_cold", "ours_restart", "ours_fresh")  # comfy_e2e.py's modes

from compiler.demo.model_configs import SD15_UNET, SD_VAE, SDXL_UNET  # noqa: E402,F401 - the real configs, one source

# --quick: the same block types, attention placement and conditioning sizes, at two
# levels and narrow widths. Compile time grows with the number of layers (each
# becomes kernels to generate and build), hardly with their width: with the real
# four levels one torch.compile of the SD1.5 layout took minutes on a 2-core CPU,
# and the sweep recompiles it several times.
QUICK_CHANGES = {
    "sd15": dict(block_out_channels=(32, 64), layers_per_block=1,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D")),
    "sdxl": dict(block_out_channels=(32, 64), layers_per_block=1, attention_head_dim=(1, 2),
                 transformer_layers_per_block=(1, 1),
                 down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D")),
    "vae": dict(block_out_channels=(32, 64), layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2),
}

SEQUENCE = 77  # one CLIP chunk; the prompt length is not what this benchmark sweeps


@dataclass
class ModelSpec:
    name: str
    title: str
    kind: str  # "unet" or "vae_decoder"
    config: Dict[str, Any]
    changes: Dict[str, Any]
    sweep_sizes: List[Tuple[int, int]]  # 5 latent (height, width)
    sweep_batches: List[int]  # 3 batch sizes
    steady_shapes: List[Shape]
    range_batch: Tuple[int, int]
    range_spatial: Tuple[int, int]
    notes: List[str] = field(default_factory=list)

    @property
    def base_shape(self) -> Shape:
        """The first call's shape (the cold compile is timed on it)."""
        return self.steady_shapes[0]

    def sweep(self) -> List[Shape]:
        return [(b, h, w) for (h, w) in self.sweep_sizes for b in self.sweep_batches]

    def shape_range(self):
        from compiler.keys.shapes import ShapeRange

        return ShapeRange(batch=self.range_batch, spatial=self.range_spatial, sequence=(1, SEQUENCE))

    def describe(self) -> dict:
        return {
            "name": self.name, "title": self.title, "kind": self.kind,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.config.items()},
            "changed_from_real_config": {k: list(v) if isinstance(v, tuple) else v for k, v in self.changes.items()},
            "sweep_sizes": [list(s) for s in self.sweep_sizes], "sweep_batches": list(self.sweep_batches),
            "steady_shapes": [list(s) for s in self.steady_shapes],
            "declared_range": {"batch": list(self.range_batch), "spatial": list(self.range_spatial),
                               "sequence": [1, SEQUENCE]},
            "notes": list(self.notes),
        }

    # -- building -----------------------------------------------------------------
    def build(self, seed: int = 0, device=None):
        """The module the benchmark calls: the UNet, or the VAE's decoder (its weights made on `device`, default
        the CPU)."""
        import torch

        torch.manual_seed(seed)
        with _made_on(device):
            if self.kind == "unet":
                from diffusers import UNet2DConditionModel

                return UNet2DConditionModel(**self.config).eval()
            from diffusers import AutoencoderKL

            return AutoencoderKL(**self.config).decoder.eval()

    def inputs(self, shape: Shape, device: str, dtype, seed: int = 0) -> Tuple[tuple, dict]:
        import torch

        batch, height, width = shape
        generator = torch.Generator().manual_seed(seed + batch * 1000 + height * 10 + width)

        def randn(*size):
            return torch.randn(*size, generator=generator).to(device=device, dtype=dtype)

        if self.kind == "vae_decoder":
            return (randn(batch, self.config["latent_channels"], height, width),), {}
        kwargs = {"encoder_hidden_states": randn(batch, SEQUENCE, self.config["cross_attention_dim"]),
                  "return_dict": False}
        if self.config.get("addition_embed_type") == "text_time":
            time_dim = self.config["addition_time_embed_dim"]
            text_dim = self.config["projection_class_embeddings_input_dim"] - 6 * time_dim
            kwargs["added_cond_kwargs"] = {"text_embeds": randn(batch, text_dim), "time_ids": randn(batch, 6)}
        timestep = torch.tensor(500.0, device=device)
        return (randn(batch, self.config["in_channels"], height, width), timestep), kwargs


def _made_on(device):
    """Where a model's weights are made: `device` (a GPU makes 2.6B random weights in a second, a CPU in tens of
    seconds: the device check builds on its GPU), or the CPU when None."""
    import contextlib

    import torch

    return torch.device(device) if device is not None else contextlib.nullcontext()


def _sizes(small: int, mid: int, large: int, step: int) -> List[Tuple[int, int]]:
    """Five latent sizes: three squares and two non-square ones."""
    return [(small, small), (mid, mid), (large, large), (mid, large), (large, mid - step)]


def _profile(kind: str, name: str, known, profile: str, device: str) -> Tuple[bool, bool]:
    """(quick, gpu) for a model of `kind` named on the command line, or a ValueError that lists the known ones."""
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; {kind}s: {', '.join(known)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}")
    quick = profile in QUICK_PROFILES
    return quick, device.startswith("cuda") and not quick


def spec(name: str, profile: str, device: str = "cpu") -> ModelSpec:
    quick, gpu = _profile("model", name, MODELS, profile, device)
    changes = dict(QUICK_CHANGES[name]) if quick else {}
    batches = [1, 2, 4]
    if name == "sd15":
        config = {**SD15_UNET, **changes}
        if gpu:  # 512-768 px images, the sizes SD1.5 is used at
            sizes, steady, spatial = _sizes(64, 80, 96, 16), [(2, 64, 64), (2, 96, 96)], (64, 128)
        elif quick:
            sizes, steady, spatial = _sizes(16, 24, 32, 8), [(2, 32, 32), (1, 24, 24), (4, 16, 16)], (16, 32)
        else:
            sizes, steady, spatial = _sizes(32, 40, 48, 8), [(2, 32, 32), (1, 48, 48)], (32, 64)
        title = "SD1.5-shaped UNet"
    elif name == "sdxl":
        config = {**SDXL_UNET, **changes}
        if gpu:  # 768-1024 px; the steady shape is 1024x1024 with classifier-free guidance
            sizes, steady, spatial = _sizes(96, 112, 128, 16), [(2, 128, 128)], (64, 160)
        elif quick:
            sizes, steady, spatial = _sizes(16, 24, 32, 8), [(2, 32, 32), (1, 24, 24)], (16, 32)
        else:
            sizes, steady, spatial = _sizes(32, 40, 48, 8), [(2, 32, 32)], (32, 64)
        title = "SDXL-shaped UNet"
    else:
        config = {**SD_VAE, **changes}
        if gpu:
            sizes, steady, spatial = _sizes(64, 96, 128, 32), [(1, 128, 128)], (32, 160)
        elif quick:
            sizes, steady, spatial = _sizes(16, 24, 32, 8), [(1, 32, 32), (2, 24, 24)], (16, 32)
        else:
            sizes, steady, spatial = _sizes(16, 24, 32, 8), [(1, 32, 32)], (16, 64)
        title = "VAE decoder (SD/SDXL layout)"
    notes = []
    if quick:
        notes.append("--quick: the real block types and conditioning sizes at two levels and narrow widths "
                     "(changed_from_real_config); per-op overhead weighs more than at real widths")
    if profile in ONE_STEADY_SHAPE:
        steady = steady[:1]
    return ModelSpec(name=name, title=title, kind="vae_decoder" if name == "vae" else "unet", config=config,
                     changes=changes, sweep_sizes=sizes, sweep_batches=batches, steady_shapes=steady,
                     range_batch=(1, max(batches)), range_spatial=spatial, notes=notes)


def parameter_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def dtype_from_flag(flag: str):
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[flag]


# -- transformers -------------------------------------------------------------------

TransformerShape = Tuple[int, int, int, int]  # (batch, latent height, latent width, latent frames)


@dataclass
class TransformerSpec:
    """A transformer benchmarked block by block; shapes carry latent frames (1 for images)."""

    name: str
    title: str
    config: Dict[str, Any]
    changes: Dict[str, Any]
    sweep_sizes: List[Tuple[int, int, int]]  # 5 (latent height, width, frames)
    sweep_batches: List[int]
    steady_shapes: List[TransformerShape]
    range_batch: Tuple[int, int]
    range_spatial: Tuple[int, int]
    range_frames: Tuple[int, int]
    text: int
    notes: List[str] = field(default_factory=list)
    kind: str = "transformer"

    @property
    def base_shape(self) -> TransformerShape:
        return self.steady_shapes[0]

    def sweep(self) -> List[TransformerShape]:
        return [(b, h, w, f) for (h, w, f) in self.sweep_sizes for b in self.sweep_batches]

    def shape_range(self):
        from compiler.keys.shapes import ShapeRange

        frames = self.range_frames if self.name == "wan" else None
        return ShapeRange(batch=self.range_batch, spatial=self.range_spatial, sequence=(1, self.text), frames=frames)

    def describe(self) -> dict:
        def plain(v):
            return list(v) if isinstance(v, tuple) else v

        return {
            "name": self.name, "title": self.title, "kind": self.kind,
            "config": {k: plain(v) for k, v in self.config.items()},
            "changed_from_real_config": {k: plain(v) for k, v in self.changes.items()},
            "sweep_sizes": [list(s) for s in self.sweep_sizes], "sweep_batches": list(self.sweep_batches),
            "steady_shapes": [list(s) for s in self.steady_shapes], "text_tokens": self.text,
            "declared_range": {"batch": list(self.range_batch), "spatial": list(self.range_spatial),
                               "sequence": [1, self.text], "frames": list(self.range_frames)},
            "notes": list(self.notes),
        }

    def build(self, seed: int = 0, device=None):
        import diffusers
        import torch

        torch.manual_seed(seed)
        with _made_on(device):
            return getattr(diffusers, CLASSES[self.name])(**self.config).eval()

    def family(self, model):
        from compiler.blocks.diffusers_families import diffusers_family

        return diffusers_family(model)

    def compile_repeated_blocks(self, model) -> None:
        """diffusers' `compile_repeated_blocks()`: torch.compile of each block whose class `_repeated_blocks` names.

        SD3Transformer2DModel declares no `_repeated_blocks` (diffusers then
        raises): its block class is named from the family (JointTransformerBlock),
        on this instance only.
        """
        if not getattr(model, "_repeated_blocks", None):
            model._repeated_blocks = list(self.family(model).block_classes)
        model.compile_repeated_blocks()

    def inputs(self, shape: TransformerShape, device: str, dtype, seed: int = 0, model=None) -> Tuple[tuple, dict]:
        """The call the family's pipeline makes (compiler.blocks.diffusers_families), at this shape."""
        from compiler.blocks.tokens import Dims

        batch, height, width, frames = shape
        args, kwargs = self.family(model).example_call(model, Dims(batch, height, width, frames, self.text))
        return args, kwargs


def transformer_spec(name: str, profile: str, device: str = "cpu") -> TransformerSpec:
    """The real config (GPU), cut to one block per structure at real widths (CPU), or narrowed (--quick)."""
    quick, gpu = _profile("transformer", name, TRANSFORMERS, profile, device)
    if profile == "check":  # a GPU: the real config, but for the changes the check makes (Flux's depth)
        changes = dict(CHECK_CHANGES.get(name, {}))
    elif quick:
        changes = dict(QUICK_TRANSFORMER_CHANGES[name])
    else:
        changes = {} if gpu else dict(CPU_DEPTH[name])
    sizes, batches, steady, spatial, frames = _transformer_sizes(name, quick, gpu)
    notes = []
    if quick:
        notes.append("--quick: the real block classes at a sixth of the depth and narrow widths "
                     "(changed_from_real_config); compile time follows depth, per-op overhead weighs more than "
                     "at real widths")
    elif not gpu:
        notes.append("CPU: the real widths with the depth cut to the fewest blocks that hold every block structure "
                     "(changed_from_real_config): a block structure's graph does not depend on how many blocks "
                     "share it, so cold compiles compare per structure; whole-model torch.compile compiles the cut "
                     "model, not the real depth")
        notes.append("CPU: latents of 16-32 and batches of 1-2, what a 2-core CPU runs at these widths")
    if profile in ONE_STEADY_SHAPE:
        steady = steady[:1]
    if profile == "check" and changes:
        notes.append("--check: the real width with fewer blocks (changed_from_real_config)")
    return TransformerSpec(name=name, title=TITLES[name], config={**REAL[name], **changes}, changes=changes,
                           sweep_sizes=sizes, sweep_batches=batches, steady_shapes=steady,
                           range_batch=(1, max(batches)), range_spatial=spatial, range_frames=frames,
                           text=QUICK_TEXT_TOKENS if quick else TEXT_TOKENS[name], notes=notes)


def _transformer_sizes(name: str, quick: bool, gpu: bool) -> Tuple[List[Tuple[int, int, int]], List[int],
                                                                   List[TransformerShape], Tuple[int, int],
                                                                   Tuple[int, int]]:
    """(sweep sizes, batches, steady shapes, latent range, frame range) of a transformer in a profile."""
    if name == "wan":
        if gpu:  # 480p-ish latents, 9-33 frames
            return ([(60, 104, 3), (60, 104, 9), (48, 80, 5), (60, 80, 9), (48, 104, 3)], [1, 2, 3],
                    [(1, 60, 104, 9)], (48, 104), (1, 21))
        if quick:
            return ([(16, 16, 2), (24, 24, 2), (16, 24, 3), (24, 16, 5), (32, 32, 3)], [1, 2, 3],
                    [(1, 24, 24, 2), (2, 16, 16, 2)], (16, 32), (1, 5))
        return ([(16, 16, 3), (24, 24, 3), (16, 24, 5), (24, 16, 9), (32, 32, 5)], [1, 2],
                [(1, 24, 24, 3)], (16, 32), (1, 9))
    if gpu:  # 512-1024 px (Flux, SD3.5, Qwen-Image and Z-Image default to 1024 x 1024: a 128 x 128 latent)
        return ([(64, 64, 1), (96, 96, 1), (128, 128, 1), (96, 128, 1), (128, 80, 1)], [1, 2, 4],
                [(1, 128, 128, 1), (2, 96, 96, 1)], (64, 128), (1, 1))
    if quick:
        return ([(16, 16, 1), (24, 24, 1), (32, 32, 1), (24, 32, 1), (32, 16, 1)], [1, 2, 4],
                [(1, 32, 32, 1), (2, 24, 24, 1)], (16, 32), (1, 1))
    return ([(16, 16, 1), (24, 24, 1), (32, 32, 1), (24, 32, 1), (32, 16, 1)], [1, 2],
            [(1, 32, 32, 1)], (16, 32), (1, 1))


def any_spec(name: str, profile: str, device: str = "cpu"):
    """The spec of a whole-model (UNet, VAE) or transformer benchmark model."""
    if name in TRANSFORMERS:
        return transformer_spec(name, profile, device)
    return spec(name, profile, device)
