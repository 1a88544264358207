"""ComfyUI-GGUF's quantised layers inside block graphs: dequantised in the graph from the bytes bound per call.

ComfyUI-GGUF (city96) loads a GGUF checkpoint into `GGMLOps` layers whose
weights are `GGMLTensor`s: the file's bytes as uint8 (Q8_0, Q4_K, ...) or
plain F32/F16 values, with the GGML type and logical shape as Python
attributes. Each call dequantises them (`GGMLLayer.get_weight`) and applies
the LoRA patches the model patcher hung on the weight (`weight.patches`).

A traced graph cannot read Python attributes of a weight: torch.export sees
a uint8 tensor of the stored shape and the layer's own forward would take
its unquantised branch (measured: `torch.export failed: a and b must have
same reduction dim, [s79, 256] X [144, 768]`, every Flux block eager). So,
while a block is traced (`GGUFWeights.tracing`, entered around
torch.export only), every quantised Linear computes
`linear(x, dequantize(bytes) + delta, bias)` with ComfyUI-GGUF's own
`dequantize` and the type and shape read from the real weight beforehand;
the bytes stay what is bound per call, so one graph per block structure and
quantisation type serves every block of it (`storage_key` puts the types in
the structure key). `delta` is a graph weight of the layer's logical shape:
zeros shared by every layer of that shape while no patch is applied, the
patches' sum (ComfyUI's `calculate_weight` on zeros: the very term ComfyUI-GGUF
adds after dequantising) while one is, computed per call and released after
it. So LoRA on, off and at any strength is one graph and no compile.

What a graph cannot do runs eager per block with the reason: a GGML type
ComfyUI-GGUF dequantises through numpy, a quantised layer that is no Linear,
a patch that is not a weight delta (DoRA, `set`, a `strength_model` other
than 1).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..compiler import MODULE_PREFIX, CallTensors, StoredWeights

DELTA = "keepfast_delta"  # the graph weight of a quantised Linear's patch sum (`m.<path>.keepfast_delta`)


def is_ggml_layer(module: torch.nn.Module) -> bool:
    """A ComfyUI-GGUF `GGMLLayer` (duck-typed: the pack never imports ComfyUI-GGUF)."""
    cls = type(module)
    return hasattr(cls, "is_ggml_quantized") and hasattr(cls, "get_weight") and hasattr(cls, "dequant_dtype")


def ggml_type(tensor: Optional[torch.Tensor]) -> Any:
    return getattr(tensor, "tensor_type", None) if tensor is not None else None


def _type_name(qtype: Any) -> str:
    return getattr(qtype, "name", repr(qtype))


def dequant_module(layer: torch.nn.Module):
    """ComfyUI-GGUF's `dequant` module, beside the `ops` module that defines the layer's class."""
    package = type(layer).__module__.rpartition(".")[0]
    return sys.modules.get(f"{package}.dequant")


def _quantised(layer: torch.nn.Module, name: str) -> bool:
    tensor = layer._parameters.get(name)
    qtype = ggml_type(tensor)
    if qtype is None:
        return False
    dequant = dequant_module(layer)
    compatible = getattr(dequant, "TORCH_COMPATIBLE_QTYPES", ()) if dequant is not None else ()
    return qtype not in compatible and _type_name(qtype) not in ("F32", "F16")


def ggml_layers(block: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    return [(path, sub) for path, sub in block.named_modules() if is_ggml_layer(sub)]


def quantised_linears(block: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The GGML Linear layers of `block` whose weight is quantised: the ones that get a delta."""
    return [(path, sub) for path, sub in ggml_layers(block)
            if isinstance(sub, torch.nn.Linear) and _quantised(sub, "weight")]


def _dequantize(tensor: torch.Tensor, qtype: Any, shape: Tuple[int, ...], dequant, dtype: torch.dtype,
                dequant_dtype: Any) -> torch.Tensor:
    """What ComfyUI-GGUF's `dequantize_tensor` computes, on the plain bytes a graph sees (no attributes)."""
    if qtype is None or qtype in dequant.TORCH_COMPATIBLE_QTYPES:
        return tensor.to(dtype)
    inner = dtype if dequant_dtype == "target" else dequant_dtype
    return dequant.dequantize(tensor, qtype, torch.Size(shape), dtype=inner).to(dtype)


