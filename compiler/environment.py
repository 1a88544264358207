"""Facts about this process that decide whether a compiled graph can run here.

A graph is native code built for one torch version and one device type; these
values go into every key and manifest from this single place.
"""

from __future__ import annotations

import platform

import torch


def torch_version() -> str:
    return torch.__version__


def device_kind(device: torch.device) -> str:
    """`cuda:1` and `cuda:0` run the same graph; `cpu` and `cuda` do not."""
    return torch.device(device).type


def machine() -> str:
    return f"{platform.system()}-{platform.machine()}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value
