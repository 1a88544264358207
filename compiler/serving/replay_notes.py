"""What a user is told about CUDA graph replays they asked for: one note per graph and reason, never per call.

Why: replays are asked for on a node (or KEEPFAST_CUDA_GRAPHS=1), and several things leave a call without
them while it still runs compiled: a model on the CPU, a backend that has none (OneFlow, block graphs), a capture
that failed or a replay that differed from the plain run (backends/cuda_graphs.py turns replay off for that graph
with the reason). The call is right either way; only its speed differs, so the user gets a note (the event log's
NOTE kind: ComfyUI's log and the page), not a fallback.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Set, Tuple

NoteSink = Callable[[str], None]


class ReplayNotes:
    """The reasons already told for one compiled forward, so each is told once."""

    def __init__(self) -> None:
        self._told: Set[Tuple[str, ...]] = set()

    def after_run(self, graph: Any, device_type: str, label: str, tell: NoteSink) -> Optional[str]:
        """After `graph` served a call on `device_type` with replays asked for: the note told now, if any."""
        key, text = self._why_not(graph, device_type, label)
        if key is None or key in self._told:
            return None
        self._told.add(key)
        tell(text)
        return text

    @staticmethod
    def _why_not(graph: Any, device_type: str, label: str) -> Tuple[Optional[Tuple[str, ...]], str]:
        graph_id = getattr(getattr(graph, "key", None), "id", "?")
        if device_type != "cuda":
            return (("device", device_type), f"{label}: CUDA graph replays were asked for, but the model runs on "
                                             f"{device_type}; its calls run compiled without them")
        state = getattr(graph, "replay_state", None)
        if not callable(state):
            return (("backend", graph_id), f"{label}: graph {graph_id} has no CUDA graph replays (only the aot "
                                           f"backend's whole-model graphs do); its calls run compiled without them")
        for index, entry in sorted(state().items()):
            if entry.get("off"):
                return (("off", graph_id, index, entry["off"]),
                        f"{label}: CUDA graph replays off for graph {graph_id} on cuda:{index}: {entry['off']}; "
                        f"its calls run compiled without them")
        return None, ""
