"""The graph store: a folder of packages and manifests, one subfolder per model structure.

Layout: ROOT/<Architecture>-<structure>/<graph_id>.json plus the package it
names, <graph_id>.<sha256 prefix><suffix>. Naming packages by content means a
manifest always points at the exact bytes it describes, so two writers of
one graph end with one valid pair, whichever renames last. A package without
a manifest is never served; a manifest whose package is missing, truncated or
changed is refused before the package is read as code.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Sequence, Tuple

from .atomic import TEMP_PREFIX, sha256_bytes, sha256_file, write_bytes
from ..backends import get_backend
from ..backends.base import CompiledGraph
from .extraction import run_folder
from ..keys.guards import GuardSet, GuardSyntaxError
from ..keys.graph_keys import FamilyKey
from ..machine.machine_fit import CannotRunHere
from .manifest import MANIFEST_SUFFIX, Manifest, ManifestError
from ..keys.signature import FlatCall
from .trust import TrustList

if TYPE_CHECKING:
    from ..serving.input_casts import Casts

_SAFE_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")


class GraphRefused(Exception):
    """A stored graph may not be used here; the message says why and what to do."""


class StoreError(Exception):
    """Writing to the store failed; nothing half-written was left behind."""


def safe_part(name: str) -> str:
    """One path component of ours: no separators, no '..', no hidden files."""
    if not _SAFE_PART.match(name or "") or ".." in name:
        raise ValueError(f"{name!r} is not a valid graph name (letters, digits, '_', '.', '-' only)")
    return name


def _clean_folder_name(architecture: str, structure: str) -> str:
    arch = re.sub(r"[^A-Za-z0-9_]", "_", architecture)[:64] or "Model"
    return f"{arch}-{structure[:12]}"


@dataclass
class StoredGraph:
    manifest: Manifest
    manifest_path: Path

    @property
    def package_path(self) -> Path:
        return self.manifest_path.parent / self.manifest.package_file

    @property
    def name(self) -> str:
        """How users name a graph: '<folder>/<graph_id>'."""
        return f"{self.manifest_path.parent.name}/{self.manifest.graph_id}"


class GraphStore:
    def __init__(self, root: os.PathLike | str, trust: Optional[TrustList] = None):
        self.root = Path(root)
        self.trust = trust or TrustList()
        self._cache: Dict[Path, Tuple[tuple, object]] = {}

    # -- paths -------------------------------------------------------------
    def folder_for(self, family: FamilyKey) -> Path:
        return self.root / _clean_folder_name(family.architecture, family.structure)

    def claim_path(self, family: FamilyKey) -> Path:
        """The hidden file a process locks while it builds a graph of `family` for this store
        (compiler/builds/claims.py): one builder per family among the processes sharing the folder."""
        return self.folder_for(family) / f".building-{family.id}.lock"

    def resolve(self, name: str) -> Path:
        """A user-given graph name or file, confined to this store."""
        parts = name.replace("\\", "/").strip("/").split("/")
        if name.startswith("/") or not 1 <= len(parts) <= 2:
            raise ValueError(f"{name!r} is not a graph name of this store (use FOLDER/GRAPH_ID)")
        for part in parts:
            safe_part(part)
        path = self.root.joinpath(*parts)
        root = self.root.resolve()
        real = path.resolve()
        if real != root and root not in real.parents:
            raise ValueError(f"{name!r} points outside the graphs folder")
        if path.is_symlink():
            raise ValueError(f"{name!r} is a link; links are not followed in the graphs folder")
        return path

    # -- reading -----------------------------------------------------------
    def _read_manifest(self, path: Path) -> Manifest:
        stat = path.stat()
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = self._cache.get(path)
        if cached and cached[0] == stamp:
            value = cached[1]
        else:
            try:
                value = Manifest.read(path)
            except ManifestError as error:
                value = error
            self._cache[path] = (stamp, value)
        if isinstance(value, ManifestError):
            raise value
        return value

    def _manifest_paths(self, folder: Optional[Path] = None) -> Iterator[Path]:
        folders = [folder] if folder else (sorted(p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink())
                                          if self.root.is_dir() else [])
        for sub in folders:
            if not sub.is_dir():
                continue
            for path in sorted(sub.glob("*" + MANIFEST_SUFFIX)):
                if not path.name.startswith(".") and not path.is_symlink():
                    yield path

    def entries(self) -> List[Tuple[Path, Optional[StoredGraph], Optional[str]]]:
        """Every manifest: (path, graph or None, problem or None)."""
        out = []
        for path in self._manifest_paths():
            try:
                out.append((path, StoredGraph(self._read_manifest(path), path), None))
            except (ManifestError, OSError) as error:
                out.append((path, None, str(error)))
        return out

    def graphs(self) -> List[StoredGraph]:
        return [graph for _, graph, _ in self.entries() if graph is not None]

    def get(self, name: str) -> StoredGraph:
        path = self.resolve(name)
        if path.suffix != MANIFEST_SUFFIX:
            path = path.with_name(path.name + MANIFEST_SUFFIX) if not path.name.endswith(MANIFEST_SUFFIX) else path
        try:
            return StoredGraph(self._read_manifest(path), path)
        except FileNotFoundError:
            raise GraphRefused(f"no graph named {name!r} in {self.root}") from None
        except ManifestError as error:
            raise GraphRefused(f"graph {name!r}: {error}") from None

    def lookup(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[StoredGraph], List[str]]:
        """A stored graph of this family that serves the call, and notes on near misses."""
        notes: List[str] = []
        folder = self.folder_for(family)
        if not folder.is_dir():
            return None, notes
        for path in self._manifest_paths(folder):
            try:
                manifest = self._read_manifest(path)
            except (ManifestError, OSError) as error:
                notes.append(f"{path.name}: {error}")
                continue
            have = manifest.key.family
            if have.structure != family.structure or have.signature != family.signature:
                continue
            differences = have.differences(family)
            superseded = manifest.superseded()
            if differences or superseded:
                notes.append(f"{path.parent.name}/{manifest.graph_id} not used: "
                             + "; ".join(differences + ([superseded] if superseded else [])))
                continue
            try:
                failure = GuardSet(manifest.info.guards).first_failure(call.shapes)
            except (GuardSyntaxError, SyntaxError) as error:
                notes.append(f"{path.name}: unreadable guard ({error})")
                continue
            if failure is None:
                return StoredGraph(manifest, path), notes
        return None, notes

    def siblings(self, family: FamilyKey, call: FlatCall) -> List[Tuple[StoredGraph, Casts]]:
        """Stored graphs of the same model, dtype, device and backend that serve `call` with some of its floating
        inputs cast to other dtypes (input_casts.py), with those casts."""
        from ..serving.input_casts import cast_plan, same_but_signature

        out = []
        folder = self.folder_for(family)
        if not folder.is_dir():
            return out
        signature = call.signature.to_json()
        for path in self._manifest_paths(folder):
            try:
                manifest = self._read_manifest(path)
            except (ManifestError, OSError):
                continue  # lookup() already noted it
            have = manifest.key.family
            if have.signature == family.signature or not same_but_signature(have, family) or manifest.superseded():
                continue
            casts = cast_plan(signature, manifest.signature)
            if casts is None:
                continue
            try:
                if GuardSet(manifest.info.guards).first_failure(call.shapes) is None:
                    out.append((StoredGraph(manifest, path), casts))
            except (GuardSyntaxError, SyntaxError):
                continue
        return out

    # -- verifying and loading ----------------------------------------------
    def problems(self, stored: StoredGraph) -> List[str]:
        """Integrity problems of a stored graph (empty when it verifies)."""
        package = stored.package_path
        if not package.is_file() or package.is_symlink():
            return [f"package {package.name} is missing"]
        size = package.stat().st_size
        if size != stored.manifest.package_bytes:
            return [f"package {package.name} has {size} bytes, the manifest says "
                    f"{stored.manifest.package_bytes} (truncated or replaced)"]
        if sha256_file(package) != stored.manifest.package_sha256:
            return [f"package {package.name} does not match its checksum (corrupt or changed)"]
        return []

    def load(self, stored: StoredGraph, family: Optional[FamilyKey] = None) -> CompiledGraph:
        """Check key, integrity and trust, then load; GraphRefused says why not."""
        manifest = stored.manifest
        if family is not None:
            differences = manifest.key.family.differences(family)
            if differences:
                raise GraphRefused(f"graph {stored.name} does not fit this run: " + "; ".join(differences))
        superseded = manifest.superseded()
        if superseded:
            raise GraphRefused(f"graph {stored.name} was {superseded}")
        try:
            data = stored.package_path.read_bytes()
        except OSError as error:
            raise GraphRefused(f"graph {stored.name}: cannot read its package ({error.strerror or error})") from None
        if len(data) != manifest.package_bytes or sha256_bytes(data) != manifest.package_sha256:
            raise GraphRefused(
                f"graph {stored.name}: package does not match its manifest's checksum "
                "(truncated, corrupt or changed); it was not loaded"
            )
        if not self.trust.is_trusted(manifest.package_sha256):
            raise GraphRefused(
                f"graph {stored.name} was not built on this machine and is not trusted; a graph is "
                f"native code. To trust it: python -m compiler graphs trust {stored.manifest_path}"
            )
        try:
            backend = get_backend(manifest.key.family.backend)
            return backend.load_bytes(data, manifest.key, manifest.info)
        except CannotRunHere as error:  # checked before the package's library is loaded
            raise GraphRefused(f"graph {stored.name} cannot run on this machine: {error}") from None
        except Exception as error:  # a package that verifies but will not load
            raise GraphRefused(f"graph {stored.name} failed to load: {type(error).__name__}: {error}") from None

    # -- writing -----------------------------------------------------------
    def save(self, graph: CompiledGraph, signature: dict, origin: str = "built here") -> StoredGraph:
        if not graph.persistent:
            reason = get_backend(graph.key.family.backend).persist_unavailable_reason()
            raise StoreError(reason or f"graphs of the {graph.key.family.backend} backend cannot be saved")
        family = graph.key.family
        folder = self.folder_for(family)
        suffix = get_backend(family.backend).package_suffix
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="keepfast-save-", dir=run_folder()) as scratch:
                scratch_path = Path(scratch) / "package"
                info = graph.write_package(scratch_path)
                data = scratch_path.read_bytes()
            sha = sha256_bytes(data)
            manifest = Manifest(
                key=graph.key, package_file=f"{graph.key.id}.{sha[:16]}{suffix}",
                package_sha256=sha, package_bytes=len(data), info=info, signature=signature, origin=origin,
            )
            return self._write(folder, manifest, data)
        except OSError as error:
            raise StoreError(_write_error_message(folder, error)) from error

    def import_graph(self, manifest: Manifest, data: bytes, origin: str) -> StoredGraph:
        folder = self.folder_for(manifest.key.family)
        manifest.origin = origin
        try:
            folder.mkdir(parents=True, exist_ok=True)
            return self._write(folder, manifest, data)
        except OSError as error:
            raise StoreError(_write_error_message(folder, error)) from error

    def _write(self, folder: Path, manifest: Manifest, data: bytes) -> StoredGraph:
        graph_id = manifest.graph_id
        manifest_path = folder / f"{graph_id}{MANIFEST_SUFFIX}"
        with open(folder / f".{graph_id}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            package_path = folder / manifest.package_file
            existed = package_path.exists()
            write_bytes(package_path, data)
            try:
                write_bytes(manifest_path, manifest.dumps())
            except BaseException:
                if not existed:  # leave the folder exactly as it was
                    package_path.unlink(missing_ok=True)
                raise
            for stale in folder.glob(f"{graph_id}.*"):
                if stale.name not in (manifest.package_file, manifest_path.name):
                    stale.unlink(missing_ok=True)
        if manifest.origin == "built here":
            self.trust.add(manifest.package_sha256, f"built on this machine into {folder}")
        return StoredGraph(manifest, manifest_path)

    def remove(self, name: str) -> List[Path]:
        stored = self.get(name)
        removed = []
        for path in (stored.manifest_path, stored.package_path):
            if path.exists():
                path.unlink()
                removed.append(path)
        return removed

    def verify(self) -> List[Tuple[Path, str]]:
        """(file, problem) for every manifest or package that does not verify."""
        bad: List[Tuple[Path, str]] = []
        referenced = set()
        for path, stored, problem in self.entries():
            if stored is None:
                bad.append((path, problem or "unreadable manifest"))
                continue
            referenced.add(stored.package_path)
            for issue in self.problems(stored):
                bad.append((stored.package_path, issue))
        if self.root.is_dir():
            for sub in self.root.iterdir():
                if not sub.is_dir():
                    continue
                for file in sub.iterdir():
                    if file.name.startswith((".", TEMP_PREFIX)) or file.suffix == MANIFEST_SUFFIX:
                        continue
                    if file not in referenced:
                        bad.append((file, "package without a manifest (left by an interrupted save?)"))
        return bad


class MultiRootStore(GraphStore):
    """A GraphStore that writes into its first folder and finds graphs in all of them.

    ComfyUI knows several `graphs` folders (models/graphs and those from
    extra_model_paths.yaml): graphs are found in any, written to the first.
    """

    def __init__(self, roots: Sequence[Path | str], trust: Optional[TrustList] = None):
        if not roots:
            raise ValueError("no graphs folder")
        super().__init__(roots[0], trust)
        self.others = [GraphStore(root, self.trust) for root in roots[1:]]

    @property
    def stores(self) -> List[GraphStore]:
        """Every folder's store, the one written into first."""
        return [self] + self.others

    @property
    def roots(self) -> List[Path]:
        return [store.root for store in self.stores]

    def lookup(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[StoredGraph], List[str]]:
        found, notes = super().lookup(family, call)
        for store in self.others:
            if found is not None:
                break
            found, more = store.lookup(family, call)
            notes += more
        return found, notes

    def siblings(self, family: FamilyKey, call: FlatCall) -> List[Tuple[StoredGraph, Casts]]:
        return [found for store in self.stores for found in GraphStore.siblings(store, family, call)]

    def store_for(self, path: Path) -> Tuple[GraphStore, str]:
        """The store holding `path` and the graph's name in it."""
        path = Path(path)
        for store in self.stores:
            root = store.root
            try:
                relative = path.relative_to(root)
            except ValueError:
                try:
                    relative = path.resolve().relative_to(root.resolve())
                except ValueError:
                    continue
            return store, relative.as_posix()
        raise ValueError(f"{path} is not inside a graphs folder ({', '.join(map(str, self.roots))})")

    def all_graphs(self) -> List[Tuple[GraphStore, Path, Optional[StoredGraph], Optional[str]]]:
        out = []
        for store in self.stores:
            for path, stored, problem in store.entries():
                out.append((store, path, stored, problem))
        return out


def _write_error_message(folder: Path, error: OSError) -> str:
    if error.errno == errno.ENOSPC:
        return f"disk full while saving a graph into {folder}; nothing was written, the graph stays in memory"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write graphs into {folder}: it is read-only ({error.strerror}); the graph stays in memory"
    return f"saving a graph into {folder} failed: {error}; nothing was written"
