"""Tiny quantised transformers loaded as ComfyUI loads them, and a LoRA for them: the ComfyUI tests and the bench.

Run inside ComfyUI's Python with COMFYUI_PATH set (tests/comfyui/kf_quantised.py
and the bench's weights worker import it there). Importing this module imports
numpy and torch only; ComfyUI, ComfyUI-GGUF and `gguf` are imported by the
functions that use them, so `compiler/` still never imports ComfyUI.

GGUF: tiny Flux / Wan written as GGUF files and loaded through ComfyUI-GGUF.

The `gguf` package writes the files. It quantises Q8_0 itself but not the
K-quants (its `quants.quantize` raises NotImplementedError for Q4_K), so
`quantize_q4_k` here encodes Q4_K blocks (a plain min/scale fit, not
llama.cpp's search) and `check_q4_k` proves the bytes with gguf's own numpy
`dequantize`, which shares no code with ComfyUI-GGUF's torch one. Loading
uses ComfyUI-GGUF's own `gguf_sd_loader`, `GGMLOps` and `GGUFModelPatcher`
(what its UnetLoaderGGUF node does), with the model config given rather than
detected: ComfyUI's Flux detection fixes 24 heads of 128 channels, so a
tiny Flux cannot be detected from its weights.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from compiler.settings import GGUF_PATH, gguf_path as _gguf_path_setting

GGUF_ENV = GGUF_PATH.name
GGUF_PACKAGE = "comfyui_gguf_under_test"

# A Flux with widths every weight's rows quantise at (Q4_K: 256 values per block): 256 wide, 2 heads of 128
# (ComfyUI's Flux rope axes 16+56+56), 2 double and 2 single blocks.
FLUX_256 = {
    "image_model": "flux", "in_channels": 16, "out_channels": 16, "patch_size": 2, "vec_in_dim": 32,
    "context_in_dim": 32, "hidden_size": 256, "mlp_ratio": 4.0, "num_heads": 2, "depth": 2,
    "depth_single_blocks": 2, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "guidance_embed": True,
    "txt_ids_dims": [], "yak_mlp": False, "txt_norm": False,
}
WAN_256 = {
    "image_model": "wan2.1", "model_type": "t2v", "dim": 256, "out_dim": 16, "num_heads": 2, "ffn_dim": 512,
    "num_layers": 2, "patch_size": (1, 2, 2), "freq_dim": 256, "window_size": (-1, -1), "qk_norm": True,
    "cross_attn_norm": True, "eps": 1e-6, "in_dim": 16, "text_dim": 32,
}
CONFIGS = {"flux": ("Flux", FLUX_256), "wan": ("WAN21_T2V", WAN_256)}


def gguf_path() -> Optional[str]:
    """Where ComfyUI-GGUF is checked out ($KEEPFAST_GGUF_PATH), or None."""
    path = _gguf_path_setting()
    return path if path and os.path.isfile(os.path.join(path, "nodes.py")) else None


def import_gguf_nodes(path: str):
    """ComfyUI-GGUF imported as a package from `path` (as ComfyUI's loader would), without its node list."""
    if GGUF_PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(GGUF_PACKAGE, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        module = importlib.util.module_from_spec(spec)
        sys.modules[GGUF_PACKAGE] = module
        spec.loader.exec_module(module)
    return importlib.import_module(GGUF_PACKAGE + ".nodes")


# -- Q4_K encoding ----------------------------------------------------------------------------------------

def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    """float32 rows (last dim a multiple of 256) -> Q4_K bytes, 144 per 256 values (GGML's block_q4_K layout)."""
    n_rows, width = rows.shape
    blocks = rows.reshape(-1, 8, 32).astype(np.float32)  # (n_blocks, 8 sub-blocks, 32)
    n = blocks.shape[0]
    low = np.minimum(blocks.min(axis=2), 0.0)  # value = scale*q - min, q in 0..15, min >= 0
    high = blocks.max(axis=2)
    scale = np.maximum((high - low) / 15.0, 1e-12)
    minimum = -low
    d = np.maximum(scale.max(axis=1) / 63.0, 1e-12).astype(np.float16)
    dmin = np.maximum(minimum.max(axis=1) / 63.0, 1e-12).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    eff_scale = d.astype(np.float32)[:, None] * sc
    eff_min = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.round((blocks + eff_min[:, :, None]) / eff_scale[:, :, None]), 0, 15).astype(np.uint8)
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibble) and 2c+1 (high nibble)
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(n, 128)
    out = np.concatenate([d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8), scales, qs], axis=1)
    return out.reshape(n_rows, width // 256 * 144)


def quantise(array: np.ndarray, qtype) -> Tuple[np.ndarray, Any]:
    """(stored array, GGML type) of one tensor: 2-D weights whose rows split into the type's blocks are
    quantised, everything else stays F32 (as ComfyUI-GGUF's convert tool keeps 1-D tensors)."""
    import gguf

    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    if array.ndim != 2 or array.shape[-1] % block:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(array.astype(np.float32)), qtype
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def check_q4_k(seed: int = 0) -> float:
    """Worst relative error of `quantize_q4_k` read back by gguf's own numpy dequantize."""
    import gguf

    x = np.random.default_rng(seed).standard_normal((4, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    return float(np.abs(back - x).max() / np.abs(x).max())


def write_gguf(state: Dict[str, torch.Tensor], path: str, qtype_name: str, arch: str) -> Dict[str, int]:
    """Write a diffusion model's state dict as GGUF (`Q8_0`, `Q4_K`, ...); returns tensors per stored type."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    writer = gguf.GGUFWriter(path, arch)
    counts: Dict[str, int] = {}
    for name, tensor in state.items():
        stored, kind = quantise(tensor.detach().float().cpu().numpy(), qtype)
        writer.add_tensor(name, stored, raw_dtype=kind if kind != gguf.GGMLQuantizationType.F32 else None)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def build_float(name: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A tiny float32 model of `name`'s GGUF config with random weights: its diffusion model's state dict."""
    from .families import _init_rest
    from .models import _comfy, _init

    _comfy()
    import comfy.supported_models

    cls, config = CONFIGS[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({})
    _init(model.diffusion_model, seed)
    _init_rest(model.diffusion_model, seed)
    return {k: v.detach().clone() for k, v in model.diffusion_model.state_dict().items()}


def load_gguf(name: str, path: str, gguf_nodes, dtype: torch.dtype = torch.float32):
    """ComfyUI-GGUF's UnetLoaderGGUF.load_unet with the tiny config in place of detection: a GGUFModelPatcher."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    loader = sys.modules[GGUF_PACKAGE + ".loader"]
    ops = gguf_nodes.GGMLOps()
    ops.Linear.dequant_dtype = None
    ops.Linear.patch_dtype = None
    state = loader.gguf_sd_loader(path)
    cls, config = CONFIGS[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.set_inference_dtype(dtype, None)
    model_config.custom_operations = ops
    model = model_config.get_model(state, "")
    model = model.to(mm.unet_offload_device())
    model.load_model_weights(state, "")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device())
    return gguf_nodes.GGUFModelPatcher.clone(patcher)


# -- LoRA -----------------------------------------------------------------------------------------------------

LORA_RANK = 4


def lora_state(patcher, rank: int = LORA_RANK, seed: int = 11) -> Dict[str, torch.Tensor]:
    """A LoRA file's tensors (kohya names: lora_unet_<path>.lora_up/lora_down/alpha) for every Linear weight
    inside the transformer blocks: random, so on and off give visibly different outputs, with no file to
    download; what `comfy.sd.load_lora_for_models` takes."""
    generator = torch.Generator().manual_seed(seed)
    state: Dict[str, torch.Tensor] = {}
    model = patcher.model.diffusion_model
    for path, module in model.named_modules():
        # ComfyUI's mixed-precision Linear (fp8 scaled) is no torch.nn.Linear: a Linear is what has in_features
        if getattr(module, "in_features", None) is None or getattr(module, "weight", None) is None \
                or "blocks." not in path:
            continue
        out_features, in_features = tuple(module.weight.shape)
        name = "lora_unet_" + path.replace(".", "_")
        state[name + ".lora_up.weight"] = torch.randn(out_features, rank, generator=generator) * 0.1
        state[name + ".lora_down.weight"] = torch.randn(rank, in_features, generator=generator) * 0.1
        state[name + ".alpha"] = torch.tensor(float(rank))
    return state


# -- fp8 scaled ---------------------------------------------------------------------------------------------

def scaled_fp8_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A float state dict as an fp8-scaled checkpoint: every 2-D block weight float8_e4m3fn divided by its own
    per-tensor scale (`<layer>.scale_weight`), and the `scaled_fp8` marker (the layout ComfyUI converts with
    `comfy.utils.convert_old_quants`)."""
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".weight") and tensor.ndim == 2 and "blocks." in name:
            scale = (tensor.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
            out[name] = (tensor.float() / scale).to(torch.float8_e4m3fn)
            out[name[:-len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[name] = tensor
    out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    return out


def load_scaled_fp8(name: str, state: Dict[str, torch.Tensor]):
    """What `comfy.sd.load_diffusion_model_state_dict` does with an fp8-scaled checkpoint, the tiny config given
    in place of detection: old scale keys converted, mixed-precision ops, dtypes chosen as ComfyUI chooses."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models
    import comfy.utils

    sd, _metadata = comfy.utils.convert_old_quants(dict(state), "", metadata={})
    cls, config = CONFIGS[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.quant_config = comfy.utils.detect_layer_quantization(sd, "")
    load_device = mm.get_torch_device()
    unet_dtype = mm.unet_dtype(model_params=comfy.utils.calculate_parameters(sd),
                               supported_dtypes=list(model_config.supported_inference_dtypes), weight_dtype=None)
    manual_cast = mm.unet_manual_cast(None, load_device, model_config.supported_inference_dtypes)
    model_config.set_inference_dtype(unet_dtype, manual_cast)
    model = model_config.get_model(sd, "")
    model = model.to(mm.unet_offload_device())
    model.load_model_weights(sd, "")
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device, offload_device=mm.unet_offload_device())


def load_float(name: str, state: Dict[str, torch.Tensor]):
    """The same tiny model unquantised (float32), as comfy.sd loads a float checkpoint: a ModelPatcher."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    cls, config = CONFIGS[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model(state, "")
    model = model.to(mm.unet_offload_device())
    model.load_model_weights(dict(state), "")
    return comfy.model_patcher.ModelPatcher(model, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())
