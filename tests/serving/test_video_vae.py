"""A video VAE that decodes chunk by chunk with a feature cache (diffusers' AutoencoderKLWan, the class of Wan
2.1 and Qwen-Image) is served one chunk at a time: every frame count and size from the graphs of one example
video, equal to eager, and after a restart from the saved graphs with no compile.

One tiny VAE (random weights), decode only: compile_pipe, the first video (3 latent frames: the first, second
and a later cache state) compiles, then other frame counts, sizes and batch sizes (a video at a time) compile nothing; save_pipe,
then a fresh VAE of other weights loads the graphs and decodes with no compile.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from compiler import ShapeRange, compile_pipe, load_pipe, save_pipe
from compiler.serving import cached_steps as C
from compiler.store.registry import GraphRegistry

pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan  # noqa: E402

RANGE = ShapeRange(batch=(1, 2), spatial=(4, 16))
Z = 4
# (batch, latent frames, height, width): frame counts on both sides of the first video's, other sizes
LATER = [(1, 5, 8, 8), (1, 2, 6, 10), (1, 1, 8, 8), (1, 4, 4, 12)]


def _vae(seed: int) -> AutoencoderKLWan:
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=8, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, False], latents_mean=[0.0] * Z, latents_std=[1.0] * Z).eval()
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.normal_(0.0, 0.1)
    return vae


def _latent(batch: int, frames: int, height: int, width: int) -> torch.Tensor:
    return torch.randn(batch, Z, frames, height, width, generator=torch.Generator().manual_seed(frames * 100 + height))


def _decode(vae, latent):
    with torch.no_grad():
        return vae.decode(latent).sample


def _counts(registry: GraphRegistry) -> dict:
    return {k: registry.log.counts.get(k, 0) for k in ("compile", "load", "fallback", "mismatch")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(pipe, eager twin, registry, what the first video did, graphs folder), compiled once for the module."""
    vae = _vae(0)
    twin = copy.deepcopy(vae)
    pipe = SimpleNamespace(vae=vae)
    registry = GraphRegistry()
    compile_pipe(pipe, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    latent = _latent(1, 3, 8, 8)
    got = _decode(vae, latent)
    first = {"diff": float((got - _decode(twin, latent)).abs().max()), "counts": _counts(registry)}
    folder = tmp_path_factory.mktemp("wan-vae-graphs")
    report = save_pipe(pipe, folder, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    return pipe, twin, registry, first, folder, report


def test_the_cache_states_round_trip_through_markers():
    x = torch.zeros(1, 2, 1, 3, 3)
    cache = [None, "Rep", torch.ones(1, 2, 2, 3, 3)]
    assert C.state_of(cache) == "NRT"
    markers = tuple(C._marker(entry, x) for entry in cache)
    fresh = [0, 0, 0]
    C.write_back(fresh, markers)
    assert fresh[0] is None and fresh[1] == "Rep" and torch.equal(fresh[2], cache[2])
    assert C.state_of([None, 3]) is None  # a slot the convention does not know: the call runs eager


def test_the_first_video_compiles_one_graph_per_cache_state_and_equals_eager(served):
    _, _, _, first, _, _ = served
    assert first["diff"] < 1e-4, first
    assert first["counts"]["compile"] == C.EXAMPLE_CHUNKS, first  # first chunk, second, every later one
    assert first["counts"]["fallback"] == 0 and first["counts"]["mismatch"] == 0, first


def test_other_frame_counts_and_sizes_compile_nothing(served):
    pipe, twin, registry, _, _, _ = served
    for shape in LATER:
        before = _counts(registry)
        latent = _latent(*shape)
        got, want = _decode(pipe.vae, latent), _decode(twin, latent)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) < 1e-4, shape
        after = _counts(registry)
        assert after["compile"] == before["compile"] and after["fallback"] == before["fallback"], (shape, after)


def test_two_videos_at_once_are_served_one_at_a_time_by_the_same_graphs(served, monkeypatch):
    """A chunk traced at batch 2 would serve 2 and up only; the batch-1 graphs serve each video of the batch."""
    from compiler.backends import aot

    pipe, twin, registry, _, _, _ = served
    before = _counts(registry)
    decoder = pipe.vae.decoder.forward.forward  # the CompiledForward behind the installed ChunkServer
    graph_calls = decoder.graph_calls
    runs = []
    run = aot.AotGraph.run
    monkeypatch.setattr(aot.AotGraph, "run", lambda graph, module, call, replay=False: runs.append(call.shapes[0][0])
                        or run(graph, module, call, replay))
    for shape in ((2, 2, 8, 8), (2, 2, 6, 12), (3, 1, 8, 8)):
        latent = _latent(*shape)
        got, want = _decode(pipe.vae, latent), _decode(twin, latent)
        assert got.shape == want.shape, shape
        assert float((got - want).abs().max()) < 1e-4, shape
    after = _counts(registry)
    assert after == before, (before, after)  # no compile, fallback or mismatch
    assert decoder.graph_calls - graph_calls == 2 + 2 + 1  # one served call per latent frame
    assert runs == [1] * (2 * 2 + 2 * 2 + 3 * 1)  # one graph run per video and latent frame
    assert decoder.eager_calls == 0


def test_a_restart_with_other_weights_loads_the_chunk_graphs_and_compiles_nothing(served, tmp_path):
    _, _, _, _, folder, report = served
    assert not report.problems, report
    assert len(report.saved) == C.EXAMPLE_CHUNKS, report
    vae = _vae(7)
    twin = copy.deepcopy(vae)
    pipe = SimpleNamespace(vae=vae)
    registry = GraphRegistry()
    loaded = load_pipe(pipe, folder, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    assert len(loaded.loaded) == C.EXAMPLE_CHUNKS and not loaded.problems, loaded
    for shape in ((1, 3, 8, 8), (1, 5, 6, 10)):
        latent = _latent(*shape)
        got, want = _decode(vae, latent), _decode(twin, latent)
        assert float((got - want).abs().max()) < 1e-4, shape
    counts = _counts(registry)
    assert counts["compile"] == 0 and counts["fallback"] == 0 and counts["load"] == C.EXAMPLE_CHUNKS, counts


def test_outside_its_scope_a_shared_chunk_module_runs_as_it_always_did():
    vae = _vae(3)
    twin = copy.deepcopy(vae)
    registry = GraphRegistry()
    from compiler.serving.compiled_forward import CompileOptions

    server = C.chunk_server(vae.decoder, CompileOptions(shape_range=RANGE), registry)  # ComfyUI's mode: scoped
    latent = _latent(1, 2, 4, 4)
    assert torch.equal(_decode(vae, latent), _decode(twin, latent))
    assert _counts(registry)["compile"] == 0 and server.forward.graph_calls == 0
    server.uninstall()
    assert "forward" not in vae.decoder.__dict__


def test_wan_2_2s_residual_vae_is_served_by_the_graphs_of_its_first_video():
    """Wan 2.2's VAE (residual up/down blocks, 2x2 patches, a `first_chunk` flag on the decoder's first chunk):
    the first video compiles one graph per cache state, then other frame counts, sizes and a batch of 2 compile
    nothing and equal eager."""
    torch.manual_seed(1)
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=Z, dim_mult=[1, 2, 2], num_res_blocks=1,
                           temperal_downsample=[True, False], latents_mean=[0.0] * Z, latents_std=[1.0] * Z,
                           is_residual=True, patch_size=2, in_channels=12, out_channels=12,
                           scale_factor_spatial=8).eval()  # 3 colours x 2x2 patches, as Wan 2.2 configures it
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.normal_(0.0, 0.1)
    twin = copy.deepcopy(vae)
    pipe = SimpleNamespace(vae=vae)
    registry = GraphRegistry()
    compile_pipe(pipe, shape_range=RANGE, ignores=("vae.encoder",), registry=registry)
    first = _latent(1, 3, 8, 8)
    assert float((_decode(vae, first) - _decode(twin, first)).abs().max()) < 1e-4
    counts = _counts(registry)
    assert counts["compile"] == C.EXAMPLE_CHUNKS and counts["fallback"] == 0 and counts["mismatch"] == 0, counts
    for shape in ((1, 5, 6, 10), (1, 1, 8, 8), (2, 2, 8, 8)):
        latent = _latent(*shape)
        got, want = _decode(vae, latent), _decode(twin, latent)
        assert got.shape == want.shape, shape
        assert float((got - want).abs().max()) < 1e-4, shape
    assert _counts(registry) == counts
