"""ComfyUI's own SD1.5 diffusion model traced in a spawned process (compiler/tracing/spawned_trace.py), in
ComfyUI's Python on the CPU (needs COMFYUI_PATH): the model and its VAE pickle without their weights, the spawned
process loads the pack under ComfyUI's name for it and ComfyUI's classes from ComfyUI's import path, and its
program, weight layout and guards are those of a trace in the caller."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui


def test_a_comfyui_sd15_diffusion_model_is_traced_in_a_spawned_process_as_here(tmp_path):
    base = S.make_base(tmp_path / "base")
    checkpoint = base / "models" / "checkpoints" / S.CHECKPOINT
    S.write_model(base, "checkpoint", checkpoint, "--seed", 0)
    result = subprocess.run([S.PYTHON, str(S.HERE / "kf_spawned_trace.py"), str(S.REPO), str(base), str(checkpoint)],
                            cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH,
                                 "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    found = json.loads(lines[-1][len("KEEPFAST-RESULT "):])
    assert found["model_class"] == "comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel", found
    assert found["operations"], found  # ComfyUI's own layer classes travelled by name
    assert found["payload_bytes"] < found["weight_bytes"] / 50, found  # without the weights
    assert found["vae_payload_bytes"] < found["vae_weight_bytes"] / 10, found
    assert found["packages"] == [found["pack_name"]], found  # the pack, by its path; ComfyUI by its import path
    assert found["failure"] is None, found
    assert {"program.pt2", "job.json", "traced.json"} <= set(found["files"]), found
    assert found["same_guards"] and found["same_out_spec"] and found["same_code"] and found["same_layout"], found
