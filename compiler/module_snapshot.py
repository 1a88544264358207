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
import threading
import weakref
from typing import Dict, Iterator, List, Tuple

import torch

MODULE_PREFIX = "m."  # a graph's name for a module tensor: the prefix, then its path (flat_module.py)
_SERIALS = itertools.count(1)  # never reused, unlike id(): a new module's snapshot never looks like an old one's


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
        subs = list(module.named_modules(remove_duplicate=False))
        self._children = [(weakref.ref(sub), tuple(weakref.ref(child) for child in sub._modules.values()))
                          for _, sub in subs]
        entries: List[Tuple[weakref.ref, str, int, List[Tuple[str, str, weakref.ref, int]]]] = []
        shapes = []
        for kind in ("_parameters", "_buffers"):
            for prefix, sub in subs:
                store = getattr(sub, kind)
                held = []
                for name, tensor in store.items():
                    if tensor is None:
                        continue
                    path = f"{prefix}.{name}" if prefix else name
                    held.append((name, MODULE_PREFIX + path, weakref.ref(tensor), _address(tensor)))
                    if kind == "_parameters":
                        shapes.append((path, tuple(tensor.shape)))
                entries.append((weakref.ref(sub), kind, len(store), held))
        self._entries = entries
        self.shapes = tuple(shapes)
        self.version += 1

    def fresh(self) -> bool:
        """Whether the module still holds what was collected, where it was collected."""
        try:
            return self._same(lambda tensor: tensor.data_ptr())
        except RuntimeError:  # a tensor subclass without storage of its own: checked by identity there
            return self._same(_address)

    def _same(self, address_of) -> bool:
        for sub_ref, children in self._children:
            sub = sub_ref()
            if sub is None or [ref() for ref in children] != list(sub._modules.values()):
                return False
        for sub_ref, kind, size, held in self._entries:
            sub = sub_ref()
            store = getattr(sub, kind, None) if sub is not None else None
            if store is None or len(store) != size:
                return False
            for name, _, ref, address in held:
                tensor = store.get(name)
                if tensor is None or tensor is not ref() or address_of(tensor) != address:
                    return False
        return True

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors as collected (call after `refresh`): a new dict each time, the caller's to keep."""
        out: Dict[str, torch.Tensor] = {}
        for _, _, _, held in self._entries:
            for _, full, ref, _ in held:
                out[full] = ref()
        return out

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
