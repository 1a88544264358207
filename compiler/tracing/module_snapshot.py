"""A module's tensors under the names graphs bind them by, collected once and re-checked on each call.

Why: a whole-model graph's call walked the module twice (its parameters' names and shapes for the structure key,
its parameters and buffers for the runner's weights): on this 2-core CPU 6.09 ms of each call of the real-depth
SD1.5 UNet (684 tensors) went outside the runner, of which 2.2 ms in those walks (named_modules builds every
path string each time). On a GPU that time is before the call's first kernel launch.

A snapshot keeps, per submodule, its `_modules`, `_parameters` and `_buffers` dicts with what they held; a call
checks that each still holds the same objects, and each tensor the same address (`module.to()` and `.data = `
move storage under the same Parameter), and collects again where anything differs: a submodule, a tensor
added, removed or replaced (ComfyUI's weight patching replaces Parameters). `version` counts the collections.
The block engine keeps its own per-instance check (blocks/binding.py `InstanceWeights`), which binds tensor
subclasses by their parts.
"""

from __future__ import annotations

import contextlib
import itertools
from operator import is_
import threading
import weakref
from typing import Dict, Iterator, List, Tuple

import torch

MODULE_PREFIX = "m."  # a graph's name for a module tensor: the prefix, then its path (flat_module.py)
_SERIALS = itertools.count(1)  # never reused, unlike id(): a new module's snapshot never looks like an old one's


def _none() -> None:
    return None


def _ref(obj):
    """A weak reference, or for a None child (a module registered as None) something that gives None back."""
    return _none if obj is None else weakref.ref(obj)


_data_ptr = torch.Tensor.data_ptr


def _address(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:  # a tensor subclass without storage of its own: its identity is checked still
        return 0


class ModuleSnapshot:
    """What one module holds, as weak references (a snapshot never keeps a replaced weight alive: ComfyUI swaps
    weights to free GPU memory between calls): `tensors()` (graph name -> tensor, the parameters then the
    buffers, each as named_parameters and named_buffers with duplicates list them) and `shapes` (the parameters'
    names and shapes)."""

    def __init__(self, module: torch.nn.Module):
        self.serial = next(_SERIALS)
        self.version = 0
        self._lock = threading.Lock()
        self._collect(module)

    @property
    def token(self) -> Tuple[int, int]:
        """Equal for two calls exactly when the module held the same tensors, where it held them, for both."""
        return self.serial, self.version

    def _collect(self, module: torch.nn.Module) -> None:
        named = list(module.named_modules(remove_duplicate=False))
        subs = [sub for _, sub in named]
        # each submodule's own dicts, held as they are (not what they held: a weight replaced in one is not kept
        # alive here); a module's dicts are made with it and stay its own, so its entries are read from them
        self._module_dicts = [sub._modules for sub in subs]
        self._stores = [sub._parameters for sub in subs] + [sub._buffers for sub in subs]
        self._children = [_ref(child) for sub in subs for child in sub._modules.values()]
        names: List[str] = []
        held: List[Tuple[str, weakref.ref]] = []
        shapes = []
        for kind in ("_parameters", "_buffers"):
            for prefix, sub in named:
                for name, tensor in getattr(sub, kind).items():
                    names.append(name)
                    if tensor is None:
                        continue
                    path = f"{prefix}.{name}" if prefix else name
                    held.append((MODULE_PREFIX + path, weakref.ref(tensor)))
                    if kind == "_parameters":
                        shapes.append((path, tuple(tensor.shape)))
        self._names = names
        self._held = held
        self._tensors = [ref for _, ref in held]
        self._addresses = [_address(ref()) for ref in self._tensors]
        self.shapes = tuple(shapes)
        self.version += 1

    def fresh(self) -> bool:
        """Whether the module still holds what was collected, where it was collected."""
        try:
            return self._same(_data_ptr)
        except RuntimeError:  # a tensor subclass without storage of its own: checked by identity there
            return self._same(_address)

    def _same(self, address_of) -> bool:
        """Each list built and compared in one pass (comprehensions, `map`): 684 tensors and 708 submodules of the
        SD1.5 UNet are checked on every call."""
        children = [child for held in self._module_dicts for child in held.values()]
        if len(children) != len(self._children) or not all(map(is_, children, [ref() for ref in self._children])):
            return False
        if [name for store in self._stores for name in store] != self._names:
            return False
        tensors = [t for store in self._stores for t in store.values() if t is not None]
        if len(tensors) != len(self._tensors) or not all(map(is_, tensors, [ref() for ref in self._tensors])):
            return False
        return list(map(address_of, tensors)) == self._addresses

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors as collected (call after `refresh`): a new dict each time, the caller's to keep."""
        return {full: ref() for full, ref in self._held}

    def refresh(self, module: torch.nn.Module) -> "ModuleSnapshot":
        with self._lock:
            if not self.fresh():
                self._collect(module)
        return self


_snapshots: "weakref.WeakKeyDictionary[torch.nn.Module, ModuleSnapshot]" = weakref.WeakKeyDictionary()
_snapshots_lock = threading.Lock()


_scope = threading.local()  # the snapshots checked in this thread's current call (one_check_per_call)


@contextlib.contextmanager
def one_check_per_call() -> Iterator[None]:
    """Within one model call, each module is checked once: the structure key and the weights' binding both ask
    (nothing of ComfyUI's changes a model's weights inside one of its calls)."""
    outer = getattr(_scope, "checked", None)
    if outer is None:
        _scope.checked = set()
    try:
        yield
    finally:
        if outer is None:
            _scope.checked = None


def snapshot_of(module: torch.nn.Module) -> ModuleSnapshot:
    """The module's snapshot, collected again where the module changed since the last call."""
    with _snapshots_lock:
        found = _snapshots.get(module)
        if found is None:
            found = _snapshots[module] = ModuleSnapshot(module)
            fresh = True
        else:
            fresh = False
    checked = getattr(_scope, "checked", None)
    if checked is not None:
        if found.serial in checked:
            return found
        checked.add(found.serial)
    return found if fresh else found.refresh(module)
