"""Pull: copy the graphs of a remote library that fit this machine (and a model) into a graphs folder.

Checked before download, in this order, per graph: the manifest (a few KB)
is read and parsed by the store's own `Manifest`; what the graph needs is
compared with this machine and the model (`select.fit_problems`); the
manifest's signature is checked against the trusted builder keys. Only a
graph that passes all three has its package downloaded, which is then
checked against the manifest's size and sha256 and written by the store's
own atomic import (temp file, fsync, rename), so the graphs folder never
holds a half-written file. A graph signed by a trusted key is added to the
local trust list, so it loads with no further question; one accepted
unsigned (`accept_unsigned`) is not trusted, like an imported bundle.

A remote that cannot be listed (no bucket, no credentials, a timeout) gives
a result with `error` set and nothing written: the worker serves eager, or
compiles, as it would with no library.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterable, List, Mapping, Optional

import torch

from ..store.atomic import sha256_bytes
from ..store.manifest import MANIFEST_SUFFIX, Manifest, ManifestError
from ..store.graph_store import GraphStore, StoreError, StoredGraph, safe_part
from ..store.trust import TrustList
from . import signing
from .location import RemoteError, RemoteLibrary
from .select import ModelSelector, fit_problems, selector_for_module

log = logging.getLogger("keepfast")

MAX_MANIFEST_BYTES = 16 << 20  # a manifest is a few KB; a library cannot make a worker read more than this


class PullStatus(str, Enum):
    PULLED = "pulled"  # downloaded, verified and written
    PRESENT = "present"  # this folder already holds the same package
    FITS = "fits"  # a dry run: would be pulled
    SKIPPED = "skipped"  # does not fit this machine or model: its package was not downloaded
    REFUSED = "refused"  # bad or untrusted signature, a package that does not match, an unreadable manifest


@dataclass(frozen=True)
class PullOutcome:
    name: str  # FOLDER/GRAPH_ID, as the remote lays it out (the graphs folder's layout)
    status: PullStatus
    reason: str = ""
    bytes: int = 0  # package bytes downloaded for this graph
    trusted: bool = False  # whether this machine will load it now
    signer: str = ""


@dataclass
class PullResult:
    url: str
    folder: Path
    outcomes: List[PullOutcome] = field(default_factory=list)
    bytes_downloaded: int = 0  # everything read from the remote: manifests and packages
    seconds: float = 0.0
    error: Optional[str] = None  # the library could not be read at all (nothing was written)

    def having(self, status: PullStatus) -> List[PullOutcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def pulled(self) -> List[PullOutcome]:
        return self.having(PullStatus.PULLED)

    @property
    def refused(self) -> List[PullOutcome]:
        return self.having(PullStatus.REFUSED)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.refused

    def summary(self) -> str:
        if self.error:
            return f"graphs from {self.url} not pulled: {self.error}"
        counts = ", ".join(f"{len(self.having(s))} {s.value}" for s in PullStatus if self.having(s))
        return (f"{counts or 'no graphs'} from {self.url} into {self.folder} "
                f"({self.bytes_downloaded / 1e6:.1f} MB read in {self.seconds:.2f} s)")

    def to_json(self) -> dict:
        return {"url": self.url, "folder": str(self.folder), "error": self.error, "seconds": self.seconds,
                "bytes_downloaded": self.bytes_downloaded,
                "graphs": [{"name": o.name, "status": o.status.value, "reason": o.reason, "bytes": o.bytes,
                            "trusted": o.trusted, "signer": o.signer} for o in self.outcomes]}


def _graph_name(relative: str) -> Optional[str]:
    """'FOLDER/GRAPH_ID' for a remote manifest path, or None for a name the store would not accept."""
    parts = relative.split("/")
    if len(parts) != 2 or not parts[1].endswith(MANIFEST_SUFFIX):
        return None
    try:
        safe_part(parts[0])
        safe_part(parts[1][: -len(MANIFEST_SUFFIX)])
    except ValueError:
        return None
    return f"{parts[0]}/{parts[1][: -len(MANIFEST_SUFFIX)]}"


def _local_copy(store: GraphStore, manifest: Manifest) -> Optional[bool]:
    """Whether the graphs folder holds this graph, verified: True with the same package, False with a build
    of its own (kept: a graph that works here is not replaced); None when it holds no usable copy."""
    path = store.folder_for(manifest.key.family) / f"{manifest.graph_id}{MANIFEST_SUFFIX}"
    try:
        local = Manifest.read(path)
    except (ManifestError, OSError):
        return None
    if store.problems(StoredGraph(local, path)):
        return None  # a broken local copy is replaced by the library's
    return local.package_sha256 == manifest.package_sha256


def _pull_one(remote: RemoteLibrary, store: GraphStore, relative: str, selector: Optional[ModelSelector],
              dtype: Optional[str], trusted_keys: Mapping[str, Any], accept_unsigned: bool,
              dry_run: bool) -> PullOutcome:
    name = _graph_name(relative)
    if name is None:
        return PullOutcome(relative, PullStatus.REFUSED, "not a graph name this store accepts; ignored")
    try:
        raw = remote.read(relative, limit=MAX_MANIFEST_BYTES)
        if len(raw) > MAX_MANIFEST_BYTES:
            return PullOutcome(name, PullStatus.REFUSED, f"its manifest is larger than {MAX_MANIFEST_BYTES} bytes; "
                                                         "not a graph manifest")
        data = json.loads(raw)
        manifest = Manifest.from_json(data)
    except (ValueError, ManifestError) as error:
        return PullOutcome(name, PullStatus.REFUSED, f"unreadable manifest: {error}")
    if manifest.graph_id != name.split("/")[1]:
        return PullOutcome(name, PullStatus.REFUSED, "the manifest's graph id does not match its file name")
    if not manifest.package_file.startswith(manifest.graph_id + "."):  # the store names packages so
        return PullOutcome(name, PullStatus.REFUSED, f"its manifest names a package {manifest.package_file!r} "
                                                     "that is not one of its graph's names")
    problems = fit_problems(manifest, selector, dtype)
    if problems:
        return PullOutcome(name, PullStatus.SKIPPED, "; ".join(problems))
    verdict = signing.check(data, trusted_keys)
    if not verdict.ok and not (verdict.unsigned and accept_unsigned):
        return PullOutcome(name, PullStatus.REFUSED, f"not downloaded: {verdict.problem}", signer=verdict.signer)
    same = _local_copy(store, manifest)
    if same is not None:
        trusted = _trust(store, manifest, verdict, remote.url) if same else False
        reason = "already in this graphs folder" if same else \
            "this graphs folder holds its own build of this graph, which is kept"
        return PullOutcome(name, PullStatus.PRESENT, reason, trusted=trusted, signer=verdict.signer)
    if dry_run:
        return PullOutcome(name, PullStatus.FITS, "fits; not downloaded (dry run)", signer=verdict.signer)
    package_name = f"{name.split('/')[0]}/{manifest.package_file}"
    try:
        package = remote.read(package_name, limit=manifest.package_bytes)
    except RemoteError as error:
        return PullOutcome(name, PullStatus.REFUSED, f"download failed, nothing written: {error}")
    if len(package) != manifest.package_bytes:
        return PullOutcome(name, PullStatus.REFUSED, (
            f"its package downloaded as {len(package)} bytes, the manifest says {manifest.package_bytes} "
            "(truncated or replaced); nothing was written"), bytes=len(package), signer=verdict.signer)
    if sha256_bytes(package) != manifest.package_sha256:
        return PullOutcome(name, PullStatus.REFUSED, (
            "its package does not match the manifest's checksum (corrupt or changed); nothing was written"),
            bytes=len(package), signer=verdict.signer)
    store.import_graph(manifest, package, origin=f"pulled from {remote.url}")
    trusted = _trust(store, manifest, verdict, remote.url)
    reason = "" if trusted else ("unsigned: not trusted; to trust it: python -m compiler graphs trust "
                                 f"{store.folder_for(manifest.key.family) / (manifest.graph_id + MANIFEST_SUFFIX)}")
    return PullOutcome(name, PullStatus.PULLED, reason, bytes=len(package), trusted=trusted, signer=verdict.signer)


def _trust(store: GraphStore, manifest: Manifest, verdict: signing.SignatureCheck, url: str) -> bool:
    if verdict.ok:
        who = f"{verdict.signer} (key {verdict.key_id})" if verdict.signer else f"key {verdict.key_id}"
        store.trust.add(manifest.package_sha256, f"signed by {who}, pulled from {url}", key_id=verdict.key_id)
        return True
    return store.trust.is_trusted(manifest.package_sha256)


def pull(url: str, folder: Path | str, selector: Optional[ModelSelector] = None, dtype: Optional[str] = None,
         options: Optional[Mapping[str, Any]] = None, trust: Optional[TrustList] = None,
         accept_unsigned: bool = False, dry_run: bool = False, names: Optional[Iterable[str]] = None) -> PullResult:
    """Pull what fits from the library at `url` into the graphs folder `folder` (only `names`,
    FOLDER/GRAPH_ID, if given: the page's "pull this graph"). Never raises for a remote problem: the
    result's `error` (library unreadable) or its refused outcomes say what went wrong."""
    started = time.perf_counter()
    result = PullResult(url, Path(folder))
    store = GraphStore(folder, trust)
    remote: Optional[RemoteLibrary] = None
    try:
        remote = RemoteLibrary.open(url, options)
        listed = remote.manifest_names()
        if names is not None:
            wanted = {f"{name.strip('/')}{MANIFEST_SUFFIX}" for name in names}
            listed = [relative for relative in listed if relative in wanted]
        trusted_keys = store.trust.keys()
        for relative in listed:
            result.outcomes.append(_pull_one(remote, store, relative, selector, dtype, trusted_keys,
                                             accept_unsigned, dry_run))
    except (RemoteError, StoreError) as error:
        result.error = str(error)
    finally:
        result.bytes_downloaded = remote.bytes_read if remote is not None else 0
        result.seconds = time.perf_counter() - started
    return result


def pull_for(url: str, folder: Path | str, module: Optional[torch.nn.Module] = None, block_family=None,
             structures: Optional[Iterable[str]] = None, dtype: Optional[str] = None,
             options: Optional[Mapping[str, Any]] = None, trust: Optional[TrustList] = None,
             accept_unsigned: bool = False) -> PullResult:
    """What a ComfyUI node calls: pull the graphs that fit here of `module` (its own, its parts' and its
    blocks') or, when the caller knows them already, of exactly `structures` (a CompiledForward's
    `structure()`, a BlockEngine's group structures); neither: every graph that fits the machine.

    Never raises: a library that cannot be read gives a result with `error`,
    logged, and the model serves eager (or compiles) as with no library.
    """
    started = time.perf_counter()
    try:
        selector = None
        if structures is not None:
            selector = ModelSelector(frozenset(structures), type(module).__name__ if module is not None else "the model")
        elif module is not None:
            selector = selector_for_module(module, block_family)
        result = pull(url, folder, selector, dtype, options, trust, accept_unsigned)
    except Exception as error:  # noqa: BLE001 - a worker must start whatever the library does
        result = PullResult(url, Path(folder), error=f"{type(error).__name__}: {error}",
                            seconds=time.perf_counter() - started)
    (log.warning if result.error or result.refused else log.info)("[KeepFast] %s", result.summary())
    for outcome in result.refused:
        log.warning("[KeepFast] %s refused: %s", outcome.name, outcome.reason)
    return result
