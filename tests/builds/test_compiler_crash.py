"""A compiler that dies mid-build never takes the caller down: the call runs eager with the reason.

The AOTInductor compile runs in a build process whether the caller waits for it (`build` before the first image)
or not (background builds). Here the real build process of a tiny SD UNet is killed while it compiles: with
SIGSEGV (what Inductor's crash in sympy on an H200 was) and SIGKILL (the kernel's OOM killer). The call, and every
call after it, returns eager's output with the reason naming the signal; this process lives on; no build process
and no build folder is left; nothing is recorded as compiled.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from compiler import CompileOptions
from compiler.builds import package_builds
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import RANGE, build_folders, gone, served_difference

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Killer(threading.Thread):
    """Kills the first build process with `sig` once it has compiled for `after` CPU seconds (torch imported,
    Inductor at work)."""

    def __init__(self, sig: int, after: float = 3.0):
        super().__init__(daemon=True)
        self.sig, self.after, self.killed = sig, after, None

    def run(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.killed is None:
            for build in list(package_builds._live):
                process = build.process
                if process is not None and process.poll() is None and _cpu_seconds(process.pid) >= self.after:
                    os.kill(process.pid, self.sig)
                    self.killed = process.pid
                    return
            time.sleep(0.05)


@pytest.mark.parametrize("background", [False, True], ids=["waited-for", "background"])
@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_a_compiler_killed_mid_build_leaves_every_call_eager_with_the_reason(sig, background):
    unet = tiny_unet(seed=5)
    twin = copy.deepcopy(unet)
    registry = GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=background), registry)
    killer = Killer(sig)
    killer.start()
    assert served_difference(unet, twin, 2, 16) == 0.0  # waited for the build, or ran eager beside it
    if background:
        forward.wait_for_builds(timeout=600)
    killer.join(timeout=600)
    assert killer.killed is not None, "no build process was seen"
    name = signal.Signals(sig).name
    for batch, side, length in ((2, 16, 77), (1, 8, 20)):
        assert served_difference(unet, twin, batch, side, length) == 0.0
        assert forward.last.eager and f"the build process died ({name})" in forward.last.reason, forward.last.reason
    assert registry.compiles == []
    assert any(name in event.reason for event in registry.fallbacks)
    assert gone(killer.killed) and package_builds.live_builds() == 0
    assert build_folders() == []
