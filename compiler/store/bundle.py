"""Graph bundles: one file to share a graph (manifest + package, no weights).

A bundle is a zip holding `manifest.json` and `package`; nothing in it is
extracted to a path or unpickled. Importing checks the package against the
manifest's sha256 and refuses a bundle built for another torch version, a
device kind this machine lacks, or (when the caller says which it needs)
another dtype -- naming the difference. An imported graph is *not* trusted:
the user trusts it explicitly (`graphs import --trust`, `graphs trust`, or
the graph library), since a package is native code.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import List, Optional

from ..machine import machine_fit
from .atomic import sha256_bytes, write_via
from ..machine.environment import kind_available, torch_version
from .manifest import Manifest, ManifestError
from .graph_store import GraphRefused, GraphStore, StoredGraph

BUNDLE_SUFFIX = ".kfgraph"
_MANIFEST = "manifest.json"
_PACKAGE = "package"
MAX_BUNDLE_BYTES = 4 << 30


def export_bundle(store: GraphStore, name: str, target: Path) -> Path:
    stored = store.get(name)
    problems = store.problems(stored)
    if problems:
        raise GraphRefused(f"graph {name} does not verify, not exporting it: {problems[0]}")
    data = stored.package_path.read_bytes()
    target = Path(target)
    if target.is_dir():
        target = target / f"{stored.manifest_path.parent.name}-{stored.manifest.graph_id}{BUNDLE_SUFFIX}"

    def produce(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as archive:
            archive.writestr(_MANIFEST, stored.manifest.dumps())
            archive.writestr(_PACKAGE, data)

    return write_via(target, produce)


def read_bundle(path: Path) -> tuple[Manifest, bytes]:
    path = Path(path)
    try:
        if path.stat().st_size > MAX_BUNDLE_BYTES:
            raise GraphRefused(f"{path.name} is larger than a graph bundle can be")
        with zipfile.ZipFile(path) as archive:
            names = set(archive.namelist())
            if names != {_MANIFEST, _PACKAGE}:
                raise GraphRefused(f"{path.name} is not a graph bundle (it holds {sorted(names)[:5]})")
            manifest = Manifest.from_json(json.loads(archive.read(_MANIFEST)))
            data = archive.read(_PACKAGE)
    except (OSError, zipfile.BadZipFile, ValueError, ManifestError) as error:
        raise GraphRefused(f"{path.name} cannot be read as a graph bundle: {error}") from None
    if len(data) != manifest.package_bytes or sha256_bytes(data) != manifest.package_sha256:
        raise GraphRefused(f"{path.name}: the package does not match the manifest's checksum (corrupt or tampered)")
    return manifest, data


def compatibility_problems(manifest: Manifest, expect_dtype: Optional[str] = None) -> List[str]:
    family = manifest.key.family
    problems = []
    if family.torch_version != torch_version():
        problems.append(f"built for torch {family.torch_version}, this is torch {torch_version()}")
    if not kind_available(family.device):
        problems.append(f"built for device {family.device}, which this machine does not have")
    if expect_dtype and family.dtype != expect_dtype:
        problems.append(f"built for dtype {family.dtype}, {expect_dtype} was asked for")
    # the CPU level or GPU it was built for: the loader checks the same before loading
    reason = machine_fit.why_not_here(manifest.info.needs)
    if reason:
        problems.append(reason)
    return problems


def import_bundle(store: GraphStore, path: Path, trust: bool = False,
                  expect_dtype: Optional[str] = None) -> StoredGraph:
    manifest, data = read_bundle(path)
    problems = compatibility_problems(manifest, expect_dtype)
    if problems:
        raise GraphRefused(f"{Path(path).name} refused: " + "; ".join(problems))
    origin = f"imported from {Path(path).name}"
    stored = store.import_graph(manifest, data, origin=origin)
    if trust:
        store.trust.add(manifest.package_sha256, f"trusted by the user on import of {Path(path).name}")
    return stored
