"""torch's AOTInductor package loader, made for one device: the one place a package is loaded (torch only).

Imported by aot.py; loaded by path (it never imports the pack) by the build process (build_process/child.py),
which loads each GPU package it built before handing it over, and run as a script by loader_check.py:

    python package_loader.py PACKAGE.pt2

loads every model in the package in a process of its own and prints "loaded" (exit 0). On the GPU machines this
project is lent (H100, torch 2.11+cu130, 2026-11-27), torch's loader killed the process with SIGSEGV for every
CUDA package, torch's own two-call example included (benchmarks/load_probe.py): a process that loads a
package it has not seen load elsewhere on this machine would die with it. Here only this process dies.
"""

from __future__ import annotations

import contextlib
import sys
import zipfile
from typing import List

LOADED = "loaded"


def new_loader(path: str, model: str = "model", device_index: int = -1):
    """torch._C._aoti.AOTIModelPackageLoader for device `device_index` (-1: the CPU, or the current GPU); its
    arguments grew over torch versions. One without the device index loads onto the current device, so that is
    set to `device_index` around it.

    Single-threaded (`run_single_threaded`, torch's flag "to avoid conflicts with CUDAGraphs"): in the default
    mode torch's model container (aoti_runtime/model_container.h, torch 2.11) has one model instance here, so
    each call after the first reclaims it from the last call with cudaEventQuery, and waits on it with
    cudaEventSynchronize while it is still running: the host waits for the GPU between calls, and a CUDA graph
    capture fails ("operation failed due to a previous error during capture", H200, torch 2.11+cu130).
    The pack never runs one container from two threads at once (AotGraph.run and SharedRunner.run hold the
    graph's lock), which is what that mode's synchronisation is for."""
    import torch

    loader_class = torch._C._aoti.AOTIModelPackageLoader
    try:
        return loader_class(path, model, True, 1, device_index)
    except TypeError:
        pass
    current = torch.cuda.device(device_index) if device_index >= 0 else contextlib.nullcontext()
    with current:
        for args in ((model, True, 1), (model, True)):
            try:
                return loader_class(path, *args)
            except TypeError:
                continue
        return loader_class(path, model)


def model_names(path: str) -> List[str]:
    """The models a package holds ("model", or a graph's parts), from its member names (data/aotinductor/NAME/)."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    found: List[str] = []
    for name in names:
        parts = name.split("/")
        for index in range(1, len(parts) - 2):  # .../data/aotinductor/NAME/FILE
            if parts[index - 1:index + 1] == ["data", "aotinductor"] and parts[index + 1] not in found:
                found.append(parts[index + 1])
    return found or ["model"]


def load_all(path: str) -> int:
    """Load every model of the package at `path` (a runner each, dropped at once); how many."""
    models = model_names(path)
    for model in models:
        loader = new_loader(path, model, -1)
        del loader
    return len(models)


def main(argv: List[str]) -> int:
    count = load_all(argv[0])
    print(f"{LOADED} {count}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
