"""What the nodes show: a node's report (its lines and the registry's messages while it ran) and the Stats
node's text."""

from __future__ import annotations

import time
from typing import List

from . import runtime


class Report:
    """The lines a node shows, plus the registry's messages (compiles, loads, fallbacks) since it started."""

    def __init__(self, title: str):
        self.title = title
        self.lines: List[str] = []
        self.started = time.time()

    def add(self, line: str) -> None:
        self.lines.append(line)

    def text(self) -> str:
        events = runtime.describe(runtime.messages_since(self.started))
        body = self.lines + ([""] + ["during this node:"] + events if events else [])
        return "\n".join([self.title] + ["- " + line if line else "" for line in body])


def stats_text() -> str:
    import json

    data = runtime.stats()
    recent = [m for m in data["messages"] if m.get("kind") != "progress"][-20:]
    lines = [f"{k}: {v}" for k, v in data["counts"].items()]
    if data["time_served"]:
        lines.append(data["time_served"])
    lines.append(f"graphs folders: {', '.join(data['graphs_folders'])}")
    if data["compile_unavailable"]:
        lines.append(f"compiling unavailable: {data['compile_unavailable']}")
    if data["background"]:
        lines.append("building in the background:")
        lines += [f"  {entry['text']}" for entry in data["background"]]
    lines.append("graphs in memory:")
    lines += [f"  {g['graph_id']} {g['family']} ({g['origin']}, {g['bytes'] / 1e6:.1f} MB)" for g in data["graphs"]]
    lines.append("recent events:")
    lines += [f"  {m['kind']}: {m['reason']}" for m in recent]
    return "\n".join(lines) + "\n\n" + json.dumps(data["counts"])
