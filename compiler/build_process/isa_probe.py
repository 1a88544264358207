"""What a build process (build_process/child.py) builds the host code for: the CPU level it picks for a CPU program
(the pack's machine_fit.py, loaded by path), Inductor's vector-ISA probe run from a folder kept per machine, or no
vector ISA at all for a GPU program's host code. The standard library and torch only.
"""

from __future__ import annotations

import json
import os


def _probe(folder: str, machine_fit: str) -> dict:
    """The CPU level to build for, picked here (the pack's machine_fit.py, loaded by path), written to
    probe.json for the parent; the Inductor settings it adds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("keepfast_machine_fit", machine_fit)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    probe = module.build_probe()
    with open(os.path.join(folder, "probe.json"), "w") as handle:
        json.dump(probe, handle)
    return {"cpp.march": probe["march"]} if probe.get("march") else {}


def _probe_isa(kept: str) -> None:
    """Inductor's vector-ISA probe, its test programs built in `kept` (a folder kept per machine and torch): after
    the first build they are found there, not built again. Its result stays in this process (Inductor caches it),
    so the build itself then runs in its own fresh cache."""
    if not kept:
        return
    build_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        os.makedirs(kept, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = kept
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        pick_vec_isa()
    except Exception:  # noqa: BLE001 - the build probes in its own cache then, as Inductor always does
        pass
    finally:
        if build_cache is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = build_cache


def skips_isa_probe(configs: dict) -> bool:
    """Whether a job's Inductor settings leave the host code without a vector ISA (a GPU program's:
    job_folder.GPU_HOST_ISA), so that no probe of one may run in this process."""
    return configs.get("cpp.vec_isa_ok") is False


def _no_isa_probe() -> None:
    """No vector ISA for this process's host code, set before anything asks Inductor for one: its probe caches what
    it found per process, and a probe run once (in torch 2.11, a Python importing torch per ISA checked) would
    decide the package's ISA whatever the build's own settings say."""
    try:
        import torch._inductor.config as inductor_config

        inductor_config.cpp.vec_isa_ok = False
    except (ImportError, AttributeError):
        pass
