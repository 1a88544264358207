"""Background builds trace in a spawned process where a fork cannot (compiler/tracing/spawned_trace.py).

A fork cannot trace where the process uses CUDA; a spawned process gets the trace pickled without its weights and
rebuilds them as fake tensors. This machine has no GPU: KEEPFAST_TRACE_PROCESS=spawn takes that path on the CPU.
torch.export is counted in this process: a trace in the spawned process leaves the count at 0 while the graph
still lands and equals eager. The program a spawned trace gives is the one a trace here gives (a fake weight's
value is never read by a trace; non-persistent buffers and tensor attributes travel with their values). A module
that cannot be pickled traces in the caller with the reason; a trace process that dies leaves the call eager with
the reason and later traces run in the caller; a trace that fails (the model's doing) keeps spawned traces on; a
parent killed mid-trace leaves no process and no files.
"""

from __future__ import annotations

import copy
import functools
import os
import signal

import pytest
import torch
from torch.export import Dim

from diffusers import UNet2DConditionModel

from compiler import CompileOptions
from compiler.backends import aot_export
from compiler.tracing import forked_trace, spawned_trace
from compiler.builds import launch, package_builds
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.demo.tiny_models import tiny_unet
from tests.support.background import (HERE, RANGE, background_unet, build_folders, gone, served_difference,
                                      stop_parent_mid_build, unet_call)


@pytest.fixture
def spawn(monkeypatch):
    """KEEPFAST_TRACE_PROCESS=spawn, spawned traces on whatever an earlier test did; torch.export calls counted in
    this process (a spawned process counts its own)."""
    monkeypatch.setenv(forked_trace.ENV, spawned_trace.SPAWN)
    monkeypatch.setattr(spawned_trace, "_disabled", None)
    monkeypatch.setattr(forked_trace, "_disabled", None)
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    return calls


def _build_of(forward) -> package_builds.PackageBuild:
    (build,) = [b for b in package_builds._live if b.label.owner_id.startswith(forward.label)]
    return build


def _slow_builds(monkeypatch, seconds: int = 600) -> None:
    """Builds that wait (tests/support/slow_build_child.py): a test about the trace need not build the package."""
    monkeypatch.setattr(launch, "CHILD", HERE / "slow_build_child.py")
    monkeypatch.setenv("KEEPFAST_TEST_BUILD_DELAY_S", str(seconds))


# -- which process traces ---------------------------------------------------------------------------------------

def test_a_fork_where_one_can_a_spawned_process_where_only_cuda_keeps_a_fork_from_it(monkeypatch):
    monkeypatch.delenv(forked_trace.ENV, raising=False)
    monkeypatch.setattr(spawned_trace, "_disabled", None)
    monkeypatch.setattr(forked_trace, "_disabled", None)
    cpu = [torch.zeros(2)]
    assert spawned_trace.chosen(cpu) == (spawned_trace.FORKED, None)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    how, why = spawned_trace.chosen(cpu)
    assert how == spawned_trace.SPAWNED and "uses CUDA" in why
    assert spawned_trace.chosen([torch.zeros(2, device="meta")])[0] == spawned_trace.CALLER  # not a CUDA device
    monkeypatch.setattr(spawned_trace, "_disabled", "a test says so")
    assert spawned_trace.chosen(cpu) == (spawned_trace.CALLER, "this process uses CUDA, which a forked process "
                                                               "cannot; a test says so")
    monkeypatch.setattr(spawned_trace, "_disabled", None)
    monkeypatch.setenv(forked_trace.ENV, "0")
    assert spawned_trace.chosen(cpu) == (spawned_trace.CALLER, f"{forked_trace.ENV}=0")
    monkeypatch.setenv(forked_trace.ENV, "spawn")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert spawned_trace.chosen(cpu) == (spawned_trace.SPAWNED, f"{forked_trace.ENV}=spawn")


# -- the module travels without its weights and is traced to the same program --------------------------------------

