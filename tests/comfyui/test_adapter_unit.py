"""The ComfyUI nodes' ComfyUI-free parts (call binding, patches, graph sets, sizes), the pack entry and the
bundled workflow files. Runs without ComfyUI and without compiling anything."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from compiler import CompiledForward, CompileOptions, GraphRegistry, MultiRootStore, TrustList
from compiler.keys.signature import FlatCall
from compiler.keys.structure import structure_hash
from tests.support.pack import pack_module

REPO = Path(__file__).resolve().parents[2]
PACK = "keepfast_pack_for_adapter_unit"
_patches = pack_module(PACK, "nodes.patches")
_sets = pack_module(PACK, "nodes.graph_sets")
_sizes = pack_module(PACK, "nodes.sizes")
_unet = pack_module(PACK, "nodes.unet")
CallDoesNotBind = pack_module(PACK, "compiler.keys.binding").CallDoesNotBind
options_reason = _patches.options_reason
GraphSetError, graph_set_entries, read_json = _sets.GraphSetError, _sets.graph_set_entries, _sets.read_json
set_file_name, write_graph_set = _sets.set_file_name, _sets.write_graph_set
latent_range, parse_batch_sizes, parse_resolutions = _sizes.latent_range, _sizes.parse_batch_sizes, _sizes.parse_resolutions
unet_example_call = _unet.unet_example_call


def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
    """UNetModel._forward's parameters."""


def _binder(function=forward):
    """The binder the Model Speedup node makes for a diffusion model whose `_forward` is `function`."""
    model_class = type("Model", (torch.nn.Module,), {"_forward": function})
    return _unet.call_binder(model_class())


def bind_call(binder, args, kwargs):
    bound = binder.bind(args, kwargs)
    return bound.inputs, bound.side.get("transformer_options", {})


# -- transformer_options ------------------------------------------------------------

def test_bookkeeping_options_compile():
    options = {"wrappers": {"diffusion_model": {"keepfast": [print]}}, "callbacks": {}, "cond_or_uncond": [1, 0],
               "uuids": ["a"], "sigmas": torch.ones(1), "sample_sigmas": torch.ones(3), "patches": {},
               "patches_replace": {"attn1": {}}, "transformer_index": 0, "block": ("input", 1)}
    assert options_reason(options) is None
    assert options_reason({}) is None and options_reason(None) is None


def test_state_read_outside_the_model_compiles():
    """EasyCache and LazyCache keep their state in transformer_options, context windows name their window there; both
    are read in wrappers and callbacks around the model."""
    assert options_reason({"easycache": object(), "uuids": ["a"]}) is None
    assert options_reason({"context_window": object()}) is None  # ComfyUI's context windows name their window
    assert "rope_options" in options_reason({"easycache": object(), "rope_options": {"scale": 2}})


def test_the_packs_wrapper_is_put_outermost_keeping_the_others_order():
    """A wrapper outside ours could answer a call (a skipped step) without ours seeing it (nodes/unet.py)."""
    import types

    first, second = print, repr
    model = types.SimpleNamespace(wrappers={"diffusion_model": {"easycache": [first], _unet.KEY: [len],
                                                                "other": [second]}, "apply_model": {}})
    _unet._outermost(model, "diffusion_model")
    assert list(model.wrappers["diffusion_model"].items()) == [(_unet.KEY, [len]), ("easycache", [first]),
                                                               ("other", [second])]
    _unet._outermost(model, "apply_model")  # no wrappers of that kind: nothing to reorder
    assert model.wrappers["apply_model"] == {}


@pytest.mark.parametrize("options, named", [
    ({"patches": {"output_block_patch": [print]}}, "patches (output_block_patch)"),
    ({"patches_replace": {"attn2": {("input", 1, 0): print}}}, "patches_replace (attn2)"),
    ({"optimized_attention_override": print}, "optimized_attention_override"),
    ({"rope_options": {"scale": 2}}, "rope_options"),
])
def test_computation_changing_options_run_eager_with_a_reason(options, named):
    reason = options_reason(options)
    assert reason is not None and named in reason and "compiled graph cannot include" in reason


# -- calls -----------------------------------------------------------------------------

