"""Model Speedup building its graphs in the background, in ComfyUI (needs COMFYUI_PATH).

kf_background.py samples a tiny SD1.5 UNet (one whole-model graph) and a tiny Flux (block graphs) through
comfy.sample, as queued workflows do: the first image runs uncompiled while the graphs build in child
processes (no compile is recorded during it, the fallback names the build), equal to the model without the
node; once the builds are done, the next image takes the graphs in (their compiles recorded as built in the
background) and the one after it compiles nothing and falls back nowhere; every image equals the model
without the node, and no build process or folder is left.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

TOLERANCE = 2e-3  # latents after 2 steps, float32; as test_comfyui_families.py
FAMILIES = ["sd15", "flux"]


@pytest.fixture(scope="module", params=FAMILIES)
def found(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"background-{request.param}")
    (base / "models" / "graphs").mkdir(parents=True)
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_background.py"), str(S.REPO), str(base), request.param],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


def _close(row) -> bool:
    return row["diff"] <= TOLERANCE * max(1.0, row["scale"])


def test_the_first_image_runs_uncompiled_while_the_graphs_build(found):
    first = found["rows"][0]
    assert "in the background" in found["report"], found["report"]  # the node's default
    assert first["events"]["compile"] == 0, first["compiles"]
    # On this CPU the graphs are traced in forked processes: the first image ran no torch.export in ComfyUI's.
    assert found["fork_unavailable"] is None and found["exports_in_first_image"] == 0, found["fork_unavailable"]
    assert first["live"] + first["waiting"] >= 1, first
    assert any("building in the background" in r for r in first["fallbacks"]), first["fallbacks"]
    assert _close(first), first


def test_the_next_image_takes_the_graphs_in_and_the_one_after_compiles_nothing(found):
    second, third = found["rows"][1], found["rows"][2]
    assert second["compiles"] and all("built in the background" in r for r in second["compiles"]), second
    assert second["fallbacks"] == [] and second["events"]["mismatch"] == 0 and _close(second), second
    assert third["events"]["compile"] == 0 and third["events"]["fallback"] == 0, third
    assert third["events"]["mismatch"] == 0 and _close(third), third
    assert third["live"] == 0 and third["waiting"] == 0 and found["leftover_build_folders"] == []


def test_graph_stats_and_the_stats_route_show_the_builds_in_flight(found):
    (entry,) = found["background_during"]
    blocks = 2 if found["family"] == "flux" else 1  # Flux: double and single stream block structures
    assert entry["total"] == blocks and entry["done"] == 0, entry
    assert f"building in the background: graph 1 of {blocks}" in entry["text"], entry
    assert "building in the background:\n  " + entry["text"] in found["stats_during"], found["stats_during"]


def test_a_model_dropped_while_its_graphs_build_stops_its_builds(found):
    unload = found["unload"]
    assert unload["live"] >= 1 and unload["background"], unload  # its build was running
    assert unload["after"] == 0 and unload["folders"] == [], unload
