"""How many latent pixels a model's spatial sizes move by: the multiple a whole-model graph is traced on.

Why: a UNet or VAE encoder halves its spatial sizes at every stride-2
convolution. Traced with height and width free in a range, each level's size
is a nested floor expression of the input's (`1 + (h - 1) // 2`, then that
halved again...), which every later shape computation, guard and index of the
graph carries. At SD1.5's real depth this made Inductor's code generation and
the C++ wrapper several times larger and slower (docs/benchmarks.md, "CPU: the
real SD1.5 UNet, cold compile"). Traced with the latent side declared as `m * k`
(`m` the model's total downsampling), every level's size is an exact
multiple of `k`, and the expressions stay flat.

The multiple is read off the module's structure: 2 to the power of the
number of stride-2 downsamplers (convolutions and pools) along each of the
last spatial axes, capped at `MAX_MULTIPLE`. Counting too many (a model with
two downsampling branches) only makes fewer sizes aligned; those get a graph
traced with free sizes, as before (compiler/backends/aot.py), so the count
decides compile time, never correctness. `KEEPFAST_ALIGN=0` turns it off.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..settings import align

MAX_MULTIPLE = 64
AXES = 3  # counted separately for the last three axes (width, height, and frames or depth)

_cache: "weakref.WeakKeyDictionary[torch.nn.Module, Tuple[int, ...]]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    return align()


def _strides(module: torch.nn.Module) -> Optional[Tuple[int, ...]]:
    """The stride of a downsampling layer, per axis (None for any other module)."""
    if isinstance(module, torch.nn.modules.conv._ConvNd) and not module.transposed:
        return tuple(module.stride)
    if isinstance(module, (torch.nn.AvgPool1d, torch.nn.AvgPool2d, torch.nn.AvgPool3d,
                           torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d)):
        stride = module.stride if module.stride is not None else module.kernel_size
        return tuple(stride) if isinstance(stride, (tuple, list)) else None
    return None


def axis_multiples(module: torch.nn.Module) -> Tuple[int, ...]:
    """Per trailing axis (last first), 2 ** (stride-2 downsamplers on it), capped at MAX_MULTIPLE."""
    try:
        return _cache[module]
    except (KeyError, TypeError):
        pass
    counts = [0] * AXES
    for sub in module.modules():
        strides = _strides(sub)
        if not strides:
            continue
        for axis, stride in enumerate(reversed(strides[-AXES:])):
            if stride == 2:
                counts[axis] += 1
    multiples = tuple(min(MAX_MULTIPLE, 2 ** count) for count in counts)
    try:
        _cache[module] = multiples
    except TypeError:
        pass
    return multiples


def spatial_multiples(module: torch.nn.Module, shape: Sequence[int], spatial_dims: Sequence[int],
                      bounds: Dict[int, Tuple[int, int]], declared: Optional[int] = None
                      ) -> Dict[int, Tuple[int, int, int]]:
    """For a tensor input's spatial dims: dim -> (multiple, lowest k, highest k) where its size is traced as
    multiple * k, k in [low, high]. The multiple is `declared` (ShapeRange.spatial_multiple) or else the
    module's own (`axis_multiples`). Only dims whose multiple is over 1, whose size in this call is a multiple
    of it, at least twice it, and whose range holds at least two multiples; the rest stay free (an empty dict
    when off). A call of exactly one multiple (SD1.5's latent 8, its lowest level 1x1) is traced free: torch's
    symbolic shapes specialise a size whose example is 1, so a Dim `k` traced at 1 made torch.export fail with
    "Constraints violated (8*spatial2_over_8)" (the SD1.5 UNet's range corners failed one after another); free,
    the size is specialised and the graph serves that size. A range of
    one multiple (a node's minimum and maximum resolution set equal) is a fixed size: torch.export refuses a
    `Dim` whose minimum equals its maximum, which had failed the compile with "Cannot create Dim with
    inconsistent min=4, max=4"."""
    if not enabled():
        return {}
    multiples = _multiples(module, declared)
    out: Dict[int, Tuple[int, int, int]] = {}
    rank = len(shape)
    for dim in spatial_dims:
        axis = rank - 1 - dim
        if not 0 <= axis < len(multiples):
            continue
        multiple = multiples[axis]
        low, high = bounds.get(dim, (shape[dim], shape[dim]))
        k_low, k_high = -(-low // multiple), high // multiple
        if multiple > 1 and shape[dim] % multiple == 0 and shape[dim] > multiple and max(1, k_low) < k_high:
            out[dim] = (multiple, max(1, k_low), k_high)
    return out


def _multiples(module: torch.nn.Module, declared: Optional[int]) -> Tuple[int, ...]:
    """Per trailing axis (last first): the declared multiple (ShapeRange.spatial_multiple), else the module's own."""
    return (declared,) * AXES if declared is not None else axis_multiples(module)


def one_multiple_sides(module: torch.nn.Module, low: int,
                       declared: Optional[int] = None) -> Tuple[Optional[int], Optional[int]]:
    """(height, width) in latent pixels that are exactly one multiple of the module's downsampling, where a range
    starting at `low` reaches down to it; None where not.

    Why: a graph traced over a range serves such a size on no axis (torch.export never keeps a size whose levels
    reach 1 dynamic: the SD1.5 UNet's graph says latent >= 16 where the range starts at 8), so each range corner
    there is a whole model's compile of its own. Covered on the first call, the default range of the UNet node
    (64 px, latent 8) made SD1.5's first call build three more graphs (before, eight failed traces: 239 s against
    95 s on this project's CPU). Those corners compile when a call first needs them (graph_supply._cover)."""
    if not enabled():
        return None, None
    width_multiple, height_multiple = _multiples(module, declared)[:2]
    return (height_multiple if 1 < height_multiple and low <= height_multiple else None,
            width_multiple if 1 < width_multiple and low <= width_multiple else None)
