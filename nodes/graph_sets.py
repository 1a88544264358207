"""Graph sets: `<graphs>/<name>.json` lists the graphs Save Graph wrote under a user's name.

Load Graph picks them back by that name. The format is versioned; a file that
is not a graph set, or of another version, is refused with the reason.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from pathlib import Path
from typing import Any, Iterable, List

from ..compiler import safe_path_part, write_file_atomically

SET_FORMAT = "keepfast-graph-set"
SET_FORMAT_VERSION = 1


class GraphSetError(ValueError):
    """A graph set file is unreadable or not one."""


def set_file_name(name: str) -> str:
    name = (name or "").strip()
    if name.endswith(".json"):
        name = name[: -len(".json")]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-") or "keepfast"
    return safe_path_part(name) + ".json"


def write_graph_set(root: Path | str, name: str, graphs: Iterable[str], note: str = "") -> Path:
    """Write `<root>/<name>.json` listing graphs by their store names ('<folder>/<graph_id>')."""
    path = Path(root) / set_file_name(name)
    payload = {
        "format": SET_FORMAT,
        "format_version": SET_FORMAT_VERSION,
        "graphs": sorted(set(graphs)),
        "note": note,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())
    return path


def read_json(path: Path | str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise GraphSetError(f"cannot read {Path(path).name}: {error}") from error


def is_graph_set(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == SET_FORMAT


def graph_set_entries(data: Any, name: str = "graph set") -> List[str]:
    if not is_graph_set(data):
        raise GraphSetError(f"{name} is not a graph set")
    if data.get("format_version") != SET_FORMAT_VERSION:
        raise GraphSetError(f"{name}: set format {data.get('format_version')}, this pack reads {SET_FORMAT_VERSION}")
    graphs = data.get("graphs")
    if not isinstance(graphs, list) or not all(isinstance(g, str) for g in graphs):
        raise GraphSetError(f"{name}: 'graphs' must be a list of graph names")
    return list(graphs)
