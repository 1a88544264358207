"""The guard interpreter: every form torch prints, Python's semantics, nothing else.

Each accepted form is compared with what torch's own generated guard code
computes (Python evaluating the same text with torch's namespace), on many
sizes; everything else is refused with a message when the guard is
compiled, and a guard that cannot be computed for some sizes simply does not
hold for them.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from compiler.keys.guards import GuardSet, GuardSyntaxError, compile_guard, readable

A, B, C = "L['flat'][0].size()[2]", "L['flat'][0].size()[3]", "L['flat'][1].size()[0]"

# Forms seen in real exports (tests/guard_data) and the rest torch's PythonPrinter can print.
FORMS = [
    f"({A} % 2) == 0",
    f"{A} == (2 + 2*(((-1) + {A}) // 2))",
    f"((2334849843.0 / (4.0*torch.sym_float(131072*{C})))) >= torch.sym_float({A}*{B})",
    f"math.ceil(({A}*{B}) / 1024) == 4",
    f"math.floor({A} / 3) <= math.trunc({B} / 2.5)",
    f"(2*torch.sym_max(1, ({B} + ((2 + (-1)*({B} % 2)) % 2)) // 2)) != 2",
    f"torch.sym_min({A}, 4096 + torch.sym_min(4096, {A}*{B})) > 64",
    f"max(0, {A} - 8, {B} - 16) <= min({A}, {B}, 20)",
    f"{C} == {A} or {C} == 1",
    f"not ({A} < 16) and {B} <= 64",
    f"{A} ** 2 + {B} ** 2 <= 4096",
    f"torch.sym_float({A}*{B}) <= 1746.34375",
    f"abs({A} - {B}) < 8",
    f"round({A} / 3) == round({B} / 3)",
    f"torch._sym_sqrt({A}*{B}) >= 16.0",
    f"math.log2({A}) <= 6",
    f"({A} if {A} > {B} else {B}) <= 40",
    f"8 <= {A} <= 64",
    f"({A} & 7) == 0 and ({B} | 1) != {B} ^ 0",
    f"({A} - 40) * math.inf > 0 and -math.inf < {B}",
]


def _torch_semantics(text: str, shapes) -> bool:
    """How torch's generated guard function evaluates the text (exec with torch's namespace)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    namespace = {**SYMPY_INTERP, "math": math, "torch": torch, "L": {"flat": [torch.empty(s, device="meta")
                                                                          for s in shapes]}}
    try:
        return bool(eval(text, namespace))  # noqa: S307 - the test's oracle, on the test's own text
    except (ZeroDivisionError, ValueError, OverflowError):
        return False


@pytest.mark.parametrize("text", FORMS)
def test_each_form_matches_torchs_own_evaluation(text):
    check = GuardSet([text])
    rng = random.Random(text)
    answers = set()
    for _ in range(200):
        shapes = [[rng.randint(1, 4), 4, rng.randint(1, 80), rng.randint(1, 80)], [rng.randint(1, 4)]]
        expected = _torch_semantics(text, shapes)
        assert check.holds(shapes) == expected, shapes
        answers.add(expected)
    assert answers == {True, False}, text


@pytest.mark.parametrize("text, why", [
    ("__import__('os').system('true')", "is not allowed in a guard"),
    ("L['flat'][0].stride()[0] == 1", "sizes"),
    ("L['flat'][0].size(0) == 1", "sizes"),
    ("L['flat'][0].shape[0] == 1", "sizes"),
    ("L['other'][0].size()[0] == 1", "L['flat']"),
    ("x == 1", "name 'x'"),
    ("().__class__.__bases__", "__bases__"),
    ("max(1)", "max() with 1 arguments"),
    ("math.floor(x=1)", "positional"),
    ("[s for s in L]", "ListComp"),
    ("(lambda: 1)()", "lambda"),
    ("'a' == 'a'", "constant 'a'"),
    ("torch.ones(1)", "function 'torch.ones'"),
    ("IsNonOverlappingAndDenseIndicator(1, 1, 1, 1)", "IsNonOverlappingAndDenseIndicator"),
    ("1 << 4 == 16", "LShift"),
    ("L['flat'][0].size()[0] == " + "9" * 2000, "integer literal"),
    ("L['flat'][0].size()[0] ==", "not an expression"),
    ("1 + " * 100_000 + "1", "characters"),
])
def test_anything_else_is_refused_with_the_reason(text, why):
    with pytest.raises(GuardSyntaxError) as error:
        GuardSet(["L['flat'][0].size()[0] >= 1", text])
    assert why in str(error.value), str(error.value)


def test_values_that_cannot_be_computed_mean_the_guard_does_not_hold():
    shapes = [[1, 4, 0, 8]]
    assert GuardSet([f"{A} == 0"]).holds(shapes)
    for text in (f"{B} // {A} == 1", f"{B} / {A} > 1.0", f"{B} % {A} == 0", "L['flat'][3].size()[0] == 1",
                 f"math.floor(math.inf) > {A}", f"math.log2({A}) < 1"):
        assert GuardSet([text]).first_failure(shapes) == text
    # short-circuit as in Python: the division is not reached
    assert GuardSet([f"{A} == 0 or {B} // {A} == 1"]).holds(shapes)


def test_huge_values_from_an_untrusted_manifest_end_quickly():
    started = time.perf_counter()
    for text in (f"{A} ** 1000000 > 1", "2 ** 10 ** 10 > 1", f"(({A} ** 64) ** 64) ** 64 > 1",
                 f"{A}*{A}*{A}*{A}*{A}*{A}*{A}*{A} * 99999999999999999999999999999999 ** 200 > 1"):
        assert GuardSet([text]).first_failure([[1, 4, 7, 7]]) == text
    assert time.perf_counter() - started < 5


def test_torch_versions_print_max_differently_and_both_are_checked():
    """torch 2.13 prints max(a, b, c); 2.14 folds it into torch.sym_max(a, torch.sym_max(b, c))."""
    old = f"max({A}, {B}, 12) <= 32"
    new = f"torch.sym_max({A}, torch.sym_max({B}, 12)) <= 32"
    for a in range(1, 40):
        for b in (1, 12, 31, 33):
            shapes = [[1, 4, a, b]]
            assert GuardSet([old]).holds(shapes) == GuardSet([new]).holds(shapes) == (max(a, b, 12) <= 32)


def test_compiled_once_and_reports_which_guard_failed():
    guards = GuardSet([f"{A} >= 8", f"({A} % 2) == 0", f"{A} * {B} <= 4096"])
    assert guards.first_failure([[1, 4, 16, 16]]) is None
    assert guards.first_failure([[1, 4, 15, 16]]) == f"({A} % 2) == 0"
    assert readable(guards.first_failure([[1, 4, 128, 64]]), ["x"]) == "x.shape[2] * x.shape[3] <= 4096"


def test_guard_is_refused_by_compile_guard_with_its_text():
    with pytest.raises(GuardSyntaxError, match="stride"):
        compile_guard("L['flat'][0].stride()[0] == 1")