def test_bound_calls_have_one_input_structure_however_passed():
    x, t, c = torch.randn(2, 4, 8, 8), torch.ones(2), torch.randn(2, 77, 768)
    signature = _binder()
    by_position, options_a = bind_call(signature, (x, t, c, None, None, {"uuids": [1]}), {})
    by_name, options_b = bind_call(signature, (x,), {"timesteps": t, "context": c, "transformer_options": {}})
    assert list(by_position) == list(by_name) == ["context", "timesteps", "x"]
    assert options_a == {"uuids": [1]} and options_b == {}
    assert FlatCall((), by_position).signature.id == FlatCall((), by_name).signature.id
    example, _ = bind_call(signature, *unet_example_call(4, 768, None, 2, 8, 8, 77, torch.float32, "cpu"))
    assert FlatCall((), example).signature.id == FlatCall((), by_name).signature.id


def test_inputs_are_made_contiguous():
    x = torch.randn(2, 8, 8, 4).movedim(-1, 1)
    assert not x.is_contiguous()
    bound, _ = bind_call(_binder(), (x, torch.ones(2)), {})
    assert bound["x"].is_contiguous() and torch.equal(bound["x"], x)


def test_extra_positional_inputs_do_not_bind():
    def takes_star(self, x, *rest, transformer_options=None):
        pass

    with pytest.raises(CallDoesNotBind):
        bind_call(_binder(takes_star), (torch.ones(1), torch.ones(1)), {})


def test_controlnet_residuals_are_a_new_input_structure():
    x, t, c = torch.randn(2, 4, 8, 8), torch.ones(2), torch.randn(2, 77, 768)
    signature = _binder()
    plain, _ = bind_call(signature, (x, t, c), {})

    def control(scale):
        return {"input": [torch.randn(2, 320, 8, 8) * scale, None], "middle": [torch.randn(2, 320, 8, 8)],
                "output": []}

    with_control, _ = bind_call(signature, (x, t, c), {"control": control(1.0)})
    stronger, _ = bind_call(signature, (x, t, c), {"control": control(0.5)})
    a, b, again = FlatCall((), plain), FlatCall((), with_control), FlatCall((), stronger)
    assert a.signature.id != b.signature.id
    assert b.signature.id == again.signature.id
    assert "control.input[0]" in b.tensor_paths and "control.middle[0]" in b.tensor_paths
    assert ("control.input[1]", None) in b.signature.constants


# -- structure ---------------------------------------------------------------------------

def test_structure_ignores_the_flags_comfyui_sets_while_loading():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Conv2d(4, 4, 1))
    before = structure_hash(module)
    for sub in module:
        sub.comfy_patched_weights = True
        sub.prev_comfy_cast_weights = False
    assert structure_hash(module) == before
    module[0].out_features = 5
    assert structure_hash(module) != before


def test_eager_path_is_the_callers_own_call():
    module = torch.nn.Linear(4, 4)
    registry = GraphRegistry()
    compiled = CompiledForward(module, CompileOptions(compile_on_miss=False, label="linear", counter="unet"),
                               registry, forward_fn=lambda m, x: m(x))
    x = torch.randn(2, 4)
    served = compiled.serve((x,), {}, eager=lambda *a, **k: "the wrapper chain")
    assert served.output == "the wrapper chain" and served.eager and "compiling is off" in served.reason
    known = compiled.serve((x,), {}, eager=lambda *a, **k: 7, eager_reason="patches")
    assert known.output == 7 and known.reason == "patches"
    assert [e.reason for e in registry.fallbacks][-1] == "linear: patches; running eager"
    assert registry.log.counts["unet.eager"] == 2 and registry.log.counts["unet.graph"] == 0
    assert compiled.eager(x).shape == (2, 4)  # the module's own forward


def test_transformer_options_with_patches_run_the_callers_call_with_the_reason():
    module = torch.nn.Linear(4, 4)
    registry = GraphRegistry()

    def fake_forward(self, x, transformer_options={}):
        pass

    compiled = CompiledForward(module, CompileOptions(label="linear"), registry, forward_fn=lambda m, x: m(x),
                               binder=_binder(fake_forward))
    options = {"patches": {"output_block_patch": [print]}}
    served = compiled.serve((torch.randn(2, 4),), {"transformer_options": options}, eager=lambda *a, **k: "eager")
    assert served.output == "eager" and "patches (output_block_patch)" in served.reason
    assert registry.compiles == []


