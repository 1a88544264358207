"""Background builds of whole-model graphs, held by the process (the registry), not by one wrapper of a model.

Why: a wrapper (CompiledForward) lives as long as whoever made it. In ComfyUI that is a Speedup node's
output, which ComfyUI drops whenever another workflow runs or anything upstream changes. When builds were the
wrapper's, that drop cancelled a build in flight, or discarded one that had finished but not yet been taken
in (graphs are taken in at a call, and none came): the next Speedup output of the same model started the
same build again, and its images stayed uncompiled (issue: "the default path holds").

Here a build is keyed as its graph will be (family and declared range: `book_key`) and lives in the
registry's book until a wrapper of any module of that structure takes it in at its next call. A build stops
only when every module that could use it is gone (weak references: ComfyUI unloading the model, a workflow
moving to another checkpoint) or on an explicit cancel. A build that failed is remembered here too, so a
new wrapper does not start it again. The book never holds a module: a build that held one would keep the
model alive and never stop.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import claims as build_claims
from ..backends.base import PendingGraph
from ..keys.graph_keys import FamilyKey, GraphKey
from ..keys.shapes import ShapeRange
from ..keys.signature import FlatCall


@dataclass
class Building:
    """A background build and what its landing records."""

    pending: PendingGraph
    family: FamilyKey
    call: FlatCall
    reason: str
    claim: Optional[build_claims.Claim] = None  # held until its graph is written (build_claims.py)
    started_by: str = ""  # the owner id of the wrapper that started it


@dataclass
class _Entry:
    building: Building
    watchers: Dict[int, weakref.finalize] = field(default_factory=dict)  # module id -> its finalizer


def book_key(family: FamilyKey, shape_range: ShapeRange) -> str:
    """The key of a family's build for a declared range: its graph's key without the variant tracing adds."""
    return GraphKey(family, shape_range).id


class BuildBook:
    """Builds in flight or finished and not yet taken in, and builds that failed, by `book_key`."""

    def __init__(self):
        self._lock = threading.RLock()
        self._entries: Dict[str, _Entry] = {}
        self._failed: Dict[str, str] = {}

    def add(self, key: str, building: Building, module: torch.nn.Module) -> None:
        with self._lock:
            self._entries[key] = _Entry(building)
            self._failed.pop(key, None)
            self._watch(key, module)

    def adopt(self, key: str, module: torch.nn.Module) -> Optional[Building]:
        """The build for `key` if there is one, now also kept alive by `module`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._watch(key, module)
            return entry.building

    def get(self, key: str) -> Optional[Building]:
        with self._lock:
            entry = self._entries.get(key)
            return entry.building if entry is not None else None

    def take(self, key: str) -> Optional[Building]:
        """The finished build for `key`, removed from the book: exactly one caller takes a build in."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not entry.building.pending.done():
                return None
            return self._remove(key).building

    def cancel(self, key: str) -> bool:
        """Stop the build for `key` and remove what it wrote; False if there was none."""
        with self._lock:
            entry = self._remove(key)
        if entry is None:
            return False
        entry.building.pending.cancel()
        build_claims.release(entry.building.claim)
        return True

    def cancel_all(self) -> int:
        with self._lock:
            keys = list(self._entries)
        return sum(self.cancel(key) for key in keys)

    def fail(self, key: str, why: str) -> None:
        with self._lock:
            self._failed[key] = why

    def failure(self, key: str) -> Optional[str]:
        with self._lock:
            return self._failed.get(key)

    def pending(self) -> List[str]:
        with self._lock:
            return list(self._entries)

    def _watch(self, key: str, module: torch.nn.Module) -> None:
        entry = self._entries[key]
        if id(module) not in entry.watchers:
            entry.watchers[id(module)] = weakref.finalize(module, self._module_gone, key, id(module))

    def _remove(self, key: str) -> Optional[_Entry]:
        entry = self._entries.pop(key, None)
        if entry is not None:
            for watcher in entry.watchers.values():
                watcher.detach()
        return entry

    def _module_gone(self, key: str, module_id: int) -> None:
        """A module that could use the build was collected: the last one gone stops it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.watchers.pop(module_id, None)
            if entry.watchers:
                return
        self.cancel(key)
