"""The oneflow backend in a real ComfyUI: workflows with backend=oneflow on ComfyUI's own UNet and VAE.

Runs where OneFlow imports in ComfyUI's Python (OneFlow 0.9.0: Python 3.10;
point COMFYUI_PYTHON at such an environment, with OneFlow's library paths
exported, see .ci/setup_oneflow.sh). Elsewhere the module is skipped with the
reason (the pack's own verdict, from /keepfast/stats); test_comfyui_server.py
covers a workflow naming oneflow where it does not run.
Image tolerance as in test_comfyui_server.py.
"""

from __future__ import annotations

import copy
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

from test_comfyui_server import (  # noqa: E402
    _with_lora, assert_same_image, assert_served, eager_images, run, txt2img, unique, workflow_prompt,
)

pytestmark = pytest.mark.comfyui

WARMED = ("256x256", "320x256")
BATCHES = (1, 2)


@pytest.fixture(scope="module")
def oneflow_server(tmp_path_factory):
    """A ComfyUI of its own, stopped when this module is done: OneFlow 0.9.0 does not give a graph's
    memory back while the process lives (GBs per graph), and the session's server runs on after."""
    probe = subprocess.run([S.PYTHON, "-c", "import importlib.util as u; print(u.find_spec('oneflow') is not None)"],
                           capture_output=True, text=True)
    if probe.stdout.strip() != "True":
        reason = f"oneflow is not installed in ComfyUI's Python ({S.PYTHON})"
        print(f"\n[tests/comfyui] skipping the OneFlow-in-ComfyUI tests: {reason}")
        pytest.skip(reason)
    base = S.make_base(tmp_path_factory.mktemp("comfy-oneflow-base"))
    S.build_models(base)
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(base / "keepfast-trust.json"), "PYTHONUNBUFFERED": "1"}
    server = S.ComfyServer(base, env)
    server.start()
    try:
        reason = server.stats()["backends"]["oneflow"]
        if reason is not None:
            print(f"\n[tests/comfyui] skipping the OneFlow-in-ComfyUI tests: {reason}")
            pytest.skip(f"oneflow does not run in this ComfyUI's Python: {reason}")
        yield server
    finally:
        server.stop()


def with_oneflow(prompt: dict) -> dict:
    S.set_inputs(prompt, "KeepFastModelSpeedup", backend="oneflow")
    S.set_inputs(prompt, "KeepFastVAESpeedup", backend="oneflow")
    return prompt


def oneflow_graphs(server) -> list:
    return [g for g in server.stats()["graphs"] if "oneflow" in g["family"]]


def test_oneflow_is_offered_and_the_first_image_equals_eager(oneflow_server):
    server = oneflow_server
    for node in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        assert "oneflow" in S.combo_options(server.object_info(), node, "backend")
    prompt = with_oneflow(txt2img(server, width=256, height=256, seed=300))
    entry, images, delta = run(server, prompt)
    assert len(images) == 1
    assert delta["compiles"] >= 2, delta  # the UNet at this shape and the VAE decoder
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert delta["vae_graph_calls"] > 0 and delta["vae_eager_calls"] == 0, delta
    architectures = {g["family"].split("/")[0] for g in oneflow_graphs(server)}
    assert any("UNetModel" in a for a in architectures) and len(architectures) >= 2, architectures
    assert_same_image(images[0], eager_images(server, prompt)[0], "oneflow 256x256")


def test_oneflow_warmup_leaves_zero_compiles_for_the_warmed_sizes(oneflow_server):
    server = oneflow_server
    prompt = with_oneflow(workflow_prompt(server, "keepfast_multi_resolution_warmup"))
    S.set_inputs(prompt, "KeepFastWarmupGraphs", resolutions=", ".join(WARMED),
                 batch_sizes=", ".join(str(b) for b in BATCHES))
    latents = S.nodes_of(prompt, "EmptyLatentImage")
    prompt[latents[0]]["inputs"].update(width=256, height=256, batch_size=1)
    prompt[latents[1]]["inputs"].update(width=320, height=256, batch_size=2)
    for node_id in S.nodes_of(prompt, "SaveImage"):
        prompt[node_id]["inputs"]["filename_prefix"] = unique("oneflow_warm")
    entry, images, delta = run(server, prompt)
    assert len(images) == 3
    report = next(t for i, t in server.texts(entry).items() if prompt[i]["class_type"] == "KeepFastWarmupGraphs")
    shapes = len(WARMED) * len(BATCHES)
    assert report.count("served by graph") == 2 * shapes, report  # the UNet and the VAE decoder at each
    # The samplers ran at warmed sizes: everything they did came from graphs.
    assert delta["unet_eager_calls"] == 0 and delta["vae_eager_calls"] == 0, delta
    for width, height, batch in ((320, 256, 1), (256, 256, 2), (320, 256, 2)):
        again = with_oneflow(txt2img(server, width=width, height=height, batch=batch, seed=310 + batch))
        entry, images, delta = run(server, again)
        assert_served(delta, vae=True)
        for a, b in zip(images, eager_images(server, again)):
            assert_same_image(a, b, f"oneflow {width}x{height} batch {batch}")


