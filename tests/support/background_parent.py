"""A process that starts a background build, prints its child's pid and its run folder, then waits to be killed
(tests/builds/test_background_builds.py: what a ComfyUI stopped with SIGTERM or SIGKILL leaves).

    python background_parent.py   (KEEPFAST_TEST_BUILD_DELAY_S long: the build is still running when killed)

With KEEPFAST_TEST_STOP_IN_TRACE=1 the trace (in a forked process) sleeps, and the pid printed is the trace
process's (tests/tracing/test_forked_trace.py), followed by which process it is (tests/tracing/test_spawned_trace.py: with
KEEPFAST_TRACE_PROCESS=spawn a spawned process, which runs the real trace, not the sleeping one). KEEPFAST_TEST_TRACE_START_DELAY_S holds the trace process back before it
takes its first step as a child (a busy machine: the parent can be gone before its child has started).
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiler import CompileOptions, ShapeRange  # noqa: E402
from compiler.builds import launch, package_builds  # noqa: E402
from compiler.diffusers_api import compile_module  # noqa: E402
from compiler.store.extraction import run_folder  # noqa: E402
from compiler.store.registry import GraphRegistry  # noqa: E402
from compiler.demo.tiny_models import prompt_embeds, tiny_unet  # noqa: E402

launch.CHILD = Path(__file__).with_name("slow_build_child.py")
in_trace = os.environ.get("KEEPFAST_TEST_STOP_IN_TRACE") == "1"
if in_trace:
    from compiler.backends import aot_export  # noqa: E402

    aot_export.trace = lambda *args, **kwargs: time.sleep(3600)
start_delay = float(os.environ.get("KEEPFAST_TEST_TRACE_START_DELAY_S", "0"))
if start_delay:
    from compiler.tracing import forked_trace  # noqa: E402

    become_child = forked_trace._become_child

    def _late_child(parent: int, *rest) -> None:
        time.sleep(start_delay)
        become_child(parent, *rest)

    forked_trace._become_child = _late_child
unet = tiny_unet(seed=6)
forward = compile_module(unet, CompileOptions(shape_range=ShapeRange(batch=(1, 2), spatial=(8, 16)),
                                              background=True), GraphRegistry())
with torch.no_grad():
    unet(torch.randn(1, 4, 8, 8), torch.tensor(500.0), prompt_embeds(1, 77), return_dict=False)
(build,) = package_builds._live
if in_trace:
    print(build.tracer.pid, run_folder(), build.trace_process, flush=True)
    time.sleep(3600)
while build.process is None:
    time.sleep(0.05)
print(build.process.pid, run_folder(), flush=True)
time.sleep(3600)
