"""A OneFlow module whose weights are a torch module's tensors (zero copy).

Every parameter and buffer of the OneFlow module is the torch tensor's
memory, wrapped through DLPack, so the graphs built on it read the torch
module's current weights: an in-place change on the torch side (a LoRA
patch, `param.data.copy_(...)`) reaches every graph without a rebuild.

A compiled `oneflow.nn.Graph` binds its variables to that memory when it is
compiled and cannot be re-pointed afterwards (OneFlow 0.9.0 registers the
variable blobs with the runtime at compile time; swapping the graph's state
tuple has no effect -- tried). So when `run` gets another torch module than
the one whose memory the graphs read, or the same module after its tensors
were replaced (`load_state_dict(assign=True)`, a device round trip, a
replaced Parameter):

- if no live module uses that memory any more (the first module was freed,
  or its tensors moved elsewhere), the module's weights are copied into it
  and the module's tensors are re-pointed at it (`tensor.data = ...`, as
  `module.to()` does): the module and the graphs share memory again, the
  module's old copy is freed, and later in-place changes reach the graphs;
- if another live module still uses it, nothing is copied (that would change
  the other module's weights) and the call is refused with the reason; the
  dispatcher runs it eagerly.

A replaced tensor may still be held elsewhere: ComfyUI's ModelPatcher keeps
the original Parameter as the backup it restores when a LoRA is removed (on
the CPU `weight.to(cpu)` is the same object). Before new values are copied
into the shared memory, every other live tensor that still reads it gets its
own copy of its values, so such a backup keeps the original weights.

OneFlow runs asynchronously: everything that writes into shared memory, and
everything that reads a graph's output, comes after `sync()`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import List, Optional, Tuple

import torch

from ..base import CannotServe
from .convert import named_tensors

log = logging.getLogger("keepfast")


class WeightsUnavailable(CannotServe, RuntimeError):
    """The graphs' weight memory cannot take this module's weights; the message says why."""


def sync() -> None:
    import oneflow

    oneflow._oneflow_internal.eager.Sync()


def to_flow(tensor: torch.Tensor):
    """A OneFlow tensor sharing the torch tensor's memory (DLPack)."""
    import oneflow

    return oneflow.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))


def to_torch(flow_tensor) -> torch.Tensor:
    import oneflow

    return torch.utils.dlpack.from_dlpack(oneflow.to_dlpack(flow_tensor))


def _slots(module: torch.nn.Module, names: List[str]) -> List[Tuple[dict, str]]:
    """(the dict holding the tensor, its key) per name: cheap to re-read every call."""
    out = []
    for name in names:
        path, _, leaf = name.rpartition(".")
        sub = module
        for part in path.split(".") if path else []:
            sub = sub._modules[part]
        if leaf in sub._parameters and sub._parameters[leaf] is not None:
            out.append((sub._parameters, leaf))
        elif leaf in sub._buffers and sub._buffers[leaf] is not None:
            out.append((sub._buffers, leaf))
        else:
            raise KeyError(name)
    return out


def _describe(module: Optional[torch.nn.Module]) -> str:
    return f"{type(module).__name__} at {id(module):#x}" if module is not None else "a freed module"


