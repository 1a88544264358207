"""Weights handed to an AOTInductor runner by pointer, without the runner keeping their memory.

Why: the pack binds a module's weights to a loaded package with `load_constants(..., user_managed=True)`, no copy.
For such a constant torch's AOTInductor runtime makes a second handle to the tensor and never frees it
(`MaybeOwningAtenTensorHandle`, aoti_runtime/utils.h: `aoti_torch_new_tensor_handle` with nothing that deletes
it; every torch this pack meets, 2.11 to 2.14.1; fixed upstream in pytorch/pytorch#194480). The handle shares the
tensor's TensorImpl, so the memory is freed when the Parameter's `.data` is replaced (ComfyUI's offload, `module.to`)
but never when the tensor itself is let go: a Parameter ComfyUI replaces (LoRA patching), the weights it moves in
for one call under partial loading, a per-call LoRA delta. Measured on this CPU (torch 2.13, 2.11, 2.14.1): 64 MB
bound and let go five times, 322 MB still held; on the H200 (2026-11-28) Flux's blocks under ComfyUI's partial
loading peaked at 11396 MB for a model of 1311 MB, the weights moved in for each step kept.

So the runner is given a view of each plain tensor over the same memory whose storage does not own it
(`torch._C._construct_storage_from_data_pointer`, what torch's CUDA graph trees use to rebuild storages): what the
runtime keeps is then a few hundred bytes, never the weights. The caller's side of the bargain: the real tensors
stay alive while the runner may run with them (the module holds them for its call; a per-call tensor is held until
the run returned, and the device's stream orders its reuse after the kernels), and a rebinding comes before any run
once a tensor is replaced or its address changes (module_snapshot.py, blocks/binding.py check both). A tensor
subclass (its parts are bound instead, blocks/binding.py) or a torch without the call is bound as it is.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

_construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class BorrowedWeights(dict):
    """Graph name -> a view that does not own its memory (`borrowed_views`); the only thing `bind` takes."""


def borrowed(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s memory (same dtype, device, shape, strides and offset) whose storage does not own
    it; `tensor` itself where no such view can be made."""
    if _construct is None or type(tensor) not in _PLAIN:
        return tensor
    try:
        storage = tensor.untyped_storage()
        unowned = _construct(storage.data_ptr(), tensor.device, storage.nbytes())
        return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
            unowned, tensor.storage_offset(), tensor.shape, tensor.stride())
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor without storage of its own (a functorch
        return tensor                                         # wrapper, a fake tensor): bound as it is


def borrowed_views(tensors: Mapping[str, torch.Tensor]) -> BorrowedWeights:
    """`borrowed` of each tensor, under the same names (about 3 us a tensor on this CPU)."""
    with torch.inference_mode(False), torch.no_grad():
        return BorrowedWeights((name, borrowed(tensor)) for name, tensor in tensors.items())


def bind(runner: Any, weights: BorrowedWeights, check_full_update: bool) -> None:
    """Hand `weights` to a loaded runner (a package's loader, or a graph in parts) by pointer."""
    if not isinstance(weights, BorrowedWeights):
        raise TypeError("bind takes borrowed_views(...): a tensor bound as it is would be kept for good")
    runner.load_constants(dict(weights), check_full_update=check_full_update, user_managed=True)