def _traced_linear(layer: torch.nn.Module, kinds: Dict[str, Tuple[Any, Tuple[int, ...]]], dequant,
                   x: torch.Tensor) -> torch.Tensor:
    """A quantised GGML Linear while traced: ComfyUI-GGUF's forward_ggml_cast_weights with the delta added
    where its get_weight applies the patches."""
    dtype = x.dtype
    qtype, shape = kinds["weight"]
    weight = _dequantize(layer.weight, qtype, shape, dequant, dtype, layer.dequant_dtype)
    weight = weight + getattr(layer, DELTA).to(dtype)
    bias = None
    if layer.bias is not None:
        qtype, shape = kinds.get("bias", (None, tuple(layer.bias.shape)))
        bias = _dequantize(layer.bias, qtype, shape, dequant, dtype, layer.dequant_dtype)
    return torch.nn.functional.linear(x, weight, bias)


# -- patches -------------------------------------------------------------------------------------------

def _patch_reason(entry: Any) -> Optional[str]:
    """None when one ComfyUI patch entry (strength, adapter, strength_model, offset, function) adds a
    delta to the weight, else what it does instead."""
    try:
        strength_model, adapter = entry[2], entry[1]
    except (TypeError, IndexError):
        return f"a patch entry of an unknown form ({type(entry).__name__})"
    if strength_model != 1.0:
        return f"a patch scales the weight itself (strength_model {strength_model})"
    name = getattr(adapter, "name", None)
    if name is not None and hasattr(adapter, "weights"):
        if name != "lora":
            return f"a {name} patch (only LoRA and diff patches are bound as weight deltas)"
        weights = adapter.weights
        if len(weights) > 4 and weights[4] is not None:
            return "a DoRA patch (it normalises the patched weight, which is no delta)"
        if len(weights) > 5 and weights[5] is not None:
            return "a LoRA patch that reshapes the weight"
        return None
    if isinstance(adapter, tuple):
        kind = "diff" if len(adapter) == 1 else adapter[0]
        if kind == "diff":
            return None
        return f"a '{kind}' patch (only LoRA and diff patches are bound as weight deltas)"
    return f"a patch of type {type(adapter).__name__} (only LoRA and diff patches are bound as weight deltas)"


def patches_reason(patches: Any) -> Optional[str]:
    """Why a GGMLTensor's `patches` ([(patch list, key)]) cannot be bound as a delta, or None."""
    for patch_list, _key in patches:
        for entry in patch_list:
            reason = _patch_reason(entry)
            if reason:
                return reason
    return None


