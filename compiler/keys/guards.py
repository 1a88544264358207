"""Shape guards: the conditions under which one compiled graph is valid.

A graph built by torch.export is only correct for inputs that meet the
guards recorded while tracing (e.g. "height is even", "batch < 64") and the
declared ranges. The AOTInductor runtime does not check them, so we do, before
every call, and route an input that fails one to eager with the guard as the
reason. Guards are stored as text in manifests, which may come from another
machine, so they are evaluated by a small interpreter that accepts only
arithmetic, comparisons and a fixed list of numeric functions over input
sizes -- never `eval`, never any other name.

What it accepts is what torch.export prints for shape guards and range
constraints (torch 2.13 and 2.14 were checked; see tests/keys/test_guard_forms.py):
integer and float literals, `+ - * / // % **`, `& | ^` on integers,
comparisons (chained too), `and`/`or`/`not`, `a if c else b`, `max`/`min`/
`abs`/`round`, `torch.sym_max`/`sym_min`/`sym_float`/`_sym_sqrt`,
`math.floor`/`ceil`/`trunc`/`sqrt`/`log2` and the trigonometric functions
torch's printer emits, `math.inf`/`math.nan`, and sizes written
`L['flat'][i].size()[j]`. Values follow Python's own semantics, which is what
torch's generated guard code runs with. Integers are capped in size (a guard
from an untrusted manifest cannot make the check run for minutes); a guard
whose value cannot be computed for some shapes (division by zero, a result
over the cap, an input that is not there) does not hold for those shapes.

Guards are compiled once, when a graph is built or loaded: a guard the
interpreter cannot check raises GuardSyntaxError there, so the build refuses
the graph with the reason instead of a call failing later.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

Shapes = Sequence[Sequence[int]]
Check = Callable[[Shapes], Any]

# Real guards are a few kilobytes at most (ComfyUI's sub-quadratic attention
# under torch 2.14 gives the longest seen, about 12 kB).
MAX_GUARD_CHARS = 200_000
# Sizes are below 2**63; products of a few of them stay far below this.
MAX_INT_BITS = 4096


class GuardSyntaxError(ValueError):
    """A guard uses something the interpreter does not check (the message says what)."""


class _Unservable(Exception):
    """This guard's value cannot be computed for these shapes."""


def size_ref(leaf: int, dim: int) -> str:
    """How a guard names dimension `dim` of tensor input number `leaf`."""
    return f"L['flat'][{leaf}].size()[{dim}]"


# -- arithmetic with Python's semantics and bounded integers -------------------

def _bounded(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise _Unservable(f"an integer over {MAX_INT_BITS} bits")
    return value


def _power(base: Any, exponent: Any) -> Any:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if max(abs(base).bit_length(), 1) * exponent > MAX_INT_BITS + 64:
            raise _Unservable(f"an integer over {MAX_INT_BITS} bits")
    return _bounded(base ** exponent)


def _sym_max(a: Any, b: Any) -> Any:
    # torch.sym_max on plain numbers: builtins.max, promoted to float if either is one.
    result = max(a, b)
    return float(result) if isinstance(a, float) or isinstance(b, float) else result


def _sym_min(a: Any, b: Any) -> Any:
    result = min(a, b)
    return float(result) if isinstance(a, float) or isinstance(b, float) else result


def _sym_float(value: Any) -> float:
    return float(value)


_BINARY: Dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: lambda a, b: _bounded(a * b),
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
    ast.BitAnd: operator.and_,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
}
_COMPARE: Dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# name -> (function, fewest arguments, most arguments or None for any number)
_FUNCTIONS: Dict[str, Tuple[Callable[..., Any], int, Optional[int]]] = {
    "max": (max, 2, None),
    "min": (min, 2, None),
    "abs": (abs, 1, 1),
    "round": (round, 1, 2),
    "torch.sym_max": (_sym_max, 2, 2),
    "torch.sym_min": (_sym_min, 2, 2),
    "torch.sym_float": (_sym_float, 1, 1),
    "torch._sym_sqrt": (math.sqrt, 1, 1),
    "torch.sym_sqrt": (math.sqrt, 1, 1),
    "math.floor": (math.floor, 1, 1),
    "math.ceil": (math.ceil, 1, 1),
    "math.trunc": (math.trunc, 1, 1),
    "math.sqrt": (math.sqrt, 1, 1),
    "math.log2": (math.log2, 1, 1),
    **{f"math.{name}": (getattr(math, name), 1, 1)
       for name in ("cos", "cosh", "acos", "sin", "sinh", "asin", "tan", "tanh", "atan")},
}
_CONSTANTS: Dict[str, float] = {"math.inf": math.inf, "math.nan": math.nan}
_EVALUATION_ERRORS = (_Unservable, ZeroDivisionError, OverflowError, ValueError, IndexError, TypeError,
                      RecursionError)


