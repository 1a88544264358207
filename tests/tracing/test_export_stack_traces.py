"""torch.export without each node's Python stack (stack_traces.without_stack_traces): 6-9% of the real-depth SD1.5 UNet's
export on a 2-core CPU (torch 2.13: 10.19 s against 10.81, three runs each; 9.95 s against 10.88 in a whole cold
compile), a record only torch's debug output reads. The setting is torch's own (torch.fx.config.do_not_emit_stack_traces, torch 2.13 and later) and is put back."""

from __future__ import annotations

import pytest
import torch
import torch.fx.config as fx_config

from compiler.build_process.stack_traces import without_stack_traces

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles


@pytest.mark.skipif(not hasattr(fx_config, "do_not_emit_stack_traces"), reason="torch before 2.13 always records")
def test_the_export_records_no_stacks_and_puts_the_setting_back():
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    with_stacks = torch.export.export(module, (torch.randn(2, 4),))
    assert any(node.meta.get("stack_trace") for node in with_stacks.graph.nodes)  # what torch does by itself
    before = fx_config.do_not_emit_stack_traces
    with without_stack_traces():
        program = torch.export.export(module, (torch.randn(2, 4),))
    assert fx_config.do_not_emit_stack_traces == before
    assert not any(node.meta.get("stack_trace") for node in program.graph.nodes)
    assert torch.equal(program.module()(torch.ones(2, 4)), module(torch.ones(2, 4)))


def test_an_error_inside_puts_the_setting_back():
    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    with pytest.raises(RuntimeError):
        with without_stack_traces():
            raise RuntimeError("export failed")
    assert getattr(fx_config, "do_not_emit_stack_traces", None) == before


@pytest.mark.skipif(not hasattr(fx_config, "do_not_emit_stack_traces"), reason="torch before 2.13 always records")
def test_a_build_process_traces_the_program_without_stacks(tmp_path, monkeypatch):
    """AOTInductor's own trace in the build process (27.4-29.5 s against 21.4 s without stacks for the real-depth
    SD1.5 UNet): the operator's fake implementation, run by that trace in the build process, sees the setting on."""
    from compiler.backends import aot_build
    from compiler.builds import package_builds, spares
    from tests.support import stack_probe_op

    probe = tmp_path / "probe.txt"
    monkeypatch.setenv("KEEPFAST_TEST_STACK_PROBE", str(probe))
    # a build process started before this test (an earlier test's spare) has no probe in its environment
    monkeypatch.setenv(spares.SPARE_ENV, "0")
    spares._stop_spares()

    class Probed(torch.nn.Module):
        def forward(self, x):
            return stack_probe_op.stack_probe(x + 1)

    program = torch.export.export(Probed(), (torch.randn(2, 4),))
    probe.write_text("")  # the export above traced it here, in the test's process
    build = package_builds.start(program, dict(aot_build.PACKAGE_CONFIG), now=True)
    build.result(timeout=600)
    seen = probe.read_text().split()
    assert seen and set(seen) == {"True"}, seen
