"""CUDA graph replays of a package's calls (compiler/backends/cuda_graphs.py), with torch's CUDA graph API faked.

No GPU here: a fake `torch.cuda.CUDAGraph` records what the runner computes while capturing and recomputes it
into the captured output buffers on replay, from the captured input buffers, as a real graph does. What is tested
is the pack's side: when a shape is captured, that a replay reads this call's values and hands out copies, that
other weights or a failed or disagreeing capture never replay, and that the memory of old captures is released.
Whether capture and replay work with AOTInductor's runner, and what they gain, is the device check's
(`ours_aot_load_cg`).
"""

from __future__ import annotations

import contextlib
from typing import List

import pytest
import torch

from compiler.backends import cuda_graphs as C
from tests.backends.test_gpu_paths import fake_loader, two_gpus  # noqa: F401 - fixtures: a fake loader on two fake GPUs

_capturing: List["FakeGraph"] = []


class FakeGraph:
    """torch.cuda.CUDAGraph: replay recomputes what was recorded into the same output buffers."""

    def __init__(self):
        self.recorded = []

    def replay(self):
        for step in self.recorded:
            step()


@contextlib.contextmanager
def fake_capture(graph, *args, **kwargs):
    _capturing.append(graph)
    try:
        yield
    finally:
        _capturing.pop()


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


class Runner:
    """A package's runner: out = x * weight + y; counts its plain runs (a capture's calls included)."""

    def __init__(self, weight: float = 2.0):
        self.weight = weight
        self.runs = 0

    def __call__(self, inputs):
        self.runs += 1
        x, y = inputs
        out = x * self.weight + y
        if _capturing:
            graph = _capturing[-1]
            graph.recorded.append(lambda: out.copy_(x * self.weight + y))
        return [out]


def _inputs(value: float, shape=(2, 3)):
    return [torch.full(shape, value), torch.full(shape, 1.0)]


def test_a_shape_is_captured_on_its_second_call_and_replays_read_each_call_s_values(fake_cuda):
    runner, replays = Runner(), C.Replays()
    first = replays.run(runner, _inputs(1.0), bound="weights-a")
    assert runner.runs == 1 and replays.captures == 0 and torch.equal(first[0], torch.full((2, 3), 3.0))
    second = replays.run(runner, _inputs(2.0), bound="weights-a")  # captured: a warm-up run, then the capture
    assert replays.captures == 1 and runner.runs == 3
    assert torch.equal(second[0], torch.full((2, 3), 5.0))
    third = replays.run(runner, _inputs(4.0), bound="weights-a")
    assert runner.runs == 3 and replays.replays == 2  # replayed, not run
    assert torch.equal(third[0], torch.full((2, 3), 9.0))  # this call's values, copied into the capture's buffers
    third[0].fill_(-1.0)  # the caller's copy: the next replay's output is not it
    fourth = replays.run(runner, _inputs(0.0), bound="weights-a")
    assert torch.equal(fourth[0], torch.full((2, 3), 1.0)) and torch.equal(third[0], torch.full((2, 3), -1.0))


def test_other_weights_never_replay_a_capture_of_the_old_ones(fake_cuda):
    runner, replays = Runner(), C.Replays()
    for value in (1.0, 2.0, 3.0):
        replays.run(runner, _inputs(value), bound="weights-a")
    assert replays.captures == 1
    runner.weight = 10.0  # what another model's weights compute (the bound token says they changed)
    runs = runner.runs
    out = replays.run(runner, _inputs(1.0), bound="weights-b")
    assert runner.runs == runs + 1 and torch.equal(out[0], torch.full((2, 3), 11.0))  # run, not replayed
    assert replays.captures == 1 and replays.replays == 2  # the old capture was released, not replayed


def test_at_most_kept_shapes_stay_captured_the_least_recently_used_released_first(fake_cuda):
    runner, replays = Runner(), C.Replays(kept=2)
    shapes = [(1, 2), (2, 2), (3, 2)]
    for shape in shapes:
        for _ in range(2):
            replays.run(runner, _inputs(1.0, shape), bound="w")
    assert replays.captures == 3
    runs = runner.runs
    replays.run(runner, _inputs(1.0, (3, 2)), bound="w")
    replays.run(runner, _inputs(1.0, (2, 2)), bound="w")
    assert runner.runs == runs  # both still captured
    out = replays.run(runner, _inputs(5.0, (1, 2)), bound="w")  # released, and a repeated shape: captured again
    assert runner.runs == runs + 2 and replays.captures == 4 and torch.equal(out[0], torch.full((1, 2), 11.0))


