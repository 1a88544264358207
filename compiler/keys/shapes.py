"""Declared shape ranges and which input dimensions are dynamic.

A graph serves every input whose dynamic dimensions fall inside the declared
range, so one compile covers every resolution, batch size and prompt length a
user is likely to run. Dimensions are given roles by a simple, documented rule
(`default_roles`) that fits diffusion UNets, VAEs and ControlNet residuals:

- every tensor with at least one dimension: dim 0 is the batch;
- 3-D tensors ([B, L, C], text embeddings): dim 1 is the sequence length;
- 4-D tensors ([B, C, H, W], latents and residuals): dims 2 and 3 are spatial;
- 5-D tensors ([B, C, T, H, W]): dims 2, 3 and 4 are spatial.

Three optional roles exist for transformer families: `frames` (latent frames
of a video model, its own axis, never height or width), `tokens` (the image or
video tokens a transformer block sees, derived from the pixel and frame range
by the block engine in `compiler.blocks`) and `audio` (the audio tokens of a
model that makes a soundtrack beside the video, LTX-2: their own stream,
sized by the video's length). A range without them serialises exactly as
before, so existing graph keys do not change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import math
from typing import Any, Dict, List, Optional, Tuple

BATCH = "batch"
SPATIAL = "spatial"
SEQUENCE = "sequence"
FRAMES = "frames"
TOKENS = "tokens"
AUDIO = "audio"
ROLES = (BATCH, SPATIAL, SEQUENCE)
OPTIONAL_ROLES = (FRAMES, TOKENS, AUDIO)  # present only when set


@dataclass(frozen=True)
class ShapeRange:
    """Inclusive bounds per role. Spatial bounds are in latent pixels (image / 8)."""

    batch: Tuple[int, int] = (1, 8)
    spatial: Tuple[int, int] = (8, 256)
    sequence: Tuple[int, int] = (1, 1024)
    frames: Optional[Tuple[int, int]] = None  # latent frames (video models)
    tokens: Optional[Tuple[int, int]] = None  # image/video tokens per sample (transformer blocks)
    audio: Optional[Tuple[int, int]] = None  # audio tokens per sample (LTX-2's audio stream)
    # The multiple a whole-model graph traces the first spatial input on (compiler/keys/alignment.py): None, the
    # model's own total downsampling; 1, sizes free (a decoder, which only upsamples).
    spatial_multiple: Optional[int] = None

    def bounds(self, role: str) -> Tuple[int, int]:
        value = getattr(self, role)
        if value is None:
            raise KeyError(f"this range declares no {role} bounds")
        return tuple(value)

    def roles(self) -> Tuple[str, ...]:
        """The roles this range declares bounds for."""
        return ROLES + tuple(r for r in OPTIONAL_ROLES if getattr(self, r) is not None)

    def to_json(self) -> dict:
        out: Dict[str, Any] = {role: list(self.bounds(role)) for role in self.roles()}
        if self.spatial_multiple is not None:
            out["spatial_multiple"] = self.spatial_multiple
        return out

    @classmethod
    def from_json(cls, data: dict) -> "ShapeRange":
        multiple = data.get("spatial_multiple")
        return cls(**{role: tuple(data[role]) for role in ROLES + OPTIONAL_ROLES if data.get(role) is not None},
                   spatial_multiple=int(multiple) if multiple is not None else None)

    @classmethod
    def for_images(
        cls,
        sizes: list[Tuple[int, int]],
        batch_sizes: list[int],
        latent_scale: int = 8,
        max_sequence: int = 1024,
    ) -> "ShapeRange":
        """The smallest range that covers these image sizes (pixels) and batches."""
        latents = [value // latent_scale for size in sizes for value in size]
        return cls(
            batch=(min(batch_sizes), max(batch_sizes)),
            spatial=(min(latents), max(latents)),
            sequence=(1, max_sequence),
        )

    def covers(self, other: "ShapeRange") -> bool:
        return all(
            self.bounds(r)[0] <= other.bounds(r)[0] and other.bounds(r)[1] <= self.bounds(r)[1]
            for r in other.roles()
            if getattr(self, r) is not None
        )

    def describe(self) -> str:
        return ", ".join(f"{r} {lo}-{hi}" for r, (lo, hi) in ((r, self.bounds(r)) for r in self.roles()))


DEFAULT_RANGE = ShapeRange()


def default_roles(ndim: int) -> Dict[int, str]:
    if ndim == 0:
        return {}
    roles = {0: BATCH}
    if ndim == 3:
        roles[1] = SEQUENCE
    elif ndim >= 4:
        for dim in range(2, ndim):
            roles[dim] = SPATIAL
    return roles


LeafBounds = List[Dict[int, Tuple[int, int]]]  # per tensor input: dim -> (low, high)


def leaf_bounds(shapes: List[Tuple[int, ...]], roles: List[Tuple[Any, ...]],
                shape_range: ShapeRange) -> LeafBounds:
    """Per tensor input, the bounds of each dynamic dimension.

    Batch and sequence bounds are the declared ones. Spatial bounds are the
    declared latent range scaled by how this tensor's size relates to the
    first spatial tensor's (a ControlNet residual at 1/8 of the latent gets
    1/8 of the range), so residuals are not held to the latent's bounds.
    """
    reference: Dict[int, int] = {}
    for shape, dims in zip(shapes, roles):
        if any(role == SPATIAL for role in dims):
            reference = {d: shape[d] for d, role in enumerate(dims) if role == SPATIAL}
            break
    out = []
    for shape, dims in zip(shapes, roles):
        bounds: Dict[int, Tuple[int, int]] = {}
        for d, role in enumerate(dims):
            if not isinstance(role, str):
                continue
            low, high = shape_range.bounds(role)
            if role == SPATIAL and d in reference and reference[d] and shape[d] != reference[d]:
                ratio = shape[d] / reference[d]
                low, high = max(1, math.floor(low * ratio)), max(1, math.ceil(high * ratio))
            bounds[d] = (low, high)
        out.append(bounds)
    return out


def asdict_range(shape_range: ShapeRange) -> dict:
    return asdict(shape_range)
