"""diffusers transformers served block by block through compile_pipe / save_pipe / load_pipe.

For Flux, SD3, Wan and Qwen-Image (diffusers' own classes, tiny configs,
random weights): the first call compiles one graph per distinct block
structure (not per block) and saves it; three resolutions, batch 1 and 2,
two prompt lengths (and two frame counts for Wan) then run with no compile
and no fallback, equal to eager within 1e-4 (float32); the saved graphs serve
a fresh process with no compile. One compile per fixture (module scope).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from compiler import GraphRegistry, compile_pipe
from compiler.backends.base import WeightsElsewhere
from compiler.blocks.binding import SharedRunner
from compiler.blocks.server import BlockServer
from compiler.diffusers_api import compiled_parts
from tests.support import tiny_transformers as tt

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4  # float32; the graphs differ from eager by ~1e-6 here


@dataclass
class Served:
    name: str
    model: torch.nn.Module
    pipe: object
    engine: object
    registry: GraphRegistry
    graphs: Path
    first_compiles: int


_SERVED = {}


def _serve(name: str, tmp_path_factory) -> Served:
    """compile_pipe, then the first call (it compiles); once per family for the whole module."""
    if name not in _SERVED:
        _SERVED[name] = _compile(name, tmp_path_factory)
    return _SERVED[name]


@pytest.fixture(scope="module", params=["flux", "flux2", "sd3", "wan", "qwen"])
def served(request, tmp_path_factory) -> Served:
    return _serve(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def flux(tmp_path_factory) -> Served:
    return _serve("flux", tmp_path_factory)


def _compile(name: str, tmp_path_factory) -> Served:
    model = tt.build(name, seed=0)
    pipe = tt.pipe_of(model)
    registry = GraphRegistry()
    graphs = tmp_path_factory.mktemp(f"blocks-{name}") / "graphs"
    compile_pipe(pipe, shape_range=tt.RANGE, graphs_dir=graphs, autosave=True, registry=registry)
    engine = compiled_parts(pipe)["transformer"]
    with torch.no_grad():
        tt.call(model, tt.FIRST)
    return Served(name, model, pipe, engine, registry, graphs, len(registry.compiles))


def test_one_compile_per_block_structure_not_per_block(served):
    assert served.first_compiles == tt.STRUCTURES[served.name], [e.reason for e in served.registry.compiles]
    report = served.engine.report()
    assert report["blocks"] == tt.BLOCKS[served.name]
    assert report["blocks_compiled"] == report["blocks"], report
    assert sum(e.detail["instances"] for e in served.registry.compiles) == tt.BLOCKS[served.name]
    # each block structure's compile says where its time went, as a whole model's does (the device check reads it):
    # the trace, the build's phases and taking the package in, whether built in the caller or beside the others
    for event in served.registry.compiles:
        phases = event.detail["phase_s"]
        assert {"export_s", "inductor_s", "take_in_s"} <= set(phases), event
        assert phases["export_s"] > 0 and phases["take_in_s"] > 0, event
        assert ("to_build_start_s" in phases) == ("built beside" in event.reason), event
    assert served.registry.fallbacks == [], [e.reason for e in served.registry.fallbacks]
    for structure in report["structures"]:
        assert structure["status"] == "compiled graph", structure
        assert structure["notes"] == [], structure  # every range corner is served by the one graph


def test_sweep_runs_compiled_with_no_compile_and_no_fallback(served):
    compiles, fallbacks = len(served.registry.compiles), len(served.registry.fallbacks)
    blocks = tt.BLOCKS[served.name]
    worst = 0.0
    with torch.no_grad():
        for dims in tt.sweep(served.name):
            before = served.engine.graph_calls
            out = tt.call(served.model, dims)
            assert served.engine.graph_calls - before == blocks, dims  # every block ran from its graph
            ref = tt.reference(served.engine, dims)
            assert out.shape == ref.shape
            worst = max(worst, float((out - ref).abs().max()))
    assert len(served.registry.compiles) == compiles
    assert len(served.registry.fallbacks) == fallbacks, [e.reason for e in served.registry.fallbacks]
    assert worst < TOLERANCE


def test_the_time_served_from_graphs_is_measured(served):
    """A call whose blocks all run from graphs: block time is graph time, what else the model call took is glue."""
    from compiler.serving.time_share import TimeShare

    before = TimeShare.from_seconds(served.registry.log.seconds)
    with torch.no_grad():
        tt.call(served.model, tt.FIRST)
    after = TimeShare.from_seconds(served.registry.log.seconds)
    graph, model = after.blocks_graph_s - before.blocks_graph_s, after.blocks_model_s - before.blocks_model_s
    assert after.blocks_eager_s == before.blocks_eager_s
    assert 0 < graph < model
    assert 0 < after.model_compiled < 1 and after.glue_s > 0
    assert after.describe().startswith("time served: diffusion model "), after.describe()


def test_graphs_were_saved_as_they_compiled(served):
    packages = sorted(served.graphs.rglob("*.pt2"))
    manifests = [json.loads(p.read_text()) for p in served.graphs.rglob("*.json")]
    assert len(packages) == tt.STRUCTURES[served.name]
    blocks = sorted(m["signature"]["block"]["class"] for m in manifests)
    assert blocks == sorted(s.group.class_name for s in served.engine.servers)
    for manifest in manifests:
        assert manifest["shape_range"]["tokens"] == list(served.engine.block_range.tokens)
        assert manifest["signature"]["block"]["model"] == tt.CLASSES[served.name]


def test_saved_graphs_serve_a_fresh_process_with_zero_compiles(served):
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.blocks_load_check", served.name, str(served.graphs)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiles"] == 0, report
    assert report["loads"] == tt.STRUCTURES[served.name], report
    assert report["fallbacks"] == [] and report["problems"] == [], report
    assert report["max_diff"] < TOLERANCE, report
    assert report["graph_calls"] > 0 and report["graph_calls"] % report["blocks"] == 0, report


def test_block_structures_build_side_by_side_on_the_first_call(served):
    """A first call that waits for its graphs starts every structure's trace and build before it waits for any
    (one after another, Flux's two took 97.5 s and 26.7 s on the H200)."""
    compiles = sorted(served.registry.compiles[:served.first_compiles], key=lambda e: e.at)
    if len(compiles) < 2:
        assert "built beside" not in compiles[0].reason  # one structure: compiled as before
        return
    assert all("(built beside the other block structures)" in e.reason for e in compiles), compiles
    for earlier, later in zip(compiles, compiles[1:]):
        assert later.at - later.seconds < earlier.at, (earlier, later)  # started before the earlier was taken in


def test_another_checkpoint_and_changed_weights_reuse_the_graphs(flux):
    """Weight binding is family-independent engine code: checked on Flux."""
    served = flux
    other = tt.build("flux", seed=1)
    pipe = tt.pipe_of(other)
    compile_pipe(pipe, shape_range=tt.RANGE, registry=served.registry)
    engine = compiled_parts(pipe)["transformer"]
    compiles = len(served.registry.compiles)
    dims = tt.sweep("flux")[2]
    with torch.no_grad():
        assert float((tt.call(other, dims) - tt.reference(engine, dims)).abs().max()) < TOLERANCE
        # a LoRA-like change in place, then a replaced parameter (how ComfyUI patches weights)
        block = other.transformer_blocks[1]
        block.ff.net[2].weight.add_(0.05)
        changed = tt.call(other, dims)
        assert float((changed - tt.reference(engine, dims)).abs().max()) < TOLERANCE
        block.attn.to_q.weight = torch.nn.Parameter(block.attn.to_q.weight * 1.5)
        replaced = tt.call(other, dims)
        assert float((replaced - tt.reference(engine, dims)).abs().max()) < TOLERANCE
        assert float((replaced - changed).abs().max()) > 1e-3  # the new weights were used
    assert len(served.registry.compiles) == compiles
    assert served.registry.fallbacks == [], [e.reason for e in served.registry.fallbacks]


def test_a_block_with_a_weight_on_another_device_is_never_bound_to_its_graph(flux):
    """ComfyUI's partial loading (low-VRAM mode) leaves some layers' weights in CPU memory while the calls run on
    the GPU; a graph reads its weights by pointer where it runs, so such an instance must run eager with the reason
    and never be bound, whatever the first weight's device is, and such an instance is never the one traced. No
    second device here: a weight on the meta device stands for the one left elsewhere (the checks are by device)."""
    server = next(s for s in flux.engine.servers if s.ready and len(s.instances) > 1)
    first, second = server.instances[0], server.instances[1]
    path, layer = [(p, m) for p, m in second.module.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    stored = layer.weight
    cpu = torch.device("cpu")
    try:
        layer.weight = torch.nn.Parameter(torch.empty_like(stored, device="meta"))  # not the first tensor
        weights, reason = server._weights_for(second, cpu)
        assert reason is not None and f"{path}.weight is on meta" in reason, reason
        with pytest.raises(WeightsElsewhere, match=f"{path}.weight is on meta"):
            server.runner.run(weights, [], None)  # refused before anything is bound
        assert server._weights_for(first, cpu)[1] is None
        assert server._lead(cpu) is first
        moved = [(p, m) for p, m in first.module.named_modules() if isinstance(m, torch.nn.Linear)][0][1]
        kept = moved.weight
        moved.weight = torch.nn.Parameter(torch.empty_like(kept, device="meta"))
        try:  # the first instance partly elsewhere: the next one whose weights are all here is traced
            expected = server.instances[2] if len(server.instances) > 2 else None
            assert server._lead(cpu) is expected
        finally:
            moved.weight = kept
    finally:
        layer.weight = stored
    assert server._weights_for(second, cpu)[1] is None  # back: served again


def test_a_block_whose_export_raises_runs_eager_with_the_reason(flux):
    """Anything export raises (here a RuntimeError) leaves that block structure eager; the call completes."""
    served = flux
    registry = GraphRegistry()
    for graph in served.registry.graphs():  # the double block's graph is found; only the single block exports
        if graph.key.family.architecture == "FluxTransformerBlock":
            registry.add(graph)
    model = tt.build("flux", seed=0)
    pipe = tt.pipe_of(model)
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry)
    engine = compiled_parts(pipe)["transformer"]

    def exploding(module, call, bounds, key, progress, **kwargs):
        progress("tracing with torch.export", 0.05)
        raise RuntimeError(f"export exploded on {type(module).__name__}")

    engine.exporter = exploding
    steps = []
    engine.prepare(progress=lambda text, fraction: steps.append((text, fraction)))
    assert any("block 2 of 2: FluxSingleTransformerBlock x3" in text and "tracing" in text for text, _ in steps), steps
    assert steps[-1] == (engine.describe(), 1.0) and "2 of 5 blocks compiled" in steps[-1][0]
    dims = tt.sweep("flux")[0]
    with torch.no_grad():
        out = tt.call(model, dims)
        ref = tt.reference(engine, dims)
    assert float((out - ref).abs().max()) < TOLERANCE
    assert registry.compiles == []
    reasons = [e.reason for e in registry.fallbacks]
    assert any("FluxSingleTransformerBlock" in r and "export exploded" in r for r in reasons), reasons
    report = engine.report()
    status = {s["class"]: s["status"] for s in report["structures"]}
    assert status["FluxTransformerBlock"] == "compiled graph"
    assert status["FluxSingleTransformerBlock"].startswith("eager: compile failed: RuntimeError: export exploded")
    assert report["blocks_compiled"] == 2 and report["blocks"] == 5
    single = [i for i in engine.instances if i.server.group.class_name == "FluxSingleTransformerBlock"]
    assert all(i.eager_calls == 1 and i.graph_calls == 0 for i in single)


def _raiser(error: BaseException):
    def raise_it(*args, **kwargs):
        raise error
    return raise_it


SERVING_FAULTS = {  # stage named in the reason -> how to make it raise
    "checking the block's call": lambda engine, mp, error: setattr(engine, "block_filter", _raiser(error)),
    "binding the block's weights": lambda engine, mp, error: mp.setattr(BlockServer, "_weights_for", _raiser(error)),
    "running graph": lambda engine, mp, error: mp.setattr(SharedRunner, "run", _raiser(error)),
}


@pytest.mark.parametrize("stage", list(SERVING_FAULTS))
def test_a_serving_stage_that_raises_runs_the_blocks_eager_with_the_reason(flux, monkeypatch, stage):
    """The block server's path goes through the pack's one boundary: an unexpected error is a reason, not a crash."""
    registry = GraphRegistry()
    for graph in flux.registry.graphs():
        registry.add(graph)
    model = tt.build("flux", seed=1)
    pipe = tt.pipe_of(model)
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry)
    engine = compiled_parts(pipe)["transformer"]
    engine.prepare()
    assert engine.report()["blocks_compiled"] == 5
    SERVING_FAULTS[stage](engine, monkeypatch, KeyError("injected"))
    for dims in tt.sweep("flux")[:2]:  # the second call too: a broken graph is not tried again, nothing escapes
        with torch.no_grad():
            out = tt.call(model, dims)
            ref = tt.reference(engine, dims)
        assert torch.equal(out, ref)
    assert registry.compiles == []
    reasons = [e.reason for e in registry.fallbacks]
    assert any(stage in r and "failed unexpectedly: KeyError: 'injected'" in r for r in reasons), reasons
    assert all(i.graph_calls == 0 and i.eager_calls == 2 for i in engine.instances)


def test_a_block_call_of_another_input_structure_runs_eager_with_the_reason(flux):
    served = flux
    block = served.model.transformer_blocks[0]
    args, kwargs = served.engine.family.example_call(served.model, tt.FIRST)
    captured = {}
    handle = block.register_forward_pre_hook(lambda m, a, k: captured.update(k), with_kwargs=True)
    try:
        with torch.no_grad():
            served.model(*args, **kwargs)
    finally:
        handle.remove()
    before = len(served.registry.fallbacks)
    changed = dict(captured, joint_attention_kwargs={"unused": None})
    with torch.no_grad():
        out = block(**changed)
        ref = type(block).forward(block, **changed)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    reasons = [e.reason for e in served.registry.fallbacks[before:]]
    assert any("input structure differs" in r for r in reasons), reasons


def test_the_graph_library_names_the_blocks_and_the_model_a_graph_serves(served):
    result = subprocess.run([sys.executable, "-m", "compiler", "graphs", "ls", str(served.graphs)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for server in served.engine.servers:
        line = f"{server.group.class_name} x{len(server.instances)} of {tt.CLASSES[served.name]}"
        assert line in result.stdout, result.stdout
