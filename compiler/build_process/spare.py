"""A spare build process: started before its build (builds/spares.py), it imports torch and what a build
imports, and for a CPU program runs the ISA probe, while the parent traces; then it waits for its job folder on
stdin, and build_process/child.py builds it. The standard library and torch only.
"""

from __future__ import annotations

import os
import sys
from typing import List

from .isa_probe import _no_isa_probe, _probe_isa
from .lifeline import _stop_when_the_parent_is_gone

# What a build imports after torch, imported by a spare while it waits for its build: reading a program
# (torch.export's deserialiser) and AOTInductor's compiler, with Triton's code generation for a GPU program.
# On this 2-core CPU (torch 2.13) torch.export.load of a small program took 1.05-1.16 s in a process that had
# imported torch only, 0.02 s after these imports (1.8 s); a spare starts while its caller traces, so that time
# is off the build's path.
BUILD_IMPORTS = ("torch.export", "torch._export.serde.serialize", "torch._inductor.compile_fx",
                 "torch._inductor.codecache", "torch._inductor.graph", "torch._inductor.scheduler",
                 "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.package")
GPU_BUILD_IMPORTS = ("triton", "torch._inductor.codegen.triton", "torch._inductor.codegen.cpp_wrapper_gpu",
                     "torch._inductor.runtime.triton_heuristics")


def _warm_imports(kind: str) -> List[str]:
    """Import what a build of `kind` ("cpu" or "gpu") will (BUILD_IMPORTS); the modules that would not import
    are left to the build, which says why if it needs them."""
    import importlib

    failed = []
    for name in BUILD_IMPORTS + (GPU_BUILD_IMPORTS if kind != "cpu" else ()):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a CPU-only torch has no Triton; the build imports what it needs
            failed.append(name)
    return failed


SPARE_WAIT_S = 600  # a spare that gets no build in this time ends (its memory is the parent's machine's)


def wait_for_build(kept_isa_cache: str, kind: str = "cpu") -> str:
    """A build process started before its build (spares.prestart): torch imported, and for a `kind` "cpu"
    build the ISA probe run, while the parent traces the graph; then it reads its job folder from stdin, which it
    returns with this process's output sent there, for child.main to build (the parent gives it a build of its kind
    only). "" (no build) on end-of-file or after SPARE_WAIT_S; it ends with its parent."""
    import select

    _stop_when_the_parent_is_gone(None)
    import torch  # noqa: F401 - what the spare is for

    if kind == "cpu":
        _probe_isa(kept_isa_cache)
    else:
        _no_isa_probe()
    _warm_imports(kind)
    ready, _, _ = select.select([sys.stdin], [], [], SPARE_WAIT_S)
    folder = sys.stdin.readline().strip() if ready else ""
    if not folder:
        return ""
    output = os.open(os.path.join(folder, "output.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "cache")
    return folder