class _WithConstants(torch.nn.Module):
    """Weights, a non-persistent buffer and a plain tensor attribute: the last two are in the program's constants."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(512, 256)  # 512 KiB of weights
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 256), persistent=False)
        self.register_buffer("shift", torch.full((256,), 0.25))
        self.offset = torch.arange(256.0).cos()

    def forward(self, x):
        return self.linear(x) * self.scale + self.shift + self.offset


def _export_batch(module: torch.nn.Module, x: torch.Tensor):
    program = torch.export.export(module, (x,), dynamic_shapes=({0: Dim.AUTO(min=1, max=8)},), strict=False)
    return program, {"batch": 3}


def _travelled(work, inputs, tmp_path):
    """`work` pickled without its weights and rebuilt with fake tensors, as a spawned process rebuilds it."""
    payload, packages = spawned_trace.weightless_pickle(work, inputs)
    assert packages == {}, packages  # everything here is found by name on the import path
    (tmp_path / "job.pkl").write_bytes(payload)
    return payload, spawned_trace.rebuilt(tmp_path / "job.pkl")


def test_the_module_travels_without_its_weights_and_traces_to_the_same_program(tmp_path):
    module, x = _WithConstants(), torch.randn(3, 512)
    work = functools.partial(_export_batch, module, x)
    payload, rebuilt = _travelled(work, [x], tmp_path)
    assert len(payload) < 16 * 1024, len(payload)  # weights and input left out; 2 KiB of constants travel
    weight = rebuilt.args[0].linear.weight
    assert type(weight).__name__ == "FakeTensor" and isinstance(weight, torch.nn.Parameter)
    assert type(rebuilt.args[1]).__name__ == "FakeTensor" and rebuilt.args[1].shape == (3, 512)
    got, extra = rebuilt()
    want, _ = work()
    assert extra == {"batch": 3}
    assert got.graph_module.code == want.graph_module.code
    assert str(got.graph_signature) == str(want.graph_signature)
    assert str(got.range_constraints) == str(want.range_constraints)
    layout = lambda ep: {k: (tuple(v.shape), v.dtype) for k, v in ep.state_dict.items()}  # noqa: E731
    assert layout(got) == layout(want) and set(got.state_dict) == {"linear.weight", "linear.bias", "shift"}
    assert set(got.constants) == set(want.constants) and len(got.constants) == 2  # scale and offset, with values
    for name, value in want.constants.items():
        assert type(got.constants[name]) is torch.Tensor, name
        torch.testing.assert_close(got.constants[name], value)


def test_a_unet_trace_travels_and_gives_the_program_and_guards_a_trace_here_gives(tmp_path):
    unet, _, _, forward = background_unet(seed=21)
    args, kwargs = unet_call(1, 16)
    call = forward.flatten(args, kwargs)
    work = functools.partial(aot_export.trace_for_build, unet, forward.forward_fn, call, RANGE)
    payload, rebuilt = _travelled(work, list(call.tensors), tmp_path)
    assert len(payload) < sum(p.nbytes for p in unet.parameters()) / 20, len(payload)  # without the weights
    assert {type(p).__name__ for p in rebuilt.args[0].parameters()} == {"FakeTensor"}
    assert "forward" not in rebuilt.args[0].__dict__  # the pack's dispatcher (CompiledForward) stayed here
    got, got_traced = rebuilt()
    want, want_traced = work()
    for traced in (got_traced, want_traced):
        traced.pop("export_s")
    assert got_traced == want_traced and got_traced["guards"]
    assert got.graph_module.code == want.graph_module.code
    assert str(got.range_constraints) == str(want.range_constraints)


def test_a_module_that_cannot_be_pickled_traces_in_the_caller_with_the_reason(spawn, monkeypatch):
    _slow_builds(monkeypatch)
    unet, twin, registry, forward = background_unet(seed=22)
    unet.conv_out.register_forward_hook(lambda module, inputs, output: None)
    assert served_difference(unet, twin, 1, 8) == 0.0 and "building in the background" in forward.last.reason
    build = _build_of(forward)
    assert build.trace_process == spawned_trace.CALLER and build.tracer is None
    assert build.trace_note.startswith("the module cannot be sent to a trace process: "), build.trace_note
    assert "lambda" in build.trace_note, build.trace_note
    assert len(spawn) >= 1  # traced here
    assert spawned_trace.chosen([])[0] == spawned_trace.SPAWNED  # a module that does not pickle turns nothing off
    assert forward.cancel_builds() == 1 and build_folders() == []


def _linear_trace():
    """A trace as start_traced takes it: (program, what else the trace found)."""
    return torch.export.export(torch.nn.Linear(4, 4), (torch.randn(2, 4),)), {"export_s": 0.0}


def test_a_build_the_caller_waits_for_is_traced_in_the_caller_where_a_spawned_process_would_trace_it(spawn,
                                                                                                     monkeypatch):
    """A block engine's structures built side by side before its first call returns (`waited`): a spawned process
    would add its start to the wait (about 17 s on the H200), so the trace runs here; a background build's still
    runs in a spawned process."""
    _slow_builds(monkeypatch)
    tensors = [torch.randn(2, 4)]
    waited = package_builds.start_traced(_linear_trace, tensors, {}, waited=True)
    assert waited.trace_process == spawned_trace.CALLER and waited.tracer is None
    assert waited.trace_note == package_builds.WAITED_TRACE and len(spawn) == 1
    background = package_builds.start_traced(_linear_trace, tensors, {})
    assert background.trace_process == spawned_trace.SPAWNED and len(spawn) == 1
    waited.cancel()
    background.cancel()
    assert build_folders() == []


# -- a background build traced in a spawned process ---------------------------------------------------------------

def test_the_trace_runs_in_a_spawned_process_and_its_graph_lands(spawn):
    unet, twin, registry, forward = background_unet(seed=23)
    assert served_difference(unet, twin, 1, 16) == 0.0 and forward.last.eager
    assert "building in the background" in forward.last.reason
    build = _build_of(forward)
    assert build.trace_process == spawned_trace.SPAWNED and build.trace_note is None
    assert isinstance(build.tracer, spawned_trace.SpawnedTrace)
    assert spawn == [], "the first call traced in the caller's process"
    assert forward.wait_for_builds(timeout=900) == 1
    (compiled,) = registry.compiles
    assert "built in the background" in compiled.reason
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (1, 12, 5)):
        args, kwargs = unet_call(batch, side, length)
        with torch.no_grad():
            got, want = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
        assert not forward.last.eager, forward.last.reason
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert spawn == [] and len(registry.compiles) == 1 and registry.mismatches == []
    assert spawned_trace.chosen([])[0] == spawned_trace.SPAWNED and build_folders() == []


class _DataDependent(UNet2DConditionModel):
    """A UNet whose forward branches on a tensor's value: it runs eagerly, torch.export refuses it."""

    def forward(self, sample, timestep, encoder_hidden_states, return_dict=True):
        if sample.sum() > 1e9:
            sample = sample * 0
        return super().forward(sample, timestep, encoder_hidden_states, return_dict=return_dict)


