"""The page's badge logic (web/lib/badges.js) under node, on a stand-in graph: no ComfyUI, no browser.

Which KeepFast node an event belongs to is decided by walking up the running
node's MODEL/VAE/GUIDER inputs; a latent input must not lead to the VAE
node of an img2img encode. Skipped, with the reason, where node is absent.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest

BADGES = Path(__file__).resolve().parents[2] / "web" / "lib" / "badges.js"

SCRIPT = r"""
const source = process.argv[1];
const m = await import("data:text/javascript;base64," + source);
class Node {
  constructor(id, type, inputs = []) { this.id = id; this.type = type; this.inputs = inputs.map(([type, from]) => ({ type, link: from == null ? null : 1, from })); }
  getInputNode(slot) { return graph.nodes.get(this.inputs[slot].from); }
}
const graph = { nodes: new Map(), getNodeById(id) { return this.nodes.get(Number(id)); } };
const add = (...args) => graph.nodes.set(args[0], new Node(...args));
add(1, "CheckpointLoaderSimple");
add(2, "KeepFastModelSpeedup", [["MODEL", 1]]);
add(3, "KeepFastVAESpeedup", [["VAE", 1]]);
add(4, "LoraLoader", [["MODEL", 2], ["CLIP", 1]]);
add(5, "VAEEncode", [["IMAGE", null], ["VAE", 3]]);
add(6, "KSampler", [["MODEL", 4], ["CONDITIONING", null], ["CONDITIONING", null], ["LATENT", 5]]);
add(7, "VAEDecode", [["LATENT", 6], ["VAE", 3]]);
add(8, "KeepFastWarmupGraphs", [["MODEL", 2], ["VAE", 3]]);
const ids = (nodes) => nodes.map((n) => n.id);
const out = {
  sampler: ids(m.badgeTargets(graph, "6")),
  decode: ids(m.badgeTargets(graph, 7)),
  encode: ids(m.badgeTargets(graph, 5)),
  warmup: ids(m.badgeTargets(graph, 8)),
  unknown: ids(m.badgeTargets(graph, 99)),
  states: [
    m.badgeState({ kind: "progress", fraction: 0.3, reason: "UNetModel: compiling" }),
    m.badgeState({ kind: "progress", fraction: 1, reason: "UNetModel: compiled" }),
    m.badgeState({ kind: "compile", seconds: 24.56, reason: "UNetModel: first call" }),
    m.badgeState({ kind: "load", reason: "UNetModel: loaded X from /g" }),
    m.badgeState({ kind: "fallback", reason: "VAE decode (TAESD): no stored graph serves this input; compiling is off; running eager" }),
    m.badgeState({ kind: "refused", reason: "Load Graph: graph a/b was not built on this machine" }),
    m.badgeState({ kind: "evict", reason: "registry full" }),
    m.badgeState({ kind: "mismatch", reason: "UNetModel: graph g disagrees with eager for inputs x [2, 4, 8, 8] (relative difference 0.7)" }),
  ],
};
const changed = m.applyEvent(graph, { kind: "compile", seconds: 2, reason: "x", node: null }, "6");
out.applied = ids(changed).concat([graph.getNodeById(2).keepfast.state, graph.getNodeById(3).keepfast ?? null]);
// Background builds: the build starts while the sampler runs (the event names its node and the block families);
// later "building" events name no node (they come between and after runs) and find the Model Speedup by family.
const seen = (id) => { const k = graph.getNodeById(id).keepfast; return k && [k.state, k.text]; };
out.background = [];
m.applyEvent(graph, { kind: "progress", background: true, fraction: 0, family: "famA", node: "6", reason: "Flux: block A: building in the background" }, null);
m.applyEvent(graph, { kind: "progress", background: true, fraction: 0, family: "famB", node: "6", reason: "Flux: block B: building in the background" }, null);
out.background.push(seen(2));
out.background.push(ids(m.applyEvent(graph, { kind: "building", families: ["famA", "famB"], done: 0, total: 2, left_s: null, node: null }, "7")));
out.background.push(seen(2));
m.applyEvent(graph, { kind: "building", families: ["famA", "famB"], done: 1, total: 2, left_s: 31.6, node: null }, null);
out.background.push(seen(2), graph.getNodeById(2).keepfast.fraction);
m.applyEvent(graph, { kind: "fallback", family: "famA", node: "6", reason: "Flux: its graph is building in the background; running eager" }, null);
out.background.push(seen(2));
out.background.push(ids(m.applyEvent(graph, { kind: "building", families: ["famZ"], done: 0, total: 1, node: null }, "6")));
m.applyEvent(graph, { kind: "building", families: ["famB"], done: 2, total: 2, ready: 2, failed: 0, node: null }, null);
out.background.push(seen(2), seen(3));
console.log(JSON.stringify(out));
"""


@pytest.fixture(scope="module")
def result() -> dict:
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed: the page's badge logic is tested with node")
    source = base64.b64encode(BADGES.read_bytes()).decode()
    done = subprocess.run([node, "--input-type=module", "-e", SCRIPT, source], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_badge_goes_to_the_keepfast_node_behind_the_running_one(result):
    assert result["sampler"] == [2]  # through the LoRA loader; the latent from VAE Encode is not followed
    assert result["decode"] == [3] and result["encode"] == [3]
    assert result["warmup"] == [8]  # a KeepFast node running itself carries its own badge
    assert result["unknown"] == []


def test_events_become_badges(result):
    progress, done, compiled, loaded, eager, refused, evicted, mismatch = result["states"]
    assert progress["state"] == "compiling" and progress["fraction"] == 0.3 and progress["text"] == "compiling 30%"
    assert done is None  # the compile event, right after, says how it went
    assert compiled["state"] == "compiled" and compiled["text"] == "compiled (24.6 s)"
    assert loaded == {"state": "loaded", "text": "loaded from disk", "reason": "UNetModel: loaded X from /g"}
    assert eager["state"] == "eager" and eager["text"] == "eager: no stored graph serves this input; compiling is off"
    assert refused["state"] == "refused" and refused["text"].startswith("refused: graph a/b was not built")
    assert evicted is None
    assert mismatch["state"] == "mismatch"
    assert mismatch["text"] == "pack error, ran eager: graph g disagrees with eager for inputs x [2, 4, 8, 8] (relative difference 0.7)"


def test_an_event_without_a_node_uses_the_running_node(result):
    assert result["applied"] == [2, "compiled", None]


def test_background_builds_show_on_the_node_that_made_the_model(result):
    started, targets, first, second, fraction, during_eager, unknown, built, vae = result["background"]
    assert started == ["building", "building in the background"]
    assert targets == [2]  # by family: not the VAE Decode (node 7) that runs when the event comes
    assert first == ["building", "building 1 of 2 in background"]
    assert second == ["building", "building 2 of 2 in background, ~32 s left"] and fraction == 0.5
    assert during_eager == second  # an eager call while it builds keeps the count and time left
    assert unknown == []  # families no node made: no badge anywhere
    assert built == ["built", "built: serves from the next step"] and vae is None
