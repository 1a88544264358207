"""The local trust list: which graph packages, and which builders' keys, this machine trusts.

A package is native code. It is loaded only if its sha256 is on this list,
which holds packages this machine built itself and ones the user approved
(a node option, the graph library's button, or `graphs trust FILE`). The list
lives outside the graphs folder, so a shared or read-only graphs folder
cannot vouch for itself.

It also holds the public keys of builders the user trusts (`graphs
trust-key`): a graph pulled from a remote library whose manifest one of them
signed is added to the package list on the way in (compiler/remote), so a
team trusts a builder once instead of every file. Removing a key removes the
packages trusted because of it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
from pathlib import Path
from typing import Dict, Optional

from ..settings import TRUST_FILE, trust_file
from .atomic import write_bytes

TRUST_ENV = TRUST_FILE.name


def default_trust_path() -> Path:
    configured = trust_file()
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "keepfast" / "trusted.json"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class TrustList:
    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path else default_trust_path()

    def _read_all(self) -> Dict[str, Dict[str, dict]]:
        """Both sections ('trusted' packages by sha256, 'keys' by key id); empty where unreadable."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {"trusted": {}, "keys": {}}
        out = {}
        for section in ("trusted", "keys"):
            entries = data.get(section) if isinstance(data, dict) else None
            out[section] = entries if isinstance(entries, dict) else {}
        return out

    def _read(self) -> Dict[str, dict]:
        return self._read_all()["trusted"]

    def _write_all(self, sections: Dict[str, Dict[str, dict]]) -> None:
        payload = {"format": 1, "trusted": sections["trusted"]}
        if sections["keys"]:
            payload["keys"] = sections["keys"]
        write_bytes(self.path, json.dumps(payload, indent=1, sort_keys=True).encode())

    def _update(self, change) -> None:
        """Read-modify-write under a file lock; `change(sections)` returns whether to write."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name("." + self.path.name + ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            sections = self._read_all()
            if change(sections):
                self._write_all(sections)

    def is_trusted(self, sha256: str) -> bool:
        return sha256 in self._read()

    def source_of(self, sha256: str) -> Optional[str]:
        entry = self._read().get(sha256)
        return entry.get("source") if isinstance(entry, dict) else None

    def add(self, sha256: str, source: str, key_id: Optional[str] = None) -> None:
        """Record `sha256` as trusted; `key_id`: the trusted builder key whose signature vouched for it."""

        def change(sections) -> bool:
            if sha256 in sections["trusted"]:
                return False
            entry = {"source": source, "added": _now()}
            if key_id:
                entry["key"] = key_id
            sections["trusted"][sha256] = entry
            return True

        self._update(change)

    def remove(self, sha256: str) -> None:
        if not self.path.exists():
            return
        self._update(lambda sections: sections["trusted"].pop(sha256, None) is not None)

    # -- builders' public keys -------------------------------------------------------
    def keys(self) -> Dict[str, dict]:
        """Trusted public keys by key id: {"public_key": line, "name": ..., "added": ...}."""
        return self._read_all()["keys"]

    def add_key(self, key_id: str, public_key: str, name: str) -> bool:
        """Trust a builder's public key (an explicit user act); False if it was trusted already."""
        added = []

        def change(sections) -> bool:
            if key_id in sections["keys"]:
                return False
            sections["keys"][key_id] = {"public_key": public_key, "name": name, "added": _now()}
            added.append(key_id)
            return True

        self._update(change)
        return bool(added)

    def remove_key(self, key_id: str) -> int:
        """Stop trusting a key and the packages trusted because of it; how many packages went."""
        dropped = []

        def change(sections) -> bool:
            if sections["keys"].pop(key_id, None) is None:
                return False
            for sha, entry in list(sections["trusted"].items()):
                if isinstance(entry, dict) and entry.get("key") == key_id:
                    del sections["trusted"][sha]
                    dropped.append(sha)
            return True

        if self.path.exists():
            self._update(change)
        return len(dropped)
