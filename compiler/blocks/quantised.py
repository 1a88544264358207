"""Blocks whose weights are stored in a form their own forward turns into compute weights per call.

Quantised checkpoints (GGUF's Q8_0 or Q4_K bytes, fp8 with a scale) keep each
Linear's weight in a storage form and convert it on every call; LoRA applied
on the fly adds a delta at the same moment. A block graph serves them when
the conversion is traced into the graph and the stored tensors are bound per
call like any weight. The compiler knows nothing of the formats: a family
(the ComfyUI adapter's, for ComfyUI-GGUF) answers through a `StoredWeights`:

Tensor-subclass weights (ComfyUI's fp8-scaled `QuantizedTensor`) need no
family help: torch.export traces their dequantisation through the subclass,
`binding.InstanceWeights` binds their parts, and `subclass_storage_key` keys
them. For other forms a family answers through a `StoredWeights`:

- `storage_key(block)`: the stored form of every tensor whose form changes
  the graph (quantisation type, storage dtype and shape). It joins the block
  structure (`structure_key`), so Q8_0 and Q4_K blocks of one class never
  share a graph, and blocks of one quantisation type share one.
- `why_not(block)`: a stored form the pack cannot trace (said before trying).
- `tracing(block)`: a context in which the block's own forward traces the
  conversion from the stored tensors (entered around torch.export only).
- `call_tensors(module, device)`: tensors bound for a call on `device` besides the module's
  own (a LoRA delta per quantised Linear: zeros when no patch is applied, so
  one graph serves LoRA on, off and every strength), and whether they live
  for this call only (computed per call, released after it, as ComfyUI-GGUF
  computes its patched weight per call).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import ContextManager, Dict, List, Optional, Tuple

import torch

from ..tracing.subclass_weights import is_subclass_weight

CallTensors = Tuple[Dict[str, torch.Tensor], bool]  # (tensors by graph name, transient)


def subclass_parts(tensor: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """The plain tensors a traceable tensor subclass flattens to (depth first, as torch.export unwraps it),
    or None for a plain tensor.

    ComfyUI's fp8-scaled layers hold a `QuantizedTensor` (comfy_kitchen): fp8
    bytes and a float32 scale. torch.export unwraps it into those parts (the
    dequantisation is traced from them), and they are what is bound per call.
    """
    if not is_subclass_weight(tensor):
        return None
    names, _context = tensor.__tensor_flatten__()
    parts: List[torch.Tensor] = []
    for name in names:
        part = getattr(tensor, name)
        nested = subclass_parts(part)
        parts.extend(nested if nested is not None else [part])
    return parts


def _context_text(context) -> str:
    """A flattening context (layout class, original dtype and shape) as stable text."""
    if isinstance(context, dict):
        return "{" + ",".join(f"{k}={_context_text(v)}" for k, v in sorted(context.items(), key=lambda kv: str(kv[0]))) + "}"
    if isinstance(context, (list, tuple)):
        return "[" + ",".join(_context_text(v) for v in context) + "]"
    if isinstance(context, type):
        return f"{context.__module__}.{context.__qualname__}"
    return str(context)


def subclass_storage_key(block: torch.nn.Module) -> str:
    """Every tensor-subclass weight's class, layout and parts (dtype, shape): an fp8-scaled block and a
    float block of one module structure report the same dtype and shape, and must not share a graph."""
    parts = []
    tensors = list(block.named_parameters(remove_duplicate=False)) + list(block.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        inner = subclass_parts(tensor)
        if inner is None:
            continue
        _names, context = tensor.__tensor_flatten__()
        stored = ",".join(f"{str(p.dtype)[6:]}{list(p.shape)}" for p in inner)
        parts.append(f"{name}:{type(tensor).__qualname__}:{_context_text(context)}:{stored}")
    return ";".join(parts)


class StoredWeights:
    """Weights as the block's forward reads them; tensor-subclass weights (fp8 scaled) are traced through
    their own dispatch and bound by their parts (binding.py): the default."""

    def storage_key(self, block: torch.nn.Module) -> str:
        return subclass_storage_key(block)

    def why_not(self, block: torch.nn.Module) -> Optional[str]:
        return None

    def tracing(self, block: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def call_tensors(self, module: torch.nn.Module,
                     device: Optional[torch.device] = None) -> Optional[CallTensors]:
        return None


PLAIN = StoredWeights()


def structure_key(structure: str, storage: str) -> str:
    """The block structure a graph is keyed by: the module structure, plus the stored form where there is one.

    The one place the two are joined: finder's groups and every graph key read it.
    """
    if not storage:
        return structure
    return f"{structure}-{hashlib.sha256(storage.encode()).hexdigest()[:12]}"
