"""Facts about this process that decide whether a compiled graph can run here.

A graph is native code built for one torch version and one device kind; these
values go into every key and manifest from this single place.
"""

from __future__ import annotations

import functools
import platform
from typing import Tuple

import torch

CUDA = "cuda"


def torch_version() -> str:
    return torch.__version__


def device_kind(device: torch.device) -> str:
    """The device part of a graph's key: `cpu`, or a CUDA GPU with its generation (`cuda-sm90`).

    A GPU graph holds kernels for one compute capability, so graphs for two
    GPU generations are keyed apart: a graph built on an sm80 GPU is never
    looked up, let alone loaded, for an sm90 one. `cuda:1` and `cuda:0` of one
    generation share a graph (it is loaded per device: backends/aot.py). Other
    device types are their type name, as CPU keys always were.
    """
    device = torch.device(device)
    if device.type != CUDA:
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    return f"{CUDA}-sm{major}{minor}"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    """A GPU's compute capability; asked once per device (keys are made on every call)."""
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def kind_type(kind: str) -> str:
    """The torch device type of a device kind: `cuda` for `cuda-sm90`, `cpu` for `cpu`."""
    return kind.split("-", 1)[0]


def kind_available(kind: str) -> bool:
    """Whether this machine has a device of `kind` (a GPU of that generation; plain `cuda`, as keys were written
    before they named one: any CUDA GPU)."""
    device_type = kind_type(kind)
    if device_type == "cpu":
        return True
    module = getattr(torch, device_type, None)
    available = getattr(module, "is_available", None)
    if not callable(available) or not available():
        return False
    if device_type != CUDA or kind == CUDA:
        return True
    return any(device_kind(torch.device(CUDA, index)) == kind for index in range(torch.cuda.device_count()))


def machine() -> str:
    return f"{platform.system()}-{platform.machine()}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value
