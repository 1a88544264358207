"""Blocks whose weights are stored in a form their own forward turns into compute weights per call.

Quantised checkpoints (GGUF's Q8_0 or Q4_K bytes, fp8 with a scale) keep each
Linear's weight in a storage form and convert it on every call; LoRA applied
on the fly adds a delta at the same moment. A block graph serves them when
the conversion is traced into the graph and the stored tensors are bound per
call like any weight. The compiler knows nothing of the formats: a family
(the ComfyUI adapter's, for ComfyUI-GGUF) answers through a `StoredWeights`:

- `storage_key(block)`: the stored form of every tensor whose form changes
  the graph (quantisation type, storage dtype and shape). It joins the block
  structure (`structure_key`), so Q8_0 and Q4_K blocks of one class never
  share a graph, and blocks of one quantisation type share one.
- `why_not(block)`: a stored form the pack cannot trace (said before trying).
- `tracing(block)`: a context in which the block's own forward traces the
  conversion from the stored tensors (entered around torch.export only).
- `call_tensors(module)`: tensors bound for this call besides the module's
  own (a LoRA delta per quantised Linear: zeros when no patch is applied, so
  one graph serves LoRA on, off and every strength), and whether they live
  for this call only (computed per call, released after it, as ComfyUI-GGUF
  computes its patched weight per call).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import ContextManager, Dict, Optional, Tuple

import torch

CallTensors = Tuple[Dict[str, torch.Tensor], bool]  # (tensors by graph name, transient)


class StoredWeights:
    """No stored forms: every tensor is what the block computes with (the default)."""

    def storage_key(self, block: torch.nn.Module) -> str:
        return ""

    def why_not(self, block: torch.nn.Module) -> Optional[str]:
        return None

    def tracing(self, block: torch.nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def call_tensors(self, module: torch.nn.Module) -> Optional[CallTensors]:
        return None


PLAIN = StoredWeights()


def structure_key(structure: str, storage: str) -> str:
    """The block structure a graph is keyed by: the module structure, plus the stored form where there is one.

    The one place the two are joined: finder's groups and every graph key read it.
    """
    if not storage:
        return structure
    return f"{structure}-{hashlib.sha256(storage.encode()).hexdigest()[:12]}"