# -- graphs folder --------------------------------------------------------------------------

def test_graph_sets_round_trip(tmp_path):
    path = write_graph_set(tmp_path, "my graphs!", ["UNetModel-abc/1", "TAESD-def/2", "UNetModel-abc/1"])
    assert path.name == "my_graphs.json"
    assert graph_set_entries(read_json(path)) == ["TAESD-def/2", "UNetModel-abc/1"]
    assert set_file_name("sd15.json") == "sd15.json" and set_file_name("../x") == "x.json"
    with pytest.raises(GraphSetError):
        graph_set_entries({"format": "keepfast-graph", "graphs": []})
    with pytest.raises(GraphSetError):
        graph_set_entries({"format": "keepfast-graph-set", "format_version": 1, "graphs": 3})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(GraphSetError, match="cannot read bad.json"):
        read_json(tmp_path / "bad.json")


def test_multi_root_store(tmp_path):
    first, second = tmp_path / "models" / "graphs", tmp_path / "shared"
    store = MultiRootStore([first, second], TrustList(tmp_path / "trust.json"))
    assert store.root == first and store.roots == [first, second]
    assert store.store_for(second / "UNetModel-abc" / "x.json")[1] == "UNetModel-abc/x.json"
    assert store.store_for(first / "set.json")[0] is store
    with pytest.raises(ValueError):
        store.store_for(tmp_path / "elsewhere.json")
    assert store.all_graphs() == []


# -- shapes ------------------------------------------------------------------------------------

def test_parsing_sizes_and_ranges():
    assert parse_resolutions("512x512, 768X512;1024") == [(512, 512), (768, 512), (1024, 1024)]
    assert parse_batch_sizes("1, 2 4") == [1, 2, 4]
    for bad in ("512by512", "0x5"):
        with pytest.raises(ValueError):
            parse_resolutions(bad)
    with pytest.raises(ValueError):
        parse_batch_sizes("1, two")
    shape_range = latent_range(64, 2048, 4)
    assert shape_range.batch == (1, 8) and shape_range.spatial == (8, 256)


# -- the pack's entry and workflows ---------------------------------------------------------------

def test_pack_entry_imports_without_comfyui():
    had_comfy = "comfy" in sys.modules
    spec = importlib.util.spec_from_file_location("keepfast_pack_probe", REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.comfy_entrypoint) and module.WEB_DIRECTORY == "./web"
    assert not hasattr(module, "NODE_CLASS_MAPPINGS")  # V3 only: ComfyUI would take V1 first
    assert ("comfy" in sys.modules) == had_comfy


WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))