def _dotted(node: ast.AST) -> Optional[str]:
    """'math.floor' for the expression math.floor, 'max' for max; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _constant_int(node: ast.AST, what: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return node.value
    raise GuardSyntaxError(f"{what} must be a non-negative integer literal")


class _Compiler:
    """Turns a parsed guard into a closure over the call's shapes, checking every node once."""

    def compile(self, node: ast.AST) -> Check:
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise GuardSyntaxError(f"{type(node).__name__} is not allowed in a guard")
        return method(node)

    def _Expression(self, node: ast.Expression) -> Check:
        return self.compile(node.body)

    def _Constant(self, node: ast.Constant) -> Check:
        value = node.value
        if type(value) not in (bool, int, float):
            raise GuardSyntaxError(f"constant {value!r} is not allowed in a guard")
        if type(value) is int and value.bit_length() > MAX_INT_BITS:
            raise GuardSyntaxError(f"an integer literal over {MAX_INT_BITS} bits")
        return lambda shapes: value

    def _BinOp(self, node: ast.BinOp) -> Check:
        op = _BINARY.get(type(node.op))
        if op is None:
            raise GuardSyntaxError(f"operator {type(node.op).__name__} is not allowed in a guard")
        left, right = self.compile(node.left), self.compile(node.right)
        return lambda shapes: op(left(shapes), right(shapes))

    def _UnaryOp(self, node: ast.UnaryOp) -> Check:
        operand = self.compile(node.operand)
        if isinstance(node.op, ast.USub):
            return lambda shapes: -operand(shapes)
        if isinstance(node.op, ast.UAdd):
            return lambda shapes: +operand(shapes)
        if isinstance(node.op, ast.Not):
            return lambda shapes: not operand(shapes)
        raise GuardSyntaxError(f"operator {type(node.op).__name__} is not allowed in a guard")

    def _BoolOp(self, node: ast.BoolOp) -> Check:
        values = [self.compile(v) for v in node.values]
        if isinstance(node.op, ast.And):
            def both(shapes):
                result = True
                for value in values:  # Python's short-circuit: later parts may divide by what earlier ones check
                    result = value(shapes)
                    if not result:
                        return result
                return result
            return both

        def either(shapes):
            result = False
            for value in values:
                result = value(shapes)
                if result:
                    return result
            return result
        return either

    def _Compare(self, node: ast.Compare) -> Check:
        first = self.compile(node.left)
        steps = []
        for op_node, right_node in zip(node.ops, node.comparators):
            op = _COMPARE.get(type(op_node))
            if op is None:
                raise GuardSyntaxError(f"comparison {type(op_node).__name__} is not allowed in a guard")
            steps.append((op, self.compile(right_node)))

        def compare(shapes):
            left = first(shapes)
            for op, right_fn in steps:
                right = right_fn(shapes)
                if not op(left, right):
                    return False
                left = right
            return True
        return compare

    def _IfExp(self, node: ast.IfExp) -> Check:
        test, body, orelse = self.compile(node.test), self.compile(node.body), self.compile(node.orelse)
        return lambda shapes: body(shapes) if test(shapes) else orelse(shapes)

    def _Call(self, node: ast.Call) -> Check:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "size":
            raise GuardSyntaxError(f"guards may only read sizes, as L['flat'][i].size()[j], not {ast.unparse(node)}")
        name = _dotted(node.func)
        if name not in _FUNCTIONS:
            raise GuardSyntaxError(f"function {name or ast.unparse(node.func)!r} is not allowed in a guard")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise GuardSyntaxError(f"{name}() takes positional arguments only in a guard")
        function, fewest, most = _FUNCTIONS[name]
        if len(node.args) < fewest or (most is not None and len(node.args) > most):
            raise GuardSyntaxError(f"{name}() with {len(node.args)} arguments is not allowed in a guard")
        args = [self.compile(a) for a in node.args]
        return lambda shapes: _bounded(function(*(a(shapes) for a in args)))

    def _Attribute(self, node: ast.Attribute) -> Check:
        name = _dotted(node)
        if name in _CONSTANTS:
            value = _CONSTANTS[name]
            return lambda shapes: value
        raise GuardSyntaxError(f"{name or node.attr!r} is not allowed in a guard")

    def _Name(self, node: ast.Name) -> Check:
        raise GuardSyntaxError(f"name {node.id!r} is not allowed in a guard")

    def _Subscript(self, node: ast.Subscript) -> Check:
        """Only L['flat'][i].size()[j], the j-th size of tensor input i, is readable."""
        call = node.value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "size"
                and not call.args and not call.keywords and isinstance(call.func.value, ast.Subscript)):
            raise GuardSyntaxError(f"guards may only read sizes, as L['flat'][i].size()[j], not {ast.unparse(node)}")
        dim = _constant_int(node.slice, "a size index")
        tensor = call.func.value
        leaf = _constant_int(tensor.slice, "an input index")
        flat = tensor.value
        if not (isinstance(flat, ast.Subscript) and isinstance(flat.value, ast.Name) and flat.value.id == "L"
                and isinstance(flat.slice, ast.Constant) and flat.slice.value == "flat"):
            raise GuardSyntaxError("guards may only read L['flat']")

        def size(shapes):
            try:
                return shapes[leaf][dim]
            except IndexError:
                raise _Unservable(f"input {leaf} has no dimension {dim}") from None
        return size


