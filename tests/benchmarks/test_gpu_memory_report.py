"""Live GPU allocations grouped by the line that made them (benchmarks/gpu_memory.py): the fourth H200
run's Flux under partial loading peaked at 11396 MB for a 1311 MB model, and a peak alone says not whose."""

from __future__ import annotations

from benchmarks import gpu_memory


def _block(mb, state, *files):
    return {"size": int(mb * 2 ** 20), "state": state,
            "frames": [{"filename": f, "line": 10 + i, "name": f"f{i}"} for i, f in enumerate(files)]}


def test_live_allocations_are_grouped_by_the_first_frame_outside_torch_the_largest_first():
    snapshot = {"segments": [
        {"blocks": [_block(300, "active_allocated", "/x/torch/_tensor.py", "/pack/nodes/lowvram.py"),
                    _block(300, "active_allocated", "/x/torch/_tensor.py", "/pack/nodes/lowvram.py"),
                    _block(500, "inactive", "/pack/nodes/lowvram.py")]},
        {"blocks": [_block(100, "active_allocated", "/c/comfy/ops.py"),
                    _block(7, "active_allocated")]}]}
    found = gpu_memory.live_by_frame(snapshot)
    assert found[0] == {"where": "nodes/lowvram.py:11 f1", "mb": 600.0, "blocks": 2}  # freed blocks not counted
    assert found[1] == {"where": "comfy/ops.py:10 f0", "mb": 100.0, "blocks": 1}
    assert found[2]["where"].startswith("no Python frame") and found[2]["mb"] == 7.0
    assert gpu_memory.live_by_frame({"segments": []}) == []
