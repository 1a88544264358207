"""Example sizes for the symbols a saved program names only inside expressions, given back after loading it.

A build process reads its program from disk (torch.export.load) and AOTInductor traces it again there, deciding
every size check that tracing meets from the example sizes the program was exported with (its symbols' hints).
torch's deserialiser (torch 2.11 to 2.14, `_export/serde/serialize.py` `_parse_sym_expr`) gives the hint it reads
for a size to that size's whole expression and none to the symbols inside it: an input whose height was exported
as `8*s55` (a size the pack declares a multiple of 8) gets a hint for `8*s55` and none for `s55`. A check that
relates `s55` to another input's symbol then has no example to decide it, and the build failed: ComfyUI's Wan VAE
encodes chunk by chunk with a cache of earlier frames at each level's resolution, and its second level's
`torch.cat` checks `4*s55 == s33` ("GuardOnDataDependentSymNode: Could not guard on data-dependent expression True
(unhinted: Eq(4*s55, s33))" in the build process; every encode ran eager).

`restore_hints` solves each hinted expression that is linear in one symbol without a hint (`8*s55 = 128` gives
`s55 = 16`), repeating while that finds more, and records the result as the symbol's hint: the example the program
was traced with, exactly. A symbol found only in non-linear expressions keeps no hint; the build then fails as
before and the call runs eager with that reason. Standalone (torch only): the build process loads it by path.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


def _shape_env(program: Any) -> Optional[Any]:
    """The ShapeEnv of a loaded program's example values (None for a program without symbolic sizes)."""
    from torch._guards import detect_fake_mode

    values = [node.meta.get("val") for node in program.graph.nodes if node.op == "placeholder"]
    mode = detect_fake_mode([value for value in values if value is not None])
    return getattr(mode, "shape_env", None) if mode is not None else None


def _solved(expression: Any, value: int, unknown: Any) -> Optional[int]:
    """The integer `unknown` takes where `expression` (linear in it, no other free symbol left) equals `value`."""
    import sympy

    if not expression.is_polynomial(unknown):
        return None
    polynomial = sympy.Poly(expression, unknown)
    if polynomial.degree() != 1:
        return None
    slope, intercept = polynomial.all_coeffs()
    solution = sympy.Rational(value - intercept, slope) if slope.is_Integer and intercept.is_Integer else None
    return int(solution) if solution is not None and solution.is_Integer else None


def restore_hints(program: Any) -> Dict[str, int]:
    """Give each symbol of `program` that has no hint the one its hinted expressions imply; returns what was
    given, by symbol name (empty where nothing was missing or nothing could be solved)."""
    shape_env = _shape_env(program)
    if shape_env is None:
        return {}
    known = shape_env.backed_var_to_val
    given: Dict[str, int] = {}
    found = True
    while found:
        found = False
        for expression, value in list(known.items()):
            free: List[Any] = [symbol for symbol in getattr(expression, "free_symbols", ()) if symbol not in known]
            if len(free) != 1 or expression.is_Symbol:
                continue
            others = {symbol: known[symbol] for symbol in expression.free_symbols if symbol in known}
            solution = _solved(expression.xreplace(others), int(value), free[0])
            if solution is not None:
                shape_env.add_backed_var_to_val(free[0], solution)
                given[str(free[0])] = solution
                found = True
    return given
