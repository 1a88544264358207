"""What users type into the nodes (resolutions, batch sizes) and the ranges graphs are built for."""

from __future__ import annotations

import re
from typing import List, Tuple

from ..compiler import ShapeRange

def parse_resolutions(text: str) -> List[Tuple[int, int]]:
    """'512x512, 768x512, 1024' -> [(512, 512), (768, 512), (1024, 1024)] as (width, height)."""
    sizes = []
    for part in re.split(r"[,;\s]+", text or ""):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:[xX*](\d+))?", part)
        if not match:
            raise ValueError(f"{part!r} is not a resolution (write WIDTHxHEIGHT, e.g. 512x768)")
        width = int(match.group(1))
        height = int(match.group(2) or width)
        if width <= 0 or height <= 0:
            raise ValueError(f"{part!r}: sizes must be positive")
        sizes.append((width, height))
    return sizes


def parse_batch_sizes(text: str) -> List[int]:
    values = []
    for part in re.split(r"[,;\s]+", text or ""):
        if not part:
            continue
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{part!r} is not a batch size (positive whole numbers, e.g. 1, 2, 4)")
        values.append(int(part))
    return values


PROMPT_TOKENS = 1024  # the longest prompt (text encoder tokens) the graphs take


def latent_range(min_size: int, max_size: int, max_batch: int, batch_factor: int = 2, scale: int = 8,
                 sequence: Tuple[int, int] = (1, PROMPT_TOKENS)) -> ShapeRange:
    """The range a diffusion model is compiled for: image sizes in pixels, batches in images.

    `batch_factor` 2: ComfyUI batches the positive and negative prompt together.
    """
    low = max(1, -(-min_size // scale))
    high = max(low, max_size // scale)
    return ShapeRange(batch=(1, max(1, max_batch * batch_factor)), spatial=(low, high), sequence=sequence)


def clamp(value: int, bounds: Tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])
