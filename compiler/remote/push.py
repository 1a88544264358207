"""Push: upload a graphs folder's graphs, signed, into a remote library.

Per graph: the local graph must verify (size and sha256, as `graphs verify`);
its manifest is signed with the builder's ed25519 key; the package goes up
first under its content name (`<graph_id>.<sha256 prefix>.pt2`, the store's
own naming, so two builds of one graph never share a package name), then the
signed manifest, create-only (S3's conditional put, a hard link on a local
or network folder). The manifest is the commit point: it appears only once
its package is complete, and when two builders push one graph at once the
first complete manifest wins; the other sees it, leaves it, and removes its
own package if the winner's is another build.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence

from ..store.manifest import MANIFEST_SUFFIX
from ..store.graph_store import GraphStore, StoredGraph
from . import signing
from .location import RemoteError, RemoteLibrary


class PushStatus(str, Enum):
    PUSHED = "pushed"
    PRESENT = "present"  # the library has this graph already (this build, or another that got there first)
    REFUSED = "refused"  # the local graph does not verify


@dataclass(frozen=True)
class PushOutcome:
    name: str
    status: PushStatus
    reason: str = ""
    bytes: int = 0


@dataclass
class PushResult:
    url: str
    outcomes: List[PushOutcome] = field(default_factory=list)
    bytes_uploaded: int = 0
    seconds: float = 0.0
    error: Optional[str] = None

    def having(self, status: PushStatus) -> List[PushOutcome]:
        return [o for o in self.outcomes if o.status == status]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.having(PushStatus.REFUSED)

    def summary(self) -> str:
        if self.error:
            return f"push to {self.url} stopped: {self.error}"
        counts = ", ".join(f"{len(self.having(s))} {s.value}" for s in PushStatus if self.having(s))
        return f"{counts or 'no graphs'} to {self.url} ({self.bytes_uploaded / 1e6:.1f} MB in {self.seconds:.2f} s)"


def _push_one(remote: RemoteLibrary, stored: StoredGraph, problems: List[str], private: Any,
              public: signing.PublicKey) -> PushOutcome:
    if problems:
        return PushOutcome(stored.name, PushStatus.REFUSED, f"does not verify here, not pushed: {problems[0]}")
    folder = stored.manifest_path.parent.name
    manifest_name = f"{folder}/{stored.manifest.graph_id}{MANIFEST_SUFFIX}"
    package_name = f"{folder}/{stored.manifest.package_file}"
    existing = _remote_package_sha(remote, manifest_name)
    if existing is not None:
        same = existing == stored.manifest.package_sha256
        return PushOutcome(stored.name, PushStatus.PRESENT, "already in the library" if same else
                           "the library holds another build of this graph (the first complete upload wins)")
    data = stored.package_path.read_bytes()
    if len(data) != stored.manifest.package_bytes:
        return PushOutcome(stored.name, PushStatus.REFUSED, "its package changed while pushing; not pushed")
    uploaded = 0
    if remote.size(package_name) != len(data):
        remote.put(package_name, data)
        uploaded = len(data)
    manifest = json.loads(stored.manifest_path.read_bytes())
    body = (json.dumps(signing.sign(manifest, private, public), indent=1, sort_keys=True) + "\n").encode()
    if remote.create(manifest_name, body):
        return PushOutcome(stored.name, PushStatus.PUSHED, bytes=uploaded + len(body))
    winner = _remote_package_sha(remote, manifest_name)
    if winner != stored.manifest.package_sha256 and uploaded:
        remote.remove(package_name)  # our build lost: leave no package that no manifest names
    return PushOutcome(stored.name, PushStatus.PRESENT,
                       "another builder pushed this graph first; theirs is kept (the first complete upload wins)")


def _remote_package_sha(remote: RemoteLibrary, manifest_name: str) -> Optional[str]:
    if not remote.exists(manifest_name):
        return None
    try:
        package = json.loads(remote.read(manifest_name)).get("package") or {}
        return str(package.get("sha256"))
    except (ValueError, AttributeError):
        return ""  # an unreadable manifest is still there: it is not replaced (graphs are never overwritten)


def push(folder: Path | str, url: str, key: Path | str, names: Optional[Sequence[str]] = None,
         options: Optional[Mapping[str, Any]] = None) -> PushResult:
    """Sign and upload the graphs of `folder` (or only `names`, FOLDER/GRAPH_ID) to the library at `url`.

    `key`: the builder's private key file (`graphs keygen`). A signing key
    problem raises signing.SigningKeyError before anything is uploaded.
    """
    started = time.perf_counter()
    private, public = signing.load_private_key(Path(key))
    result = PushResult(url)
    store = GraphStore(folder)
    remote: Optional[RemoteLibrary] = None
    try:
        remote = RemoteLibrary.open(url, options, writable=True)
        graphs = [store.get(name) for name in names] if names else store.graphs()
        for stored in graphs:
            result.outcomes.append(_push_one(remote, stored, store.problems(stored), private, public))
    except RemoteError as error:
        result.error = str(error)
    finally:
        result.bytes_uploaded = remote.bytes_written if remote is not None else 0
        result.seconds = time.perf_counter() - started
    return result
