"""The oneflow backend on ComfyUI's own model classes (comfy.ldm UNetModel, AutoencoderKL, TAESD).

Needs OneFlow (the Python 3.10 environment .ci/setup_oneflow.sh builds) and
ComfyUI's source (COMFYUI_PATH) with the few pure-Python packages comfy.ldm
imports (einops, psutil, Pillow). The models are built in this process from
ComfyUI's classes with random weights, and run through the nodes' own
forward functions (nodes/unet.py, nodes/vae.py) and the oneflow backend with
the ComfyUI converter (nodes/oneflow_comfy.py), as the speedup nodes do.

    eval "$(.ci/setup_oneflow.sh "$ENV")"
    "$ONEFLOW_ENV/bin/pip" install einops psutil
    COMFYUI_PATH=/path/to/ComfyUI "$ONEFLOW_ENV/bin/python" -m pytest tests/oneflow -m oneflow

Without COMFYUI_PATH (CI) the module is skipped with the reason printed.
Tolerance: ATOL, absolute; these outputs are O(1) and measured differences
are ~1e-6 (float32 on the CPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from compiler.backends.oneflow_support import oneflow_unavailable_reason
from tests.support.pack import pack_module

REPO = Path(__file__).resolve().parents[2]
COMFYUI = os.environ.get("COMFYUI_PATH")


def _skip(reason: str) -> None:
    print(f"\n[tests/oneflow] skipping the OneFlow tests on ComfyUI's models: {reason}", file=sys.stderr)
    pytest.skip(reason, allow_module_level=True)


_REASON = oneflow_unavailable_reason()
if _REASON is not None:
    if os.environ.get("KEEPFAST_REQUIRE_ONEFLOW") == "1":
        pytest.fail(f"KEEPFAST_REQUIRE_ONEFLOW=1 but the oneflow backend is unavailable: {_REASON}", pytrace=False)
    _skip(_REASON)
if not COMFYUI:
    _skip("COMFYUI_PATH is not set (ComfyUI's source is not on a package registry; see the README)")

sys.path.append(COMFYUI)  # after the repository: ComfyUI has top-level `tests` and `utils` of its own
try:
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
    import comfy.ops  # noqa: E402
    from comfy.ldm.models.autoencoder import AutoencoderKL  # noqa: E402
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel  # noqa: E402
    from comfy.taesd.taesd import TAESD  # noqa: E402
except ImportError as error:  # COMFYUI_PATH given: a missing package is a setup error, not a skip
    pytest.fail(f"COMFYUI_PATH={COMFYUI} is set but ComfyUI's model code does not import here: {error} "
                "(comfy.ldm needs einops, psutil and Pillow next to torch)", pytrace=False)

sys.path.insert(0, str(REPO))
from benchmarks.comfy.models import UNET_CONFIG, _init  # noqa: E402

pytestmark = pytest.mark.oneflow

PACK = "keepfast_pack_oneflow_comfy"
ATOL = 1e-4
LATENTS = ((8, 8), (16, 12))
BATCHES = (2, 4)  # the sampler batches cond and uncond: batch 1 and 2 images
VAE_CONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
              "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}


def _pack(name: str):
    return pack_module(PACK, name)


oneflow_comfy = _pack("nodes.oneflow_comfy")
node_unet = _pack("nodes.unet")
node_vae = _pack("nodes.vae")
pack_compiler = _pack("compiler")
pack_oneflow = _pack("compiler.backends.oneflow_backend")


@pytest.fixture(scope="module", autouse=True)
def _setup():
    oneflow_comfy.register()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two shared cores: two OpenMP threads spin against each other
    yield
    torch.set_num_threads(threads)


def _options(label: str, spatial=(8, 16), **changes):
    shape_range = pack_compiler.ShapeRange(batch=(1, 4), spatial=spatial, sequence=(1, 77))
    # verify off: these tests compare every output with eager themselves, and fail if eager runs instead of a graph
    return pack_compiler.CompileOptions(backend="oneflow", shape_range=shape_range, cover_range=False, label=label,
                                        verify=False, **changes)


def _unet(seed: int = 0) -> UNetModel:
    unet = UNetModel(dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init, **UNET_CONFIG)
    _init(unet, seed)
    return unet.eval()


def _unet_call(batch: int, height: int, width: int, seed: int) -> dict:
    torch.manual_seed(seed)
    _, kwargs = node_unet.unet_example_call(4, 768, None, batch, height, width, 77, torch.float32, "cpu")
    kwargs["timesteps"] = torch.linspace(10.0, 900.0, batch)
    return kwargs


def _unet_forward(unet, options, registry, forward_fn):
    """A compiled forward as the Model Speedup node makes it (its binder: the model's `_forward`)."""
    return pack_compiler.CompiledForward(unet, options, registry, forward_fn=forward_fn,
                                         binder=node_unet.call_binder(unet))


def _call(forward, eager, *args, **kwargs):
    """One call served as the nodes serve it: `eager` is what runs when no graph can."""
    return forward.serve(args, kwargs, eager=eager).output


def _eager_unet(unet, kwargs):
    with torch.no_grad():
        return unet._forward(transformer_options={}, **kwargs)


@pytest.fixture(scope="module")
def unet_setup(numbers):
    registry = pack_compiler.GraphRegistry()
    unet = _unet(0)
    forward = _unet_forward(unet, _options("UNetModel"), registry, node_unet._forward_fn)
    calls = [((), _unet_call(batch, h, w, seed=batch + h)) for batch in BATCHES for h, w in LATENTS]
    results = forward.warmup(calls)
    builds = [round(event.seconds, 2) for event in registry.compiles]
    numbers.append(("ComfyUI UNetModel warmup builds (s)", builds))
    return registry, unet, forward, results


def test_unet_warmup_builds_one_graph_per_shape_sharing_the_weights(unet_setup):
    registry, unet, forward, results = unet_setup
    assert [r.eager for r in results] == [False] * len(BATCHES) * len(LATENTS), [r.reason for r in results]
    graphs = registry.graphs()
    assert len(graphs) == len(BATCHES) * len(LATENTS)
    assert all(isinstance(g, pack_oneflow.OneflowGraph) for g in graphs)
    assert len({id(g.binding) for g in graphs}) == 1
    binding = graphs[0].binding
    name = "input_blocks.0.0.weight"
    assert unet.input_blocks[0][0].weight.data_ptr() == binding.memory[binding.names.index(name)].data_ptr()


def test_unet_graphs_equal_comfyui_eager_and_a_sweep_builds_nothing(unet_setup, numbers):
    registry, unet, forward, _ = unet_setup
    registry.reset_counters()
    worst = 0.0
    for batch in BATCHES:
        for height, width in LATENTS:
            kwargs = _unet_call(batch, height, width, seed=1000 + batch * 10 + height)
            out = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
            assert forward.last_status == "compiled graph"
            diff = float((out - _eager_unet(unet, kwargs)).abs().max())
            worst = max(worst, diff)
            assert diff < ATOL, (batch, height, width, diff)
    assert len(registry.compiles) == 0
    numbers.append(("ComfyUI UNetModel max |graph - eager| over the sweep", f"{worst:.2e} (tolerance {ATOL:g})"))


def test_an_unwarmed_shape_builds_one_more_graph_and_says_so(unet_setup):
    registry, unet, forward, _ = unet_setup
    registry.reset_counters()
    kwargs = _unet_call(2, 12, 8, seed=7)
    out = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    assert len(registry.compiles) == 1
    assert float((out - _eager_unet(unet, kwargs)).abs().max()) < ATOL


def test_controlnet_residuals_add_a_graph_and_the_plain_graph_keeps_serving(unet_setup):
    registry, unet, forward, _ = unet_setup
    registry.reset_counters()
    kwargs = _unet_call(2, 8, 8, seed=11)
    generator = torch.Generator().manual_seed(3)
    # Residuals as ComfyUI's ControlNet hands them over; UNetModel pops them, so each call gets new lists.
    residuals = {"output": [torch.randn(2, 320, 8, 8, generator=generator) * 0.1 for _ in range(2)],
                 "middle": [torch.randn(2, 320, 8, 8, generator=generator) * 0.1]}

    def control():
        return {name: list(tensors) for name, tensors in residuals.items()}

    with torch.no_grad():
        reference = unet._forward(transformer_options={}, control=control(), **kwargs)
    out = _call(forward, lambda *a, **k: pytest.fail("ran eager"), control=control(), **kwargs)
    assert len(registry.compiles) == 1
    assert float((out - reference).abs().max()) < ATOL
    assert float((out - _eager_unet(unet, kwargs)).abs().max()) > 1e-3  # the residuals changed the output
    registry.reset_counters()
    plain = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    assert len(registry.compiles) == 0
    assert float((plain - _eager_unet(unet, kwargs)).abs().max()) < ATOL


def test_an_in_place_weight_change_reaches_every_graph(unet_setup):
    registry, unet, forward, _ = unet_setup
    kwargs = _unet_call(4, 16, 12, seed=5)
    before = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    weight = unet.out[2].weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(1.5)  # what ComfyUI's LoRA patching does to a loaded model's weights
        registry.reset_counters()
        after = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
        assert len(registry.compiles) == 0
        assert float((after - before).abs().max()) > 1e-3
        assert float((after - _eager_unet(unet, kwargs)).abs().max()) < ATOL
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_a_lora_patched_and_unpatched_as_comfyui_does_keeps_the_base_weights(unet_setup):
    """ComfyUI's ModelPatcher keeps the original Parameter as its backup (weight.to(cpu) is the same
    object on the CPU), puts a new Parameter with the patched weight in its place, and puts the backup
    back to unpatch. The graphs read one block of weight memory: the backup must not be overwritten."""
    registry, unet, forward, _ = unet_setup
    kwargs = _unet_call(4, 16, 12, seed=21)
    base = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    layer = unet.out[2]
    backup = layer.weight.to(device="cpu", copy=False)  # what ModelPatcher.patch_weight_to_device keeps
    assert backup is layer.weight
    original = backup.detach().clone()
    layer.weight = torch.nn.Parameter(backup.detach() * 1.5, requires_grad=False)  # comfy.utils.set_attr_param
    registry.reset_counters()
    patched = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    assert len(registry.compiles) == 0
    assert float((patched - _eager_unet(unet, kwargs)).abs().max()) < ATOL
    assert float((patched - base).abs().max()) > 1e-3
    assert torch.equal(backup.detach(), original), "the backup ComfyUI unpatches with was overwritten"
    layer.weight = backup  # ModelPatcher.unpatch_model
    restored = _call(forward, lambda *a, **k: pytest.fail("ran eager"), **kwargs)
    assert len(registry.compiles) == 0
    assert torch.equal(layer.weight.detach(), original)
    assert float((restored - base).abs().max()) < ATOL
    assert float((restored - _eager_unet(unet, kwargs)).abs().max()) < ATOL


# SDXL's layout, narrowed: linear transformer projections, class-embedding input y, two levels with a
# downsample, attention heads by channel count.
SDXL_LIKE_CONFIG = {
    "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 64, "num_res_blocks": [1, 1],
    "channel_mult": [1, 2], "transformer_depth": [0, 1], "transformer_depth_output": [0, 0, 0, 1, 1, 1],
    "transformer_depth_middle": 1, "use_spatial_transformer": True, "context_dim": 64,
    "use_linear_in_transformer": True, "num_heads": -1, "num_head_channels": 32, "legacy": False,
    "adm_in_channels": 32, "num_classes": "sequential", "use_temporal_resblock": False,
    "use_temporal_attention": False,
}


def test_an_sdxl_layout_unet_equals_comfyui_eager(numbers):
    registry = pack_compiler.GraphRegistry()
    unet = UNetModel(dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init,
                     **SDXL_LIKE_CONFIG)
    _init(unet, 3)
    unet.eval()
    forward = _unet_forward(unet, _options("UNetModel SDXL-like"), registry, node_unet._forward_fn)
    generator = torch.Generator().manual_seed(6)
    kwargs = {"x": torch.randn(2, 4, 16, 16, generator=generator), "timesteps": torch.tensor([5.0, 700.0]),
              "context": torch.randn(2, 77, 64, generator=generator), "y": torch.randn(2, 32, generator=generator)}
    out = _call(forward, lambda *a, **k: pytest.fail(f"ran eager: {registry.fallbacks}"), **kwargs)
    diff = float((out - _eager_unet(unet, kwargs)).abs().max())
    assert diff < ATOL
    numbers.append(("ComfyUI SDXL-layout UNetModel max |graph - eager|", f"{diff:.2e}"))


@pytest.mark.parametrize("make, op, shape", [
    (lambda: AutoencoderKL(ddconfig=VAE_CONFIG, embed_dim=4), "decode", (1, 4, 16, 16)),
    (lambda: AutoencoderKL(ddconfig=VAE_CONFIG, embed_dim=4), "encode", (1, 3, 64, 64)),
    (lambda: TAESD(latent_channels=4), "decode", (2, 4, 8, 12)),
], ids=["AutoencoderKL-decode", "AutoencoderKL-encode", "TAESD-decode"])
def test_vae_graphs_equal_comfyui_eager(make, op, shape, numbers):
    registry = pack_compiler.GraphRegistry()
    vae = make()
    _init(vae, 1)
    vae.eval()
    forward = pack_compiler.CompiledForward(vae, _options(f"VAE {op}", spatial=(8, 64)), registry, forward_fn=node_vae._vae_forward)
    sample = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    out = _call(forward, lambda *a, **k: pytest.fail(f"ran eager: {registry.fallbacks}"), op, sample)
    assert forward.last_status == "compiled graph", forward.last_status
    with torch.no_grad():
        reference = getattr(vae, op)(sample)
    diff = float((out - reference).abs().max())
    assert out.shape == reference.shape and diff < ATOL
    numbers.append((f"ComfyUI {type(vae).__name__} {op} max |graph - eager|", f"{diff:.2e}"))


def test_weights_comfyui_casts_on_the_fly_run_eager_with_the_reason():
    registry = pack_compiler.GraphRegistry()
    unet = _unet(1)
    unet.out[2].comfy_cast_weights = True  # what ComfyUI sets in low-VRAM mode or for manual_cast models
    forward = _unet_forward(unet, _options("UNetModel"), registry, node_unet._forward_fn)
    kwargs = _unet_call(2, 8, 8, seed=3)
    ran = []

    def eager(**called):
        ran.append(True)
        return _eager_unet(unet, called)

    out = _call(forward, eager, **kwargs)
    assert ran == [True]
    assert forward.last_status.startswith("eager: ")
    assert "UNetModel.out.2: ComfyUI casts this Conv2d's weights on the fly" in forward.last_status
    assert float((out - _eager_unet(unet, kwargs)).abs().max()) == 0.0


def test_a_forward_function_that_is_not_portable_is_refused_with_the_reason():
    registry = pack_compiler.GraphRegistry()
    unet = _unet(2)

    def calls_torch_directly(module, **kwargs):
        return module._forward(transformer_options={}, **kwargs) * torch.ones(1)

    forward = _unet_forward(unet, _options("UNetModel"), registry, calls_torch_directly)
    kwargs = _unet_call(2, 8, 8, seed=4)
    _call(forward, lambda *a, **k: _eager_unet(unet, kwargs), **kwargs)
    assert "is not marked portable" in forward.last_status


def test_the_real_comfyui_modules_stay_in_sys_modules(unet_setup):
    import comfy.model_management

    assert comfy.ops.__file__.startswith(COMFYUI)
    assert comfy.ops.torch is torch  # the real comfy.ops runs on torch
    assert hasattr(comfy.model_management, "current_loaded_models")  # the real one, not the stand-in
    assert sys.modules["comfy.model_management"] is comfy.model_management
    assert sys.modules["torch"] is torch
    assert not any(type(m).__name__ == "MissingDtype" for m in vars(torch).values())


def test_a_registered_package_that_does_not_import_leaves_the_others_working():
    """Last in this module: it leaves a package registered that never imports."""
    isolation = _pack("compiler.backends.oneflow_support.isolation")
    isolation.register_package(isolation.FlowPackage(root="keepfast_no_such_package"))
    registry = pack_compiler.GraphRegistry()
    vae = TAESD(latent_channels=4)
    _init(vae, 4)
    vae.eval()
    forward = pack_compiler.CompiledForward(vae, _options("VAE decode"), registry, forward_fn=node_vae._vae_forward)
    sample = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(5))
    out = _call(forward, lambda *a, **k: pytest.fail(f"ran eager: {registry.fallbacks}"), "decode", sample)
    with torch.no_grad():
        assert float((out - vae.decode(sample)).abs().max()) < ATOL
    assert "No module named 'keepfast_no_such_package'" in isolation.IMPORT_ERRORS["keepfast_no_such_package"]
