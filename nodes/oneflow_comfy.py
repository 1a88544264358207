"""ComfyUI's own models (comfy.ldm UNetModel, AutoencoderKL, TAESD, ...) for the oneflow backend.

The compiler knows no ComfyUI (compiler/ never imports it); this module tells
its oneflow backend how to build OneFlow modules for ComfyUI's classes:

- a `FlowPackage` for `comfy`: a second copy of ComfyUI's `comfy` package,
  imported from the same files under `oneflow.mock_torch` and kept out of
  `sys.modules` (see compiler/backends/oneflow_support/isolation.py). It shares
  the parsed command line (`comfy.cli_args`, `comfy.options`) with the real
  one, sees `comfy_kitchen` as not installed (a torch-bound extension; the
  copy takes ComfyUI's own fallback), and imports a small stand-in for
  `comfy.model_management` (the real one queries CUDA, xformers and cuDNN at
  import through APIs OneFlow 0.9.0 lacks, and holds process state -- loaded
  models, the interrupt flag -- that must stay the real module's);
- a converter that copies the built torch module tree into that copy's
  classes (oneflow_support.clone). ComfyUI's `comfy.ops` layers become plain
  OneFlow layers: with weight casting off they compute exactly their torch
  base layer, and a layer ComfyUI casts or patches on the fly (low VRAM,
  manual_cast, fp8) is refused, because a graph reads the stored weights.

Registering imports neither oneflow nor the copy; both happen on the first
oneflow compile.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import logging
import os
import sys
import types
from typing import Dict, Iterator, Optional

import torch

from ..compiler import (CloneRefused, ConversionError, FlowPackage, clone_module, flow_attention, flow_copies,
                        flow_copy_missing, flow_dtype, register_converter, register_flow_package)

log = logging.getLogger("keepfast")

ROOT = "comfy"
_OPS_MODULE = "comfy.ops"
# The real ComfyUI modules whose state the copy shares.
SHARED = ("comfy.cli_args", "comfy.options")


def model_management_stand_in(real: types.ModuleType) -> types.ModuleType:
    """What the OneFlow copy of comfy.ldm reads from comfy.model_management, and no more.

    Attention: the copy always takes ComfyUI's "pytorch" attention path, which
    calls comfy.ops.scaled_dot_product_attention (set to OneFlow's in
    `_prepare_copy`), never xformers, sage or flash attention (torch
    extensions). Weight casting and offload streams raise: their callers are
    the cast paths, which the converter refuses.
    """
    stand_in = types.ModuleType("comfy.model_management")
    stand_in.__file__ = __file__
    stand_in.__doc__ = "KeepFast's stand-in for comfy.model_management inside the OneFlow copy of comfy"
    stand_in.WINDOWS = False  # skips comfy.ops' torch.nn.attention priority block
    stand_in.torch_version_numeric = (0, 0)
    stand_in.OOM_EXCEPTION = MemoryError
    for name in ("is_nvidia", "xformers_enabled", "xformers_enabled_vae", "sage_attention_enabled",
                 "flash_attention_enabled"):
        setattr(stand_in, name, lambda *args, **kwargs: False)
    stand_in.pytorch_attention_enabled = lambda: True
    stand_in.pytorch_attention_enabled_vae = lambda: True

    def force_upcast_attention_dtype():
        upcast = real.force_upcast_attention_dtype() if real is not None else None
        return None if upcast is None else {flow_dtype(k): flow_dtype(v) for k, v in upcast.items()}

    stand_in.force_upcast_attention_dtype = force_upcast_attention_dtype
    if real is not None:
        stand_in.throw_exception_if_processing_interrupted = real.throw_exception_if_processing_interrupted
    else:
        stand_in.throw_exception_if_processing_interrupted = lambda: None
    stand_in.soft_empty_cache = lambda force=False: None
    stand_in.get_free_memory = lambda dev=None, torch_free_too=False: (1 << 40, 1 << 40) if torch_free_too else 1 << 40

    def refused(name):
        def fn(*args, **kwargs):
            raise RuntimeError(f"comfy.model_management.{name} is not available to the OneFlow copy of comfy "
                               "(weights cast or offloaded on the fly cannot be compiled)")
        return fn

    for name in ("cast_to", "device_supports_non_blocking", "current_stream", "get_offload_stream", "sync_stream",
                 "supports_fp8_compute", "supports_nvfp4_compute"):
        setattr(stand_in, name, refused(name))

    def __getattr__(name):
        raise AttributeError(f"comfy.model_management.{name} is not provided to the OneFlow copy of comfy")

    stand_in.__getattr__ = __getattr__
    return stand_in


def _stand_ins(real: Dict[str, types.ModuleType]) -> Dict[str, types.ModuleType]:
    return {"comfy.model_management": model_management_stand_in(real.get("comfy.model_management"))}


PACKAGE = FlowPackage(
    root=ROOT, shared=SHARED, stand_ins=_stand_ins, blocked=("comfy_kitchen",),
    preload=("einops", "psutil", "numpy", "PIL.Image", "safetensors", "safetensors.torch"),
)


def _proxy_aware_isinstance():
    """isinstance that sees through nn.Graph's module proxies.

    Inside a graph a submodule is a ProxyModule, not an instance of its class,
    so ComfyUI's `isinstance(layer, TimestepBlock)` dispatch (openaimodel's
    forward_timestep_embed) would take the wrong branch. Installed as a global
    of the copy's modules only; the real ComfyUI is untouched.
    """
    from oneflow.nn.graph.proxy import Proxy

    plain = builtins.isinstance

    def isinstance(obj, classes):  # noqa: A001 - shadows the builtin in the copy on purpose
        if plain(obj, Proxy):
            origin = obj.__dict__.get("_oneflow_internal_origin__")
            if origin is not None and plain(origin, classes):
                return True
        return plain(obj, classes)

    return isinstance


def _prepare_copy() -> None:
    """Inside active(): OneFlow's attention for the copy's ops, proxy-aware isinstance in its modules."""
    ops = importlib.import_module(_OPS_MODULE)
    ops.scaled_dot_product_attention = flow_attention
    for module_name in ("comfy.ldm.modules.diffusionmodules.openaimodel", "comfy.ldm.modules.attention",
                        "comfy.ldm.modules.diffusionmodules.model"):
        importlib.import_module(module_name)
    checker = _proxy_aware_isinstance()
    for name, module in list(sys.modules.items()):
        if module is not None and PACKAGE.owns(name) and name not in SHARED and name != "comfy.model_management":
            module.__dict__["isinstance"] = checker


def _weights_cast_on_the_fly(module: torch.nn.Module) -> Optional[str]:
    if getattr(module, "comfy_cast_weights", False):
        return (f"ComfyUI casts this {type(module).__name__}'s weights on the fly (low VRAM, or weights stored in "
                "another dtype than the model computes in); a OneFlow graph reads the stored weights")
    if getattr(module, "weight_function", None) or getattr(module, "bias_function", None):
        return (f"ComfyUI patches this {type(module).__name__}'s weights on the fly (a LoRA in low-VRAM mode); "
                "a OneFlow graph reads the stored weights")
    return None


def _is_comfy_ops_layer(cls: type) -> bool:
    return cls.__module__ == _OPS_MODULE


class _CopyImportLogs(logging.Filter):
    """The copy's import-time messages ("Failed to import comfy_kitchen", "old pytorch version")
    describe the OneFlow copy, not the user's ComfyUI: kept at debug level on KeepFast's logger."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.pathname).startswith(self.folder):
            return True
        log.debug("OneFlow copy of comfy: %s", record.getMessage())
        return False


