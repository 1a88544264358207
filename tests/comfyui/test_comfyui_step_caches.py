"""ComfyUI's step caches (EasyCache, LazyCache) together with Model Speedup (needs COMFYUI_PATH).

A cache node skips some sampling steps; the steps it runs must come from the pack's graphs, in either node order,
with the same steps skipped and the same latent as the cache on the model without the pack's node. Run in
ComfyUI's Python by kf_step_caches.py for an SD-style UNet (one whole-model graph) and Flux (block graphs).
"""

from __future__ import annotations

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

STEPS = 10  # kf_step_caches.STEPS
ORDERS = {"cache, then speedup", "speedup, then cache"}


@pytest.fixture(scope="module", params=["sd15", "flux"])
def findings(request, tmp_path_factory) -> dict:
    return S.run_family_script("kf_step_caches.py", tmp_path_factory, request.param)



def test_every_cache_and_order_was_run(findings):
    assert {(row["cache"], row["order"]) for row in findings["rows"]} == {
        (cache, order) for cache in ("EasyCache", "LazyCache") for order in ORDERS}
    assert findings["warm"]["compile"] >= 1 and S.model_calls_from_graphs(findings, findings["warm"]) == STEPS


def test_each_cache_skips_the_same_steps_as_on_the_model_alone(findings):
    for row in findings["rows"]:
        assert len(row["skipped"]) == 1 and 0 < row["skipped"][0] < STEPS, row
        assert row["skipped"] == row["reference"]["skipped"], row


def test_the_steps_a_cache_runs_are_served_by_graphs_with_no_compile(findings):
    for row in findings["rows"]:
        events = row["events"]
        assert events["compile"] == 0 and events["fallback"] == 0 and events["refused"] == 0, row
        assert events["eager_calls"] == 0 and events["block_eager_calls"] == 0, row
        assert S.model_calls_from_graphs(findings, events) == STEPS - row["skipped"][0], row
    assert findings["fallbacks"] == []


def test_the_latent_matches_the_cache_without_the_pack(findings):
    for row in findings["rows"]:
        assert row["diff"] <= 1e-4 * max(1.0, row["scale"]), row
