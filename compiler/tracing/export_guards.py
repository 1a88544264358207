"""What torch.export recorded about input sizes, as guard text the pack checks itself.

An exported program holds three kinds of shape facts:
- each input dimension: a fixed size, a symbol (`s39`), or an expression of
  other inputs' symbols (`2*s39`);
- the range of each symbol (the declared Dim bounds, maybe narrowed);
- the guards tracing added (`ep._guards_code`, printed by torch with sizes
  written `L['flat'][i].size()[j]`): "height is even", "batch < 64", and with
  ComfyUI's split or sub-quadratic attention, expressions with `/`,
  `math.ceil` and `torch.sym_max` of the free memory seen while tracing.

`exported_shapes` collects them; `guard_texts` prints them, every symbol
replaced by the first input dimension that holds it, as the guard list a
manifest carries. Keeping the two apart lets the tests feed recorded facts
from other torch versions through the same printing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from ..keys.guards import size_ref
from ..backends.base import CompileFailed

Dim = Union[int, Any]  # an int, or a sympy expression over symbols


@dataclass
class ExportedShapes:
    dims: List[List[Dim]]  # per user tensor input, each dimension
    ranges: Dict[Any, Tuple[int, Optional[int]]]  # symbol -> (low, high); high None when unbounded
    guard_code: List[str] = field(default_factory=list)  # torch's own guard text


def exported_shapes(ep: "Any") -> ExportedShapes:
    """The shape facts of an ExportedProgram; CompileFailed when this torch does not expose them."""
    from torch.export.graph_signature import InputKind

    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    dims: List[List[Dim]] = []
    for name in user_inputs:
        value = placeholders[name].meta.get("val")
        if value is None or not hasattr(value, "shape"):
            raise CompileFailed(f"export input {name} is not a tensor; its sizes cannot be guarded")
        dims.append([size if isinstance(size, int) else size.node.expr for size in value.shape])
    ranges = {symbol: _bounds(bounds) for symbol, bounds in ep.range_constraints.items()}
    return ExportedShapes(dims=dims, ranges=ranges, guard_code=_guard_code(ep))


def _multiple_of_new_symbol(size: Any, refs: Dict[Any, str]) -> Optional[Tuple[Any, int]]:
    """(symbol, multiple) where `size` is `multiple * symbol` of a symbol no input size names yet."""
    import sympy

    if not isinstance(size, sympy.Mul) or len(size.args) != 2:
        return None
    coefficient, symbol = size.as_coeff_Mul()
    if not isinstance(symbol, sympy.Symbol) or symbol in refs or not coefficient.is_Integer or coefficient <= 1:
        return None
    return symbol, int(coefficient)


def _bounds(bounds: Any) -> Tuple[int, Optional[int]]:
    low = int(bounds.lower) if _finite(bounds.lower) else 0
    high = int(bounds.upper) if _finite(bounds.upper) else None
    return low, high


def _finite(value: Any) -> bool:
    if getattr(value, "is_finite", True) is False:  # sympy's oo and torch's int_oo
        return False
    try:
        int(value)
    except Exception:  # sympy raises several kinds for values without an integer
        return False
    return True


def _guard_code(ep: "Any") -> List[str]:
    """torch's printing of the guards; without it a graph's validity could not be checked."""
    code = getattr(ep, "_guards_code", None)
    if code is None:
        try:
            from torch.export.exported_program import _convert_guards_to_code

            code = _convert_guards_to_code(ep.graph_module)
        except (ImportError, AttributeError) as error:
            raise CompileFailed(f"this torch does not expose torch.export's shape guards ({error}); "
                                "a graph whose guards cannot be checked is not built") from None
    return [str(text) for text in code]


def guard_texts(shapes: ExportedShapes) -> List[str]:
    """Every fact as one guard over input sizes, in a stable order, without repeats."""
    import sympy
    from torch.utils._sympy.printers import PythonPrinter

    guards: List[str] = []
    refs: Dict[Any, str] = {}
    derived: List[Tuple[str, Any]] = []
    for leaf, dims in enumerate(shapes.dims):
        for dim, size in enumerate(dims):
            ref = size_ref(leaf, dim)
            if isinstance(size, int):
                guards.append(f"{ref} == {size}")
            elif isinstance(size, sympy.Symbol) and size not in refs:
                refs[size] = ref
                low, high = shapes.ranges.get(size, (0, None))
                guards.append(f"{ref} >= {low}")
                if high is not None:
                    guards.append(f"{ref} <= {high}")
            elif _multiple_of_new_symbol(size, refs) is not None:
                # A size declared as a multiple (`8*s1`, compiler/keys/alignment.py): s1 is that size // 8.
                symbol, multiple = _multiple_of_new_symbol(size, refs)
                refs[symbol] = f"({ref} // {multiple})"
                low, high = shapes.ranges.get(symbol, (0, None))
                guards.append(f"{ref} % {multiple} == 0")
                guards.append(f"{ref} >= {multiple * low}")
                if high is not None:
                    guards.append(f"{ref} <= {multiple * high}")
            else:
                derived.append((ref, size))
    printer = PythonPrinter()
    for ref, expr in derived:
        unknown = [s for s in expr.free_symbols if s not in refs]
        if unknown:
            raise CompileFailed(f"cannot express the size {expr} of an input as a guard "
                                f"({', '.join(map(str, unknown))} is no input's size)")
        named = expr.xreplace({symbol: sympy.Symbol(refs[symbol]) for symbol in expr.free_symbols})
        try:
            text = printer.doprint(named)
        except Exception as error:  # a sympy form torch's printer does not print
            raise CompileFailed(f"cannot print the size {expr} of an input as a guard ({error})") from None
        guards.append(f"{ref} == {text}")
    guards.extend(shapes.guard_code)
    return list(dict.fromkeys(guards))
