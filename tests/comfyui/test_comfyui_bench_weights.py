"""The bench's quantised-weights part (`bench --weights`) run for real on its smallest config (needs COMFYUI_PATH).

The fp8-scaled tiny Flux (no ComfyUI-GGUF needed), eager and ours, through
`weights.run_weights` exactly as the bench runs it: each in its own ComfyUI
Python process. Nothing about time is asserted; the counts and outputs are:
ours compiles once per block structure in the first image and nothing over
the sweep, the LoRA at 1.0, 0.5 and off, and the steady steps; every output
within float32 reordering of the eager process's; bench.json's summary
carries the counts.
"""

from __future__ import annotations

import json
import os

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

# Latent after two steps against the eager process's, relative to its scale (at least 1): the same maths
# reordered by Inductor in float32 (test_comfyui_quantised.py allows the same; seen there for fp8: 3e-6 to 4e-6).
TOLERANCE = 1e-3


def test_weights_bench_on_fp8_flux_counts_compiles_and_ours_compiles_nothing_after_the_first_image(tmp_path):
    from benchmarks import weights as W
    from benchmarks import weights_report as R

    raw = W.run_weights(tmp_path / "weights", ["fp8"], quick=True, variants=["eager", "ours"], timeout=1500,
                        env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH})
    variants = raw["results"]["fp8"]["variants"]
    for name in ("eager", "ours"):
        assert "error" not in variants[name] and "skipped" not in variants[name], variants[name]
    eager, ours = variants["eager"], variants["ours"]
    assert ours["weight_class"] == "QuantizedTensor"  # ComfyUI's fp8-scaled layers, as its loader makes them
    assert eager["compiles_first_image"] == 0 and eager["compiles_after_first_image"] == 0
    assert ours["compiles_first_image"] == 2  # Flux: one graph per block structure (double, single)
    assert ours["compiles_after_first_image"] == 0 and ours["compiles_lora_rows"] == 0
    assert ours["steady"]["compiles_warmup"] == 0 and ours["steady"]["compiles_timed"] == 0
    assert ours["blocks"]["blocks_compiled"] == ours["blocks"]["blocks"] == 4, ours["blocks"]
    assert ours["fallback_reasons"] == []
    assert [row["lora"] for row in ours["rows"] if row["lora"] is not None] == [1.0, 1.0, 0.5, 0.5]
    for row in ours["rows"]:
        assert row["events"]["fallback"] == 0 and row["events"]["mismatch"] == 0, row
        assert row["finite"] and row["diff"] < TOLERANCE * max(1.0, row["scale"]), row
    assert ours["lora_changed_output_by"] > 100 * TOLERANCE  # the LoRA took effect
    assert ours["steady"]["step_s_median"] > 0 and ours["steady"]["eager_step_s_median"] > 0
    summary = R.summarise(raw)["fp8"]
    assert summary["compiles_after_first_image"] == {"ours": 0}
    assert summary["variants"]["ours"]["compiles_first_image"] == 2
    json.dumps(summary)