@contextlib.contextmanager
def _copy_logs_to_debug() -> Iterator[None]:
    real = sys.modules.get(ROOT)
    folder = next(iter(getattr(real, "__path__", None) or []), "")  # comfy may be a namespace package
    if not folder:
        yield
        return
    quiet = _CopyImportLogs(folder + os.sep)
    root_logger = logging.getLogger()
    root_logger.addFilter(quiet)
    try:
        yield
    finally:
        root_logger.removeFilter(quiet)


class ComfyConverter:
    """The oneflow backend's converter for modules of ComfyUI's `comfy` package."""

    name = "ComfyUI models"

    def claims(self, module: torch.nn.Module) -> bool:
        return PACKAGE.owns(type(module).__module__ or "")

    def build(self, module: torch.nn.Module):
        try:
            with _copy_logs_to_debug(), flow_copies() as roots:
                if ROOT not in roots:
                    raise ImportError(flow_copy_missing(ROOT))
                _prepare_copy()
                return clone_module(module, ROOT, refuse=_weights_cast_on_the_fly,
                                          plain_layer=_is_comfy_ops_layer, path=type(module).__name__)
        except CloneRefused as error:
            raise ConversionError(f"{type(module).__name__} cannot run on OneFlow: {error}") from None
        except ImportError as error:
            raise ConversionError(f"ComfyUI's comfy package does not import under OneFlow: {error}") from error


def register() -> None:
    """Make the oneflow backend build ComfyUI's models (idempotent; imports nothing heavy)."""
    register_flow_package(PACKAGE)
    register_converter(ComfyConverter())
