"""The guard interpreter agrees with sympy on guards recorded from real exports.

tests/guard_data holds what torch.export recorded for the pack's tiny
diffusers UNet (SDPA) and for ComfyUI's own models under each attention
ComfyUI picks (SD1.5 UNetModel under split, sub-quadratic and pytorch
attention; Flux), with torch 2.13 and 2.14. For each record, a few hundred
shapes inside and outside the declared range are checked two ways: by the
pack (its guard printing and interpreter, as a manifest would carry them) and
by sympy on torch's own expressions. They must agree on every shape, and each
record must give both answers, so agreement is not vacuous.
"""

from __future__ import annotations

import random

import pytest

from compiler.tracing.export_guards import guard_texts
from compiler.keys.guards import GuardSet
from tests.support.guards import records, random_values, shapes_for, sympy_serves

RECORDS = records()
SAMPLES = 300


def test_records_cover_each_attention_and_both_torch_versions():
    seen = {(".".join(r.data["torch"].split("+")[0].split(".")[:2]), r.data["attention"]) for r in RECORDS}
    versions = {version for version, _ in seen}
    assert {"2.13", "2.14"} <= versions, versions
    for version in ("2.13", "2.14"):
        attentions = {attention for v, attention in seen if v == version}
        assert {"attention_split", "attention_sub_quad", "attention_pytorch"} <= attentions, (version, attentions)
    assert any("Flux" in r.data["model"] for r in RECORDS)


@pytest.mark.parametrize("record", RECORDS, ids=[r.name for r in RECORDS])
def test_interpreter_agrees_with_sympy(record):
    guards = GuardSet(guard_texts(record.exported_shapes()))
    assert guards.holds(record.example), guards.first_failure(record.example)
    rng = random.Random(record.name)
    symbols, example = record.symbols(), record.example_values()
    answers = {True: 0, False: 0}
    for _ in range(SAMPLES):
        values = random_values(symbols, record.ranges, example, rng)
        shapes = shapes_for(record, values, rng, perturb=0.03)
        expected = sympy_serves(record, shapes)
        assert guards.holds(shapes) == expected, (shapes, guards.first_failure(shapes))
        answers[expected] += 1
    assert answers[True] >= SAMPLES // 10 and answers[False] >= SAMPLES // 10, answers


def test_recorded_forms_include_what_comfyui_attention_produces():
    """The records hold the forms that failed before: true division, sym_float, ceil, sym_max/max, floats."""
    text = "\n".join(code for r in RECORDS for code in r.guard_code)
    for form in (" / ", "torch.sym_float(", "math.ceil(", " // ", " % ", " or ", ".0"):
        assert form in text, form
    assert "torch.sym_max(" in text or "max(" in text


def test_printing_ranges_derived_sizes_and_unbounded_ranges():
    """Sizes that are expressions of other inputs' sizes become equalities; an unbounded range has no upper guard."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    from compiler.tracing.export_guards import ExportedShapes, _bounds

    b, h = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("s1", integer=True, positive=True)
    shapes = ExportedShapes(dims=[[b, 4, h], [2 * b, FloorDiv(h, 2)]],
                            ranges={b: _bounds(ValueRanges(1, int_oo)), h: _bounds(ValueRanges(8, 64))},
                            guard_code=["(L['flat'][0].size()[2] % 2) == 0"])
    texts = guard_texts(shapes)
    assert texts == [
        "L['flat'][0].size()[0] >= 1", "L['flat'][0].size()[1] == 4", "L['flat'][0].size()[2] >= 8",
        "L['flat'][0].size()[2] <= 64", "L['flat'][1].size()[0] == 2*L['flat'][0].size()[0]",
        "L['flat'][1].size()[1] == L['flat'][0].size()[2] // 2", "(L['flat'][0].size()[2] % 2) == 0",
    ], texts
    guards = GuardSet(texts)
    assert guards.holds([[3, 4, 10], [6, 5]]) and guards.holds([[300, 4, 10], [600, 5]])
    assert not guards.holds([[3, 4, 10], [5, 5]]) and not guards.holds([[3, 4, 11], [6, 5]])