def compile_guard(text: str) -> Check:
    """The guard as a function of the call's shapes; GuardSyntaxError if it cannot be checked."""
    if not isinstance(text, str):
        raise GuardSyntaxError(f"a guard must be text, not {type(text).__name__}")
    if len(text) > MAX_GUARD_CHARS:
        raise GuardSyntaxError(f"a guard of {len(text)} characters (at most {MAX_GUARD_CHARS})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
        return _Compiler().compile(tree)
    except SyntaxError as error:
        raise GuardSyntaxError(f"not an expression ({error.msg})") from None
    except (RecursionError, MemoryError):
        raise GuardSyntaxError("too deeply nested") from None


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GuardSet:
    """Compiled guards, checked against the shapes of one call."""

    def __init__(self, guards: Sequence[str]):
        self.texts: List[str] = list(guards)
        self._checks: List[Check] = []
        for text in self.texts:
            try:
                self._checks.append(compile_guard(text))
            except GuardSyntaxError as error:
                raise GuardSyntaxError(f"{error}: {_short(str(text))}") from None

    def first_failure(self, shapes: Shapes) -> Optional[str]:
        """The first guard the shapes break, or None when the graph serves them."""
        for text, check in zip(self.texts, self._checks):
            try:
                ok = bool(check(shapes))
            except _EVALUATION_ERRORS:
                ok = False
            if not ok:
                return text
        return None

    def holds(self, shapes: Shapes) -> bool:
        return self.first_failure(shapes) is None


def readable(guard: str, paths: Sequence[str]) -> str:
    """Rewrite `L['flat'][0].size()[2]` as `sample.shape[2]` for messages."""
    text = guard
    for index, path in enumerate(paths):
        text = text.replace(f"L['flat'][{index}].size()", f"{path}.shape")
    return _short(text, 500)
