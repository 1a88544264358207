"""`python -m compiler bench --out DIR [--quick]`: eager vs plain torch.compile vs KeepFast.

For an SD1.5-shaped UNet, an SDXL-shaped UNet and the VAE decoder (real
diffusers configs, random weights; `--quick`: two-level, narrow versions), and
a Flux-shaped and a Wan-shaped transformer (whole-model torch.compile vs
torch.compile of the repeated blocks vs our block graphs), each
configuration in its own process: steady-state step time, first call (cold
compile) and restart-to-first-result with saved graphs, compiles over a
sweep of 5 resolutions x 3 batch sizes, peak memory; then sessions (first image,
20 images and a restart from process start: eager, torch.compile, ours
blocking, ours building in the background; session.py). With COMFYUI_PATH set,
the same comparison end to end in a headless ComfyUI, and (`--weights`) Flux
with GGUF or fp8-scaled weights in ComfyUI's own classes: eager vs
TorchCompileModel vs ours, over a sweep that changes a LoRA's strength
(weights.py). Writes DIR/bench.json,
DIR/bench.md and DIR/bench.png. `--check` is the device check of one GPU
machine (check.py; docs/gpu.md). See docs/benchmarks.md.

Importing this package imports neither torch nor diffusers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .models import ALL_MODELS as MODELS
from .models import COMFY_MODES, DEFAULT_VARIANTS
from .models import VARIANTS as VARIANT_NAMES
from .session import SESSION_VARIANTS
from .weights import VARIANTS as WEIGHT_VARIANTS
from .weights import WEIGHTS


def _names(text: str, allowed) -> list:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)}; choose from {', '.join(allowed)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder for bench.json, bench.md and bench.png")
    parser.add_argument("--quick", action="store_true",
                        help="two-level, narrow versions of the models (real block types and conditioning sizes): "
                             "a smoke run that takes tens of minutes, not hours, on a small CPU")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda[:N])")
    parser.add_argument("--dtype", default=None, choices=("fp32", "fp16", "bf16"),
                        help="weights and inputs (default: fp32 on CPU, fp16 on CUDA)")
    parser.add_argument("--models", type=lambda t: _names(t, MODELS), default=list(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--variants", type=lambda t: _names(t, VARIANT_NAMES), default=None,
                        help=f"comma-separated subset of {','.join(VARIANT_NAMES)} (default: all but ours_oneflow, "
                             "which needs OneFlow's Python 3.10 environment, and ours_aot_load_cg; with --check: "
                             "all of the check's own)")
    parser.add_argument("--reps", type=int, default=None, help="timed eager/compiled pairs per shape (default 11 with --quick, else 5)")
    parser.add_argument("--no-comfy", action="store_true", help="skip the ComfyUI part even with COMFYUI_PATH set")
    parser.add_argument("--comfy-attention", default="default", choices=("default", "pytorch", "split", "quad"),
                        help="ComfyUI's attention flag for the ComfyUI part (default: none, ComfyUI picks; "
                             "sub-quadratic on a CPU)")
    parser.add_argument("--comfy-modes", type=lambda t: _names(t, COMFY_MODES), default=list(COMFY_MODES),
                        help=f"comma-separated subset of the ComfyUI modes {','.join(COMFY_MODES)} "
                             "(ours_restart and ours_fresh read the graphs ours_cold saves)")
    parser.add_argument("--no-sessions", action="store_true",
                        help="skip the session figures (first image, 20 images and a restart from process start, "
                             "per variant; benchmarks/session.py)")
    parser.add_argument("--sessions-only", action="store_true",
                        help="only the session figures (no steady-state, sweep or ComfyUI parts)")
    parser.add_argument("--session-variants", type=lambda t: _names(t, SESSION_VARIANTS),
                        default=list(SESSION_VARIANTS),
                        help=f"comma-separated subset of {','.join(SESSION_VARIANTS)} for the sessions (the first "
                             "image ratio needs eager and ours_background; the session ratio a torch.compile "
                             "variant too)")
    parser.add_argument("--weights", type=lambda t: _names(t, WEIGHTS), default=[],
                        help=f"with --models flux: also run the tiny Flux in ComfyUI's own classes with these weights "
                             f"(comma-separated subset of {','.join(WEIGHTS)}; GGUF through ComfyUI-GGUF at "
                             "$KEEPFAST_GGUF_PATH): eager vs TorchCompileModel vs ours, step time, compiles over a "
                             "sweep with a LoRA strength change, outputs against eager; needs COMFYUI_PATH, a kind "
                             "that cannot run is skipped with the reason")
    parser.add_argument("--weights-variants", type=lambda t: _names(t, WEIGHT_VARIANTS), default=list(WEIGHT_VARIANTS),
                        help=f"comma-separated subset of {','.join(WEIGHT_VARIANTS)} for --weights (eager runs "
                             "anyway: the others' outputs are compared with its)")
    parser.add_argument("--weights-only", action="store_true",
                        help="only the --weights part (no steady-state, sweep, session or ComfyUI end-to-end parts)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, caches, graphs)")
    parser.add_argument("--job-timeout", type=float, default=None,
                        help="seconds per configuration (with --check: instead of each one's own limit in check.py)")
    parser.add_argument("--check", action="store_true",
                        help="the device check of one GPU (with --device cuda): the real SD1.5, SDXL and VAE "
                             "configs whole, Flux (1 double + 2 single blocks, full width) and Wan 2.1 1.3B by "
                             "blocks; eager, torch.compile, compile_repeated_blocks, ours cold and loaded; within "
                             "--budget seconds, writing bench.json, bench.md, check.log and bench.png into --out as "
                             "it goes (check.py); --models and --variants narrow it")
    parser.add_argument("--budget", type=float, default=None,
                        help="with --check: seconds for the whole check (default 420: about 7 minutes)")
    parser.add_argument("--lanes", type=int, default=None,
                        help="with --check: jobs run at once (default 3; 1: one after the other)")
    parser.add_argument("--rehearse", action="store_true",
                        help="with --check --device cpu: a CPU rehearsal of the check (its jobs, processes, limits "
                             "and files) with the quick profile's small models; its figures are not a GPU's")


def run_from_args(args: argparse.Namespace) -> int:
    from .runner import run_bench

    if args.check:
        from . import check

        return check.run_check(Path(args.out), device=args.device, models=args.models, variants=args.variants,
                               budget_s=args.budget or check.BUDGET_S, lanes=args.lanes or check.LANES,
                               keep=args.keep, rehearse=args.rehearse, job_timeout=args.job_timeout)
    dtype = args.dtype or ("fp16" if str(args.device).startswith("cuda") else "fp32")
    only = args.sessions_only or args.weights_only
    return run_bench(Path(args.out), quick=args.quick, device=args.device, dtype=dtype, models=args.models,
                     variants=list(DEFAULT_VARIANTS) if args.variants is None else args.variants, reps=args.reps, comfy=not (args.no_comfy or only), keep=args.keep,
                     comfy_modes=args.comfy_modes, sessions=not (args.no_sessions or args.weights_only),
                     steady=not only, job_timeout=args.job_timeout, comfy_attention=args.comfy_attention,
                     weights=args.weights, weight_variants=args.weights_variants,
                     session_variants=args.session_variants)


__all__ = ["add_arguments", "run_from_args", "VARIANT_NAMES"]
