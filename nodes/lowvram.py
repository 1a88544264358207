"""Blocks ComfyUI patches or moves in per call in low-VRAM mode, served by their graph with those weights bound.

When ComfyUI loads a model partly (low-VRAM mode), a layer it did not load
gets `weight_function = [LowVramPatch(key, patches)]`: every call casts the
weight to the compute dtype, copies it, and applies the LoRA with
`calculate_weight` (comfy/ops.py `cast_bias_weight`). The block's graph
computes with whatever weight is bound, so the same is done here before the
call: the patched weight, computed exactly as ComfyUI computes it, is bound
in place of the stored one for that call only and released after it
(`compiler/blocks/quantised.py`, `call_tensors`). One graph, 0 compiles, at
any LoRA strength.

A layer whose weights ComfyUI left in CPU memory (the model did not fit:
`comfy_cast_weights`, weights moved to the GPU on every call) is served the
same way: its weights are moved to the call's device for that call and bound,
as ComfyUI's own cast does, then released; the graph is traced from a block
whose weights all sit where the calls run (compiler/blocks/server.py). So are
the tensors of a module that is not one of ComfyUI's castable layers, left in
CPU memory because it did not fit (comfy/model_patcher.py `load` moves such a
module only where it fits, and the model's code moves its tensors in per call:
Flux's QK-norm scale through `common_dit.rms_norm`'s `cast_to`). On the H200
(2026-11-28) Flux's blocks ran eager under partial loading for want of this
("its tensor img_attn.norm.key_norm.scale is on cpu").

Eager, with the reason: a weight function that is not ComfyUI's LowVramPatch
(Python the pack does not know), and a patched weight stored in another dtype
than the model computes in (fp8 weights computing in bfloat16, an fp8-scaled
QuantizedTensor): the graph binds stored weights and casts them itself, and a
patched weight in the compute dtype is another graph input.
"""

from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import torch

from ..compiler import MODULE_PREFIX, CallTensors, dtype_name, subclass_parts

PATCHED_ON_THE_FLY = ("its weights are patched on the fly (the model is only partly loaded: low-VRAM mode "
                      "applies LoRA per call)")


def is_low_vram_patch(function: Any) -> bool:
    """ComfyUI's `comfy.model_patcher.LowVramPatch` (duck-typed: a key and the patcher's patch dict)."""
    return type(function).__name__ == "LowVramPatch" and hasattr(function, "patches") and hasattr(function, "key")


def _functions(layer: torch.nn.Module) -> List[Tuple[str, list]]:
    return [(name, list(getattr(layer, f"{name}_function", None) or ())) for name in ("weight", "bias")]


class LowVramWeights:
    """Per-call patched weights of a model's low-VRAM layers; `dtype` is what the model computes in."""

    def __init__(self, dtype: Optional[torch.dtype]):
        self.dtype = dtype
        self._layers: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        self._plain: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()

    def plain_tensors(self, module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
        """(the graph's name, the holder, its attribute) of every tensor in `module` held by a module that is not one
        of ComfyUI's castable layers (an RMSNorm's scale), found once per module."""
        found = self._plain.get(module)
        if found is None:
            found = self._plain[module] = [
                (MODULE_PREFIX + (f"{path}." if path else "") + name, sub, name)
                for path, sub in module.named_modules() if not hasattr(sub, "weight_function")
                for name in (*sub._parameters, *sub._buffers)]
        return found

    def layers(self, module: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
        """ComfyUI's castable layers in `module` (they carry weight_function), found once per module."""
        found = self._layers.get(module)
        if found is None:
            found = self._layers[module] = [(path, sub) for path, sub in module.named_modules()
                                            if hasattr(sub, "weight_function")]
        return found

    def reason(self, module: torch.nn.Module) -> Optional[str]:
        """Why this call's per-call weight patches cannot be bound, or None (none, or all bindable)."""
        for path, layer in self.layers(module):
            for name, functions in _functions(layer):
                if not functions:
                    continue
                if not all(is_low_vram_patch(f) for f in functions):
                    return PATCHED_ON_THE_FLY
                stored = layer._parameters.get(name)
                if stored is None:
                    continue
                if subclass_parts(stored) is not None:
                    return (f"low-VRAM mode patches {path}.{name} per call, which is stored as a "
                            f"{type(stored).__name__} (the graph binds its stored parts, not a patched weight)")
                if self.dtype is not None and stored.dtype != self.dtype:
                    return (f"low-VRAM mode patches {path}.{name} per call, stored as {dtype_name(stored.dtype)} "
                            f"and computed in {dtype_name(self.dtype)} (the graph casts stored weights itself)")
        return None

    def call_tensors(self, module: torch.nn.Module,
                     device: Optional[torch.device] = None) -> Optional[CallTensors]:
        """The weights for a call on `device` that are not the stored ones, under the names the graph binds the
        stored ones by: the patched ones, and those of layers ComfyUI left in CPU memory (a model loaded partly:
        `comfy_cast_weights` layers it moves in on every call), moved in for this call only."""
        tensors = {}
        for path, layer in self.layers(module):
            for name, functions in _functions(layer):
                stored = layer._parameters.get(name)
                if stored is None:
                    continue
                away = (device is not None and stored.device != device and getattr(layer, "comfy_cast_weights", False)
                        and subclass_parts(stored) is None)  # a subclass is bound by its parts: it stays, and eager
                if not functions and not away:
                    continue
                # as comfy.ops.cast_bias_weight does: moved to the call's device (without waiting where the memory is
                # pinned: the copy is ordered before the graph on the stream), cast, then patched there
                value = stored.to(device=device if away else stored.device,
                                  dtype=(self.dtype or stored.dtype) if functions else stored.dtype,
                                  non_blocking=away, copy=True)
                for function in functions:
                    value = function(value)
                tensors[MODULE_PREFIX + (f"{path}." if path else "") + name] = value
        if device is not None and device.type != "cpu":
            for key, holder, name in self.plain_tensors(module):
                stored = getattr(holder, name, None)
                if stored is None or stored.device.type != "cpu" or subclass_parts(stored) is not None:
                    continue  # only what a partial load left in CPU memory
                # as the model's own code does with it (comfy.model_management.cast_to): a copy on the call's
                # device, its dtype kept
                tensors[key] = stored.to(device=device, copy=True)
        return (tensors, True) if tensors else None