class WeightBinding:
    """One OneFlow module + the torch memory its parameters alias; shared by all graphs built on it."""

    def __init__(self, flow_module, module: torch.nn.Module, group: tuple):
        self.flow_module = flow_module
        self.group = group  # (architecture, structure, dtype, device): who may share it
        self.names = [name for name, _ in named_tensors(module)]
        self.lock = threading.RLock()
        self.notes: List[str] = []
        self.copies = 0
        self._slot_cache: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
        tensors = self.current(module)
        for name, tensor in zip(self.names, tensors):
            if not tensor.is_contiguous():
                raise WeightsUnavailable(f"weight {name} is not contiguous; OneFlow cannot share it")
            if tensor.dtype == torch.bool:
                raise WeightsUnavailable(f"buffer {name} is a bool tensor; OneFlow 0.9.0's DLPack cannot share it")
        self.memory: List[torch.Tensor] = [t.detach() for t in tensors]
        self.devices = sorted({str(t.device) for t in self.memory})
        if len(self.devices) > 1:
            raise WeightsUnavailable(
                f"the module's weights are on several devices ({', '.join(self.devices)}); "
                "a OneFlow graph needs them on one"
            )
        self.owner = weakref.ref(module)
        # Per tensor: the torch tensors whose memory is the graphs' (weak: a dropped one needs nothing).
        self._holders: List[List["weakref.ref[torch.Tensor]"]] = [[weakref.ref(t)] for t in tensors]
        self._share()

    # -- the OneFlow side -----------------------------------------------------
    def _share(self) -> None:
        import oneflow

        flow_slots = _slots(self.flow_module, self.names)
        for (container, leaf), tensor in zip(flow_slots, self.memory):
            shared = to_flow(tensor)
            if isinstance(container.get(leaf), oneflow.nn.Parameter):
                shared = oneflow.nn.Parameter(shared, requires_grad=False)
            container[leaf] = shared

    # -- the torch side ---------------------------------------------------------
    def current(self, module: torch.nn.Module) -> List[torch.Tensor]:
        slots = self._slot_cache.get(module)
        if slots is None:
            slots = _slots(module, self.names)
            self._slot_cache[module] = slots
        return [container[leaf] for container, leaf in slots]

    def _aliases(self, tensors: List[torch.Tensor]) -> List[bool]:
        return [t.data_ptr() == m.data_ptr() and t.device == m.device for t, m in zip(tensors, self.memory)]

    def shares_with(self, module: torch.nn.Module) -> bool:
        try:
            return all(self._aliases(self.current(module)))
        except KeyError:
            return False

    def in_use_by_other(self, module: torch.nn.Module) -> Optional[torch.nn.Module]:
        owner = self.owner()
        if owner is None or owner is module:
            return None
        try:
            return owner if any(self._aliases(self.current(owner))) else None
        except KeyError:
            return None

    def available_to(self, module: torch.nn.Module) -> bool:
        """Graphs on this binding can run `module` (now or after a copy)."""
        return self.shares_with(module) or self.in_use_by_other(module) is None

    def bind(self, module: torch.nn.Module) -> None:
        """Make the shared memory hold `module`'s weights; call with `lock` held."""
        try:
            tensors = self.current(module)
        except KeyError as missing:
            raise WeightsUnavailable(f"the module has no tensor {missing.args[0]}") from None
        aliased = self._aliases(tensors)
        if all(aliased):
            return
        other = self.in_use_by_other(module)
        if other is not None:
            raise WeightsUnavailable(
                f"these OneFlow graphs read the weights of another live {_describe(other)}; "
                "OneFlow 0.9.0 cannot re-point a compiled graph's weights and copying would overwrite that "
                "module's, so this module runs eager (free the other module, or compile this one first)"
            )
        for tensor, memory in zip(tensors, self.memory):
            if tensor.shape != memory.shape or tensor.dtype != memory.dtype:
                raise WeightsUnavailable("the module's weights differ in shape or dtype from the graphs'")
            if tensor.device != memory.device:
                raise WeightsUnavailable(
                    f"the module's weights are on {tensor.device}, these OneFlow graphs' on {memory.device}"
                )
        sync()  # no graph may still be reading the memory we are about to write
        copied = kept = 0
        with torch.no_grad():
            for index, (tensor, memory, same) in enumerate(zip(tensors, self.memory, aliased)):
                if same:
                    continue
                kept += self._keep_other_holders(index, tensor, memory)
                memory.copy_(tensor)
                tensor.data = memory  # the module now uses the graphs' memory (as module.to() re-points)
                self._holders[index] = [weakref.ref(tensor)]
                copied += 1
        if self.memory and self.memory[0].is_cuda:
            torch.cuda.synchronize(self.memory[0].device)
        previous = self.owner()
        if previous is module:
            before = "the module's own tensors had been replaced"
        elif previous is None:
            before = "its previous module was freed"
        else:
            before = f"{_describe(previous)} no longer uses it"
        self.owner = weakref.ref(module)
        self.copies += 1
        note = (f"copied {copied} of {len(tensors)} weight tensors of {_describe(module)} into the OneFlow graphs' "
                f"weight memory ({before}); the module now shares that memory with the graphs")
        if kept:
            note += (f"; {kept} replaced tensors still held elsewhere (e.g. a patcher's backup of the unpatched "
                     "weights) got their own copy of their values first")
        self.notes.append(note)
        del self.notes[:-20]
        log.warning("oneflow backend: %s", note)

    def _keep_other_holders(self, index: int, tensor: torch.Tensor, memory: torch.Tensor) -> int:
        """Give every live tensor other than `tensor` that reads `memory` its own copy; how many."""
        kept = 0
        for ref in self._holders[index]:
            holder = ref()
            if holder is None or holder is tensor:
                continue
            if holder.device == memory.device and holder.data_ptr() == memory.data_ptr():
                holder.data = memory.clone()
                kept += 1
        return kept

    def status(self) -> dict:
        return {"owner": _describe(self.owner()), "tensors": len(self.names), "copies": self.copies,
                "device": self.devices[0] if self.devices else "-", "notes": list(self.notes)}