def test_an_unwarmed_size_builds_one_graph_with_the_reason(oneflow_server):
    server = oneflow_server
    before = len(oneflow_graphs(server))
    prompt = with_oneflow(txt2img(server, width=192, height=256, seed=320))
    entry, images, delta = run(server, prompt)
    assert delta["compiles"] == 2 and delta["unet_eager_calls"] == 0 and delta["vae_eager_calls"] == 0, delta
    assert len(oneflow_graphs(server)) == before + 2
    reasons = [m["reason"] for m in server.stats()["messages"] if m["kind"] == "compile"][-2:]
    assert all("OneFlow graphs have static shapes" in r for r in reasons), reasons
    assert_same_image(images[0], eager_images(server, prompt)[0], "oneflow 192x256")


def test_a_lora_on_and_off_runs_from_the_graphs_and_leaves_the_base_weights(oneflow_server):
    """The graphs read the model's weight memory: ComfyUI patching a LoRA in and out must end with the
    checkpoint's own weights (compared with an image made before any LoRA ran)."""
    server = oneflow_server
    base = with_oneflow(txt2img(server, width=256, height=256, seed=330))
    before_lora = eager_images(server, base)[0]
    run(server, base)
    lora = _with_lora(base, 1.0, before_speedup=False)
    S.set_inputs(lora, "SaveImage", filename_prefix=unique("oneflow_lora"))
    entry, images, delta = run(server, lora)
    assert_served(delta, vae=True)
    with_lora = images[0]
    assert_same_image(with_lora, eager_images(server, lora)[0], "oneflow with a LoRA")
    entry, images, delta = run(server, base)
    assert_served(delta, vae=True)
    assert_same_image(images[0], before_lora, "oneflow after the LoRA was removed vs before it ran")
    assert_same_image(eager_images(server, base)[0], before_lora, "eager after the LoRA was removed")
    changed, _ = S.image_difference(with_lora, images[0])
    assert changed > 1.0, f"the LoRA did not change the image (mean difference {changed:.3f})"


def test_save_graph_says_plainly_that_oneflow_graphs_are_rebuilt(oneflow_server):
    server = oneflow_server
    prompt = workflow_prompt(server, "keepfast_save_graph")
    # Save Graph saves with the backend the speedup nodes chose: put them in front of it, set to oneflow.
    speedups = txt2img(server)
    save = prompt[S.nodes_of(prompt, "KeepFastSaveGraph")[0]]["inputs"]
    for node, output in (("KeepFastModelSpeedup", "model"), ("KeepFastVAESpeedup", "vae")):
        node_id = f"{node}_oneflow"
        prompt[node_id] = copy.deepcopy(speedups[S.nodes_of(speedups, node)[0]])
        prompt[node_id]["inputs"][output] = save[output]
        save[output] = [node_id, 0]
    with_oneflow(prompt)
    # Save Graph warms up at 512 px clamped to the nodes' range: 256 px keeps the OneFlow graphs small.
    S.set_inputs(prompt, "KeepFastModelSpeedup", max_resolution=256)
    S.set_inputs(prompt, "KeepFastVAESpeedup", max_resolution=256)
    S.set_inputs(prompt, "KeepFastSaveGraph", name="oneflow_set")
    entry, images, delta = run(server, prompt)
    report = next(t for i, t in server.texts(entry).items() if prompt[i]["class_type"] == "KeepFastSaveGraph")
    assert "graphs of the oneflow backend cannot be saved (OneFlow 0.9.0 cannot serialise compiled graphs" in report
    assert "graphs are rebuilt on load" in report and "no graph was saved" in report, report
    assert not list((server.base / "models" / "graphs").glob("oneflow_set*"))
