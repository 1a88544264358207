"""The graph library: the one way graphs move between a graphs folder and memory.

Finding a stored graph for a call, loading it (key, integrity and trust
checked by the store), registering it in the graph cache, recording the load
or the refusal, saving a compiled graph, verifying a folder and trusting a
graph all happen here. The compiled forward, the ComfyUI nodes, the diffusers
API, the page's routes and the command line call these functions; none of
them repeats the sequence.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional, Tuple

from ..backends.base import CompiledGraph
from ..keys.graph_keys import FamilyKey
from .manifest import MANIFEST_SUFFIX, Manifest, ManifestError
from .registry import LOAD, REFUSED, GraphRegistry, default_registry
from ..keys.signature import FlatCall
from .graph_store import GraphRefused, GraphStore, StoreError, StoredGraph

log = logging.getLogger("keepfast")


class GraphLibrary:
    """A graphs folder (or none) and the registry graphs from it go into."""

    def __init__(self, store: Optional[GraphStore], registry: Optional[GraphRegistry] = None):
        self.store = store
        self.registry = registry or default_registry()

    # -- finding ---------------------------------------------------------------
    def lookup(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[StoredGraph], Optional[str]]:
        """A stored graph of `family` that serves `call`, or (None, why none does).

        Near misses (another torch version, an unreadable manifest) are
        recorded as refusals, so a user sees why a saved graph was not used.
        """
        if self.store is None:
            return None, None
        try:
            stored, notes = self.store.lookup(family, call)
        except OSError as error:
            return None, f"graphs folder {self.store.root} cannot be read: {error}"
        for note in notes:
            self.registry.record(REFUSED, family, note)
        if stored is None:
            return None, notes[0] if notes else None
        return stored, None

    def in_memory(self, graph_id: str) -> Optional[CompiledGraph]:
        return self.registry.cache.get(graph_id)

    # -- loading ---------------------------------------------------------------
    def load(self, stored: StoredGraph, wanted: Optional[FamilyKey], label: str,
             where: Optional[GraphStore] = None) -> CompiledGraph:
        """Load `stored` (from `where`, default this library's store) for a run that needs `wanted`.

        Returns the graph already in memory when there is one. Raises
        GraphRefused, recorded with its reason, when the graph does not fit
        this run, fails verification, is not trusted or does not load.
        """
        where = where or self.store
        if where is None:
            raise GraphRefused("no graphs folder was given")
        family = stored.manifest.key.family
        if wanted is not None:
            differences = family.differences(wanted)
            if differences:  # checked first: a graph in memory may still not fit this run
                raise self._refused(label, family, f"graph {stored.name} does not fit this run: "
                                    + "; ".join(differences), stored)
        existing = self.in_memory(stored.manifest.graph_id)
        if existing is not None:
            return existing
        started = time.perf_counter()
        try:
            graph = where.load(stored, wanted)
        except GraphRefused as error:
            raise self._refused(label, family, str(error), stored) from None
        self.registry.add(graph)
        self.registry.note_signature(family.signature, stored.manifest.signature)
        self.registry.record(LOAD, family, f"{label}: loaded {stored.name} from {where.root}",
                             seconds=time.perf_counter() - started, graph_id=graph.key.id)
        return graph

    def cast_sibling(self, family: FamilyKey, call: FlatCall, label: str) -> Optional[CompiledGraph]:
        """A graph of the same model that serves `call` with floating inputs cast (input_casts.py), in memory or
        stored (then loaded), as a CastGraph registered under `family`; None when there is none."""
        from ..serving.input_casts import CastGraph, best, cast_call, cast_plan, same_but_signature

        signature = call.signature.to_json()
        candidates = []
        for graph in self.registry.graphs():
            have = graph.key.family
            known = self.registry.signature(have.signature)
            if isinstance(graph, CastGraph) or have.signature == family.signature or known is None \
                    or not same_but_signature(have, family):
                continue
            casts = cast_plan(signature, known)
            if casts is not None and graph.why_not(cast_call(call, casts)) is None:
                candidates.append((graph, casts))
        found = best(candidates)
        if found is None and self.store is not None:
            stored = best(self.store.siblings(family, call))
            if stored is not None:
                try:
                    found = (self.load(stored[0], stored[0].manifest.key.family, label), stored[1])
                except GraphRefused:
                    found = None
        if found is None:
            return None
        graph = CastGraph(found[0], family, found[1])
        self.registry.add(graph)
        return graph

    def _refused(self, label: str, family: FamilyKey, reason: str, stored: StoredGraph) -> GraphRefused:
        self.registry.record(REFUSED, family, f"{label}: {reason}", graph_id=stored.manifest.graph_id)
        log.warning("%s: %s", label, reason)
        return GraphRefused(reason)

    # -- saving ----------------------------------------------------------------
    def save(self, graph: CompiledGraph, signature: dict, label: str) -> StoredGraph:
        """Write `graph` into the store; StoreError (recorded) says why it could not be."""
        if self.store is None:
            raise StoreError("no graphs folder was given")
        try:
            return self.store.save(graph, signature)
        except StoreError as error:
            self.registry.record(REFUSED, graph.key.family, f"{label}: {error}", graph_id=graph.key.id)
            log.warning("%s", error)
            raise


# -- verifying and trusting (no registry needed) ------------------------------------

def trust(where: GraphStore, stored: StoredGraph, source: str) -> None:
    """Add a graph's package to the trust list, after it verifies; GraphRefused says why not.

    A graph is native code: trusting a package whose bytes do not match its
    manifest would vouch for something nobody looked at.
    """
    problems = where.problems(stored)
    if problems:
        raise GraphRefused(problems[0])
    where.trust.add(stored.manifest.package_sha256, source)


def stored_at(path: Path | str) -> Tuple[GraphStore, StoredGraph]:
    """The store and graph of a manifest (or package) file a user named."""
    path = Path(path)
    manifest_path = path if path.name.endswith(MANIFEST_SUFFIX) else path.with_suffix(MANIFEST_SUFFIX)
    try:
        manifest = Manifest.read(manifest_path)
    except (ManifestError, OSError) as error:
        raise GraphRefused(f"{manifest_path}: {error}") from None
    return GraphStore(manifest_path.parent.parent), StoredGraph(manifest, manifest_path)


class NotAGraphsFolder(ValueError):
    """A folder the command line was given is not a graphs folder; the message names the one to give."""


def graphs_folder(path: Path | str) -> Path:
    """`path` if it holds graphs; NotAGraphsFolder, naming the folder to give, otherwise.

    The demo's --out folder holds a `graphs/` folder; users give the parent
    (that used to report every subfolder as a package without a manifest).
    """
    path = Path(path)
    if not path.is_dir():
        raise NotAGraphsFolder(f"{path}: no such folder")
    if _holds_manifests(path):
        return path
    inner = [child for child in [path / "graphs", *sorted(path.glob("*/graphs"))] if _holds_manifests(child)]
    if inner:
        raise NotAGraphsFolder(f"{path} is not a graphs folder; it holds one: give {inner[0]}")
    raise NotAGraphsFolder(f"{path} holds no graphs (a graphs folder holds one subfolder per model, each with "
                           "GRAPH_ID.json manifests; give the folder graphs were saved into, e.g. OUT/graphs "
                           "for the demo or ComfyUI's models/graphs)")


def _holds_manifests(folder: Path) -> bool:
    """Whether a subfolder of `folder` holds a graph manifest (not just any JSON file, such as a workflow)."""
    if not folder.is_dir():
        return False
    for child in folder.iterdir():
        if not child.is_dir() or child.is_symlink():
            continue
        for path in sorted(child.glob("*" + MANIFEST_SUFFIX))[:3]:
            try:
                Manifest.read(path)
            except (ManifestError, OSError):
                continue
            return True
    return False
