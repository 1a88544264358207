"""KeepFast on a real, headless ComfyUI (CPU): workflows, sweeps, LoRA, ControlNet, save/restart/load.

Needs COMFYUI_PATH (skipped otherwise). One server serves the session; the
tests run in the order written (the restart tests last). Counters come from
the pack's /keepfast/stats route: every check of "zero compiles" also checks
that the diffusion model really ran from a graph (graph calls > 0, eager 0).

Image tolerance: an image from a compiled run equals the same workflow
without the KeepFast nodes when the mean absolute difference is below
0.25 and the largest below 4, in 0-255 pixel levels (AOTInductor's float32
kernels round differently from eager PyTorch; at 2 sampling steps the
differences seen are below 0.01 mean and 1 max).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

MEAN_TOLERANCE = 0.25
MAX_TOLERANCE = 4.0
STEPS = 2  # sampling steps every test runs with (CPU time); everything else as the workflows have it
WORKFLOW_ORDER = ["keepfast_txt2img", "keepfast_multi_resolution_warmup", "keepfast_save_graph",
                  "keepfast_load_graph", "keepfast_lora", "keepfast_img2img"]
_counter = {"n": 0}


# -- helpers -----------------------------------------------------------------------

def unique(prefix: str) -> str:
    _counter["n"] += 1
    return f"{prefix}_{_counter['n']:03d}"


def workflow_prompt(server, name: str) -> dict:
    """The bundled workflow as the page queues it, steps lowered; its Speedup nodes compile before the first
    image (these tests count that image's compiles; the queue-twice test runs the default, background builds)."""
    prompt = S.ui_to_api(S.load_workflow(name), server.object_info())
    for node_id in S.nodes_of(prompt, "KSampler"):
        prompt[node_id]["inputs"]["steps"] = STEPS
    for kind in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        for node_id in S.nodes_of(prompt, kind):
            prompt[node_id]["inputs"]["build"] = S.BLOCKING_BUILD
    return prompt


def txt2img(server, width=256, height=256, batch=1, positive=None, seed=42, ckpt=None) -> dict:
    prompt = workflow_prompt(server, "keepfast_txt2img")
    S.set_inputs(prompt, "EmptyLatentImage", width=width, height=height, batch_size=batch)
    S.set_inputs(prompt, "KSampler", seed=seed)
    S.set_inputs(prompt, "SaveImage", filename_prefix=unique("t2i"))
    if positive is not None:
        sampler = prompt[S.nodes_of(prompt, "KSampler")[0]]
        prompt[sampler["inputs"]["positive"][0]]["inputs"]["text"] = positive
    if ckpt is not None:
        S.set_inputs(prompt, "CheckpointLoaderSimple", ckpt_name=ckpt)
    return prompt


def run(server, prompt: dict):
    before = server.counts()
    entry = server.run(prompt)
    after = server.counts()
    delta = {key: after[key] - before[key] for key in after}
    return entry, server.images(entry), delta


def assert_served(delta: dict, vae: bool = False) -> None:
    """Zero compiles, and the diffusion model (and VAE) ran from graphs only."""
    assert delta["compiles"] == 0, delta
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    if vae:
        assert delta["vae_graph_calls"] > 0 and delta["vae_eager_calls"] == 0, delta


def assert_same_image(a, b, what: str) -> None:
    mean, largest = S.image_difference(a, b)
    assert mean < MEAN_TOLERANCE and largest <= MAX_TOLERANCE, f"{what}: mean {mean:.4f}, max {largest}"


def eager_images(server, prompt: dict):
    plain = S.without_speedup(prompt)
    for node_id in S.nodes_of(plain, "SaveImage"):
        plain[node_id]["inputs"]["filename_prefix"] = unique("eager")
    entry, images, delta = run(server, plain)
    assert delta["unet_graph_calls"] == 0 and delta["vae_graph_calls"] == 0, delta
    return images


def messages(server, kind: str):
    return [m["reason"] for m in server.stats()["messages"] if m["kind"] == kind]


def graphs_folder(server) -> Path:
    return server.base / "models" / "graphs"


# -- the pack in ComfyUI -------------------------------------------------------------

def test_nodes_route_and_templates(server):
    info = server.object_info()
    for node in ("KeepFastModelSpeedup", "KeepFastVAESpeedup", "KeepFastSaveGraph", "KeepFastLoadGraph",
                 "KeepFastWarmupGraphs", "KeepFastGraphStats"):
        assert node in info, node
        assert info[node]["category"] == "KeepFast"
    assert info["KeepFastModelSpeedup"]["output"] == ["MODEL"]
    assert info["KeepFastVAESpeedup"]["output"] == ["VAE"]
    stats = server.stats()
    assert stats["graphs_folders"] == [str(graphs_folder(server))]
    assert stats["compile_unavailable"] is None
    templates = server.get("/workflow_templates").json()
    assert sorted(templates.get(S.PACK_NAME, [])) == sorted(WORKFLOW_ORDER) == S.bundled_workflows()
    for name in WORKFLOW_ORDER:
        response = server.get(f"/api/workflow_templates/{S.PACK_NAME}/{name}.json")
        assert response.status_code == 200 and response.json()["nodes"], name


@pytest.mark.parametrize("name", WORKFLOW_ORDER)
def test_bundled_workflow_runs(server, name):
    """Every bundled workflow runs as the page would queue it (steps lowered to 2)."""
    prompt = workflow_prompt(server, name)
    entry, images, delta = run(server, prompt)
    texts = server.texts(entry)
    if name == "keepfast_save_graph":
        assert not images
        report = next(t for i, t in texts.items() if prompt[i]["class_type"] == "KeepFastSaveGraph")
        assert "saved UNetModel-" in report and "VAE decode: saved" in report and "VAE encode: saved" in report, report
        data = json.loads((graphs_folder(server) / "sd15_keepfast.json").read_text())
        assert len(data["graphs"]) >= 3
        return
    expected = {"keepfast_multi_resolution_warmup": 3}.get(name, 1)
    assert len(images) == expected, (name, len(images))
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert delta["vae_graph_calls"] > 0 and delta["vae_eager_calls"] == 0, delta
    if name != WORKFLOW_ORDER[0]:
        assert delta["compiles"] == 0, delta
    elif delta["compiles"]:
        assert "[KeepFast] compiled in" in server.log_text()  # the reason and time are logged
    stats_text = next(t for i, t in texts.items() if prompt[i]["class_type"] == "KeepFastGraphStats")
    assert "unet_graph_calls" in stats_text
    if name == "keepfast_multi_resolution_warmup":
        report = next(t for i, t in texts.items() if prompt[i]["class_type"] == "KeepFastWarmupGraphs")
        assert report.count("served by graph") == 12, report
    reference = eager_images(server, prompt)
    for index, (a, b) in enumerate(zip(images, reference)):
        assert_same_image(a, b, f"{name} image {index}")


# -- shapes ------------------------------------------------------------------------------

LONG = ", ".join(["a highly detailed photograph of an old lighthouse on a rocky coast at dusk"] * 6)
SWEEP = [
    dict(width=256, height=256),
    dict(width=320, height=256),
    dict(width=256, height=384),
    dict(width=448, height=320),
    dict(width=256, height=256, batch=2),
    dict(width=256, height=256, batch=3),
    dict(width=256, height=256, positive="a cat"),
    dict(width=256, height=256, positive=LONG),  # 3 chunks of 77 tokens
    dict(width=256, height=256, positive=LONG + ", " + LONG),  # 6 chunks
]


def test_sweeps_no_recompile(server):
    """Resolution, batch size and prompt length sweeps: zero compiles after the first; images as eager."""
    run(server, txt2img(server, width=320, height=320, seed=1))  # compiles if nothing did yet
    for case in SWEEP:
        prompt = txt2img(server, seed=5, **case)
        entry, images, delta = run(server, prompt)
        assert_served(delta, vae=True)
        batch = case.get("batch", 1)
        assert len(images) == batch and images[0].shape == (case["height"], case["width"], 3), case
        for a, b in zip(images, eager_images(server, prompt)):
            assert_same_image(a, b, str(case))


def test_inputs_untouched(server):
    """The speedup nodes return copies: the input MODEL and VAE used in the same prompt run uncompiled."""
    prompt = txt2img(server, seed=9)
    sampler_id = S.nodes_of(prompt, "KSampler")[0]
    sampler = prompt[sampler_id]
    speedup_id = sampler["inputs"]["model"][0]
    original_model = prompt[speedup_id]["inputs"]["model"]
    decode_id = S.nodes_of(prompt, "VAEDecode")[0]
    original_vae = prompt[prompt[decode_id]["inputs"]["vae"][0]]["inputs"]["vae"]
    prompt["100"] = copy.deepcopy(sampler)
    prompt["100"]["inputs"]["model"] = original_model
    prompt["101"] = {"class_type": "VAEDecode", "inputs": {"samples": ["100", 0], "vae": original_vae}}
    prompt["102"] = {"class_type": "SaveImage", "inputs": {"images": ["101", 0], "filename_prefix": unique("orig")}}
    entry, images, delta = run(server, prompt)
    assert delta["compiles"] == 0, delta
    assert delta["unet_graph_calls"] == STEPS and delta["unet_eager_calls"] == 0, delta
    assert delta["vae_graph_calls"] == 1 and delta["vae_eager_calls"] == 0, delta
    assert_same_image(images[0], images[1], "compiled vs original model in one prompt")


def test_vae_tiled_decode(server):
    """VAEDecodeTiled's tiles (three tile shapes, edges) are served by the decode graph; image as eager."""
    prompt = txt2img(server, width=384, height=256, seed=3)
    decode_id = S.nodes_of(prompt, "VAEDecode")[0]
    prompt[decode_id] = {"class_type": "VAEDecodeTiled",
                         "inputs": {**prompt[decode_id]["inputs"], "tile_size": 128, "overlap": 32,
                                    "temporal_size": 64, "temporal_overlap": 8}}
    entry, images, delta = run(server, prompt)
    assert_served(delta, vae=True)
    assert delta["vae_graph_calls"] > 3, delta
    assert_same_image(images[0], eager_images(server, prompt)[0], "tiled decode")


# -- model machinery ---------------------------------------------------------------------

def _with_lora(prompt: dict, strength: float, before_speedup: bool) -> dict:
    prompt = copy.deepcopy(prompt)
    sampler = prompt[S.nodes_of(prompt, "KSampler")[0]]
    speedup_id = sampler["inputs"]["model"][0]
    checkpoint_id = prompt[speedup_id]["inputs"]["model"][0]
    prompt["90"] = {"class_type": "LoraLoaderModelOnly",
                    "inputs": {"lora_name": S.LORA, "strength_model": strength}}
    if before_speedup:
        prompt["90"]["inputs"]["model"] = [checkpoint_id, 0]
        prompt[speedup_id]["inputs"]["model"] = ["90", 0]
    else:
        prompt["90"]["inputs"]["model"] = [speedup_id, 0]
        sampler["inputs"]["model"] = ["90", 0]
    return prompt


def test_lora_strengths_no_recompile(server):
    """LoRA before or after the speedup node, on, off and at other strengths: image as eager, no recompile."""
    run(server, txt2img(server, seed=21))  # warm
    base = txt2img(server, seed=22)
    results = {}
    for label, strength, before in [("1.0 before", 1.0, True), ("0.5 before", 0.5, True),
                                    ("1.0 after", 1.0, False), ("0.3 after", 0.3, False), ("0.0 after", 0.0, False)]:
        prompt = _with_lora(base, strength, before)
        S.set_inputs(prompt, "SaveImage", filename_prefix=unique("lora"))
        entry, images, delta = run(server, prompt)
        assert_served(delta)
        assert_same_image(images[0], eager_images(server, prompt)[0], f"LoRA {label}")
        results[label] = images[0]
    entry, images, delta = run(server, base)  # no LoRA, after LoRA runs: nothing of it stays applied
    assert_served(delta)
    assert_same_image(images[0], eager_images(server, base)[0], "no LoRA after LoRA runs")
    assert_same_image(results["1.0 before"], results["1.0 after"], "LoRA before vs after the speedup node")
    assert_same_image(results["0.0 after"], images[0], "LoRA at 0 vs no LoRA")
    changed, _ = S.image_difference(results["1.0 after"], images[0])
    assert changed > 1.0, f"the LoRA did not change the image (mean difference {changed:.3f})"
    half, _ = S.image_difference(results["0.5 before"], results["1.0 before"])
    assert half > 0.5, f"LoRA strength did not change the image (mean difference {half:.3f})"


def test_other_checkpoint_reuses_graphs(server):
    S.build_other_checkpoint(server.base)
    first = txt2img(server, seed=31)
    entry, images_first, delta = run(server, first)
    other = txt2img(server, seed=31, ckpt=S.OTHER_CHECKPOINT)
    entry, images, delta = run(server, other)
    assert_served(delta, vae=True)
    assert_same_image(images[0], eager_images(server, other)[0], "other checkpoint")
    differs, _ = S.image_difference(images[0], images_first[0])
    assert differs > 1.0, "the other checkpoint's weights were not used"


def test_attention_patch_runs_eager_with_reason(server):
    """FreeU puts block patches in transformer_options: those calls run eagerly, with the reason shown."""
    prompt = txt2img(server, seed=41)
    sampler = prompt[S.nodes_of(prompt, "KSampler")[0]]
    prompt["95"] = {"class_type": "FreeU_V2", "inputs": {"model": sampler["inputs"]["model"], "b1": 1.3, "b2": 1.4,
                                                         "s1": 0.9, "s2": 0.2}}
    sampler["inputs"]["model"] = ["95", 0]
    entry, images, delta = run(server, prompt)
    assert delta["unet_eager_calls"] == STEPS and delta["unet_graph_calls"] == 0 and delta["compiles"] == 0, delta
    assert any("patches (output_block_patch)" in reason for reason in messages(server, "fallback"))
    assert_same_image(images[0], eager_images(server, prompt)[0], "FreeU")


def test_controlnet_adds_a_graph_and_plain_keeps_serving(server):
    run(server, txt2img(server, seed=50))  # the plain graph exists
    prompt = txt2img(server, seed=51)
    sampler = prompt[S.nodes_of(prompt, "KSampler")[0]]
    prompt["80"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": S.CONTROLNET}}
    prompt["81"] = {"class_type": "LoadImage", "inputs": {"image": S.IMAGE}}
    prompt["82"] = {"class_type": "ControlNetApplyAdvanced",
                    "inputs": {"positive": sampler["inputs"]["positive"], "negative": sampler["inputs"]["negative"],
                               "control_net": ["80", 0], "image": ["81", 0], "strength": 0.8,
                               "start_percent": 0.0, "end_percent": 1.0}}
    sampler["inputs"]["positive"], sampler["inputs"]["negative"] = ["82", 0], ["82", 1]
    graphs_before = server.counts()["graphs"]
    entry, images, delta = run(server, prompt)
    assert delta["compiles"] <= 1, delta  # one new input structure: one graph (none if it was loaded)
    assert delta["unet_graph_calls"] == STEPS and delta["unet_eager_calls"] == 0, delta
    assert server.counts()["graphs"] >= graphs_before
    assert_same_image(images[0], eager_images(server, prompt)[0], "ControlNet")
    S.set_inputs(prompt, "ControlNetApplyAdvanced", strength=0.5)
    S.set_inputs(prompt, "SaveImage", filename_prefix=unique("cn"))
    entry, images, delta = run(server, prompt)
    assert_served(delta)
    entry, images, delta = run(server, txt2img(server, seed=52))  # the plain graph keeps serving
    assert_served(delta)


# -- graphs on disk ---------------------------------------------------------------------

def _load_prompt(server, graph: str, seed: int = 61, vae: bool = True) -> dict:
    """The bundled Load Graph workflow at 256x256; vae=False loads for the model only."""
    prompt = workflow_prompt(server, "keepfast_load_graph")
    S.set_inputs(prompt, "KeepFastLoadGraph", graph=graph)
    S.set_inputs(prompt, "KSampler", seed=seed)
    S.set_inputs(prompt, "EmptyLatentImage", width=256, height=256)
    S.set_inputs(prompt, "SaveImage", filename_prefix=unique("load"))
    if not vae:
        loader = S.nodes_of(prompt, "KeepFastLoadGraph")[0]
        checkpoint = S.nodes_of(prompt, "CheckpointLoaderSimple")[0]
        del prompt[loader]["inputs"]["vae"]
        for node in prompt.values():
            for name, value in node["inputs"].items():
                if value == [loader, 1]:
                    node["inputs"][name] = [checkpoint, 2]
    return prompt


def saved_set(server) -> list:
    """The graphs of the set the bundled Save Graph workflow writes (saving it now if it is not there)."""
    path = graphs_folder(server) / "sd15_keepfast.json"
    if not path.is_file():
        run(server, workflow_prompt(server, "keepfast_save_graph"))
    return json.loads(path.read_text())["graphs"]


def _report(server, entry, prompt) -> str:
    return next(t for i, t in server.texts(entry).items() if prompt[i]["class_type"] == "KeepFastLoadGraph")


def test_load_graph_refuses_what_does_not_fit(server):
    """Another architecture or torch version: refused with the field that differs; the workflow goes on."""
    from compiler.keys.graph_keys import FamilyKey, GraphKey
    from compiler.store.manifest import Manifest

    folder = graphs_folder(server)
    set_entries = saved_set(server)
    vae_graph = next(name for name in set_entries if name.startswith("TAESD-"))
    unet_graph = next(name for name in set_entries if name.startswith("UNetModel-"))
    # A TAESD graph offered to the diffusion model.
    prompt = _load_prompt(server, vae_graph + ".json", vae=False)
    entry, images, delta = run(server, prompt)
    report = _report(server, entry, prompt)
    assert "architecture: graph has TAESD, this run needs UNetModel" in report, report
    assert len(images) == 1
    # A UNet graph built by another torch version (manifest rewritten with a consistent id).
    manifest = Manifest.read(folder / (unet_graph + ".json"))
    family = FamilyKey(**{**manifest.key.family.to_json(), "torch_version": "1.0.0"})
    manifest.key = GraphKey(family, manifest.key.shape_range, manifest.key.variant)
    foreign = folder / "foreign"
    foreign.mkdir(exist_ok=True)
    shutil.copy(folder / unet_graph.split("/")[0] / manifest.package_file, foreign / manifest.package_file)
    (foreign / f"{manifest.graph_id}.json").write_bytes(manifest.dumps())
    prompt = _load_prompt(server, f"foreign/{manifest.graph_id}.json", seed=62)
    entry, images, delta = run(server, prompt)
    report = _report(server, entry, prompt)
    assert "torch_version: graph has 1.0.0, this run needs" in report, report
    assert delta["unet_eager_calls"] == 0 and len(images) == 1, delta
    shutil.rmtree(foreign)


def test_save_restart_load_zero_compiles(server):
    """Save Graph, restart ComfyUI, Load Graph: the first image needs no compile and is the same image."""
    run(server, workflow_prompt(server, "keepfast_save_graph"))
    assert (graphs_folder(server) / "sd15_keepfast.json").is_file()
    entry, before, delta = run(server, _load_prompt(server, "sd15_keepfast.json", seed=71))
    server.restart()
    entry, after, delta = run(server, _load_prompt(server, "sd15_keepfast.json", seed=71))
    assert_served(delta, vae=True)
    assert delta["loads"] >= 2, delta
    assert_same_image(before[0], after[0], "before vs after restart")
    assert S.image_difference(before[0], after[0])[1] <= 1.0


def test_restart_speedup_finds_stored_graphs(server):
    """After a restart the speedup nodes alone find the stored graphs: zero compiles."""
    server.restart()
    entry, images, delta = run(server, txt2img(server, seed=81))
    assert_served(delta, vae=True)
    assert delta["loads"] >= 2, delta
    assert any("loaded" in reason for reason in messages(server, "load"))


def test_corrupt_files_in_graphs_folder(server):
    """A corrupt manifest or package: the workflow finishes and the message says why."""
    folder = graphs_folder(server)
    set_entries = saved_set(server)  # first: run alone, nothing has made the graphs folder yet
    broken = folder / "broken"
    broken.mkdir(exist_ok=True)
    (broken / "garbage.json").write_text("{ this is not json")
    # The plain txt2img graph (the set may also hold the ControlNet input structure's, in any order).
    unet_graph = next(name for name in set_entries if name.startswith("UNetModel-") and not any(
        path.startswith("control") for path in json.loads((folder / (name + ".json")).read_text())["input_paths"]))
    manifest_path = folder / (unet_graph + ".json")
    package = manifest_path.parent / json.loads(manifest_path.read_text())["package"]["file"]
    data = package.read_bytes()
    copied = folder / "copied"
    copied.mkdir(exist_ok=True)
    shutil.copy(manifest_path, copied / manifest_path.name)
    (copied / package.name).write_bytes(data[: len(data) // 2])
    try:
        server.restart()  # nothing in memory: the truncated copy is read, not served from memory
        prompt = _load_prompt(server, f"copied/{manifest_path.name}", seed=92)
        entry, images, delta = run(server, prompt)
        report = _report(server, entry, prompt)
        assert "package does not match its manifest's checksum (truncated, corrupt or changed)" in report, report
        assert len(images) == 1 and delta["compiles"] == 0, delta  # the speedup found the intact graph

        prompt = _load_prompt(server, "broken/garbage.json", seed=91)
        entry, images, delta = run(server, prompt)
        report = _report(server, entry, prompt)
        assert "refused broken/garbage.json" in report and "cannot read garbage.json" in report, report
        assert len(images) == 1

        prompt = _load_prompt(server, "(every stored graph that fits)", seed=93)
        entry, images, delta = run(server, prompt)
        report = _report(server, entry, prompt)
        assert "ignored broken/garbage: cannot read garbage.json" in report, report
        assert len(images) == 1

        # The real package corrupt, a fresh process, compiling off: runs uncompiled and says why.
        package.write_bytes(data[: len(data) // 2])
        server.restart()
        prompt = txt2img(server, seed=94)
        S.set_inputs(prompt, "KeepFastModelSpeedup", compile=False)
        entry, images, delta = run(server, prompt)
        assert len(images) == 1
        assert delta["compiles"] == 0 and delta["unet_eager_calls"] == STEPS, delta
        refused = messages(server, "refused")
        assert any("does not match its manifest's checksum" in reason for reason in refused), refused
        fallbacks = messages(server, "fallback")
        assert any("checksum" in reason and "compiling is off" in reason for reason in fallbacks), fallbacks
    finally:
        package.write_bytes(data)
        shutil.rmtree(broken, ignore_errors=True)
        shutil.rmtree(copied, ignore_errors=True)


# -- the backend choice ----------------------------------------------------------------------

def _with_backend(prompt: dict, backend: str) -> dict:
    S.set_inputs(prompt, "KeepFastModelSpeedup", backend=backend)
    S.set_inputs(prompt, "KeepFastVAESpeedup", backend=backend)
    return prompt


def test_a_backend_that_does_not_run_here_passes_through_with_the_reason(server):
    """A workflow saved where OneFlow runs still runs here (ComfyUI's Python has no OneFlow): uncompiled."""
    if server.stats()["backends"]["oneflow"] is None:
        pytest.skip("oneflow runs in this ComfyUI's Python: test_comfyui_oneflow.py runs its workflows instead")
    choices = S.combo_options(server.object_info(), "KeepFastModelSpeedup", "backend")
    assert "aot" in choices and "oneflow" not in choices, choices
    reason = server.stats()["backends"]["oneflow"]
    assert "oneflow is not installed" in reason
    prompt = _with_backend(txt2img(server, seed=120), "oneflow")
    entry, images, delta = run(server, prompt)
    assert len(images) == 1
    assert delta["compiles"] == 0 and delta["unet_graph_calls"] == 0 and delta["vae_graph_calls"] == 0, delta
    texts = server.texts(entry)
    for node in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        report = next(t for i, t in texts.items() if prompt[i]["class_type"] == node)
        assert "the oneflow backend is unavailable here" in report and reason in report, report
    assert_same_image(images[0], eager_images(server, prompt)[0], "oneflow chosen, uncompiled")


def test_a_prompt_written_before_the_backend_input_existed_still_runs(server):
    """API-format prompts saved by an earlier version have no `backend`: the default serves them."""
    run(server, txt2img(server, seed=125))  # compiles if nothing did yet
    prompt = txt2img(server, seed=126)
    for node in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        for node_id in S.nodes_of(prompt, node):
            del prompt[node_id]["inputs"]["backend"]
    entry, images, delta = run(server, prompt)
    assert len(images) == 1
    assert_served(delta, vae=True)


def test_inductor_backend_serves_new_shapes_without_compiling(server):
    """torch.compile (in memory) chosen on the nodes: after the first image, other sizes compile nothing."""
    first = _with_backend(txt2img(server, width=256, height=256, seed=130), "inductor")
    entry, images, delta = run(server, first)
    assert delta["compiles"] >= 1 and delta["unet_eager_calls"] == 0 and delta["vae_eager_calls"] == 0, delta
    inductor_graphs = [g for g in server.stats()["graphs"] if "inductor" in g["family"]]
    assert inductor_graphs, server.stats()["graphs"]
    assert_same_image(images[0], eager_images(server, first)[0], "inductor 256x256")
    for case in (dict(width=320, height=256), dict(width=256, height=384, batch=2)):
        prompt = _with_backend(txt2img(server, seed=131, **case), "inductor")
        entry, images, delta = run(server, prompt)
        assert_served(delta, vae=True)
        for a, b in zip(images, eager_images(server, prompt)):
            assert_same_image(a, b, f"inductor {case}")


def test_load_graph_pulls_from_a_remote_library(server, tmp_path):
    """A fleet worker (docs/fleet.md): a builder pushes its graphs, signed, to a library (a shared folder
    here; S3 in tests/remote/test_remote_s3.py); the worker trusts the builder's key once, starts with an empty
    graphs folder, and Load Graph with `library` pulls what fits and serves the first image with no compile."""
    import subprocess
    import sys

    saved_set(server)
    folder, library, key = graphs_folder(server), tmp_path / "library", tmp_path / "builder.key"
    env = {**os.environ, "KEEPFAST_TRUST_FILE": server.env["KEEPFAST_TRUST_FILE"]}

    def graphs(*args):
        done = subprocess.run([sys.executable, "-m", "compiler", "graphs", *map(str, args)], cwd=S.REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    graphs("keygen", key, "--name", "builder")
    graphs("push", folder, library, "--key", key)
    graphs("trust-key", f"{key}.pub")
    kept = folder.with_name("graphs-before-pull")
    folder.rename(kept)
    folder.mkdir()
    try:
        server.restart()
        prompt = _load_prompt(server, "(every stored graph that fits)", seed=91)
        S.set_inputs(prompt, "KeepFastLoadGraph", library=str(library))
        entry, images, delta = run(server, prompt)
        report = _report(server, entry, prompt)
        assert "pulled" in report and str(library) in report, report
        assert_served(delta, vae=True)
        assert delta["loads"] >= 2 and delta["compiles"] == 0, delta
        assert sorted(p.name for p in folder.glob("*/*.json")), "nothing was pulled into the graphs folder"
        assert_same_image(images[0], eager_images(server, prompt)[0], "graphs pulled from the library")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        kept.rename(folder)
