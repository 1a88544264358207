"""Loading an AOTInductor package the pack unpacked (compiler/store/extraction.py): its metadata, and a runner of it
for one device, loaded by torch's package loader directly (package_loader.py) with no probe of the CPU, after the
loader check of its kind (loader_check.py); a graph in parts as one runner of its parts (aot_parts.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import torch

from ..machine.environment import kind_type
from ..tracing import program_split
from . import aot_parts, loader_check, package_loader
from .base import CompileFailed, call_device
from .flat_runner import FlatRunner

def _package_metadata(folder: Path) -> Dict[str, str]:
    """The AOTI_* metadata torch wrote into an unpacked package (platform, machine, ISA, device)."""
    found = sorted(folder.glob("*/data/aotinductor/*/*_metadata.json"))
    found.sort(key=lambda p: not p.name.endswith("wrapper_metadata.json"))  # the one torch's loader reads
    if not found:
        raise CompileFailed("the package has no AOTInductor model metadata (not an AOTInductor package?)")
    return {str(k): str(v) for k, v in json.loads(found[0].read_text()).items()}


def index_of(device: torch.device) -> int:
    """A runner's index for calls on `device`: its GPU index; -1 for the CPU."""
    return -1 if device.type == "cpu" or device.index is None else int(device.index)


def device_index(tensors) -> int:
    """The index of the device a call's tensors are on (`base.call_device`: the first one not on the CPU)."""
    return index_of(call_device(tensors))


def _home_index(kind: str) -> int:
    """The device a graph's package is first loaded for: this process's current CUDA device for a CUDA graph (the
    index a call from there names, so its runner is found again), else -1 (the CPU)."""
    return torch.cuda.current_device() if kind_type(kind) == "cuda" else -1


_new_loader = package_loader.new_loader  # the loader for one device (package_loader.py)


def _package_kind(folder: Path) -> str:
    """The device kind an unpacked package computes on (its AOTI_DEVICE_KEY); "cpu" where it does not say."""
    try:
        return _package_metadata(folder).get("AOTI_DEVICE_KEY", "cpu") or "cpu"
    except CompileFailed:
        return "cpu"


def refuse_where_the_loader_crashes(device: str) -> None:
    """CompileFailed with the reason where torch's package loader crashed on this machine for `device`'s kind
    (loader_check.py): a graph that cannot be loaded is not traced and built (minutes) for nothing."""
    reason = loader_check.refusal(loader_check.kind_of(device))  # a family's device: "cuda-sm90"
    if reason:
        raise CompileFailed(reason)


def _load_runner(folder: Path, package_bytes: bytes, wiring: Optional[dict] = None, index: int = -1):
    """Load an unpacked package (verified bytes, in the pack's own folder) for device `index` without probing the
    CPU; a graph in parts (`wiring`) as one runner of its parts (aot_parts.py).

    torch >= 2.13 loads the unpacked folder in place; an older torch loads only
    a .pt2 file and unpacks it again into a folder of its own.
    """
    from torch._inductor.package.package import AOTICompiledModel

    kind = _package_kind(folder)
    if loader_check.applies(kind):  # loaded in a process of its own first, until one loaded on this machine
        path = folder / "graph.pt2"
        if loader_check.known(kind) is None and not path.is_file():  # a check process reads a .pt2 file
            path.write_bytes(package_bytes)
        refused = loader_check.before_load(kind, path)
        if refused:
            raise CompileFailed(refused)

    def load(model: str):
        try:
            return FlatRunner(AOTICompiledModel(_new_loader(str(folder), model, index)))
        except RuntimeError as error:
            if "zip" not in str(error).lower():
                raise
            path = folder / "graph.pt2"
            if not path.is_file():
                path.write_bytes(package_bytes)
            return FlatRunner(AOTICompiledModel(_new_loader(str(path), model, index)))

    if wiring is None:
        return load("model")
    return aot_parts.ChainedRunner(load, program_split.Wiring.from_json(wiring))