def test_bundled_workflows_exist():
    assert {p.stem for p in WORKFLOWS} == {
        "keepfast_txt2img", "keepfast_multi_resolution_warmup", "keepfast_save_graph", "keepfast_load_graph",
        "keepfast_lora", "keepfast_img2img"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_workflow_is_ui_format_and_consistent(path):
    data = json.loads(path.read_text())
    nodes = {node["id"]: node for node in data["nodes"]}
    assert data["last_node_id"] >= max(nodes) and data["last_link_id"] >= max(link[0] for link in data["links"])
    assert any(node["type"].startswith("KeepFast") for node in nodes.values())
    for link_id, origin, slot, target, target_slot, kind in data["links"]:
        assert link_id in (nodes[origin]["outputs"][slot]["links"] or [])
        assert nodes[target]["inputs"][target_slot]["link"] == link_id
    for node in nodes.values():
        for entry in node.get("inputs", []):
            if entry.get("link") is None:
                assert entry.get("shape") == 7, f"required input {entry['name']} of {node['type']} is unconnected"


# -- block graphs of ComfyUI's transformer families (nodes/blocks.py, image_families.py, video_families.py) --------

_blocks = pack_module(PACK, "nodes.blocks")
_image, _video = pack_module(PACK, "nodes.image_families"), pack_module(PACK, "nodes.video_families")
_attention = pack_module(PACK, "nodes.attention")
Dims = pack_module(PACK, "compiler").Dims


class _Instance:
    """A block instance as the policy reads it: its module, and its server's engine's family (a family with no
    low-VRAM or GGUF support here: a patched weight is one the pack does not know)."""

    def __init__(self, module, family=None):
        import types

        self.module = module
        family = family if family is not None else types.SimpleNamespace()
        self.server = types.SimpleNamespace(engine=types.SimpleNamespace(family=family))


class _CastLinear(torch.nn.Linear):
    """The attributes ComfyUI's ops give a Linear (weights patched per call when the lists are non-empty)."""

    def __init__(self):
        super().__init__(4, 4)
        self.weight_function, self.bias_function = [], []


def test_a_block_runs_eager_for_its_own_attention_override_or_weights_patched_per_call():
    policy = _blocks.BlockPolicy()
    block = torch.nn.Sequential(_CastLinear(), torch.nn.GELU(), _CastLinear())
    instance = _Instance(block)
    ours = _attention.graph_attention_options()
    assert policy(instance, (), {"transformer_options": ours}) is None
    assert policy(instance, (), {"transformer_options": {"block_index": 3, "cond_or_uncond": [0, 1]}}) is None

    def sage_attention(func, *args, **kwargs):
        return func(*args, **kwargs)

    reason = policy(instance, (), {"transformer_options": {"optimized_attention_override": sage_attention}})
    assert "attention override" in reason and "sage_attention" in reason
    block[2].weight_function.append(lambda weight, **kwargs: weight)
    assert "patched on the fly" in policy(instance, (), {"transformer_options": ours})


def test_video_families_turn_frames_and_pixels_into_their_latent_units():
    wan, ltxv, flux = _video.WanFamily(), _video.LTXVFamily(), _image.FluxFamily()
    assert wan.latent_frames(81) == 21 and ltxv.latent_frames(97) == 13 and flux.latent_frames(81) == 81
    r = _blocks.block_range(wan, 64, 1024, 2, 81)
    assert (r.spatial, r.frames, r.batch) == ((8, 128), (1, 21), (1, 4))
    r = _blocks.block_range(ltxv, 64, 1024, 1, 97)
    assert (r.spatial, r.frames) == ((2, 32), (1, 13))  # LTXV's VAE: 32 pixels per latent pixel
    assert _blocks.block_range(flux, 64, 1024, 1, 81).frames is None
    assert wan.geometry.tokens(Dims(1, 16, 16, frames=5)) == 5 * 8 * 8  # frames are their own axis


def test_ltx2_blocks_take_its_audio_stream_and_run_eager_where_a_node_switches_a_stream_off():
    """LTX-2 (ComfyUI's LTXAVModel): LTXV's video latents and 25 audio tokens a second beside them, the audio range
    sized from max_frames at 8 frames a second; its blocks read stream switches from transformer_options, which
    a graph computes all of, and skip the audio where a call has none."""
    ltx2 = _video.LTX2Family()
    assert _blocks.family_of(_comfy_like("LTXAVModel")).name == "ltx2"
    assert _blocks.family_of(_comfy_like("LTXVModel")).name == "ltxv"
    r = ltx2.geometry.block_range(_blocks.block_range(ltx2, 64, 1024, 1, 121))
    assert (r.spatial, r.frames) == ((2, 32), (1, 16)) and r.audio == (1, 16 * 25)  # 121 frames at 8 a second
    assert 121 / 8 * 25 <= r.audio[1]
    policy = _blocks.BlockPolicy()
    instance = _Instance(torch.nn.Linear(4, 4), family=ltx2)
    streams = (torch.zeros(2, 16, 8), torch.zeros(2, 9, 4))
    ours = _attention.graph_attention_options()
    assert policy(instance, (streams,), {"transformer_options": ours}) is None
    assert policy(instance, (streams,), {"transformer_options": {**ours, "run_ax": True}}) is None
    reason = policy(instance, (streams,), {"transformer_options": {**ours, "a2v_cross_attn": False}})
    assert "a2v_cross_attn" in reason and "turn off" in reason
    reason = policy(instance, ((streams[0], torch.zeros(2, 0, 4)),), {"transformer_options": ours})
    assert "no audio" in reason
    assert "audio" in _unet.RANGE_ADVICE and "max_frames" in _unet.RANGE_ADVICE["audio"]


def _comfy_like(class_name: str, **attributes) -> torch.nn.Module:
    """A module named as one of ComfyUI's diffusion model classes, with the attributes its families read."""
    module = type(class_name, (torch.nn.Module,), {})()
    for name, value in attributes.items():
        setattr(module, name, value)
    return module


def test_variants_sharing_a_comfyui_class_get_their_own_latent_units():
    """Flux 2 is ComfyUI's Flux class, HunyuanVideo 1.5 and HunyuanImage 2.1 its HunyuanVideo class and Wan 2.2
    5B its WanModel: each takes latents of another VAE (and patch), which the node's pixel range must be read in."""
    from types import SimpleNamespace

    def family(class_name, **attributes):
        return _blocks.family_of(_comfy_like(class_name, **attributes)).name

    assert family("Flux", params=SimpleNamespace(global_modulation=False), patch_size=2) == "flux"
    assert family("Flux", params=SimpleNamespace(global_modulation=True), patch_size=1) == "flux2"
    assert family("HunyuanVideo", patch_size=[1, 2, 2], out_channels=16) == "hunyuan-video"
    assert family("HunyuanVideo", patch_size=[1, 1, 1], out_channels=32) == "hunyuan-video15"
    assert family("HunyuanVideo", patch_size=[1, 1], out_channels=64) == "hunyuan-image21"
    assert family("WanModel", out_dim=16) == "wan" and family("WanModel", out_dim=48) == "wan22"
    assert _blocks.family_of(_comfy_like("UNetModel")) is None
    # one token per 16 pixels on each side for both Flux generations: the same 1024-pixel image, the same tokens
    flux, flux2 = _image.FluxFamily(), _image.Flux2Family()
    for f in (flux, flux2):
        r = f.geometry.block_range(_blocks.block_range(f, 64, 1024, 1, 1))
        assert r.tokens == (16, 4096), f.name
    image = _image.HunyuanImage21Family()
    r = _blocks.block_range(image, 64, 2048, 1, 81)
    assert r.spatial == (2, 64) and r.frames is None and image.geometry.tokens(Dims(1, 64, 64)) == 4096
    video15, wan22 = _video.HunyuanVideo15Family(), _video.Wan22Family()
    assert _blocks.block_range(video15, 64, 1280, 1, 121).spatial == (4, 80)
    # image-to-video joins 729 SigLIP tokens to a prompt of up to 1024
    assert _blocks.block_range(video15, 64, 1280, 1, 121).sequence == (1, 1024 + 729)
    assert _blocks.block_range(wan22, 64, 1280, 1, 121).sequence == (1, 1024)
    assert video15.geometry.tokens(Dims(1, 45, 80, frames=31)) == 31 * 45 * 80
    r = _blocks.block_range(wan22, 64, 1280, 1, 121)
    assert r.spatial == (4, 80) and r.frames == (1, 31)


class _Chunking(torch.nn.Module):
    """As Kandinsky 5's SelfAttention: a size branch between `_forward` and `_forward_chunked`."""

    def _forward(self, x):
        return x + 1

    def _forward_chunked(self, x):
        return torch.cat([c + 1 for c in x.chunk(2, dim=1)], dim=1)

    def forward(self, x):
        return self._forward_chunked(x) if x.shape[1] > 4 else self._forward(x)


class _Cross(_Chunking):
    """As Kandinsky 5's CrossAttention: inherits both paths, its own forward takes other inputs."""

    def forward(self, x, context):
        return x + context


def test_kandinsky_blocks_are_traced_on_the_one_piece_path_and_left_as_they_were():
    block = torch.nn.ModuleDict({"attention": _Chunking(), "cross": _Cross()})
    calls = []
    block["attention"]._forward_chunked = lambda x: calls.append("chunked") or x + 1
    with _video._one_piece(block):
        assert block["attention"](torch.zeros(1, 8)).sum() == 8 and calls == []  # one piece past the branch's size
        assert block["cross"](torch.zeros(1, 2), torch.ones(1, 2)).sum() == 2  # a layer with its own forward: as is
    block["attention"](torch.zeros(1, 8))
    assert calls == ["chunked"] and "forward" not in vars(block["attention"])
    assert _blocks.family_of(_comfy_like("Kandinsky5", patch_size=(1, 2, 2))).name == "kandinsky5"


def test_sd3_joint_blocks_positional_inputs_are_named_for_the_graph_and_passed_back_in_order():
    sd3 = _image.SD3Family()
    context, x, c = torch.zeros(1, 3, 4), torch.ones(1, 5, 4), torch.zeros(1, 4)
    args, kwargs = sd3.block_inputs((context, x), {"c": c, "use_checkpoint": False, "transformer_options": {}})
    assert args == () and list(kwargs) == ["context", "x", "c", "use_checkpoint"]
    seen = []

    class JointBlock(torch.nn.Module):
        def forward(self, *args, **kwargs):
            seen.append((args, sorted(kwargs)))
            return args

    sd3.block_forward(JointBlock(), **kwargs)
    (got_args, got_names), = seen
    assert got_args[0] is context and got_args[1] is x
    assert got_names == ["c", "transformer_options", "use_checkpoint"]


class _OffloadableLinear(torch.nn.Linear):
    """ComfyUI's castable layer as nodes/lowvram.py sees it (comfy.ops: weight_function, comfy_cast_weights)."""

    weight_function: list = []
    bias_function: list = []
    comfy_cast_weights = False


class _Norm(torch.nn.Module):
    """A module with a tensor of its own that is not one of ComfyUI's castable layers (Flux's RMSNorm)."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))


class LowVramPatch:
    """Duck-typed ComfyUI LowVramPatch: adds its delta to the weight it is given."""

    def __init__(self, delta: float):
        self.key, self.patches, self.delta = "k", {}, delta

    def __call__(self, weight):
        return weight + self.delta


def test_low_vram_layers_left_in_cpu_memory_are_moved_to_the_call_s_device_for_the_call():
    """A model ComfyUI loaded partly: layers it left in CPU memory (comfy_cast_weights) get their weights moved
    to the call's device for that call, patched there where a LoRA applies, under the graph's names; layers
    already there, and layers that are not ComfyUI's to move, are not. The meta device stands for the GPU."""
    lowvram = pack_module(PACK, "nodes.lowvram")
    prefix = pack_module(PACK, "compiler").MODULE_PREFIX
    block = torch.nn.Sequential(_OffloadableLinear(4, 4), _OffloadableLinear(4, 4), _OffloadableLinear(4, 4),
                                _OffloadableLinear(4, 4), _Norm(4), _Norm(4).to("meta"))
    block[0].comfy_cast_weights = True  # offloaded: moved in per call
    block[1].comfy_cast_weights = True
    block[1].weight_function = [LowVramPatch(1.0)]  # offloaded and patched
    block[2].to("meta")  # loaded: already where the call runs
    # block[3]: a castable layer in CPU memory that ComfyUI does not cast: left as it is (the serving check names it)
    # block[4]: not a castable layer, left in CPU memory (it did not fit): the model's code moves its scale in per
    # call (common_dit.rms_norm's cast_to), so it is moved; block[5] is already where the call runs
    weights = lowvram.LowVramWeights(torch.float32)
    unplaced, _ = weights.call_tensors(block, None)  # no device given: nothing moved, the patch applied
    assert sorted(unplaced) == [prefix + "1.weight"]
    tensors, transient = weights.call_tensors(block, torch.device("meta"))
    assert transient
    assert sorted(tensors) == [prefix + n for n in ("0.bias", "0.weight", "1.bias", "1.weight", "4.scale")]
    assert all(t.device.type == "meta" and t.dtype == torch.float32 for t in tensors.values())
    assert block[4].scale.device.type == "cpu"
    assert block[0].weight.device.type == "cpu"  # the stored weights stay where ComfyUI keeps them
    on_cpu, _ = weights.call_tensors(block, torch.device("cpu"))  # the patch alone, where nothing is away
    assert sorted(on_cpu) == [prefix + "1.weight"]
    assert torch.equal(on_cpu[prefix + "1.weight"], block[1].weight + 1.0)
