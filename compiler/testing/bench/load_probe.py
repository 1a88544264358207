"""Where a CUDA AOTInductor package's load crashes: torch's own path against the pack's, one step at a time.

The device check (2026-11-27, H100, torch 2.11+cu130) saw the SDXL UNet, Flux's and Wan's block graphs build and
then SIGSEGV in `aot._new_loader` (torch._C._aoti.AOTIModelPackageLoader) in the process that loads them. This
runs, each in a process of its own (a crash ends that one only, with its signal and Python's stack):

- `torch_default`: torch.export + aoti_compile_and_package with torch's defaults (weights in the .so) and
  torch._inductor.aoti_load_package, as torch's docs do it;
- `torch_weightless`: the pack's package settings (aot.PACKAGE_CONFIG: weights left out), built in this process,
  loaded with aot._new_loader from the .pt2 file and given the weights with load_constants(user_managed);
- `pack_build_child`: the same program built by the pack's build process (package_builds.start), loaded from
  the .pt2 file the same way (not the pack's unpacked-folder path);
- `pack_whole`: the pack's whole path (compile_module: trace, build process, read_package, serve);
- `pack_flux_blocks` (optional): the pack's block path on a real-width Flux (the check's crash);
- `torch_linked` (optional): `torch_default` after the pack's C++ runtime check (backends/cxx_linkage.py: the
  crash's cause was libstdc++ linked statically into the model library), with what it found.

Each writes one JSON line: its steps, the package's files (a proxy-executor .json beside the .so?), the
outputs' difference from eager. `--gdb a,b` runs those under gdb (or cuda-gdb, all the lent GPU machines have) for
the C stack.

`--stages` instead builds torch's default package once (`torch_build`) and loads it one step per process
(load_stages.py: dlopen alone, the container runner, the package loader), each with a C-stack printer preloaded,
after a CPU package's build and load on the same machine (`cpu_control`), and records the machine's facts.

    python -m compiler.testing.bench.load_probe --device cuda --out DIR [--only a,b | --stages] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import load_stages

VARIANTS = ("torch_default", "torch_weightless", "pack_build_child", "pack_whole", "pack_flux_blocks", "torch_linked")
STAGED_PACKAGE = "torch_build.pt2"  # --stages: torch's default package, built once for every step's process


def _model(device: str, dtype):
    """A small UNet-like module with the ops the crashing graphs have: conv, group norm, linear, layer norm,
    scaled-dot-product attention, nearest upsampling, GELU, SiLU."""
    import torch
    import torch.nn.functional as F

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_in = torch.nn.Conv2d(4, 64, 3, padding=1)
            self.norm = torch.nn.GroupNorm(8, 64)
            self.proj = torch.nn.Linear(64, 192)
            self.text = torch.nn.Linear(32, 128)
            self.ln = torch.nn.LayerNorm(64)
            self.out = torch.nn.Linear(64, 64)
            self.conv_out = torch.nn.Conv2d(64, 4, 3, padding=1)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 64))

        def forward(self, x, context):
            h = F.silu(self.norm(self.conv_in(x)))
            b, c, hh, ww = h.shape
            tokens = self.ln(h.flatten(2).transpose(1, 2))
            q, k, v = self.proj(tokens).chunk(3, dim=-1)
            kc, vc = self.text(context).chunk(2, dim=-1)
            k, v = torch.cat([k, kc], 1), torch.cat([v, vc], 1)
            q, k, v = (t.view(b, -1, 4, 16).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
            tokens = tokens + F.gelu(self.out(a)) * self.scale
            h = tokens.transpose(1, 2).reshape(b, c, hh, ww)
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            return self.conv_out(h)[:, :, ::2, ::2] + x

    torch.manual_seed(0)
    module = Probe().to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 32, 32, generator=g).to(device=device, dtype=dtype)
    context = torch.randn(2, 77, 32, generator=g).to(device=device, dtype=dtype)
    return module, (x, context)


def _files(path: Path) -> List[str]:
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    shown = [n for n in names if not n.endswith((".cubin", ".hsaco"))]
    kernels = len(names) - len(shown)
    return shown[:40] + ([f"... and {kernels} kernel binaries"] if kernels else [])


def _diff(got, want) -> float:
    return float((got.float() - want.float()).abs().max())


def _export(module, args):
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1, max=4)
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=({0: batch}, {0: batch}), strict=False)


def _load_weightless(path: Path, module, args, steps: List[str], device_index: int):
    import torch
    from torch._inductor.package.package import AOTICompiledModel

    from ...backends import aot
    from ...backends.borrowed_weights import bind, borrowed_views

    steps.append(f"loader({path.name}, device_index={device_index})")
    runner = AOTICompiledModel(aot._new_loader(str(path), "model", device_index))
    steps.append("loaded")
    fqns = runner.get_constant_fqns()
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    steps.append(f"load_constants({len(fqns)})")
    bind(runner, borrowed_views({name: state[name] for name in fqns}), check_full_update=True)  # as the pack binds
    steps.append("run")
    with torch.no_grad():
        out = runner(*args)
    torch.cuda.synchronize() if args[0].is_cuda else None
    return out[0] if isinstance(out, (list, tuple)) else out


def variant(name: str, device: str, work: Path) -> Dict[str, Any]:
    """One variant in this process; returns its figures (the caller prints them as one JSON line)."""
    import torch

    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    result: Dict[str, Any] = {"variant": name, "steps": []}
    steps = result["steps"]
    started = time.perf_counter()
    if name == "pack_flux_blocks":
        return _flux_blocks(device, work, result)
    module, args = _model(device, dtype)
    if name in load_stages.STAGES:
        result["steps"] = load_stages.run_stage(name, work.parent / STAGED_PACKAGE, work, device, list(args))
        return result
    with torch.no_grad():
        want = module(*args)
    steps.append("eager")
    if name == "pack_whole":
        from ...compiled_forward import CompileOptions
        from ...diffusers_api import compile_module
        from ...registry import GraphRegistry
        from ...shapes import ShapeRange

        registry = GraphRegistry()
        replay = device.startswith("cuda")  # CUDA graph replays: captured on a shape's second call
        forward = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 4), spatial=(16, 48)),
                                                        label="probe", cuda_graphs=replay), registry)
        steps.append("compile_module; first call")
        with torch.no_grad():
            got = module(*args)
        steps.append(f"served: {forward.last_status}")
        if replay:
            result["replay_calls"] = _replay_calls(module, args, want)
            result["cuda_graph_replays"] = {g.key.id: g.replay_state() for g in registry.graphs()
                                            if hasattr(g, "replay_state")}
        result["compiles"] = len(registry.compiles)
        result["compile_detail"] = [{k: v for k, v in (e.detail or {}).items()
                                     if isinstance(v, (str, int, float, bool, dict))} for e in registry.compiles]
    else:
        ep = _export(module, args)
        steps.append("exported")
        path = work / f"{name}.pt2"
        if name == "torch_build":  # --stages: built here, loaded by the stages' processes
            torch._inductor.aoti_compile_and_package(ep, package_path=str(work.parent / STAGED_PACKAGE))
            result["files"] = _files(work.parent / STAGED_PACKAGE)
            result["seconds"] = round(time.perf_counter() - started, 1)
            steps.append("built in this process")
            return result
        if name == "torch_linked":
            from ...backends import cxx_linkage, package_builds

            compiler = cxx_linkage.inductor_compiler()
            result["print_file_name"] = {n: subprocess.run([compiler, f"-print-file-name={n}"], capture_output=True,
                                                           text=True).stdout.strip()
                                         for n in ("libstdc++.so", "libstdc++.a", "libstdc++.so.6")}
            result["linkage"] = cxx_linkage.apply(package_builds.cxx_link_folder())._asdict()
            steps.append(f"linkage: {result['linkage']['state']}")
        if name in ("torch_default", "torch_linked"):
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
            steps.append("built in this process")
            result["files"] = _files(path)
            runner = torch._inductor.aoti_load_package(str(path))
            steps.append("loaded (aoti_load_package)")
            with torch.no_grad():
                got = runner(*args)
            got = got[0] if isinstance(got, (list, tuple)) else got
        elif name == "torch_weightless":
            from ...backends import aot

            march, configs = aot.package_configs(gpu=device.startswith("cuda"))
            result["configs"] = {k: v for k, v in configs.items()}
            torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs=configs)
            steps.append("built in this process")
            result["files"] = _files(path)
            got = _load_weightless(path, module, args, steps, -1)
        else:  # pack_build_child
            from ...backends import aot, package_builds

            build = package_builds.start(ep, dict(aot.PACKAGE_CONFIG), probe=True, now=True)
            package = build.result()
            result["build_usage"] = dict(build.usage)
            steps.append("built in the pack's build process")
            path.write_bytes(package)
            result["files"] = _files(path)
            got = _load_weightless(path, module, args, steps, -1)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    result["max_abs_diff"] = _diff(got, want)
    result["seconds"] = round(time.perf_counter() - started, 1)
    steps.append("done")
    return result


def _replay_calls(module, args, want) -> List[Dict[str, Any]]:
    """Four more calls of the same shape (the second captures, the later ones replay), each against eager's output
    and timed, then one call of another batch size: whether AOTInductor's runner replays in a CUDA graph at all."""
    import torch

    calls = []
    for batch in (2, 2, 2, 2, 1):
        call = tuple(a[:batch] for a in args)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            got = module(*call)
        torch.cuda.synchronize()
        calls.append({"batch": batch, "ms": round((time.perf_counter() - started) * 1e3, 3),
                      "max_abs_diff": _diff(got, want[:batch])})
    return calls


