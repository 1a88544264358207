"""Every output the nodes serve equals the model's own, in every order of calls (needs COMFYUI_PATH).

The correctness matrix through ComfyUI's own classes and comfy.sample (kf_matrix.py, one process per
phase): ComfyUI's SD1.5 and SDXL UNets (whole-model graphs, under ComfyUI's default attention and
with --use-pytorch-cross-attention for SD1.5), Flux, SD3 and Wan (block graphs), and ComfyUI's
AutoencoderKL (decode and encode). Each is compiled from a first call at a model batch of 1 (one
image at cfg 1.0, how Turbo, Lightning, LCM and Flux-guidance workflows run) and, in another process,
at 2 (cfg 2.0); then 1, 2 and 3 images x cfg off and on x two sizes x two prompt lengths (Wan: x two
frame counts) in a seeded order, each sampled with and without the node; then a restart with other
weights loads the saved graphs and runs the matrix in another order. Before KeepFast 0.2.0 a graph
compiled from a batch-1 call served every larger batch wrong (0.46-0.67 off in the latent) with no
fallback: this is the test that would have seen it.
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

KINDS = ["sd15", "sd15-pytorch-attention", "sdxl", "vae", "flux", "sd3", "wan"]
FIRSTS = ["first1", "first2"]
# float32; latent (and image) differences relative to the output's scale (at least 1): the same maths reordered.
TOLERANCE = 1e-3
GRAPH_CALLS = {"vae": "vae.graph", "flux": "blocks.graph", "sd3": "blocks.graph", "wan": "blocks.graph"}


def _run(base, graphs, kind: str, phase: str) -> dict:
    model, _, attention = kind.partition("-")
    flags = ["--use-pytorch-cross-attention"] if attention else []
    result = subprocess.run(
        [S.PYTHON, str(S.HERE / "kf_matrix.py"), str(S.REPO), str(base), str(graphs), model, phase, *flags],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=1800,
        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


_RUNS: dict = {}


def _runs(kind: str, first: str, tmp_path_factory) -> tuple:
    """(first phase, restart) findings, run once per case and shared by its tests."""
    key = (kind, first)
    if key not in _RUNS:
        base = tmp_path_factory.mktemp(f"matrix-{kind}-{first}")
        graphs = base / "graphs"
        graphs.mkdir()
        _RUNS[key] = (_run(base, graphs, kind, first), _run(base, graphs, kind, "restart"), base)
    return _RUNS[key]


@pytest.fixture(scope="module", params=[(k, f) for k in KINDS for f in FIRSTS], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory):
    kind, first = request.param
    found, restart, base = _runs(kind, first, tmp_path_factory)
    return kind, found, restart


def _assert_equal_to_eager(rows) -> None:
    for row in rows:
        assert row["finite"], row
        assert row["diff"] <= TOLERANCE * max(1.0, row["scale"]), row


def _graph_calls(kind: str, rows) -> int:
    counter = GRAPH_CALLS.get(kind.partition("-")[0], "unet.graph")
    return sum(row["events"][counter] for row in rows)


def test_the_first_call_compiles_and_equals_eager(case):
    kind, found, _ = case
    assert found["first_events"]["compile"] >= 1, found["first_events"]
    assert found["first_events"]["mismatch"] == 0, found["first_events"]
    _assert_equal_to_eager(found["first"])


def test_every_later_call_equals_eager_with_no_compile_fallback_or_mismatch(case):
    kind, found, _ = case
    rows = found["rows"]
    assert len(rows) >= 12, rows
    for row in rows:
        events = row["events"]
        assert (events["compile"], events["fallback"], events["mismatch"]) == (0, 0, 0), row
    _assert_equal_to_eager(rows)
    assert _graph_calls(kind, rows) >= len(rows), rows  # every call reached a graph (not eager by luck)


def test_a_restart_with_other_weights_loads_and_equals_eager_with_no_compile(case):
    """The same workflow after a restart (a new process, other weights): the saved graphs load, nothing compiles."""
    kind, _, restart = case
    assert sum(row["events"]["load"] for row in restart["rows"]) >= 1, restart["rows"][:2]
    for row in restart["rows"]:
        events = row["events"]
        assert (events["compile"], events["fallback"], events["mismatch"]) == (0, 0, 0), row
    _assert_equal_to_eager(restart["rows"])
    assert _graph_calls(kind, restart["rows"]) >= len(restart["rows"])


def test_a_graph_that_gives_a_wrong_answer_is_caught_and_eager_returned(tmp_path_factory):
    """A test-only fault (the graph adds 0.5 to its output at batch 2) is caught by the first-use check."""
    _, _, base = _runs("sd15", "first1", tmp_path_factory)
    found = _run(base, base / "graphs", "sd15", "fault")
    plain, first_cfg, again, other_size = found["rows"]
    _assert_equal_to_eager(found["rows"])  # eager's output came back every time
    assert plain["events"]["mismatch"] == 0 and plain["events"]["unet.graph"] > 0
    assert first_cfg["events"]["mismatch"] == 1  # caught on its first use at batch 2...
    assert again["events"]["mismatch"] == 0 and again["events"]["unet.graph"] == 0  # ...then eager, unchecked
    assert other_size["events"]["mismatch"] == 1  # another batch-2 shape is checked on its own
    assert found["stats_mismatches"] == 2
    assert all("disagrees with eager" in reason for reason in found["mismatch_reasons"])
    assert "mismatches: 2" in found["stats_text"]
