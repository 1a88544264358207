"""Build tiny models ComfyUI's own loaders accept, with random weights: for the tests and the benchmark.

A script, run inside ComfyUI's Python with COMFYUI_PATH set (the ComfyUI
tests and the bench start it as a subprocess). Importing this module imports
torch only: ComfyUI's classes are imported by the functions that build with
them, so `compiler/` still never imports ComfyUI.

    python benchmarks/comfy/models.py checkpoint OUT.safetensors [--seed N]
    python benchmarks/comfy/models.py lora CHECKPOINT OUT.safetensors [--seed N]
    python benchmarks/comfy/models.py controlnet OUT.safetensors [--seed N]
    python benchmarks/comfy/models.py image OUT.png [--size 512] [--seed N]
    python benchmarks/comfy/models.py vae OUT.safetensors --kind kl16|wan21|hunyuan-video|ltxv [--seed N]
    python benchmarks/comfy/models.py family-lora OUT.safetensors --family FAMILY [--seed N]

Everything is built from ComfyUI's classes so their loaders detect it:
- checkpoint: SD1.5 layout (detected as SD15: 320 model channels, context 768,
  conv proj_in, no adm), a UNet with channel_mult [1] and one res block (13.6M
  parameters), the full CLIP-L text encoder stored as float8 (it dominates the
  file), and a TAESD VAE whose last conv is rescaled so decoded images are
  mid-grey with visible structure, not black.
- lora: kohya-format LoRA over the UNet's attention, feed-forward and 1x1
  projection weights.
- controlnet: a ControlNet of the same tiny UNet layout (ldm keys).
Nothing generated is ever committed: the tests write into temporary folders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from typing import Optional

import torch

UNET_CONFIG = {
    "image_size": 32, "in_channels": 4, "out_channels": 4, "model_channels": 320, "num_res_blocks": [1],
    "channel_mult": [1], "transformer_depth": [1], "transformer_depth_output": [0, 0],
    "transformer_depth_middle": -2, "use_spatial_transformer": True, "context_dim": 768,
    "use_linear_in_transformer": False, "num_heads": 8, "num_head_channels": -1, "legacy": False,
    "adm_in_channels": None, "use_temporal_resblock": False, "use_temporal_attention": False,
}
_INIT_TYPES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.GroupNorm,
               torch.nn.LayerNorm, torch.nn.Embedding)
_LORA_SUFFIXES = (
    ".attn1.to_q.weight", ".attn1.to_k.weight", ".attn1.to_v.weight", ".attn1.to_out.0.weight",
    ".attn2.to_q.weight", ".attn2.to_k.weight", ".attn2.to_v.weight", ".attn2.to_out.0.weight",
    ".ff.net.0.proj.weight", ".ff.net.2.weight", ".proj_in.weight", ".proj_out.weight",
)


def _comfy(gpu: bool = False):
    """ComfyUI importable, on the CPU unless `gpu` (ComfyUI reads --cpu once, when comfy.model_management is
    first imported: after that the device it chose stays)."""
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        sys.exit("COMFYUI_PATH is not set")
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.cli_args

    if "comfy.model_management" not in sys.modules:
        comfy.cli_args.args.cpu = not gpu
    import comfy.ops  # noqa: F401


_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _init(module: torch.nn.Module, seed: int) -> None:
    """ComfyUI's ops skip weight init (torch.empty); run torch's own init per layer.

    torch's init does not draw float8 numbers: such a layer is initialised in float32 and cast back.
    """
    torch.manual_seed(seed)
    for sub in module.modules():
        for base in _INIT_TYPES:
            if isinstance(sub, base):
                stored = {p.dtype for p in sub.parameters(recurse=False)}
                float8 = next((d for d in stored if d in _FLOAT8), None)
                if float8 is not None:
                    sub.float()
                base.reset_parameters(sub)
                if float8 is not None:
                    sub.to(float8)
                break


def _save(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt", **(metadata or {})})


def checkpoint(path: str, seed: int = 0) -> None:
    _comfy()
    import copy

    import comfy.ops
    import comfy.sd1_clip
    import comfy.taesd.taesd
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    state = {}
    unet = UNetModel(dtype=torch.float32, device="cpu", operations=comfy.ops.disable_weight_init, **UNET_CONFIG)
    _init(unet, seed)
    state.update({"model.diffusion_model." + k: v.half() for k, v in unet.state_dict().items()})
    del unet

    text = comfy.sd1_clip.SDClipModel(device="cpu", dtype=torch.float32)
    _init(text, seed + 1)
    for key, value in text.state_dict().items():
        if key.startswith("transformer."):
            if value.is_floating_point():
                value = value.to(torch.float8_e4m3fn if value.ndim >= 2 else torch.float16)
            state["cond_stage_model." + key] = value
    del text

    vae = comfy.taesd.taesd.TAESD(latent_channels=4)
    _init(vae, seed + 2)
    with torch.no_grad():
        probe = copy.deepcopy(vae.taesd_decoder).double()
        generator = torch.Generator().manual_seed(seed)
        raw = probe(torch.randn((1, 4, 8, 8), generator=generator, dtype=torch.float64))
        factor = float("%.3g" % (0.2 / max(raw.std().item(), 1e-6)))
        last = vae.taesd_decoder[-1]
        last.weight.mul_(factor)
        last.bias.fill_(0.5)
    state.update({"first_stage_model." + k: v.float() for k, v in vae.state_dict().items()})
    _save(state, path)


def lora(checkpoint_path: str, path: str, seed: int = 123, rank: int = 4, magnitude: float = 0.5) -> None:
    _comfy()
    import comfy.model_detection
    import comfy.utils
    from safetensors import safe_open

    with safe_open(checkpoint_path, "pt") as handle:
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    config = comfy.model_detection.detect_unet_config(meta, "model.diffusion_model.")
    mapping = comfy.utils.unet_to_diffusers(config)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for diffusers_key in sorted(mapping):
        if not diffusers_key.endswith(_LORA_SUFFIXES):
            continue
        key = "model.diffusion_model." + mapping[diffusers_key]
        if key not in shapes:
            continue
        shape = shapes[key]
        out_features, in_features = shape[0], shape[1]
        std = math.sqrt(magnitude / (math.sqrt(in_features) * math.sqrt(rank)))
        up = torch.randn((out_features, rank), generator=generator) * std
        down = torch.randn((rank, in_features), generator=generator) * std
        if len(shape) == 4:
            up, down = up.reshape(out_features, rank, 1, 1), down.reshape(rank, in_features, 1, 1)
        base = "lora_unet_" + diffusers_key[: -len(".weight")].replace(".", "_")
        out[base + ".lora_up.weight"] = up.half()
        out[base + ".lora_down.weight"] = down.half()
        out[base + ".alpha"] = torch.tensor(float(rank))
    if not out:
        raise SystemExit("no LoRA target found in " + checkpoint_path)
    _save(out, path)


def family_lora(family: str, path: str, seed: int = 123, rank: int = 4, magnitude: float = 0.5) -> None:
    """A LoRA for a tiny family of comfy_families (the layout ComfyUI loads for DiTs: diffusion_model.<layer>
    .lora_A/.lora_B), on every 2-D Linear weight of its repeated blocks."""
    _comfy()
    if __package__:
        from .families import build
    else:  # run as a script (the tests' way): the repository's package
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from benchmarks.comfy.families import build

    model = build(family).patcher.model.diffusion_model
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or not any(part.isdigit() for part in name.split(".")):
            continue
        out_features, in_features = module.weight.shape
        std = math.sqrt(magnitude / (math.sqrt(in_features) * math.sqrt(rank)))
        out[f"diffusion_model.{name}.lora_B.weight"] = (torch.randn((out_features, rank), generator=generator)
                                                        * std).half()
        out[f"diffusion_model.{name}.lora_A.weight"] = (torch.randn((rank, in_features), generator=generator)
                                                        * std).half()
    if not out:
        raise SystemExit(f"no LoRA target found in the tiny {family}")
    _save(out, path)


def controlnet(path: str, seed: int = 5) -> None:
    _comfy()
    import comfy.cldm.cldm
    import comfy.ops

    config = {k: v for k, v in UNET_CONFIG.items() if k not in ("out_channels", "transformer_depth_output")}
    model = comfy.cldm.cldm.ControlNet(hint_channels=3, dtype=torch.float32, device="cpu",
                                       operations=comfy.ops.disable_weight_init, **config)
    _init(model, seed)
    _save({k: v.half() for k, v in model.state_dict().items()}, path)


def image(path: str, size: int = 512, seed: int = 7) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + 1), np.cos(5 * y), np.sin(4 * (x + y))], axis=-1) * 0.35 + 0.5
    pixels = np.clip(base + rng.normal(0, 0.05, base.shape), 0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray((pixels * 255).astype(np.uint8)).save(path)


VAE_KINDS = ("kl16", "flux2", "wan21", "hunyuan-video", "ltxv")
# LTXV's video VAE as ComfyUI builds it from a file's "config" metadata: its widths are fixed (128 base channels),
# its depth is not: one res layer per level and the three 2x compressions ComfyUI's 8x/32x ratios assume.
LTXV_VAE_CONFIG = {
    "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "blocks": [["res_x", 1], ["compress_all", 1], ["compress_all", 1], ["compress_all", 1], ["res_x", 1]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False,
}


def vae(path: str, kind: str, seed: int = 0) -> None:
    """A VAE file ComfyUI's VAELoader detects, random weights.

    kl16: the 16-channel KL autoencoder of Flux, SD3 and Z-Image ("ae.safetensors"); ComfyUI fixes its
    widths (128 base channels, 84 M parameters), so it is full size. flux2: Flux 2's, the same autoencoder with 32
    channels and a batch-normalised latent packed 2x2 (128 channels at 1/16), full size for the same reason. wan21: Wan 2.1's causal video VAE
    (also Qwen-Image's), whose base width ComfyUI reads from the file: 8 channels here. hunyuan-video:
    HunyuanVideo's causal 3-D KL autoencoder (ComfyUI fixes its widths: full size). ltxv: LTX-Video's, its
    depth cut through the config ComfyUI reads from the file's metadata (LTXV_VAE_CONFIG).
    """
    _comfy()
    if kind == "kl16":
        from comfy.ldm.models.autoencoder import AutoencodingEngine

        params = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                  "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
        model = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": params},
            decoder_config={"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": params})
        _init(model, seed)
    elif kind == "flux2":
        from comfy.ldm.models.autoencoder import AutoencoderKL

        params = {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                  "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                  "batch_norm_latent": True}
        model = AutoencoderKL(ddconfig=params, embed_dim=32)
        _init(model, seed)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # the latent statistics ComfyUI reads for the packed latent
            model.bn.running_mean.copy_(torch.randn(model.bn.running_mean.shape, generator=generator) * 0.1)
            model.bn.running_var.copy_(torch.rand(model.bn.running_var.shape, generator=generator) + 0.5)
    elif kind == "wan21":
        from comfy.ldm.wan.vae import WanVAE

        torch.manual_seed(seed)
        model = WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                       temperal_downsample=[False, True, True])
        with torch.no_grad():
            for parameter in model.parameters():  # random weights with outputs of a useful size
                parameter.normal_(0.0, 0.05)
    elif kind == "hunyuan-video":
        from comfy.ldm.models.autoencoder import AutoencoderKL

        params = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                  "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                  "conv3d": True, "time_compress": 4}
        model = AutoencoderKL(ddconfig=params, embed_dim=16)
        _init(model, seed)
    elif kind == "ltxv":
        from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

        torch.manual_seed(seed)
        model = VideoVAE(config=LTXV_VAE_CONFIG)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.02)
            for name, buffer in model.named_buffers():  # the latents' per-channel statistics
                buffer.fill_(1.0 if "std" in name else 0.0)
        _save({k: v.float() for k, v in model.state_dict().items()}, path,
              metadata={"config": json.dumps({"vae": LTXV_VAE_CONFIG})})
        return
    else:
        raise ValueError("unknown VAE kind %r; known: %s" % (kind, ", ".join(VAE_KINDS)))
    _save({k: v.float() for k, v in model.state_dict().items()}, path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("checkpoint")
    p.add_argument("path")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("lora")
    p.add_argument("checkpoint")
    p.add_argument("path")
    p.add_argument("--seed", type=int, default=123)
    p = sub.add_parser("controlnet")
    p.add_argument("path")
    p.add_argument("--seed", type=int, default=5)
    p = sub.add_parser("family-lora")
    p.add_argument("path")
    p.add_argument("--family", required=True)
    p.add_argument("--seed", type=int, default=123)
    p = sub.add_parser("vae")
    p.add_argument("path")
    p.add_argument("--kind", choices=VAE_KINDS, required=True)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("image")
    p.add_argument("path")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    if args.what == "checkpoint":
        checkpoint(args.path, args.seed)
    elif args.what == "lora":
        lora(args.checkpoint, args.path, args.seed)
    elif args.what == "controlnet":
        controlnet(args.path, args.seed)
    elif args.what == "family-lora":
        family_lora(args.family, args.path, args.seed)
    elif args.what == "vae":
        vae(args.path, args.kind, args.seed)
    else:
        image(args.path, args.size, args.seed)


if __name__ == "__main__":
    main()
