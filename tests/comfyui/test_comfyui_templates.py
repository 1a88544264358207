"""ComfyUI's official templates, served compiled end to end (needs COMFYUI_PATH).

Each template is fetched from the server as the template browser fetches it,
its subgraphs expanded, KeepFast Model Speedup put after its model loader and
KeepFast VAE Speedup after its VAE loader (kf_templates.py says what else a test
changes: loaders of files that cannot run here, sizes, steps). ComfyUI runs with
its default attention, as users start it. Per template:
- the first image (or video) compiles;
- a second one at another size, batch and prompt length (another frame count for
  video) compiles nothing, falls back nowhere, and its diffusion model blocks (or
  whole UNet) and VAE run from graphs only;
- both equal the same template run without the KeepFast nodes.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import pytest

import kf_support as S
import kf_templates as T

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

KEPT_EVENTS = 100  # the stats route's messages: the last 100 events (nodes/runtime.py)
MEAN_TOLERANCE = 0.25  # 0-255 pixel levels, as test_comfyui_server.py
MAX_TOLERANCE = 4.0
MODEL_SETTINGS = dict(min_resolution=64, max_resolution=512, max_batch_size=2, max_frames=17, build=S.BLOCKING_BUILD)
VAE_SETTINGS = dict(min_resolution=64, max_resolution=512, max_batch_size=2, build=S.BLOCKING_BUILD)


# HunyuanVideo's VAE decodes in a Python loop of 2-frame chunks whose count follows the frames: nodes/vae.py
# runs it eager with this reason (README, the table of what runs uncompiled).
VIDEO_VAE_EAGER = "is a video VAE that KeepFast does not serve yet"


@dataclass(frozen=True)
class Template:
    name: str                      # the template's file name in comfyui-workflow-templates
    family: Optional[str]          # template_nodes' tiny family; None: the template's own loaders
    vae_files: Dict[str, str] = field(default_factory=dict)  # models/vae file name -> comfy_models VAE kind
    checkpoint_vae: Optional[str] = None  # the VAE file a checkpoint template's checkpoint would hold
    loras: Tuple[str, ...] = ()    # LoRA files the template loads, written for its tiny family
    images: Tuple[str, ...] = ()   # input images the template loads (LoadImage)
    first: Tuple[int, int, int, int] = (256, 256, 1, 9)     # width, height, batch, video length (pixel frames)
    second: Tuple[int, int, int, int] = (192, 128, 2, 5)
    blocks: bool = True            # served block by block (DiT) rather than as one UNet graph
    vae_eager: Optional[str] = None  # the reason this template's VAE runs eager (named in the README), if it does
    whole_vae: bool = False        # its VAE is served by one whole-model graph per operation (not chunk by chunk)


TEMPLATES = [
    Template("default", None, blocks=False, whole_vae=True),
    Template("image_z_image_turbo", "z-image", {"ae.safetensors": "kl16"}, whole_vae=True),
    # Flux Kontext: the input image, encoded, is both the sampled latent and a reference latent (ReferenceLatent):
    # the blocks see twice the image's tokens, inside the range max_resolution gives (its advice says so). One image
    # a run: the latent is the encoded image, so the second run changes the size and the prompt, not the batch.
    Template("flux_kontext_dev_basic", "flux", {"ae.safetensors": "kl16"},
             images=("flux_kontext_dev_basic_input_image.jpg",), first=(256, 192, 1, 9), second=(192, 256, 1, 5),
             whole_vae=True),
    Template("flux_schnell", "flux", {"ae.safetensors": "kl16"}, checkpoint_vae="ae.safetensors", whole_vae=True),
    Template("image_flux2_text_to_image", "flux2", {"flux2-vae.safetensors": "flux2"}, whole_vae=True),
    Template("sd3.5_simple_example", "sd3", {"ae.safetensors": "kl16"}, checkpoint_vae="ae.safetensors",
             whole_vae=True),
    Template("image_qwen_image", "qwen-image", {"qwen_image_vae.safetensors": "wan21"},
             loras=("Qwen-Image-Lightning-8steps-V1.0.safetensors",)),
    Template("text_to_video_wan", "wan", {"wan_2.1_vae.safetensors": "wan21"}, first=(128, 128, 1, 9),
             second=(192, 128, 1, 5)),
    Template("image_to_video_wan", "wan-i2v", {"wan_2.1_vae.safetensors": "wan21"},
             images=("image_to_video_wan_start_image.png",), first=(128, 128, 1, 9), second=(192, 128, 1, 5)),
    Template("hunyuan_video_text_to_video", "hunyuan-video",
             {"hunyuan_video_vae_bf16.safetensors": "hunyuan-video"}, first=(96, 64, 1, 9), second=(64, 96, 1, 5),
             vae_eager=VIDEO_VAE_EAGER),
    Template("ltxv_text_to_video", "ltxv", {"ltxv_vae.safetensors": "ltxv"}, checkpoint_vae="ltxv_vae.safetensors",
             first=(128, 96, 1, 9), second=(96, 128, 1, 17), whole_vae=True),
]
_counter = {"n": 0}


def _prefix(tag: str) -> str:
    _counter["n"] += 1
    return f"{tag}_{_counter['n']:03d}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = S.make_base(tmp_path_factory.mktemp("templates"))
    S.build_models(base)  # the SD1.5 checkpoint under the default template's name
    fixtures = base / "custom_nodes" / "keepfast_template_fixtures"
    fixtures.symlink_to(S.HERE / "template_nodes", target_is_directory=True)
    written = set()
    for template in TEMPLATES:
        for name, kind in template.vae_files.items():
            if name not in written:
                S.write_model(base, "vae", base / "models" / "vae" / name, "--kind", kind)
                written.add(name)
        for name in template.images:
            S.write_model(base, "image", base / "input" / name, "--size", "256")
        for name in template.loras:
            S.write_model(base, "family-lora", base / "models" / "loras" / name, "--family", template.family)
    env = {**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")}
    server = S.ComfyServer(base, env, attention="default")
    server.start()
    yield server
    server.stop()


def _prompt(server, template: Template, size, text: str, compiled: bool) -> dict:
    width, height, batch, length = size
    prompt = T.template_prompt(server, template.name)
    T.use_fixtures(prompt, template.family, template.checkpoint_vae)
    T.shrink(prompt, width, height, batch, length, steps=2, text=text)
    if compiled:
        T.add_speedups(prompt, server.object_info(), _settings(server, "KeepFastModelSpeedup", MODEL_SETTINGS),
                       _settings(server, "KeepFastVAESpeedup", VAE_SETTINGS))
    return T.save_frames(prompt, _prefix(template.name.replace(".", "_")))


def _settings(server, class_type: str, wanted: dict) -> dict:
    info = server.object_info()[class_type]["input"]
    names = set(info.get("required") or {}) | set(info.get("optional") or {})
    return {k: v for k, v in wanted.items() if k in names}


def _run(server, prompt: dict):
    """(images, counts added by the run, the run's events): the stats keep the last 100 events, so a run
    whose events do not all fit fails here rather than be judged on part of them."""
    before = server.counts()
    started = time.time()
    entry = server.run(prompt, timeout=1800)
    after = server.counts()
    delta = {key: after[key] - before[key] for key in after}
    kept = server.stats()["messages"]
    messages = [m for m in kept if m["at"] >= started]
    assert len(messages) < len(kept) or len(kept) < KEPT_EVENTS, "more events than the stats keep"
    return server.images(entry), delta, messages


def _assert_same(compiled, eager, what: str) -> None:
    assert len(compiled) == len(eager) > 0, (what, len(compiled), len(eager))
    for index, (a, b) in enumerate(zip(compiled, eager)):
        mean, largest = S.image_difference(a, b)
        assert mean < MEAN_TOLERANCE and largest <= MAX_TOLERANCE, \
            f"{what} image {index}: mean {mean:.4f}, max {largest}"


_RUNS: dict = {}


def _runs(server, template: Template) -> dict:
    if template.name not in _RUNS:
        found = {}
        for phase, size, text in (("first", template.first, "a red fox in the snow"),
                                  ("second", template.second,
                                   "a lighthouse on a rocky coast at dusk with waves and gulls and a long pier")):
            images, delta, messages = _run(server, _prompt(server, template, size, text, compiled=True))
            eager, eager_delta, _ = _run(server, _prompt(server, template, size, text, compiled=False))
            found[phase] = dict(images=images, delta=delta, messages=messages, eager=eager, eager_delta=eager_delta)
        _RUNS[template.name] = found
    return _RUNS[template.name]


@pytest.fixture(params=TEMPLATES, ids=[t.name for t in TEMPLATES])
def runs(request, server):
    return request.param, _runs(server, request.param)


def _reasons(messages, kind: str):
    return [m["reason"] for m in messages if m["kind"] == kind]


def test_the_first_image_compiles_and_equals_eager(runs):
    template, found = runs
    first = found["first"]
    assert first["delta"]["compiles"] > 0, first["delta"]
    compiles = _reasons(first["messages"], "compile")
    vae = [r for r in compiles if r.startswith("VAE decode (")]
    if template.whole_vae:  # one graph per structure, built from one image, for every batch size (none where
        # an earlier template's VAE graph serves): a batch its guards do not take runs an image at a time
        assert len(vae) <= 1 and not any("range corner" in r for r in compiles if r.startswith("VAE ")), compiles
    assert first["delta"]["mismatches"] == 0, _reasons(first["messages"], "mismatch")
    _assert_same(first["images"], first["eager"], f"{template.name} first")


def test_a_second_image_at_other_sizes_compiles_nothing_and_runs_from_graphs(runs):
    template, found = runs
    second = found["second"]
    delta = second["delta"]
    assert delta["compiles"] == 0, (delta, _reasons(second["messages"], "compile"))
    unnamed = [r for r in _reasons(second["messages"], "fallback") if not template.vae_eager or template.vae_eager not in r]
    assert not unnamed and delta["mismatches"] == 0, unnamed  # a VAE that runs eager says so each time it is set up
    if not template.vae_eager:
        assert delta["fallbacks"] == 0, delta
    if template.blocks:
        assert delta["block_graph_calls"] > 0 and delta["block_eager_calls"] == 0, delta
    else:
        assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    if template.vae_eager is None:
        assert delta["vae_graph_calls"] > 0 and delta["vae_eager_calls"] == 0, delta
    else:  # the named exception: every decode eager, for the reason the first image's report gave
        assert delta["vae_graph_calls"] == 0 and delta["vae_eager_calls"] > 0, delta
        reasons = _reasons(found["first"]["messages"], "fallback")
        assert any(template.vae_eager in reason for reason in reasons), reasons
    _assert_same(second["images"], second["eager"], f"{template.name} second")


def test_the_runs_without_the_nodes_touch_no_graph(runs):
    _, found = runs
    for phase in ("first", "second"):
        delta = found[phase]["eager_delta"]
        assert delta["compiles"] == 0 and delta["block_graph_calls"] == 0 and delta["unet_graph_calls"] == 0, delta
        assert delta["vae_graph_calls"] == 0, delta
