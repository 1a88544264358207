"""Run in a child process by `package_builds.py`: one AOTInductor package from a weight-free exported program.

    python package_build_child.py JOB_FOLDER

The folder holds `program.pt2` (torch.export.save of a program whose weights
are empty placeholders) and `job.json` (each weight's shape, stride, dtype and
device, the Inductor settings, and the modules that define the program's
custom operators, imported first). The weights are made again here, with no
values: a package built with its weights left out needs only their layout.
Writes `graph.pt2`, or `error.txt` (first line: what failed) and exits 1.

This file imports torch only (and those operator modules), never the pack: in
ComfyUI the pack's package name is not one a child process can import. It lowers its own priority so the
sampler in the parent keeps the cores it needs.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _weights(spec: dict):
    import torch

    made = {}
    for name, (shape, stride, dtype, device, parameter) in spec.items():
        tensor = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=device)
        made[name] = torch.nn.Parameter(tensor, requires_grad=False) if parameter else tensor
    return made


def _die_with_parent() -> None:
    """Linux: the kernel kills this child when the process that started it dies (no orphan builds)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's exit handler stops it
        pass


def main(folder: str) -> int:
    _die_with_parent()
    try:
        os.nice(10)
    except (AttributeError, OSError):  # not POSIX, or not allowed: build at the same priority
        pass
    try:
        import torch

        with open(os.path.join(folder, "job.json")) as handle:
            job = json.load(handle)
        import importlib

        for module in job.get("imports", []):  # the modules that register the graph's custom operators
            try:
                importlib.import_module(module)
            except Exception as error:  # noqa: BLE001
                raise RuntimeError(f"the graph's custom operators come from {module}, which the build process "
                                   f"cannot import ({type(error).__name__}: {error})") from error
        program = torch.export.load(os.path.join(folder, "program.pt2"))
        program._state_dict.update(_weights(job["weights"]))
        target = os.path.join(folder, "graph.partial.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=target, inductor_configs=job["configs"])
        os.replace(target, os.path.join(folder, "graph.pt2"))  # whole, or not there
        return 0
    except BaseException as error:  # noqa: BLE001 - the parent reads the reason from error.txt
        with open(os.path.join(folder, "error.txt"), "w") as handle:
            handle.write(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}\n")
            handle.write(traceback.format_exc())
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
