"""The in-process graph registry, shared by every wrapper in the process.

One compiled graph per key, reused by every module of the same architecture
(weights are bound per call, not baked in). Bounded by count and bytes, least
recently used first out. It also keeps the counters a user or a test reads to
see what happened: compiles and loads (each with its reason and time), hits,
and fallbacks to eager (each with its reason).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

from .backends.base import CompiledGraph
from .keys import FamilyKey
from .signature import FlatCall

COMPILE = "compile"
LOAD = "load"
FALLBACK = "fallback"
EVICT = "evict"
REFUSED = "refused"
PROGRESS = "progress"


@dataclass
class Event:
    kind: str
    family: str
    reason: str
    seconds: float = 0.0
    graph_id: str = ""
    detail: Dict[str, object] = field(default_factory=dict)
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)


Listener = Callable[[Event], None]


class GraphRegistry:
    def __init__(self, max_graphs: int = 32, max_bytes: Optional[int] = None, history: int = 500):
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self._graphs: "OrderedDict[str, CompiledGraph]" = OrderedDict()
        self._families: Dict[str, List[str]] = defaultdict(list)
        self._lock = threading.RLock()
        self._family_locks: Dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._listeners: List[Listener] = []
        self._history = history
        self.generation = 0
        self.reset_counters()

    # -- counters -----------------------------------------------------------
    def reset_counters(self) -> None:
        with self._lock:
            self.hits = 0
            self.events: List[Event] = []

    def _record(self, event: Event) -> Event:
        with self._lock:
            if event.kind != PROGRESS:
                self.events.append(event)
                del self.events[: -self._history]
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must never break a run
                pass
        return event

    def _of_kind(self, kind: str) -> List[Event]:
        with self._lock:
            return [e for e in self.events if e.kind == kind]

    @property
    def compiles(self) -> List[Event]:
        return self._of_kind(COMPILE)

    @property
    def loads(self) -> List[Event]:
        return self._of_kind(LOAD)

    @property
    def fallbacks(self) -> List[Event]:
        return self._of_kind(FALLBACK)

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def record(self, kind: str, family: FamilyKey | str, reason: str, **fields) -> Event:
        family_id = family.id if isinstance(family, FamilyKey) else family
        return self._record(Event(kind, family_id, reason, **fields))

    # -- graphs -------------------------------------------------------------
    def family_lock(self, family: FamilyKey) -> threading.Lock:
        """Held while compiling or loading, so one family is never built twice at once."""
        with self._lock:
            return self._family_locks[family.id]

    def find(self, family: FamilyKey, call: FlatCall) -> tuple[Optional[CompiledGraph], Optional[str]]:
        """A graph of the family that serves the call, or (None, why none does)."""
        with self._lock:
            ids = list(self._families.get(family.id, ()))
            graphs = [self._graphs[i] for i in ids if i in self._graphs]
        why = None
        for graph in graphs:
            reason = graph.why_not(call)
            if reason is None:
                with self._lock:
                    self.hits += 1
                    if graph.key.id in self._graphs:
                        self._graphs.move_to_end(graph.key.id)
                return graph, None
            why = why or reason
        return None, why

    def add(self, graph: CompiledGraph) -> None:
        evicted = []
        with self._lock:
            graph_id = graph.key.id
            self._graphs[graph_id] = graph
            self._graphs.move_to_end(graph_id)
            family = self._families[graph.key.family.id]
            if graph_id not in family:
                family.append(graph_id)
            while len(self._graphs) > self.max_graphs or (
                self.max_bytes is not None and self.total_bytes() > self.max_bytes and len(self._graphs) > 1
            ):
                old_id, old = self._graphs.popitem(last=False)
                self._families[old.key.family.id].remove(old_id)
                evicted.append(old)
            self.generation += 1
        for old in evicted:
            self.record(EVICT, old.key.family, "registry full (least recently used)", graph_id=old.key.id)

    def graphs(self) -> List[CompiledGraph]:
        with self._lock:
            return list(self._graphs.values())

    def family_graphs(self, family: FamilyKey) -> List[CompiledGraph]:
        with self._lock:
            return [self._graphs[i] for i in self._families.get(family.id, ()) if i in self._graphs]

    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self._graphs.values())

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._families.clear()
            self.generation += 1

    def stats(self) -> dict:
        with self._lock:
            return {
                "graphs": [
                    {"graph_id": g.key.id, "family": g.key.family.describe(), "origin": g.origin,
                     "backend": g.key.family.backend, "bytes": g.nbytes,
                     "shape_range": g.key.shape_range.to_json()}
                    for g in self._graphs.values()
                ],
                "hits": self.hits,
                "compiles": [e.to_json() for e in self.events if e.kind == COMPILE],
                "loads": [e.to_json() for e in self.events if e.kind == LOAD],
                "fallbacks": [e.to_json() for e in self.events if e.kind == FALLBACK],
                "refused": [e.to_json() for e in self.events if e.kind == REFUSED],
            }


_DEFAULT = GraphRegistry()


def default_registry() -> GraphRegistry:
    return _DEFAULT
