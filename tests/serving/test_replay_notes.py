"""What a user is told when CUDA graph replays were asked for and a call runs without them (replay_notes.py):
once per graph and reason, as a NOTE in the event log, never a fallback (the call still runs compiled)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from compiler import CompileOptions, GraphRegistry, compile_module
from compiler.store.registry import FALLBACK, NOTE
from compiler.serving.replay_notes import ReplayNotes


def _graph(state=None, graph_id="g1"):
    graph = SimpleNamespace(key=SimpleNamespace(id=graph_id))
    if state is not None:
        graph.replay_state = lambda: state
    return graph


def _told(notes, graph, device, calls=3):
    said = []
    for _ in range(calls):
        notes.after_run(graph, device, "UNet", said.append)
    return said


def test_a_cpu_model_is_told_once_that_replays_need_cuda():
    notes = ReplayNotes()
    said = _told(notes, _graph({}), "cpu") + _told(notes, _graph({}, "g2"), "cpu")
    assert len(said) == 1 and "runs on cpu" in said[0] and "compiled without them" in said[0]


def test_a_graph_replaying_on_cuda_says_nothing():
    assert _told(ReplayNotes(), _graph({"0": {"captures": 1, "replays": 4, "off": None}}), "cuda") == []
    assert _told(ReplayNotes(), _graph({}), "cuda") == []  # before its first capture


def test_replay_turned_off_is_told_once_with_its_reason_and_again_for_another_graph():
    notes = ReplayNotes()
    off = {"0": {"captures": 0, "replays": 0, "off": "capturing a CUDA graph failed: RuntimeError: x"}}
    said = _told(notes, _graph(off), "cuda") + _told(notes, _graph(off, "g2"), "cuda")
    assert len(said) == 2
    assert said[0].startswith("UNet: CUDA graph replays off for graph g1 on cuda:0: capturing a CUDA graph failed")
    assert "g2" in said[1]


def test_a_backend_without_replays_is_told_once_per_graph():
    notes = ReplayNotes()
    said = _told(notes, _graph(None), "cuda")
    assert len(said) == 1 and "has no CUDA graph replays" in said[0]


def test_a_compiled_forward_asked_for_replays_on_the_cpu_notes_it_once_and_serves_compiled():
    """The whole path: the note comes from CompiledForward after a graph served the call; the calls are
    compiled and equal eager's, and nothing is recorded as a fallback."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    registry = GraphRegistry()
    compiled = compile_module(module, CompileOptions(backend="inductor", cuda_graphs=True, verify=False), registry)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = compiled.eager(x)
        outs = [module(x) for _ in range(3)]
    assert compiled.graph_calls == 3 and compiled.eager_calls == 0
    assert all(torch.allclose(o, want, atol=1e-5) for o in outs)
    notes = registry.log.of_kind(NOTE)
    assert len(notes) == 1 and "runs on cpu" in notes[0].reason, [e.reason for e in notes]
    assert registry.log.of_kind(FALLBACK) == []


def test_no_note_where_replays_were_not_asked_for():
    module = torch.nn.Linear(4, 4)
    registry = GraphRegistry()
    compile_module(module, CompileOptions(backend="inductor", cuda_graphs=False, verify=False), registry)
    with torch.no_grad():
        module(torch.randn(2, 4))
    assert registry.log.of_kind(NOTE) == []