def test_a_trace_that_fails_in_the_spawned_process_leaves_the_inputs_eager_and_spawns_stay_on(spawn):
    unet = tiny_unet(seed=24)
    unet.__class__ = _DataDependent
    twin, registry = copy.deepcopy(unet), GraphRegistry()
    forward = compile_module(unet, CompileOptions(shape_range=RANGE, background=True), registry)
    assert served_difference(unet, twin, 1, 8) == 0.0
    assert _build_of(forward).trace_process == spawned_trace.SPAWNED
    assert forward.wait_for_builds(timeout=300) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "compile failed: torch.export failed: " in forward.last.reason, forward.last.reason
    assert spawn == [] and registry.compiles == [] and build_folders() == []
    assert spawned_trace.chosen([])[0] == spawned_trace.SPAWNED  # the model's failure, not the process's


def test_a_spawned_trace_process_that_dies_says_so_and_later_traces_run_in_the_caller(spawn, monkeypatch):
    unet, twin, registry, forward = background_unet(seed=25)
    assert served_difference(unet, twin, 1, 8) == 0.0
    pid = _build_of(forward).tracer.pid
    os.kill(pid, signal.SIGKILL)
    assert forward.wait_for_builds(timeout=120) == 0
    assert served_difference(unet, twin, 1, 8) == 0.0 and forward.last.eager
    assert "the trace process was killed by signal 9" in forward.last.reason, forward.last.reason
    how, why = spawned_trace.chosen([])
    assert how == spawned_trace.CALLER and "a trace in a spawned process failed" in why, why
    assert forked_trace.general_refusal() is None  # forks are not this failure's concern
    assert registry.compiles == [] and build_folders() == [] and gone(pid)
    # A later model's trace runs here, with the reason, and its calls run.
    _slow_builds(monkeypatch)
    other, other_twin, _, other_forward = background_unet(seed=26)
    assert served_difference(other, other_twin, 1, 8) == 0.0 and len(spawn) >= 1
    build = _build_of(other_forward)
    assert build.trace_process == spawned_trace.CALLER and "killed by signal 9" in build.trace_note
    assert other_forward.cancel_builds() == 1 and build_folders() == []


def test_a_parent_killed_mid_trace_leaves_no_spawned_process_and_no_files(tmp_path):
    """The spawned process ends with its parent (its parent-death signal, or its first look at its parent) and
    removes what the parent left."""
    stopped = stop_parent_mid_build(tmp_path, signal.SIGKILL, {"KEEPFAST_TEST_STOP_IN_TRACE": "1",
                                                               forked_trace.ENV: spawned_trace.SPAWN})
    assert stopped.how == spawned_trace.SPAWNED and stopped.ran
    assert gone(stopped.pid), "the trace process outlived its parent"
    assert not stopped.run.exists() and not list(stopped.temp.rglob("build-*")), sorted(stopped.temp.rglob("*"))


def test_a_flux_transformer_s_blocks_are_traced_in_spawned_processes_and_served(spawn, monkeypatch):
    from compiler import compile_pipe
    from compiler.diffusers_api import compiled_parts
    from tests.support import tiny_transformers as tt

    monkeypatch.setenv("KEEPFAST_BUILD_PROCESSES", "1")
    model = tt.build("flux", seed=0)
    registry = GraphRegistry()
    pipe = tt.pipe_of(model)
    compile_pipe(pipe, shape_range=tt.RANGE, registry=registry, background=True)
    engine = compiled_parts(pipe)["transformer"]
    with torch.no_grad():
        got, want = tt.call(model, tt.FIRST), tt.reference(engine, tt.FIRST)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    builds = [b for b in package_builds._live]
    assert len(builds) == 2 and {b.trace_process for b in builds} == {spawned_trace.SPAWNED}
    assert spawn == [] and registry.compiles == []
    assert engine.wait_for_builds() == 2 and len(registry.compiles) == 2
    graph_calls = engine.graph_calls
    for dims in tt.sweep("flux")[:3]:
        with torch.no_grad():
            got, want = tt.call(model, dims), tt.reference(engine, dims)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert engine.graph_calls - graph_calls == 3 * tt.BLOCKS["flux"]
    assert spawn == [] and registry.mismatches == [] and build_folders() == []
