"""A loaded package called with one flat list of tensors skips torch's per-call spec parsing
(compiler/backends/flat_runner.py); any other call goes to torch's own model, and both give the same outputs."""

from __future__ import annotations

import torch

from compiler.backends import aot_build
from compiler.backends.package_loader import new_loader
from compiler.backends.flat_runner import FlatRunner


class TakesList(torch.nn.Module):
    def forward(self, tensors):
        a, b = tensors
        return [a * 2 + b, (a - b).sum(dim=1)]


class TakesTwo(torch.nn.Module):
    def forward(self, a, b):
        return a * 2 + b


def _loaded(module, args, tmp_path, name):
    from torch._inductor.package.package import AOTICompiledModel

    program = torch.export.export(module, args)
    path = str(tmp_path / f"{name}.pt2")
    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=dict(aot_build.PACKAGE_CONFIG))
    return AOTICompiledModel(new_loader(path))


def test_a_package_taking_one_list_is_called_straight_and_gives_torch_s_outputs(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    model = _loaded(TakesList(), ([a, b],), tmp_path, "list")
    runner = FlatRunner(model)
    assert runner._flat
    calls = []
    real = model.loader
    runner.loader = type("Counting", (), {"boxed_run": lambda self, inputs: calls.append(len(inputs))
                                          or real.boxed_run(inputs)})()
    got = runner([a, b])
    assert calls == [2]  # straight to the loader, the list its own
    want = TakesList()([a, b])
    assert isinstance(got, list) and all(torch.allclose(g, w) for g, w in zip(got, want))
    assert runner.get_constant_fqns() == model.get_constant_fqns()  # everything else is torch's model's
    assert all(torch.allclose(g, w) for g, w in zip(runner((a, b)), want))  # a tuple: torch's own call path


def test_a_package_taking_other_arguments_is_called_as_torch_calls_it(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    runner = FlatRunner(_loaded(TakesTwo(), (a, b), tmp_path, "two"))
    assert not runner._flat
    assert torch.allclose(runner(a, b), a * 2 + b)


class TakesTwoLists(torch.nn.Module):
    """A block graph with its weights as inputs (weight_inputs.py): the call's tensors, then the weights."""

    def forward(self, tensors, weights):
        (a,), (w, bias) = tensors, weights
        return [a @ w + bias]


def test_a_package_taking_its_weights_as_a_second_list_is_called_straight(tmp_path):
    a, w, bias = torch.randn(3, 4), torch.randn(4, 5), torch.randn(5)
    model = _loaded(TakesTwoLists(), ([a], [w, bias]), tmp_path, "lists")
    runner = FlatRunner(model)
    assert runner._flat
    got = runner([a, w, bias])  # one list: the call's tensors, then the weights
    assert torch.allclose(got[0], a @ w + bias, atol=1e-5)
