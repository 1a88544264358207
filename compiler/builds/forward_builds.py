"""One wrapper's background builds: started in a child process, adopted from the process's build book, taken in.

Split from the wrapper (compiled_forward.py) because it is a job of its own: a background build belongs to the
process (build_book.py), not to the wrapper that started it, so this side only remembers which of the book's
builds its families wait for, takes finished ones in (the graph joins the registry, is recorded, saved when
autosave is on) and says why a failed one leaves its inputs eager.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from . import claims as build_claims
from ..backends.base import BuildLabel, CompileDeferred
from .book import Building, book_key
from ..keys.graph_keys import FamilyKey, GraphKey
from ..serving.supply import Found, GraphSource, Wrapper
from ..store.registry import PROGRESS
from ..keys.signature import FlatCall

log = logging.getLogger("keepfast")


class ForwardBuilds:
    """The background builds one wrapper's families wait for (the wrapper's `supply.builds`): started, taken in
    and landed with the steps of its graph source (`supply`, serving/supply.py's GraphSource)."""

    def __init__(self, supply: GraphSource, forward: Wrapper):
        self.supply = supply
        self.forward = forward
        # family id -> the registry's book key of its graph's background build (build_book.py: the build is
        # the process's, kept while any module of its structure lives, and taken in by whoever calls first)
        self.building: Dict[str, str] = {}

    @property
    def owner_id(self) -> str:
        return f"{self.forward.label}@{id(self.forward):x}"

    def book_key(self, family: FamilyKey) -> str:
        return book_key(family, self.forward.options.shape_range)

    def start(self, backend, family: FamilyKey, call: FlatCall, reason: str,
              claim: Optional[build_claims.Claim] = None) -> Optional[str]:
        """Start the family's build in a child process and run this call eager (CompileDeferred: not settled,
        a later call finds the graph once it lands; the book's entry holds `claim` until then). Otherwise
        returns why tracing failed (a failed compile), or None where the backend cannot build off the
        caller's process: the caller compiles now, as without the option."""
        forward = self.forward
        key = GraphKey(family, forward.options.shape_range)
        log.info("%s: building in the background (%s)", forward.label, reason)
        pending, failure = self.supply.start_building(family, lambda: backend.start_compile(
            forward.module, forward.forward_fn, call, key,
            BuildLabel(owner=forward.label, what=forward.label, family=family.id, owner_id=self.owner_id)))
        if pending is None:
            return failure
        book_entry = self.book_key(family)
        forward.registry.builds.add(book_entry, Building(pending, family, call, reason, claim, self.owner_id),
                                    forward.module)
        self.building[family.id] = book_entry
        forward.registry.record(PROGRESS, family, f"{forward.label}: building in the background ({reason})",
                                detail={"fraction": 0.0, "background": True})
        raise CompileDeferred("its graph is building in the background; this call runs eager")

    def from_the_book(self, family: FamilyKey, call: FlatCall,
                      wait: bool) -> Found:
        """A background build of this family's graph that the process already has (started by this wrapper or by
        another one of a module of this structure: build_book.py): its graph once taken in (at once when it has
        finished; waited for when `wait`), CompileDeferred (the call runs eager) while it builds, or (None, its
        failure); (None, None) when there is none."""
        forward = self.forward
        key = self.book_key(family)
        book = forward.registry.builds
        failure = book.failure(key)
        if failure is not None:
            return None, failure + " (not retried)"
        building = book.adopt(key, forward.module)
        if building is None:
            return None, None
        if family.id not in self.building:
            self.building[family.id] = key
            if building.started_by != self.owner_id:
                log.info("%s: adopting the background build of its graph started earlier (%.0f s so far)",
                         forward.label, building.pending.seconds)
                forward.registry.record(PROGRESS, family, f"{forward.label}: adopted the background build of its "
                                        f"graph, started earlier for this model ({building.pending.seconds:.0f} s "
                                        "so far)", detail={"fraction": 0.0, "background": True, "adopted": True})
        if wait or building.pending.done():
            self.wait()
            graph, _ = forward.registry.find(family, call)
            if graph is not None:
                return graph, None
            failure = self.supply.failures.get(family.id)
            return (None, failure) if failure else (None, None)  # it landed and does not serve this call
        raise CompileDeferred(f"its graph is building in the background ({building.pending.seconds:.0f} s so far)")

    def land(self) -> int:
        """Take in the background builds of this wrapper's families that finished (whoever started them): their
        graphs serve calls from now on (the first-use check applies to each). A failed build leaves its inputs
        eager with the reason, here and for every other wrapper. Returns how many landed."""
        forward, supply = self.forward, self.supply
        landed = 0
        book = forward.registry.builds
        for family_id, key in list(self.building.items()):
            if book.get(key) is None:  # taken in by another wrapper, or cancelled
                del self.building[family_id]
                failure = book.failure(key)
                if failure is not None:
                    supply.failures[family_id] = failure
                continue
            building = book.take(key)
            if building is None:  # still building
                continue
            del self.building[family_id]
            family = building.family
            try:
                graph, why = supply.take_in(family, "a graph", lambda: building.pending.finish(forward.module))
                if graph is None:
                    book.fail(key, why)
                    continue
                whose = "" if building.started_by == self.owner_id else ", started earlier for this model"
                supply.landed(graph, family, f"{building.reason} (built in the background{whose})",
                              building.pending.seconds, signature=building.call.signature.to_json(),
                              detail={"shapes": [list(s) for s in building.call.shapes],
                                      "background": True, "adopted": bool(whose),
                                      **building.pending.usage, **getattr(graph, "build_usage", {})})
                supply.keep(graph, building.call)
            finally:  # written (or failed): others sharing the store may look now
                build_claims.release(building.claim)
            landed += 1
        return landed

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait until every background build of this wrapper's families has finished (or `timeout` s passed),
        then land them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        book = self.forward.registry.builds

        def running() -> bool:
            return any((b := book.get(key)) is not None and not b.pending.done() for key in self.building.values())

        while running():
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return self.land()

    def cancel(self) -> int:
        """Stop every background build of this wrapper's families (stopping the workflow); returns how many."""
        keys, self.building = list(self.building.values()), {}
        return sum(self.forward.registry.builds.cancel(key) for key in keys)

    @property
    def pending(self) -> int:
        book = self.forward.registry.builds
        return sum(1 for key in self.building.values() if book.get(key) is not None)
