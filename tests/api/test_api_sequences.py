"""Whatever order the API is called in, saved graphs serve: zero compiles, images equal eager.

OneDiff users lost saved graphs to "input structure key changed": load_pipe
after compile_pipe used to replace the compiled forward's options and drop
its call binder, so the pipeline's positional UNet call got another key and
every graph compiled again. Each sequence runs in a fresh process (as a
restart would), on a pipeline with other weights than the saved one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.inputs import unet_inputs

ROOT = Path(__file__).resolve().parents[2]
SDXL_IGNORES = ("vae.decoder", "vae.encoder")
FP16_IGNORES = ("unet", "vae.encoder")


@pytest.fixture(scope="module")
def sdxl_graphs(tmp_path_factory, test_range):
    """An SDXL-style (text_time) UNet's graphs, saved before any image."""
    from compiler import GraphRegistry, save_pipe
    from compiler.demo.tiny_models import tiny_sdxl_pipeline

    graphs = tmp_path_factory.mktemp("sdxl") / "graphs"
    report = save_pipe(tiny_sdxl_pipeline(0), graphs, shape_range=test_range, ignores=SDXL_IGNORES,
                       registry=GraphRegistry())
    assert report.problems == [] and report.saved, report
    return graphs


@pytest.fixture(scope="module")
def fp16_vae_graphs(tmp_path_factory, test_range):
    """A float16 VAE that the pipeline upcasts to float32: both dtypes' decoder graphs, saved before any image."""
    from compiler import GraphRegistry, save_pipe
    from compiler.demo.tiny_models import tiny_sdxl_pipeline

    graphs = tmp_path_factory.mktemp("fp16") / "graphs"
    report = save_pipe(tiny_sdxl_pipeline(0, vae_dtype=torch.float16), graphs, shape_range=test_range,
                       ignores=FP16_IGNORES, registry=GraphRegistry())
    assert report.problems == [], report
    assert any("(float16)" in line for line in report.saved) and any("(float32)" in line for line in report.saved)
    return graphs


def _run(graphs: Path, sequence: str, kind: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "tests.support.api_sequence", str(graphs), sequence, kind],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_served_without_compiling(report: dict, targets) -> None:
    assert report["compiles"] == [], report
    assert report["fallbacks"] == [] and report["problems"] == [], report
    for target in targets:
        assert report["graph_calls"][target] > 0, report
    assert report["max_diff"] < 1e-3, report


@pytest.mark.parametrize("sequence", ["compile_then_load", "load_alone", "compile_save_load", "save_then_load"])
def test_sd_pipe_any_api_order_compiles_nothing(saved_pipe, sequence):
    _assert_served_without_compiling(_run(saved_pipe.graphs, sequence, "sd"), ["unet", "vae.decoder"])


@pytest.mark.parametrize("sequence", ["compile_then_load", "load_alone"])
def test_sdxl_pipe_any_api_order_compiles_nothing(sdxl_graphs, sequence):
    _assert_served_without_compiling(_run(sdxl_graphs, sequence, "sdxl"), ["unet"])


@pytest.mark.parametrize("sequence", ["compile_then_load", "save_then_load"])
def test_float16_pipe_whose_vae_runs_upcast_compiles_nothing(fp16_vae_graphs, sequence):
    _assert_served_without_compiling(_run(fp16_vae_graphs, sequence, "fp16_vae"), ["vae.decoder"])


def test_positional_and_keyword_calls_are_one_graph(saved_pipe):
    unet = saved_pipe.pipe.unet
    compiled = unet.forward
    registry = saved_pipe.registry
    compiles = len(registry.compiles)
    (sample, timestep), kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        unet(sample, timestep, kwargs["encoder_hidden_states"], return_dict=False)
        by_position = compiled.last
        unet(sample=sample, timestep=timestep, encoder_hidden_states=kwargs["encoder_hidden_states"],
             return_dict=False, timestep_cond=None, cross_attention_kwargs=None)
        by_name = compiled.last
        unet(sample, 500.0, kwargs["encoder_hidden_states"], return_dict=False)  # a Python number
        number = compiled.last
    assert not by_position.eager and not by_name.eager and not number.eager, compiled.last
    assert by_position.graph_id == by_name.graph_id == number.graph_id
    assert len(registry.compiles) == compiles
