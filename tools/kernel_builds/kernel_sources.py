"""Inductor's Triton kernel sources for a model, written on a CPU, to be built for a GPU elsewhere (kernel_builds.py).

Why: an AOTInductor build of the SD1.5 UNet on an H200 spent 4x longer per Triton configuration than torch.compile on
the same machine, while one-at-a-time builds of the same kernels on a CPU differ by 1.27x between static and
dynamic sizes. To tell kernel content from machine contention, a GPU machine builds a fixed set of kernels at
several concurrencies, with no diffusers, no network and a ~40 s budget. So the kernels are made on a CPU machine:

- a fake Triton driver lets Inductor run with `cpu_backend = "triton"` on a CPU-only machine;
- `AsyncCompile.triton` is replaced to record each kernel's name and source instead of building it;
- the CPU `DeviceProperties` in each source are replaced with an H100/H200-like sm_90 one (and its
  `set_driver_to_cpu()` with `set_driver_to_gpu()`), so the kernel loads as a CUDA kernel where it is built (kernel_builds.py builds it with `triton.compile` for sm_90);
- a dynamo backend calls Inductor's `compile_fx` (what torch.compile's inductor backend calls) and then runs the
  graph eagerly, so a graph break does not end the capture.

    python -m tools.kernel_builds.kernel_sources --out .kernels/sd15_kernels.json [--sizes static|dynamic|both]

Each set is captured in its own process (the patches are process-wide; `--model tiny` is a 3-op module for tests).
Output: {"torch", "triton", "model", "dtype", "call", "sets": {"static": [{"name", "source"}...], "dynamic": [...]},
"graphs": {set: dynamo graphs compiled}}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from .kernel_builds import install_fake_driver

SETS = ("static", "dynamic")
MODELS = ("sd15", "tiny")
# The sm_90 device Inductor would see on an H100/H200 (132 SMs): what the kernels are built for.
CUDA_SM90_PROPS = ("DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, "
                   "regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, warp_size=32)")
_CPU_PROPS = re.compile(r"DeviceProperties\(type='cpu'[^)]*\)")


def as_cuda_source(source: str, props: str = CUDA_SM90_PROPS) -> str:
    """The kernel source as Inductor writes it for a CUDA device: its CPU device properties replaced by a CUDA
    device's (sm_90 by default) and the driver it selects on loading the GPU's."""
    source = source.replace("triton_helpers.set_driver_to_cpu()", "triton_helpers.set_driver_to_gpu()")
    return _CPU_PROPS.sub(props, source)


class _NotBuilt:
    """Stands for a kernel whose source was captured and not built: nothing may run it."""

    def __getattr__(self, name):
        raise RuntimeError("kernel_sources: captured kernel, not built")

    def run(self, *args, **kwargs):
        raise RuntimeError("kernel_sources: captured kernel, not built")


def _model_and_call(model: str, dynamic: bool):
    """(module, args, kwargs): the real-depth SD1.5 UNet in fp16 at batch 2, 24x24 latents, 77 tokens (the
    real-depth test's first call), or a 3-op module for tests. Dynamic: sample dims 0, 2, 3 and text dim 1."""
    import torch

    if model == "tiny":
        class Tiny(torch.nn.Module):
            def forward(self, x, y):
                return torch.softmax(x * y + 1.0, dim=-1).sum(dim=1)

        x, y = torch.randn(2, 8, 16, dtype=torch.float16), torch.randn(2, 8, 16, dtype=torch.float16)
        if dynamic:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        return Tiny(), (x, y), {}

    from compiler.demo.tiny_models import real_depth_unet

    unet = real_depth_unet("sd15").half()
    generator = torch.Generator().manual_seed(2 * 1000 + 24 * 10 + 24 + 77)
    text = torch.randn(2, 77, unet.config.cross_attention_dim, generator=generator).half()
    sample = torch.randn(2, unet.config.in_channels, 24, 24, generator=generator).half()
    if dynamic:
        for dim in (0, 2, 3):
            torch._dynamo.mark_dynamic(sample, dim)
        torch._dynamo.mark_dynamic(text, 1)
    return unet, (sample, torch.tensor(500.0)), {"encoder_hidden_states": text, "return_dict": False}


def record_gpu_kernels() -> List[Dict[str, str]]:
    """From now on in this process, Inductor writes Triton kernels for an sm_90 GPU from the CPU's tensors, and each
    kernel's name and source (as for a CUDA device) is appended to the list returned instead of being built.
    Patches Triton's driver and Inductor process-wide: for a process of its own (tests/support/reduction_kinds.py
    reads the kinds of kernel Inductor chose the same way)."""
    install_fake_driver()
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor import async_compile

    inductor_config.cpu_backend = "triton"
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False  # a cache hit would skip the code generation that is captured
    torch._functorch.config.enable_autograd_cache = False
    kernels: List[Dict[str, str]] = []

    def record(self, kernel_name, source_code, device_str="cuda"):
        kernels.append({"name": kernel_name, "source": as_cuda_source(source_code)})
        return _NotBuilt()

    async_compile.AsyncCompile.triton = record
    return kernels


def writes_kernels(gm, example_inputs):
    """A dynamo backend that has Inductor write the graph's kernels (recorded by `record_gpu_kernels`) and runs the
    graph eagerly, so a graph break does not end the capture."""
    from torch._inductor.compile_fx import compile_fx

    compile_fx(gm, example_inputs)
    return gm.forward


def capture(model: str, sizes: str) -> Dict[str, Any]:
    """Run torch.compile on `model` with static or dynamic sizes in this process and return the captured kernels
    ({"kernels": [{"name", "source"}], "graphs": n}). Patches Triton's driver and Inductor process-wide."""
    kernels = record_gpu_kernels()
    import torch

    graphs = [0]

    def backend(gm, example_inputs):
        graphs[0] += 1
        return writes_kernels(gm, example_inputs)

    module, args, kwargs = _model_and_call(model, sizes == "dynamic")
    compiled = torch.compile(module, backend=backend, dynamic=(sizes == "dynamic"))
    with torch.no_grad():
        compiled(*args, **kwargs)
    return {"kernels": kernels, "graphs": graphs[0]}


def write_sources(out: Path, model: str = "sd15", sizes: str = "both", timeout_s: float = 1800) -> Dict[str, Any]:
    """Capture each requested set in its own process (a fresh Inductor cache each) and write them to `out`."""
    import torch
    import triton

    wanted = SETS if sizes == "both" else (sizes,)
    doc: Dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "model": model,
                           "dtype": "fp16", "call": "batch 2, 24x24 latents, 77 tokens" if model == "sd15" else "tiny",
                           "device_properties": CUDA_SM90_PROPS, "sets": {}, "graphs": {}, "capture_s": {}}
    root = Path(__file__).resolve().parents[2]
    for name in wanted:
        with tempfile.TemporaryDirectory(prefix="kernel-sources-") as work:
            part = Path(work) / "set.json"
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(work) / "inductor"),
                   "TRITON_CACHE_DIR": str(Path(work) / "triton")}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
            started = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tools.kernel_builds.kernel_sources", "--one-set", name,
                            "--model", model, "--out", str(part)], check=True, env=env, cwd=str(root),
                           timeout=timeout_s)
            captured = json.loads(part.read_text())
        doc["sets"][name] = captured["kernels"]
        doc["graphs"][name] = captured["graphs"]
        doc["capture_s"][name] = round(time.perf_counter() - started, 1)
        print(f"kernel_sources: {name}: {len(captured['kernels'])} kernels from {captured['graphs']} graph(s) "
              f"in {doc['capture_s'][name]} s", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"kernel_sources: wrote {out} ({out.stat().st_size / 1e6:.2f} MB)", flush=True)
    return doc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write (e.g. .kernels/sd15_kernels.json)")
    parser.add_argument("--sizes", choices=("static", "dynamic", "both"), default="both")
    parser.add_argument("--model", choices=MODELS, default="sd15",
                        help="sd15: the real-depth SD1.5 UNet (needs diffusers); tiny: a 3-op module (tests)")
    parser.add_argument("--one-set", choices=SETS, help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args(argv)
    if args.one_set:
        captured = capture(args.model, args.one_set)
        Path(args.out).write_text(json.dumps(captured))
        return 0
    write_sources(Path(args.out), model=args.model, sizes=args.sizes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
