"""The default path holds: graphs built in the background serve every later run, whatever ran in between.

ComfyUI's templates (SD1.5 default, Z-Image Turbo, Wan 2.1 text-to-video, Flux schnell), Model Speedup and VAE
Speedup after every loader with their defaults (graphs build in the background), in a ComfyUI server started
as users start it. Per template, the sequence a user makes:

1. the template with the pack (uncompiled; its builds start);
2. the template without the pack, queued at once while the builds run (ComfyUI drops the Speedup outputs);
3. wait until the stats list no build in flight; the template without the pack again;
4. the template with the pack and a LoRA at another strength upstream of Model Speedup (new Speedup outputs);
5. the template with the pack at another size and batch.

Runs 4 and 5 are served from graphs: no build starts, nothing falls back, no call runs eager; the graphs built
for run 1 are taken in (recorded "built in the background, started earlier for this model" where the Speedup
output that started them was dropped). Every image with the pack equals the same workflow without it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest

import kf_support as S
import kf_templates as T

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

MODEL_SETTINGS = dict(min_resolution=64, max_resolution=512, max_batch_size=2, max_frames=17)  # build: default
VAE_SETTINGS = dict(min_resolution=64, max_resolution=512, max_batch_size=2)
EAGER_COUNTS = ("unet_eager_calls", "block_eager_calls", "vae_eager_calls")


@dataclass(frozen=True)
class Template:
    name: str
    family: Optional[str]  # template_nodes' tiny family; None: the template's own loaders (SD1.5 checkpoint)
    vae_files: Tuple[Tuple[str, str], ...] = ()
    checkpoint_vae: Optional[str] = None
    first: Tuple[int, int, int, int] = (256, 256, 1, 9)  # width, height, batch, video frames
    second: Tuple[int, int, int, int] = (192, 192, 2, 5)
    lora: str = ""


TEMPLATES = [
    Template("default", None, lora=S.LORA),
    Template("image_z_image_turbo", "z-image", (("ae.safetensors", "kl16"),), lora="z-image-lora.safetensors"),
    Template("text_to_video_wan", "wan", (("wan_2.1_vae.safetensors", "wan21"),), first=(128, 128, 1, 9),
             second=(192, 128, 1, 5), lora="wan-lora.safetensors"),
    Template("flux_schnell", "flux", (("ae.safetensors", "kl16"),), checkpoint_vae="ae.safetensors",
             lora="flux-lora.safetensors"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = S.make_base(tmp_path_factory.mktemp("default-path"))
    S.build_models(base)  # the SD1.5 checkpoint under the default template's name, and its LoRA
    (base / "custom_nodes" / "keepfast_template_fixtures").symlink_to(S.HERE / "template_nodes",
                                                                       target_is_directory=True)
    written = set()
    for template in TEMPLATES:
        for name, kind in template.vae_files:
            if name not in written:
                S.write_model(base, "vae", base / "models" / "vae" / name, "--kind", kind)
                written.add(name)
        if template.family:
            S.write_model(base, "family-lora", base / "models" / "loras" / template.lora, "--family", template.family)
    env = {**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")}
    server = S.ComfyServer(base, env, attention="default")
    server.start()
    yield server
    server.stop()


def _prompt(server, template: Template, size, pack: bool, lora: float = 0.0) -> dict:
    width, height, batch, length = size
    prompt = T.template_prompt(server, template.name)
    T.use_fixtures(prompt, template.family, template.checkpoint_vae)
    T.shrink(prompt, width, height, batch, length, steps=2)
    if pack:
        info = server.object_info()
        T.add_speedups(prompt, info, MODEL_SETTINGS, VAE_SETTINGS)
    if lora:
        T.insert_lora(prompt, server.object_info(), template.lora, lora)
    return T.save_frames(prompt, S.unique_prefix(template.name))


def _counted(server, prompt: dict) -> dict:
    before, started = server.counts(), time.time()
    entry = server.run(prompt, timeout=1800)
    after = server.counts()
    messages = [m for m in server.stats()["messages"] if m["at"] >= started]
    return {"images": server.images(entry), "delta": {k: after[k] - before[k] for k in after},
            "messages": messages}


def _same(server, prompt_with_pack: dict, images) -> None:
    plain = S.without_speedup(prompt_with_pack)
    for node_id in S.nodes_of(plain, "SaveImage"):
        plain[node_id]["inputs"]["filename_prefix"] = S.unique_prefix("plain")
    reference = server.images(server.run(plain, timeout=1800))
    assert len(images) == len(reference) > 0
    for a, b in zip(images, reference):
        mean, largest = S.image_difference(a, b)
        assert mean < S.IMAGE_MEAN_TOLERANCE and largest <= S.IMAGE_MAX_TOLERANCE, (mean, largest)


_RUNS: dict = {}


def _sequence(server, template: Template) -> dict:
    if template.name in _RUNS:
        return _RUNS[template.name]
    first = _prompt(server, template, template.first, pack=True)
    runs = {"first": _counted(server, first)}
    runs["plain_while_building"] = _counted(server, _prompt(server, template, template.first, pack=False))
    runs["builds"] = S.wait_for_builds(server)
    runs["plain_after"] = _counted(server, _prompt(server, template, template.first, pack=False))
    with_lora = _prompt(server, template, template.first, pack=True, lora=0.6)
    runs["lora"] = _counted(server, with_lora)
    second = _prompt(server, template, template.second, pack=True)
    runs["second"] = _counted(server, second)
    runs["prompts"] = {"first": first, "lora": with_lora, "second": second}
    _RUNS[template.name] = runs
    return runs


@pytest.fixture(params=TEMPLATES, ids=[t.name for t in TEMPLATES])
def runs(request, server):
    return request.param, server, _sequence(server, request.param)


def _reasons(run: dict, kind: str):
    return [m["reason"] for m in run["messages"] if m["kind"] == kind]


def test_the_first_run_starts_its_builds_and_runs_uncompiled(runs):
    template, server, found = runs
    first = found["first"]
    assert first["delta"]["compiles"] == 0, _reasons(first, "compile")
    assert any("in the background" in r for r in _reasons(first, "fallback")), _reasons(first, "fallback")
    _same(server, found["prompts"]["first"], first["images"])


def test_after_other_workflows_ran_the_pack_s_workflow_is_served_from_graphs(runs):
    template, server, found = runs
    for phase in ("lora", "second"):
        run = found[phase]
        delta = run["delta"]
        assert delta["fallbacks"] == 0, (phase, _reasons(run, "fallback"))
        assert all(delta[count] == 0 for count in EAGER_COUNTS), (phase, delta)
        assert delta["mismatches"] == 0, (phase, _reasons(run, "mismatch"))
        compiles = _reasons(run, "compile")
        # Only graphs taken in: a build started now would have made its call run eager (a fallback, above).
        assert all("built in the background" in reason for reason in compiles), (phase, compiles)
        _same(server, found["prompts"][phase], run["images"])
    taken_in = _reasons(found["lora"], "compile") + _reasons(found["second"], "compile")
    # Whole-model graphs (the SD UNet, a whole VAE) built for the first run's Speedup outputs, which ComfyUI has
    # dropped since, say so when a new output takes them in. Block graphs and a video VAE's chunk graphs are
    # the process's from the start (a template whose VAE an earlier template already compiled takes in none).
    whole = [reason for reason in taken_in if "block structure" not in reason and " chunk " not in reason]
    assert not whole or any("started earlier for this model" in reason for reason in whole), taken_in


def test_the_runs_without_the_pack_touch_no_graph_and_stop_no_build(runs):
    _, _, found = runs
    for phase in ("plain_while_building", "plain_after"):
        delta = found[phase]["delta"]
        assert delta["compiles"] == 0 and delta["unet_graph_calls"] == 0 and delta["block_graph_calls"] == 0, delta
    assert found["builds"] and all(entry["done"] >= entry["total"] for entry in found["builds"]), found["builds"]
