"""The nodes in ComfyUI's own Python, without a server and without compiling a graph (needs COMFYUI_PATH)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui


@pytest.fixture(scope="module")
def findings(comfy_base):
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_inprocess.py"), str(S.REPO), str(comfy_base), S.CHECKPOINT],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=600,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH,
             "KEEPFAST_TRUST_FILE": str(comfy_base / "inprocess-trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-2000:] + result.stderr[-4000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


def test_nodes_and_graphs_folder(findings, comfy_base):
    assert findings["nodes"] == sorted(["KeepFastModelSpeedup", "KeepFastVAESpeedup", "KeepFastSaveGraph",
                                        "KeepFastLoadGraph", "KeepFastWarmupGraphs", "KeepFastGraphStats"])
    # A path given before the pack loaded (extra_model_paths.yaml) stays first; manifests only are listed.
    assert findings["graphs_paths"] == [str(comfy_base / "user_graphs"), str(comfy_base / "models" / "graphs")]
    assert findings["graphs_extensions"] == [".json"]


def test_inputs_are_not_changed(findings):
    assert findings["model_is_clone"] and findings["input_model_wrappers"] == []
    assert findings["output_model_wrappers"] == ["keepfast"]
    assert findings["respeed_wrappers"] == [1, 1]  # speeding up a sped-up model replaces, never stacks
    assert findings["vae_is_copy"] and findings["vae_weights_shared"]
    assert findings["input_vae_decode"] == "method" and findings["output_vae_decode"] == "_Method"


def test_without_a_compiler_every_node_passes_through_with_the_reason(findings):
    for node, (passed_through, reason_shown) in findings["unavailable_passthrough"].items():
        assert passed_through and reason_shown, node


def test_warmup_validates_its_text_inputs(findings):
    ok, bad_size, bad_batch = findings["warmup_validation"]
    assert ok is True
    assert "not a resolution" in bad_size and "not a batch size" in bad_batch


def test_wrappers_of_other_packs_inside_ours_still_run(findings):
    assert findings["inner_wrapper_calls"] == ["UNetModel"]
    assert findings["chained_eager_calls"] == 1
    assert any("compiling is off" in reason for reason in findings["chained_fallbacks"])


def test_a_fault_inside_the_pack_never_fails_the_workflow(findings):
    """An exception nobody expected (injected after torch.export) becomes an eager run with the reason."""
    assert findings["fault_max_diff"] == 0.0  # exactly what the model gives without the speedup node
    assert any("compile failed: KeyError: 'injected fault'" in reason for reason in findings["fault_fallbacks"]), \
        findings["fault_fallbacks"]


def test_progress_and_messages_reach_comfyui(findings):
    assert findings["progress"] == [[30, 100], [100, 100]]
    assert findings["sent"] == [["keepfast.event", "progress", "test"], ["keepfast.event", "progress", "test"],
                                ["keepfast.event", "compile", "test"]]


def test_backend_choice_offers_what_runs_here_and_says_why_not(findings):
    reason = findings["oneflow_reason"]
    if reason is None:  # a Python 3.10 ComfyUI environment with OneFlow (test_comfyui_oneflow.py runs there)
        assert findings["backend_choices"] == ["aot", "inductor", "oneflow"]
        assert "Not offered here" not in findings["backend_tooltip"]
    else:  # OneFlow is published for Python 3.10 only, with its own CUDA 11 libraries
        assert "oneflow is not installed" in reason
        assert findings["backend_choices"] == ["aot", "inductor"]
        assert "oneflow: " + reason in findings["backend_tooltip"]
        # A workflow naming a backend that does not run here: its speedup nodes pass model and VAE
        # through with the reason.
        assert findings["oneflow_passthrough"] == [True, True, True, True]
    # Validation does not stop a workflow naming a registered backend, runnable here or not.
    assert findings["backend_validation"][:2] == [True, True]
    assert "unknown backend 'tensorrt'" in findings["backend_validation"][2]
    assert findings["inductor_runner_backend"] == "inductor"
