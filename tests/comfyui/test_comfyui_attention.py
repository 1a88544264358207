"""KeepFast in ComfyUI started with each attention it can pick on this CPU.

ComfyUI chooses its attention function at start: with no flag it picks the
sub-quadratic one on a CPU (and on some Apple and AMD setups), and users pass
--use-split-cross-attention or --use-quad-cross-attention. Those functions
compute their chunking from the shapes and the free memory, which torch.export
records as guards with division, `math.ceil` and `sym_max` (an earlier version
failed there with "GuardSyntaxError: Div is not allowed in a guard").

One ComfyUI per attention mode, each in a base folder of its own (its own
graphs folder, so the first image compiles under that attention; the
checkpoint is a link to the session's). The bundled txt2img workflow with the
Model Speedup node (range 64-512 px, batch up to 2; the VAE Speedup node is
bypassed: the VAE has no attention and its compile would only add time): the
first image compiles or loads, then three other resolutions and a batch of 2
run with zero compiles and zero fallbacks, the diffusion model served by
graphs only, and each image equals the same prompt run without the KeepFast
nodes within the tolerance of the other server tests (mean absolute
difference below 0.25 and largest below 4, in 0-255 levels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

MEAN_TOLERANCE = 0.25
MAX_TOLERANCE = 4.0
STEPS = 2
SPEEDUP = dict(min_resolution=64, max_resolution=512, max_batch_size=2, build=S.BLOCKING_BUILD)
# The attention ComfyUI says in its log that it picked, per mode (on this CPU).
PICKED = {"default": "sub quadratic", "quad": "sub quadratic", "split": "split"}
AFTER_FIRST = [dict(width=320, height=256), dict(width=192, height=384), dict(width=384, height=320),
               dict(width=256, height=256, batch=2)]
_names = {"n": 0}


def unique(prefix: str) -> str:
    _names["n"] += 1
    return f"{prefix}_{_names['n']:03d}"


def txt2img(server, width: int = 256, height: int = 256, batch: int = 1, seed: int = 7) -> dict:
    prompt = S.ui_to_api(S.load_workflow("keepfast_txt2img"), server.object_info())
    S.set_inputs(prompt, "KSampler", steps=STEPS, seed=seed)
    S.set_inputs(prompt, "KeepFastModelSpeedup", **SPEEDUP)
    S.set_inputs(prompt, "EmptyLatentImage", width=width, height=height, batch_size=batch)
    S.set_inputs(prompt, "SaveImage", filename_prefix=unique("attn"))
    for node_id in S.nodes_of(prompt, "KeepFastVAESpeedup"):
        vae = prompt.pop(node_id)["inputs"]["vae"]
        for node in prompt.values():
            for name, value in node["inputs"].items():
                if value == [node_id, 0]:
                    node["inputs"][name] = vae
    return prompt


def run(server, prompt: dict):
    before = server.counts()
    entry = server.run(prompt)
    after = server.counts()
    return server.images(entry), {key: after[key] - before[key] for key in after}


def eager_images(server, prompt: dict):
    plain = S.without_speedup(prompt)
    S.set_inputs(plain, "SaveImage", filename_prefix=unique("eager"))
    images, delta = run(server, plain)
    assert delta["unet_graph_calls"] == 0, delta
    return images


def assert_same_images(images, reference, what: str) -> None:
    assert len(images) == len(reference), what
    for index, (a, b) in enumerate(zip(images, reference)):
        mean, largest = S.image_difference(a, b)
        assert mean < MEAN_TOLERANCE and largest <= MAX_TOLERANCE, f"{what} image {index}: mean {mean:.4f}, " \
                                                                     f"max {largest}"


@dataclass
class Started:
    mode: str
    server: S.ComfyServer
    first_delta: dict
    first_images: list


@pytest.fixture(scope="module", params=sorted(PICKED))
def attention(request, comfy_base, tmp_path_factory):
    """A ComfyUI started with one attention mode, after its first image."""
    mode = request.param
    base = S.make_base(tmp_path_factory.mktemp(f"attention-{mode}"))
    (base / "models" / "checkpoints" / S.CHECKPOINT).symlink_to(comfy_base / "models" / "checkpoints" / S.CHECKPOINT)
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(base / "keepfast-trust.json"), "PYTHONUNBUFFERED": "1"}
    server = S.ComfyServer(base, env, attention=mode)
    server.start()
    try:
        images, delta = run(server, txt2img(server))
        yield Started(mode, server, delta, images)
    finally:
        server.stop()


def test_comfyui_uses_the_attention_it_was_started_with(attention):
    assert S.picked_attention(attention.server.log_text()) == PICKED[attention.mode], attention.server.log_tail()
    assert "--use-pytorch-cross-attention" not in attention.server.attention_args


def test_first_image_compiles_or_loads_then_runs_from_graphs(attention):
    delta = attention.first_delta
    assert delta["compiles"] + delta["loads"] >= 1, delta
    assert delta["fallbacks"] == 0, (delta, [m["reason"] for m in attention.server.stats()["messages"]
                                             if m["kind"] == "fallback"])
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert_same_images(attention.first_images, eager_images(attention.server, txt2img(attention.server)),
                       f"{attention.mode} first")


@pytest.mark.parametrize("case", AFTER_FIRST, ids=lambda c: f"{c['width']}x{c['height']}x{c.get('batch', 1)}")
def test_other_sizes_and_batch_without_compiles_or_fallbacks(attention, case):
    server = attention.server
    prompt = txt2img(server, seed=11, **case)
    images, delta = run(server, prompt)
    assert delta["compiles"] == 0 and delta["fallbacks"] == 0, (delta, [
        m["reason"] for m in server.stats()["messages"] if m["kind"] in ("compile", "fallback")][-4:])
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert len(images) == case.get("batch", 1) and images[0].shape == (case["height"], case["width"], 3)
    assert_same_images(images, eager_images(server, prompt), f"{attention.mode} {case}")
