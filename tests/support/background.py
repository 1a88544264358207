"""What the background-build tests share: the tiny SD UNet's calls, the build folders, processes by /proc, and a
parent process (background_parent.py) stopped mid-build.

Used by tests/builds/test_background_builds.py, tests/tracing/test_forked_trace.py and tests/comfyui/test_comfyui_background_server.py.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Tuple

import torch

from compiler import CompileOptions, ShapeRange
from compiler.diffusers_api import compile_module
from compiler.store.extraction import run_folder
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import prompt_embeds, tiny_unet

HERE = Path(__file__).parent
RANGE = ShapeRange(batch=(1, 2), spatial=(8, 16), sequence=(1, 77))


def unet_call(batch: int, side: int, length: int = 77):
    latent = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(side + batch))
    return (latent, torch.tensor(500.0), prompt_embeds(batch, length)), {"return_dict": False}


def served_difference(unet, twin, batch: int, side: int, length: int = 77) -> float:
    """max |unet - twin| for one call (the compiled UNet against its eager copy)."""
    args, kwargs = unet_call(batch, side, length)
    with torch.no_grad():
        got, want = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
    return float((got - want).abs().max())


def background_unet(seed: int):
    """(a tiny SD UNet compiled with background builds, its eager copy, the registry, its CompiledForward)."""
    unet = tiny_unet(seed=seed)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    return unet, twin, registry, compile_module(unet, CompileOptions(shape_range=RANGE, background=True), registry)


def build_folders() -> List[str]:
    return sorted(p.name for p in run_folder().glob("build-*"))


def processes() -> Iterator[Tuple[int, str, int, bytes]]:
    """(pid, state, parent pid, command line with NULs) of every process /proc shows now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        yield int(entry.name), fields[0], int(fields[1]), command


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


class StoppedParent(NamedTuple):
    pid: int  # the process background_parent.py printed (a build, or a trace process)
    ran: bool  # it was running when the parent was stopped
    run: Path  # the parent's run folder
    temp: Path  # the parent's TMPDIR
    how: str = ""  # a trace process: "forked" or "spawned" (PackageBuild.trace_process)


def stop_parent_mid_build(tmp_path: Path, signal_number: int, env: Dict[str, str]) -> StoppedParent:
    """Start background_parent.py (TMPDIR in `tmp_path`, `env` added), read the pid it prints, stop the parent with
    `signal_number`, then wait (30 s at most) until that process is gone and the parent's run folder removed."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    parent = subprocess.Popen([sys.executable, str(HERE / "background_parent.py")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "TMPDIR": str(temp), **env})
    try:
        pid, run, *how = parent.stdout.readline().split()
        ran = not gone(int(pid))
    finally:
        parent.send_signal(signal_number)
        parent.wait(60)
    deadline = time.monotonic() + 30
    while (not gone(int(pid)) or Path(run).exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return StoppedParent(int(pid), ran, Path(run), temp, "".join(how))
