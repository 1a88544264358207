"""The first-use check's comparison (compiler/serving/verify.py): what counts as agreeing with eager."""

from __future__ import annotations

import math

import pytest
import torch

from compiler.serving.verify import Agreement, Verdicts, compare, judge, retired_reason, snapshot, tolerance_for


def _sample(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype, noise, agrees", [
    (torch.float32, 1e-6, True), (torch.float32, 1e-2, False),
    (torch.float16, 1e-3, True), (torch.float16, 1e-1, False),
    (torch.bfloat16, 1e-2, True), (torch.bfloat16, 2e-1, False),
])
def test_each_dtype_has_its_tolerance(dtype, noise, agrees):
    reference = _sample(2, 4, 8, 8, dtype=dtype)
    output = (reference.float() * (1 + noise)).to(dtype)
    agreement = compare(output, reference)
    assert agreement.ok is agrees, agreement.describe()
    assert agreement.tolerance == tolerance_for(dtype)


def test_one_wrong_sample_in_a_batch_is_a_difference():
    reference = _sample(8, 4, 16, 16)
    output = reference.clone()
    output[5] += 0.5 * output[5].std()
    agreement = compare(output, reference)
    assert not agreement.ok and agreement.relative > 0.3


def test_nan_or_inf_where_eager_is_finite_is_a_difference_but_shared_nan_is_not():
    reference = _sample(2, 16)
    output = reference.clone()
    output[0, 3] = float("nan")
    output[1, 2] = float("inf")
    agreement = compare(output, reference)
    assert not agreement.ok and agreement.nonfinite == 2
    assert "2 NaN or Inf" in agreement.describe()
    both = reference.clone()
    both[0, 3] = float("nan")
    assert compare(both.clone(), both).ok


def test_outputs_of_another_structure_shape_or_dtype_disagree():
    a = _sample(2, 3)
    assert not compare((a, a), (a,)).ok
    assert "eager's is" in compare(a, a.reshape(3, 2)).describe()
    assert not compare(a.double(), a).ok
    assert not compare(torch.tensor([1, 2]), torch.tensor([1, 3])).ok and compare(torch.tensor([1]), torch.tensor([1])).ok


def test_a_zero_reference_is_compared_against_a_floor_not_divided_by_zero():
    zero = torch.zeros(2, 8)
    assert compare(zero.clone(), zero).ok
    assert not compare(zero + 1e-3, zero).ok


def test_outputs_in_a_tree_are_compared_leaf_by_leaf():
    a, b = _sample(2, 4), _sample(2, 4, seed=1)
    assert compare({"x": a, "y": (b,)}, {"x": a.clone(), "y": (b.clone(),)}).ok
    assert not compare({"x": a, "y": (b + 1,)}, {"x": a, "y": (b,)}).ok


def test_each_graph_and_shapes_is_judged_once_and_the_verdict_kept():
    verdicts = Verdicts()
    reference = _sample(2, 4)
    assert verdicts.get("g", ((2, 4),)) is None
    assert judge(verdicts, "g", ((2, 4),), reference.clone(), reference) is None
    assert verdicts.get("g", ((2, 4),)).ok and verdicts.get("g", ((3, 4),)) is None and verdicts.get("h", ((2, 4),)) is None
    disagreement = judge(verdicts, "g", ((3, 4),), reference + 5, reference)
    assert disagreement is not None and not disagreement.ok
    assert verdicts.get("g", ((3, 4),)) is disagreement and list(verdicts.retired()) == [("g", ((3, 4),))]


def test_an_output_that_cannot_be_compared_is_not_trusted():
    disagreement = judge(Verdicts(), "g", (), torch.zeros(2), object())
    assert disagreement is not None and "returned 1 tensors, eager 0" in disagreement.describe()


def test_snapshot_copies_tensors_and_containers_and_restore_puts_eager_s_state_back():
    x = torch.zeros(3)
    residuals = {"output": [torch.ones(2), torch.ones(2)]}
    copies = snapshot((x,), {"control": residuals, "name": "unet"})
    copies.args[0].add_(1)  # eager's in-place update, on the copy
    copies.kwargs["control"]["output"].pop()  # ComfyUI's UNet pops residuals from their lists
    assert torch.equal(x, torch.zeros(3)) and len(residuals["output"]) == 2 and copies.kwargs["name"] == "unet"
    x.add_(7)  # a (wrong) graph's in-place update of the caller's tensor
    copies.restore()
    assert torch.equal(x, torch.ones(3)) and torch.equal(residuals["output"][0], torch.ones(2))


def test_a_full_verdict_store_forgets_agreements_before_retirements():
    verdicts = Verdicts(limit=3)
    bad = Agreement(1.0, 0.002, 1.0)
    good = Agreement(0.0, 0.002, 0.0)
    verdicts.put("g", 1, bad)
    verdicts.put("g", 2, good)
    verdicts.put("g", 3, good)
    verdicts.put("g", 4, good)
    assert verdicts.get("g", 1) is bad and verdicts.get("g", 2) is None and verdicts.get("g", 4) is good


def test_the_retirement_names_the_graph_inputs_and_difference():
    text = retired_reason("abc", ["sample", "timestep"], [(2, 4, 8, 8), (2,)], Agreement(0.71, 0.002, 0.97))
    assert text.startswith("graph abc disagrees with eager for inputs sample [2, 4, 8, 8], timestep [2]")
    assert "relative difference 0.71 (allowed 0.002)" in text and text.endswith("which run eager")
    assert math.isinf(compare((), (torch.zeros(1),)).relative)


class _UpdatesInPlace(torch.nn.Module):
    """A model that updates its input in place and returns it, as ComfyUI's Flux blocks do (`img += ...`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        x += self.linear(x)
        return x


def test_the_check_of_a_model_that_updates_its_input_in_place_sees_the_model_s_own_result(tmp_path):
    """Eager runs on copies taken before the graph: on the caller's tensor it would start from the graph's
    update, overwrite the output it is compared with, and compare it with itself."""
    from compiler import CompiledForward, CompileOptions, GraphRegistry, ShapeRange

    registry = GraphRegistry()
    module = _UpdatesInPlace().eval()
    options = CompileOptions(shape_range=ShapeRange(batch=(1, 4), spatial=(8, 8), sequence=(1, 8)), cover_range=False)
    compiled = CompiledForward(module, options, registry)
    for batch in (1, 2, 2):
        x = torch.randn(batch, 3, 8, generator=torch.Generator().manual_seed(batch))
        expected = x + module.linear(x)
        with torch.no_grad():
            served = compiled.serve((x.clone(),), {})
        assert not served.eager, served.reason
        assert float((served.output - expected).abs().max()) < 1e-5
    assert len(registry.compiles) == 1 and registry.mismatches == [] and len(registry.verdicts) == 2