def test_a_capture_that_raises_leaves_replay_off_with_the_reason_and_every_call_runs(fake_cuda, monkeypatch):
    def refuse(graph, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(torch.cuda, "graph", refuse)
    runner, replays = Runner(), C.Replays()
    outs = [replays.run(runner, _inputs(v), bound="w")[0] for v in (1.0, 2.0, 3.0, 4.0)]
    assert [float(o[0, 0]) for o in outs] == [3.0, 5.0, 7.0, 9.0]
    assert replays.captures == 0 and replays.replays == 0
    assert replays.reason == ("capturing a CUDA graph failed: RuntimeError: operation not permitted when stream is "
                              "capturing")


def test_a_replay_that_differs_from_the_plain_run_is_never_used(fake_cuda):
    class Drifting(Runner):
        """A runner whose captured work is not what it ran (a kernel that reads host state, say)."""

        def __call__(self, inputs):
            out = super().__call__(inputs)
            if _capturing:
                _capturing[-1].recorded.append(lambda: out[0].add_(0.5))
            return out

    runner, replays = Drifting(), C.Replays()
    outs = [replays.run(runner, _inputs(v), bound="w")[0] for v in (1.0, 2.0, 3.0)]
    assert [float(o[0, 0]) for o in outs] == [3.0, 5.0, 7.0]  # the plain run's, every time
    assert replays.captures == 0 and replays.reason is not None
    assert replays.reason.startswith("a CUDA graph's replay differs from the plain run: output 0 differs")


def test_a_runner_giving_one_tensor_is_replayed_as_a_list_of_one(fake_cuda):
    class Single(Runner):
        def __call__(self, inputs):
            return super().__call__(inputs)[0]

    runner, replays = Single(), C.Replays()
    outs = [replays.run(runner, _inputs(v), bound="w") for v in (1.0, 2.0, 3.0)]
    assert [len(o) for o in outs] == [1, 1, 1] and replays.replays == 2
    assert torch.equal(outs[2][0], torch.full((2, 3), 7.0))


def test_replay_is_asked_for_by_the_environment_only(monkeypatch):
    from compiler import CompileOptions

    monkeypatch.delenv(C.ENV, raising=False)
    assert CompileOptions().cuda_graphs is False
    monkeypatch.setenv(C.ENV, "1")
    assert CompileOptions().cuda_graphs is True


def test_a_loaded_package_replays_only_where_its_calls_ask_for_it(fake_cuda, fake_loader, monkeypatch):
    """AotGraph.run: replay=True on a GPU call goes through the runner's replays (bound weights as the key),
    replay=False runs it every time."""
    from compiler.keys.signature import FlatCall
    from tests.backends.test_gpu_paths import FakeLoader, _gpu_graph, _on_cuda1, OnCuda1

    def boxed_run(self, inputs):  # what the package computes, recorded when captured
        self.runs += 1
        out = inputs[0] * 2
        if _capturing:
            _capturing[-1].recorded.append(lambda: out.copy_(inputs[0] * 2))
        return [out]

    monkeypatch.setattr(FakeLoader, "boxed_run", boxed_run)
    module = torch.nn.Linear(4, 4)
    graph = _gpu_graph(module)
    _on_cuda1(module)
    calls = [torch.full((2, 4), float(v)).as_subclass(OnCuda1) for v in range(4)]
    outs = [graph.run(module, FlatCall((x,), {}), replay=False)[0] for x in calls]
    on_1 = fake_loader.made[1]
    assert on_1.runs == 4 and graph.replay_state() == {}
    outs = [graph.run(module, FlatCall((x,), {}), replay=True)[0] for x in calls]
    assert [float(o[0, 0]) for o in outs] == [0.0, 2.0, 4.0, 6.0]
    assert on_1.runs == 4 + 3  # a plain run, the capture's warm-up and capture runs, then replays
    assert graph.replay_state() == {"1": {"captures": 1, "replays": 3, "off": None}}
