"""ComfyUI on a machine whose AOTInductor package loader crashes (compiler/backends/loader_check.py; needs
COMFYUI_PATH).

On an H100 (torch 2.11+cu130) torch's loader killed every process that loaded a CUDA package:
in ComfyUI that is the server gone with the workflow. Here (a CPU) the machine's verdict says so for CPU packages
(KEEPFAST_LOADER_CHECK=all, the verdict written by the pack's own `record` in ComfyUI's Python). The bundled
txt2img workflow must then finish with the image of the same workflow without the nodes, its UNet and VAE compiled
by torch.compile in ComfyUI's process (not saved), every compile saying why, and no package written.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

REASON = "torch's AOTInductor package loader crashed (SIGSEGV) in a ComfyUI test"


@pytest.fixture(scope="module")
def crashing_server(tmp_path_factory):
    base = S.make_base(tmp_path_factory.mktemp("loader-crash-base"))
    S.build_models(base)
    verdicts = base / "package-loader.json"
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(base / "trust.json"), "PYTHONUNBUFFERED": "1",
           "KEEPFAST_LOADER_CHECK": "all", "KEEPFAST_LOADER_VERDICTS": str(verdicts)}
    done = subprocess.run([S.PYTHON, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "from compiler.backends import loader_check; loader_check.record('cpu', False, sys.argv[2])",
                           str(S.REPO), REASON], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and verdicts.is_file(), done.stdout + done.stderr
    server = S.ComfyServer(base, env)
    server.start()
    yield server
    server.stop()


def test_a_workflow_finishes_with_torch_compile_in_the_process_and_the_reason(crashing_server):
    server = crashing_server
    prompt = S.ui_to_api(S.load_workflow("keepfast_txt2img"), server.object_info())
    S.set_inputs(prompt, "KSampler", steps=2, seed=7)
    S.set_inputs(prompt, "EmptyLatentImage", width=256, height=256, batch_size=1)
    S.set_inputs(prompt, "SaveImage", filename_prefix=S.unique_prefix("crash"))
    for kind in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        S.set_inputs(prompt, kind, build=S.BLOCKING_BUILD)
    entry, images, delta = S.run_counted(server, prompt)
    S.same_as_without_the_nodes(server, prompt, images)
    assert delta["compiles"] >= 2 and delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    stats = server.stats()
    assert stats["graphs"] and all(", inductor, " in g["family"] for g in stats["graphs"]), stats["graphs"]
    compiles = [m["reason"] for m in stats["messages"] if m["kind"] == "compile"]
    said = [r for r in compiles if REASON in r and "torch.compile in this process" in r]
    assert len(said) >= 2 and any("UNet" in r for r in said), compiles  # the UNet's and the VAE's
    assert not list((server.base / "models" / "graphs").rglob("*.pt2"))  # nothing saved: nothing to load later
