"""The standalone demo: compile once, serve every shape, save, reload with zero compiles.

Builds a small Stable Diffusion pipeline from configs (random weights, no
downloads), generates eager reference images, compiles the UNet and VAE
decoder, generates at several resolutions and two batch sizes, saves the
graphs, then starts a fresh Python process that loads them and generates the
same images again. With `--background` the first image runs uncompiled while
the graphs build in a child process (docs/background.md); the demo then waits
for them before the sweep. Prints a table and writes DIR/report.json. Prints its own
progress lines only: the third-party notices its calls trigger are dropped
while it runs (compiler/serving/quiet.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from ..diffusers_api import compile_pipe, compiled_parts, load_pipe, save_pipe
from ..serving.quiet import third_party_quiet
from ..store.registry import default_registry
from ..keys.shapes import ShapeRange
from .tiny_models import prompt_embeds, tiny_sd_pipeline

# (height, width) in pixels. The tiny VAE downsamples by 2, so latents are 16-32.
SIZES: List[Tuple[int, int]] = [(32, 32), (48, 32), (64, 64), (32, 64)]
BATCHES = [1, 2]
# Classifier-free guidance doubles the UNet batch: 1-2 images -> UNet batch 2-4.
RANGE = ShapeRange(batch=(1, 4), spatial=(8, 32), sequence=(1, 154))
IGNORES = ("vae.encoder",)


def _generate(pipe, height: int, width: int, batch: int, steps: int) -> torch.Tensor:
    embeds = prompt_embeds(batch, seed=1)
    negative = prompt_embeds(batch, seed=2)
    generator = torch.Generator().manual_seed(42)
    with torch.no_grad():
        out = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, height=height, width=width,
                   num_inference_steps=steps, guidance_scale=5.0, generator=generator, output_type="pt")
    return out.images


def _step_times(compiled_unet, eager_unet, repeats: int = 7) -> Tuple[float, float]:
    """Median UNet step of (compiled, eager), runs alternated so load affects both alike."""
    sample = torch.randn(2, 4, 24, 24)
    context = prompt_embeds(2)
    timestep = torch.tensor(500.0)
    times: Dict[str, List[float]] = {"compiled": [], "eager": []}
    with torch.no_grad():
        for _ in range(repeats + 1):
            for name, step in (("compiled", compiled_unet), ("eager", eager_unet)):
                started = time.perf_counter()
                step(sample, timestep, encoder_hidden_states=context, return_dict=False)
                times[name].append(time.perf_counter() - started)
    return statistics.median(times["compiled"][1:]), statistics.median(times["eager"][1:])


def _sweep(pipe, steps: int) -> Dict[str, torch.Tensor]:
    return {f"{h}x{w}x{b}": _generate(pipe, h, w, b, steps) for (h, w) in SIZES for b in BATCHES}


def _max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run_demo(out: Path, steps: int = 4, load_check: bool = False, background: bool = False) -> int:
    with third_party_quiet():
        return _run_demo(out, steps, load_check, background)


def _run_demo(out: Path, steps: int, load_check: bool, background: bool = False) -> int:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out.mkdir(parents=True, exist_ok=True)
    graphs = out / "graphs"
    if load_check:
        return _load_check(out, graphs, steps)
    registry = default_registry()
    pipe = tiny_sd_pipeline(seed=0)
    print("1/5 eager reference images ...", flush=True)
    started = time.perf_counter()
    _generate(pipe, *SIZES[0], BATCHES[0], steps)
    eager_first_image_s = time.perf_counter() - started
    reference = _sweep(pipe, steps)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in reference.items()}, str(out / "reference.safetensors"))

    if background:
        print("2/5 the first image, uncompiled, while the UNet's and VAE decoder's graphs build in the background ...",
              flush=True)
    else:
        print("2/5 compiling the UNet and VAE decoder on the first image ...", flush=True)
    compile_pipe(pipe, shape_range=RANGE, ignores=IGNORES, graphs_dir=graphs, background=background)
    started = time.perf_counter()
    _generate(pipe, *SIZES[0], BATCHES[0], steps)
    first_image_s = time.perf_counter() - started
    build_wait_s = 0.0
    if background:
        started = time.perf_counter()
        for part in compiled_parts(pipe).values():
            part.wait_for_builds()
        build_wait_s = time.perf_counter() - started
        print(f"    first image {first_image_s:.2f} s (eager {eager_first_image_s:.2f} s); the builds landed "
              f"{build_wait_s:.1f} s after it", flush=True)
    compiles_first = len(registry.compiles)
    # Background builds overlap and wait in a queue: their wall time from the first call is the cold compile.
    cold_compile_s = first_image_s + build_wait_s if background else sum(e.seconds for e in registry.compiles)

    print(f"3/5 sweeping {len(SIZES)} resolutions x {len(BATCHES)} batch sizes ...", flush=True)
    compiled = _sweep(pipe, steps)
    compiles_after = len(registry.compiles) - compiles_first
    compiled_step, eager_step = _step_times(pipe.unet, compiled_parts(pipe)["unet"].eager)

    print("4/5 saving graphs ...", flush=True)
    report = save_pipe(pipe, graphs)
    for line in report.problems:
        print("  problem:", line)

    print("5/5 loading the graphs in a fresh process ...", flush=True)
    child = subprocess.run(
        [sys.executable, "-m", "compiler", "demo", "--out", str(out), "--steps", str(steps), "--load-check"],
        cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True,  # the repository root
    )
    if child.returncode != 0:
        print(child.stdout, child.stderr, file=sys.stderr)
        return 1
    loaded = json.loads((out / "load_check.json").read_text())

    result = {
        "compiles_first_image": compiles_first,
        "compiles_after_warmup": compiles_after,
        "compiles_on_load": loaded["compiles"],
        "graphs_loaded": loaded["loads"],
        "cold_compile_s": round(cold_compile_s, 2),
        "first_image_s": round(first_image_s, 2),
        "eager_first_image_s": round(eager_first_image_s, 2),
        "background": background,
        "builds_landed_after_first_image_s": round(build_wait_s, 2),
        "load_s": loaded["load_s"],
        "eager_step_s": round(eager_step, 5),
        "compiled_step_s": round(compiled_step, 5),
        "max_abs_diff_vs_eager": _max_diff(compiled, reference),
        "max_abs_diff_loaded_vs_eager": loaded["max_abs_diff_vs_eager"],
        "fallbacks": [e.reason for e in registry.fallbacks] + loaded["fallbacks"],
        "sizes": [f"{h}x{w}" for h, w in SIZES],
        "batches": BATCHES,
        "saved": report.saved,
        "compile_reasons": [e.reason for e in registry.compiles],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    (out / "report.json").write_text(json.dumps(result, indent=1))
    _print_table(result)
    ok = result["compiles_after_warmup"] == 0 and result["compiles_on_load"] == 0
    return 0 if ok else 1


def _load_check(out: Path, graphs: Path, steps: int) -> int:
    from safetensors.torch import load_file

    registry = default_registry()
    pipe = tiny_sd_pipeline(seed=0)
    started = time.perf_counter()
    report = load_pipe(pipe, graphs, shape_range=RANGE, ignores=IGNORES)
    load_s = time.perf_counter() - started
    images = _sweep(pipe, steps)
    reference = load_file(str(out / "reference.safetensors"))
    result = {
        "compiles": len(registry.compiles),
        "loads": len(registry.loads),
        "load_s": round(load_s, 3),
        "max_abs_diff_vs_eager": _max_diff(images, reference),
        "fallbacks": [e.reason for e in registry.fallbacks],
        "problems": report.problems,
    }
    (out / "load_check.json").write_text(json.dumps(result, indent=1))
    return 0


def _print_table(result: dict) -> None:
    rows = [
        ("compiles for the first image", result["compiles_first_image"]),
        ("compiles over the sweep after it", result["compiles_after_warmup"]),
        ("compiles after loading in a fresh process", result["compiles_on_load"]),
        ("graphs loaded from disk", result["graphs_loaded"]),
        ("first image, s: ours / eager" + (" (built in the background)" if result["background"] else ""),
         f"{result['first_image_s']} / {result['eager_first_image_s']}"),
        ("cold compile (s)" + (": first call to graphs in" if result["background"] else ""), result["cold_compile_s"]),
        ("load in a fresh process (s)", result["load_s"]),
        ("load / cold compile", round(result["load_s"] / max(result["cold_compile_s"], 1e-9), 4)),
        ("UNet step eager (s)", result["eager_step_s"]),
        ("UNet step compiled (s)", result["compiled_step_s"]),
        ("compiled / eager step", round(result["compiled_step_s"] / result["eager_step_s"], 3)),
        ("max |image - eager|", f"{result['max_abs_diff_vs_eager']:.2e}"),
        ("max |loaded image - eager|", f"{result['max_abs_diff_loaded_vs_eager']:.2e}"),
        ("machine load (1 min) / torch threads", f"{result['load_average_1min']} / {result['torch_threads']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print()
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    if result["fallbacks"]:
        print("  fallbacks:")
        for reason in result["fallbacks"]:
            print("   -", reason)
