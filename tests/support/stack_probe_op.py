"""A custom operator whose fake implementation writes down whether torch records Python stacks while it is traced
(torch.fx.config.do_not_emit_stack_traces) to the file KEEPFAST_TEST_STACK_PROBE names: a build process imports
this module (the graph names the operator) and so tells the test what its AOTInductor trace was set to."""

from __future__ import annotations

import os

import torch


@torch.library.custom_op("keepfast_test::stack_probe", mutates_args=())
def stack_probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@stack_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    path = os.environ.get("KEEPFAST_TEST_STACK_PROBE")
    if path:
        import torch.fx.config as fx_config

        with open(path, "a") as handle:
            handle.write(f"{getattr(fx_config, 'do_not_emit_stack_traces', None)}\n")
    return torch.empty_like(x)
