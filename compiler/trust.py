"""The local trust list: which graph packages this machine may load.

A package is native code. It is loaded only if its sha256 is on this list,
which holds packages this machine built itself and ones the user approved
(a node option, the graph library's button, or `graphs trust FILE`). The list
lives outside the graphs folder, so a shared or read-only graphs folder
cannot vouch for itself.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
from pathlib import Path
from typing import Dict, Optional

from .atomic import write_bytes

TRUST_ENV = "KEEPFAST_TRUST_FILE"


def default_trust_path() -> Path:
    if os.environ.get(TRUST_ENV):
        return Path(os.environ[TRUST_ENV])
    base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "keepfast" / "trusted.json"


class TrustList:
    def __init__(self, path: Optional[Path] = None):
        self.path = Path(path) if path else default_trust_path()

    def _read(self) -> Dict[str, dict]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}
        entries = data.get("trusted") if isinstance(data, dict) else None
        return entries if isinstance(entries, dict) else {}

    def is_trusted(self, sha256: str) -> bool:
        return sha256 in self._read()

    def source_of(self, sha256: str) -> Optional[str]:
        entry = self._read().get(sha256)
        return entry.get("source") if isinstance(entry, dict) else None

    def add(self, sha256: str, source: str) -> None:
        """Record `sha256` as trusted (read-modify-write under a file lock)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_path = self.path.with_name("." + self.path.name + ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._read()
            if sha256 in entries:
                return
            entries[sha256] = {
                "source": source,
                "added": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            }
            payload = json.dumps({"format": 1, "trusted": entries}, indent=1, sort_keys=True)
            write_bytes(self.path, payload.encode())

    def remove(self, sha256: str) -> None:
        lock_path = self.path.with_name("." + self.path.name + ".lock")
        if not self.path.exists():
            return
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._read()
            if entries.pop(sha256, None) is not None:
                payload = json.dumps({"format": 1, "trusted": entries}, indent=1, sort_keys=True)
                write_bytes(self.path, payload.encode())