def _flux_blocks(device: str, work: Path, result: Dict[str, Any]) -> Dict[str, Any]:
    """The check's crash itself: a Flux transformer at full width (1 double + 1 single block), by blocks."""
    import torch

    from ...blocks import BlockOptions, compile_blocks
    from ...registry import GraphRegistry
    from .models import transformer_spec

    steps = result["steps"]
    spec = transformer_spec("flux", "check" if device.startswith("cuda") else "quick", device)
    spec.config.update(num_layers=1, num_single_layers=1)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = spec.build(seed=0, device=device).to(device=device, dtype=dtype)
    args, kwargs = spec.inputs((1, 64, 64, 1), device, dtype, model=model)
    with torch.no_grad():
        want = model(*args, **kwargs)
    want = want[0] if isinstance(want, (list, tuple)) else getattr(want, "sample", want)
    steps.append("eager")
    registry = GraphRegistry()
    compile_blocks(model, BlockOptions(shape_range=spec.shape_range(), label="flux"), registry)
    steps.append("compile_blocks; first call")
    with torch.no_grad():
        got = model(*args, **kwargs)
    got = got[0] if isinstance(got, (list, tuple)) else getattr(got, "sample", got)
    torch.cuda.synchronize() if device.startswith("cuda") else None
    result["compiles"] = len(registry.compiles)
    result["compile_detail"] = [{k: v for k, v in (e.detail or {}).items()
                                 if isinstance(v, (str, int, float, bool, dict))} for e in registry.compiles]
    result["max_abs_diff"] = _diff(got, want)
    steps.append("done")
    return result


