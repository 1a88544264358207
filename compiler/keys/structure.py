"""The model structure hash: what makes two modules able to share one graph.

It covers the architecture and nothing of the weights' values: every
submodule's class, its scalar settings (head counts, epsilons, strides, ...)
and each parameter's and buffer's name and shape. Two checkpoints of one
architecture hash the same, so a graph compiled (or loaded) for one serves the
other with its own weights bound. Dtype and device are separate key fields.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

import torch

# Attributes that change while a model runs or is managed, not its graph.
_VOLATILE_ATTRIBUTES = frozenset(
    {"training", "dump_patches", "call_super_init", "comfy_cast_weights", "weight_function",
     "bias_function", "gradient_checkpointing", "current_patcher", "device", "dtype",
     "manual_cast_dtype", "parameters_manual_cast_dtype", "offload_device",
     "load_device", "model_loaded_weight_memory", "lowvram_patch_counter",
     "comfy_patched_weights", "prev_comfy_cast_weights", "comfy_force_cast_weights",
     "model_lowvram", "current_weight_patches_uuid"}
)
_SCALARS = (bool, int, float, str, type(None))


def _scalar_view(value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(item, _SCALARS) for item in value):
        return list(value)
    return _OMIT


_OMIT = object()


def _module_settings(module: torch.nn.Module, ignored: frozenset = frozenset()) -> dict:
    settings = {}
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name in _VOLATILE_ATTRIBUTES or name in ignored:
            continue
        view = _scalar_view(value)
        if view is not _OMIT:
            settings[name] = view
    return settings


def _config_view(module: torch.nn.Module) -> Any:
    """diffusers models carry their full architecture in `config`."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "items"):
        return None
    view = {}
    for key, value in sorted(config.items()):
        if key.startswith("_"):
            continue
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        view[key] = value
    return view


def describe_structure(module: torch.nn.Module, ignored: frozenset = frozenset()) -> dict:
    """`ignored`: settings a caller knows the forward never reads (a block's position in its stack,
    such as Lumina's `layer_id`); left in, they would make every block of a stack a structure of its own."""
    modules = []
    for path, sub in module.named_modules():
        cls = type(sub)
        modules.append([path, f"{cls.__module__}.{cls.__qualname__}", _module_settings(sub, ignored)])
    tensors = [[name, list(t.shape)] for name, t in _named_tensors(module)]
    return {"config": _config_view(module), "modules": modules, "tensors": tensors}


def _named_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def structure_hash(module: torch.nn.Module, ignored: frozenset = frozenset()) -> str:
    text = json.dumps(describe_structure(module, ignored), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def architecture_name(module: torch.nn.Module) -> str:
    return type(module).__name__


def module_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype the module computes in: that of its first floating parameter."""
    for tensor in module.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def module_device(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")
