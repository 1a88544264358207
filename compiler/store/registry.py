"""The process's graph cache and event log, and the registry that holds one of each.

- `GraphCache`: the graphs in memory, one per key, reused by every module of
  the same structure (weights are bound per call, never baked in); bounded by
  count and bytes, least recently used first out.
- `EventLog`: what happened and why -- compiles and loads (with their times),
  refusals, fallbacks to eager (with their reasons), graphs that disagreed
  with eager (the first-use check, `verify.py`), evictions, progress --
  plus counters of calls served by a graph or run eagerly. Anyone who wants
  to show or count events (the ComfyUI nodes, the page, the stats route, a
  test) subscribes to it or reads it; nobody keeps a copy.

`GraphRegistry` is the pair, plus the first-use check's verdicts (which
graph was compared with eager for which input shapes) and the whole-model
builds in the background (`build_book.py`), shared by every compiled forward
and block server of a process.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

from ..backends.base import CompiledGraph
from ..builds.book import BuildBook
from ..keys.graph_keys import FamilyKey
from ..keys.signature import FlatCall
from ..serving.verify import Verdicts

COMPILE = "compile"
LOAD = "load"
FALLBACK = "fallback"
EVICT = "evict"
REFUSED = "refused"
PROGRESS = "progress"
NOTE = "note"
MISMATCH = "mismatch"  # a graph disagreed with eager (a pack error: the call ran eager)


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


class EventLog:
    """A bounded history of events, counts of every kind ever recorded, and listeners."""

    def __init__(self, history: int = 500):
        self._history = history
        self._lock = threading.RLock()
        self._listeners: List[Listener] = []
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.events: List[Event] = []
            self.counts: Counter = Counter()
            self.seconds: Counter = Counter()

    def record(self, kind: str, family: FamilyKey | str, reason: str, **fields) -> Event:
        family_id = family.id if isinstance(family, FamilyKey) else family
        event = Event(kind, family_id, reason, **fields)
        with self._lock:
            if kind != PROGRESS:
                self.events.append(event)
                del self.events[: -self._history]
                self.counts[kind] += 1
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(event)
            except Exception:  # a broken listener must never break a run
                pass
        return event

    def count(self, name: str, amount: int = 1) -> None:
        """Count something too frequent to log one event each (calls served, calls run eagerly)."""
        with self._lock:
            self.counts[name] += amount

    def add_time(self, name: str, seconds: float) -> None:
        """Wall time spent in something counted (graph calls, eager calls, whole model calls): the shares
        the reports give. Host time: on a GPU, kernels still running when a call returns are not in it."""
        with self._lock:
            self.seconds[name] += seconds

    def of_kind(self, kind: str) -> List[Event]:
        with self._lock:
            return [e for e in self.events if e.kind == kind]

    def since(self, mark: float) -> List[Event]:
        with self._lock:
            return [e for e in self.events if e.at >= mark]

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener not in self._listeners:
                self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


class GraphCache:
    """Graphs in memory by key, grouped by family; evicts least recently used past its bounds."""

    def __init__(self, max_graphs: int = 32, max_bytes: Optional[int] = None,
                 on_evict: Optional[Callable[[CompiledGraph], None]] = None):
        self.max_graphs = max_graphs
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self._graphs: "OrderedDict[str, CompiledGraph]" = OrderedDict()
        self._families: Dict[str, List[str]] = defaultdict(list)
        self._lock = threading.RLock()
        self._family_locks: Dict[str, threading.Lock] = defaultdict(threading.Lock)
        self.hits = 0
        self.generation = 0  # bumped whenever the set of graphs changes

    def family_lock(self, family: FamilyKey) -> threading.Lock:
        """Held while compiling or loading, so one family is never built twice at once."""
        with self._lock:
            return self._family_locks[family.id]

    def find(self, family: FamilyKey, call: FlatCall) -> tuple[Optional[CompiledGraph], Optional[str]]:
        """A graph of the family that serves the call, or (None, why none does)."""
        why = None
        for graph in self.family_graphs(family):
            reason = graph.why_not(call)
            if reason is None:
                with self._lock:
                    self.hits += 1
                    if graph.key.id in self._graphs:
                        self._graphs.move_to_end(graph.key.id)
                return graph, None
            why = why or reason
        return None, why

    def count_hit(self) -> None:
        """A call served by a graph found outside `find` (a block graph serving its next instance)."""
        with self._lock:
            self.hits += 1

    def get(self, graph_id: str) -> Optional[CompiledGraph]:
        with self._lock:
            return self._graphs.get(graph_id)

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
            if self._on_evict is not None:
                self._on_evict(old)

    def graphs(self) -> List[CompiledGraph]:
        with self._lock:
            return list(self._graphs.values())

    def remove(self, graph_id: str) -> None:
        with self._lock:
            graph = self._graphs.pop(graph_id, None)
            if graph is not None:
                self._families[graph.key.family.id].remove(graph_id)
                self.generation += 1

    def family_graphs(self, family: FamilyKey) -> List[CompiledGraph]:
        with self._lock:
            return [self._graphs[i] for i in self._families.get(family.id, ()) if i in self._graphs]

    def total_bytes(self) -> int:
        with self._lock:
            return sum(g.nbytes for g in self._graphs.values())

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._families.clear()
            self.generation += 1


class GraphRegistry:
    """One graph cache and one event log, shared by every compiled forward of a process."""

    def __init__(self, max_graphs: int = 32, max_bytes: Optional[int] = None, history: int = 500):
        self.log = EventLog(history)
        self.cache = GraphCache(max_graphs, max_bytes, on_evict=self._evicted)
        self.verdicts = Verdicts()
        # Whole-model graphs building in the background, until a wrapper of their model takes them in.
        self.builds = BuildBook()
        # The input structure (Signature.to_json) behind each family signature id of the graphs in memory: what
        # a call in other floating dtypes is matched against (input_casts.py).
        self._signatures: Dict[str, dict] = {}

    def note_signature(self, signature_id: str, signature: dict) -> None:
        self._signatures[signature_id] = signature

    def signature(self, signature_id: str) -> Optional[dict]:
        return self._signatures.get(signature_id)

    def remove(self, graph_id: str) -> None:
        self.cache.remove(graph_id)

    def _evicted(self, graph: CompiledGraph) -> None:
        self.log.record(EVICT, graph.key.family, "registry full (least recently used)", graph_id=graph.key.id)

    # -- the log ------------------------------------------------------------
    def record(self, kind: str, family: FamilyKey | str, reason: str, **fields) -> Event:
        return self.log.record(kind, family, reason, **fields)

    def reset_counters(self) -> None:
        self.log.reset()
        self.cache.hits = 0

    @property
    def events(self) -> List[Event]:
        return self.log.events

    @property
    def compiles(self) -> List[Event]:
        return self.log.of_kind(COMPILE)

    @property
    def loads(self) -> List[Event]:
        return self.log.of_kind(LOAD)

    @property
    def fallbacks(self) -> List[Event]:
        return self.log.of_kind(FALLBACK)

    @property
    def mismatches(self) -> List[Event]:
        return self.log.of_kind(MISMATCH)

    def add_listener(self, listener: Listener) -> None:
        self.log.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self.log.remove_listener(listener)

    # -- the cache ----------------------------------------------------------
    @property
    def hits(self) -> int:
        return self.cache.hits

    @property
    def generation(self) -> int:
        return self.cache.generation

    def family_lock(self, family: FamilyKey) -> threading.Lock:
        return self.cache.family_lock(family)

    def count_hit(self) -> None:
        self.cache.count_hit()

    def find(self, family: FamilyKey, call: FlatCall) -> tuple[Optional[CompiledGraph], Optional[str]]:
        return self.cache.find(family, call)

    def add(self, graph: CompiledGraph) -> None:
        self.cache.add(graph)

    def graphs(self) -> List[CompiledGraph]:
        return self.cache.graphs()

    def family_graphs(self, family: FamilyKey) -> List[CompiledGraph]:
        return self.cache.family_graphs(family)

    def total_bytes(self) -> int:
        return self.cache.total_bytes()

    def clear(self) -> None:
        self.cache.clear()
        self.verdicts.clear()

    def stats(self) -> dict:
        events = list(self.log.events)
        return {
            "graphs": [
                {"graph_id": g.key.id, "family": g.key.family.describe(), "origin": g.origin,
                 "backend": g.key.family.backend, "bytes": g.nbytes,
                 "shape_range": g.key.shape_range.to_json()}
                for g in self.cache.graphs()
            ],
            "hits": self.cache.hits,
            "counts": dict(self.log.counts),
            "compiles": [e.to_json() for e in events if e.kind == COMPILE],
            "loads": [e.to_json() for e in events if e.kind == LOAD],
            "fallbacks": [e.to_json() for e in events if e.kind == FALLBACK],
            "mismatches": [e.to_json() for e in events if e.kind == MISMATCH],
            "refused": [e.to_json() for e in events if e.kind == REFUSED],
        }


_DEFAULT = GraphRegistry()


def default_registry() -> GraphRegistry:
    return _DEFAULT