def _child(name: str, device: str, work: str) -> int:
    import faulthandler

    faulthandler.enable()
    try:
        out = variant(name, device, Path(work))
    except Exception as error:  # noqa: BLE001 - the parent reports it
        import traceback

        out = {"variant": name, "error": f"{type(error).__name__}: {error}"[:1500],
               "stack": traceback.format_exc()[-3000:]}
    print("RESULT " + json.dumps(out, default=str), flush=True)
    return 0


class _Runs:
    """The probe's child processes: started with their log, waited for, their results kept in load_probe.json."""

    def __init__(self, out: Path, work: Path, device: str, under_gdb: set, gdb: Optional[str],
                 summary: Dict[str, Any]):
        self.out, self.work, self.device, self.summary = out, work, device, summary
        self.under_gdb, self.gdb = under_gdb, gdb
        self.running: Dict[str, tuple] = {}

    def start(self, name: str, device: Optional[str] = None, base: Optional[str] = None,
              preload: Optional[Path] = None) -> None:
        env = dict(os.environ)
        if preload is not None:
            env["LD_PRELOAD"] = " ".join(p for p in (str(preload), env.get("LD_PRELOAD", "")) if p)
        command = [sys.executable, "-m", "compiler.testing.bench.load_probe", "--out", str(self.out), "--device",
                   device or self.device, "--child", base or name, "--work", str(self.work / name)]
        (self.work / name).mkdir(parents=True, exist_ok=True)
        if name in self.under_gdb:
            command = [self.gdb, "-q", "-batch", "-ex", "handle SIGPIPE SIGUSR1 SIGUSR2 nostop noprint", "-ex",
                       "run", "-ex", "bt 40", "--args"] + command
        log = open(self.out / f"{name}.log", "w")
        self.running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=os.getcwd(),
                                               env=env), log)

    def finish_all(self, deadline: float) -> None:
        for name, (process, log) in list(self.running.items()):
            try:
                process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
            del self.running[name]
            text = (self.out / f"{name}.log").read_text(errors="replace")
            found = [line[7:] for line in text.splitlines() if line.startswith("RESULT ")]
            entry = json.loads(found[-1]) if found else {"variant": name, "error": "no result",
                                                         "steps_reached": [line[5:] for line in text.splitlines()
                                                                           if line.startswith("STEP ")],
                                                         "log_tail": text[-2500:]}
            entry["returncode"] = process.returncode
            if "Segmentation fault" in text or process.returncode in (-11, -6, -7):
                entry["crash_log_tail"] = text[-4000:]
            self.summary["variants"][name] = entry
            print(f"{name}: rc {process.returncode}; " + json.dumps({k: v for k, v in entry.items()
                                                                      if k not in ("crash_log_tail", "stack",
                                                                                   "log_tail")}, default=str)[:1500],
                  flush=True)
            self.write()

    def write(self) -> None:
        (self.out / "load_probe.json").write_text(json.dumps(self.summary, indent=1, default=str))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiler.testing.bench.load_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default=",".join(VARIANTS[:4]))
    parser.add_argument("--timeout", type=float, default=170.0)
    parser.add_argument("--gdb", default="", help="variants to run under gdb (where the machine has it), for the C "
                                                  "stack of a crash")
    parser.add_argument("--stages", action="store_true", help="torch's default package loaded one step per process "
                                                                   "(load_stages.py), with the machine's facts")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return _child(options.child, options.device, options.work)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    gdb = shutil.which("gdb") or shutil.which("cuda-gdb")  # the lent GPU machines have only cuda-gdb
    under_gdb = set(options.gdb.split(",")) if gdb else set()
    work = Path(tempfile.mkdtemp(prefix="keepfast-load-probe-"))
    summary: Dict[str, Any] = {"gdb": gdb, "under_gdb": sorted(under_gdb), "device": options.device, "variants": {}}
    deadline = time.monotonic() + options.timeout
    runs = _Runs(out, work, options.device, under_gdb, gdb, summary)
    if options.stages:
        preload = load_stages.c_stack_preload(work)
        summary["c_stack_preload"] = str(preload) if preload else "not built (no gcc?)"
        runs.start("cpu_control", device="cpu", base="torch_default")  # does a CPU package load on this machine?
        runs.start("torch_build")
        runs.finish_all(deadline)
        package = work / STAGED_PACKAGE
        try:
            library = load_stages.model_library(package, work / "facts") if package.is_file() else None
        except Exception:  # noqa: BLE001 - the facts are kept without the library's
            library = None
        summary["facts"] = load_stages.machine_facts(library)
        runs.write()
        for stage in load_stages.STAGES if package.is_file() else ():
            runs.start(stage, preload=preload)
            runs.finish_all(deadline)
    else:
        for name in [n for n in options.only.split(",") if n]:
            runs.start(name)
        runs.finish_all(deadline)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