class GGUFWeights(StoredWeights):
    """ComfyUI-GGUF's stored forms for the block engine (compiler/blocks/quantised.py), one per model.

    `dtype` is what the model computes in (the sampler's input dtype): the deltas' dtype.
    """

    def __init__(self, dtype: Optional[torch.dtype]):
        self.dtype = dtype or torch.float32
        self._layers: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        self._zeros: Dict[tuple, torch.Tensor] = {}
        self._reasons: Dict[int, Tuple[Any, Optional[str]]] = {}

    def _linears(self, module: torch.nn.Module) -> list:
        found = self._layers.get(module)
        if found is None:
            found = self._layers[module] = [(MODULE_PREFIX + (f"{path}." if path else "") + DELTA, layer)
                                            for path, layer in quantised_linears(module)]
        return found

    # -- the structure ----------------------------------------------------------------------------
    def storage_key(self, block: torch.nn.Module) -> str:
        """Every GGML tensor's type, storage dtype and stored shape, and the layers' dequant dtype."""
        parts = []
        for path, layer in ggml_layers(block):
            for name in ("weight", "bias"):
                tensor = layer._parameters.get(name)
                qtype = ggml_type(tensor)
                if qtype is not None:
                    parts.append(f"{path}.{name}:{_type_name(qtype)}:{str(tensor.dtype)[6:]}:"
                                 f"{list(torch.Tensor.size(tensor))}")
            if _quantised(layer, "weight") or _quantised(layer, "bias"):
                parts.append(f"{path}:dequant={layer.dequant_dtype}:delta={str(self.dtype)[6:]}")
        plain = super().storage_key(block)  # tensor-subclass weights beside GGUF's, should a block hold both
        return ("gguf;" + ";".join(parts) if parts else "") + (f"|{plain}" if plain else "")

    def why_not(self, block: torch.nn.Module) -> Optional[str]:
        for path, layer in ggml_layers(block):
            dequant = dequant_module(layer)
            for name in ("weight", "bias"):
                if not _quantised(layer, name):
                    continue
                qtype = ggml_type(layer._parameters[name])
                if dequant is None:
                    return f"ComfyUI-GGUF's dequant module is not loaded beside {type(layer).__module__}"
                if qtype not in getattr(dequant, "dequantize_functions", {}):
                    return (f"{path}.{name} is GGUF {_type_name(qtype)}, which ComfyUI-GGUF dequantises through "
                            "numpy (no torch code a graph could trace)")
                if not isinstance(layer, torch.nn.Linear):
                    return f"{path} is a quantised {type(layer).__name__} (graphs dequantise Linear layers only)"
        return None

    @contextlib.contextmanager
    def tracing(self, block: torch.nn.Module) -> Iterator[None]:
        """GGML weights as plain tensors of their stored bytes, quantised Linears dequantising from them."""
        swapped: List[Tuple[torch.nn.Module, str, Any]] = []
        installed: List[torch.nn.Module] = []
        try:
            for path, layer in ggml_layers(block):
                kinds = {}
                quantised = isinstance(layer, torch.nn.Linear) and _quantised(layer, "weight")
                for name in ("weight", "bias"):
                    tensor = layer._parameters.get(name)
                    if ggml_type(tensor) is None:
                        continue
                    kinds[name] = (ggml_type(tensor), tuple(tensor.shape))  # GGMLTensor.shape: the logical shape
                    swapped.append((layer, name, tensor))
                    layer._parameters[name] = torch.nn.Parameter(torch.Tensor.as_subclass(tensor, torch.Tensor),
                                                                 requires_grad=False)
                if quantised:
                    shape = kinds["weight"][1]
                    layer._buffers[DELTA] = torch.zeros(shape, dtype=self.dtype, device=layer.weight.device)
                    layer.__dict__["forward"] = functools.partial(_traced_linear, layer, kinds, dequant_module(layer))
                    installed.append(layer)
            yield
        finally:
            for layer in installed:
                layer._buffers.pop(DELTA, None)
                layer.__dict__.pop("forward", None)
            for layer, name, tensor in reversed(swapped):
                layer._parameters[name] = tensor

    # -- per call -------------------------------------------------------------------------------
    def _zero(self, shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = (shape, device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = torch.zeros(shape, dtype=self.dtype, device=device)
        return zero

    def patch_reason(self, module: torch.nn.Module) -> Optional[str]:
        """Why this call's patches on the block's quantised weights cannot be bound (cached per patch list)."""
        for _name, layer in self._linears(module):
            patches = getattr(layer._parameters["weight"], "patches", None)
            if not patches:
                continue
            cached = self._reasons.get(id(layer))
            if cached is None or cached[0] is not patches:
                cached = self._reasons[id(layer)] = (patches, patches_reason(patches))
            if cached[1]:
                return f"its GGUF weights carry {cached[1]}"
        return None

    def _delta(self, layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
        """The patches' sum as ComfyUI-GGUF's get_weight adds it, on zeros of the compute dtype."""
        import comfy.lora

        ops = sys.modules.get(type(layer).__module__)
        move = getattr(ops, "move_patch_to_device", None)
        patch_list, key = [], None
        for patches, key in weight.patches:
            patch_list += move(patches, weight.device) if move is not None else patches
        base = torch.zeros(tuple(weight.shape), dtype=self.dtype, device=weight.device)
        if layer.patch_dtype is None:
            return comfy.lora.calculate_weight(patch_list, base, key)
        patch_dtype = self.dtype if layer.patch_dtype == "target" else layer.patch_dtype
        return comfy.lora.calculate_weight(patch_list, base, key, patch_dtype).to(self.dtype)

    def call_tensors(self, module: torch.nn.Module,
                     device: Optional[torch.device] = None) -> Optional[CallTensors]:
        linears = self._linears(module)
        if not linears:
            return None
        tensors, transient = {}, False
        for name, layer in linears:
            weight = layer._parameters["weight"]
            if getattr(weight, "patches", None):
                tensors[name] = self._delta(layer, weight)
                transient = True
            else:
                tensors[name] = self._zero(tuple(weight.shape), weight.device)
        return tensors, transient
