"""Shape guards: the conditions under which one compiled graph is valid.

A graph built by torch.export is only correct for inputs that meet the
guards recorded while tracing (e.g. "height is even", "batch < 64") and the
declared ranges. The AOTInductor runtime does not check them, so we do, before
every call, and route an input that fails one to eager with the guard as the
reason. Guards are stored as text in manifests, which may come from another
machine, so they are evaluated by a small interpreter that accepts only
integer arithmetic and comparisons over input sizes -- never `eval`.
"""

from __future__ import annotations

import ast
import operator
from typing import Sequence

Shapes = Sequence[Sequence[int]]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}


class GuardSyntaxError(ValueError):
    """A guard uses something other than size arithmetic."""


def size_ref(leaf: int, dim: int) -> str:
    """How a guard names dimension `dim` of tensor input number `leaf`."""
    return f"L['flat'][{leaf}].size()[{dim}]"


class _Interpreter:
    def __init__(self, shapes: Shapes):
        self.shapes = shapes

    def run(self, node: ast.AST):
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise GuardSyntaxError(f"{type(node).__name__} is not allowed in a guard")
        return method(node)

    def _Expression(self, node: ast.Expression):
        return self.run(node.body)

    def _Constant(self, node: ast.Constant):
        if isinstance(node.value, (bool, int)):
            return node.value
        raise GuardSyntaxError(f"constant {node.value!r} is not allowed in a guard")

    def _BinOp(self, node: ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise GuardSyntaxError(f"operator {type(node.op).__name__} is not allowed")
        return op(self.run(node.left), self.run(node.right))

    def _UnaryOp(self, node: ast.UnaryOp):
        value = self.run(node.operand)
        if isinstance(node.op, ast.USub):
            return -value
        if isinstance(node.op, ast.Not):
            return not value
        raise GuardSyntaxError(f"operator {type(node.op).__name__} is not allowed")

    def _BoolOp(self, node: ast.BoolOp):
        values = (self.run(v) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)

    def _Compare(self, node: ast.Compare):
        left = self.run(node.left)
        for op_node, right_node in zip(node.ops, node.comparators):
            op = _COMPARE.get(type(op_node))
            if op is None:
                raise GuardSyntaxError(f"comparison {type(op_node).__name__} is not allowed")
            right = self.run(right_node)
            if not op(left, right):
                return False
            left = right
        return True

    def _Subscript(self, node: ast.Subscript):
        # Only the shape of L['flat'][i].size()[j] is reachable.
        index = node.slice
        if not isinstance(index, ast.Constant) or not isinstance(index.value, (int, str)):
            raise GuardSyntaxError("subscripts must be constants")
        target = node.value
        if isinstance(target, ast.Call):
            return self._size_of(target)[index.value]
        if isinstance(target, ast.Subscript):
            flat = self._flat(target)
            return self.shapes[index.value] if flat else None
        raise GuardSyntaxError("unexpected subscript in a guard")

    def _flat(self, node: ast.Subscript) -> bool:
        if (
            isinstance(node.value, ast.Name)
            and node.value.id == "L"
            and isinstance(node.slice, ast.Constant)
            and node.slice.value == "flat"
        ):
            return True
        raise GuardSyntaxError("guards may only read L['flat']")

    def _size_of(self, call: ast.Call):
        func = call.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "size"
            and not call.args
            and not call.keywords
            and isinstance(func.value, ast.Subscript)
        ):
            leaf = func.value
            if not isinstance(leaf.slice, ast.Constant) or not isinstance(leaf.slice.value, int):
                raise GuardSyntaxError("input index must be an integer")
            self._flat(leaf.value)
            return tuple(self.shapes[leaf.slice.value])
        raise GuardSyntaxError("only .size() calls are allowed in a guard")


def parse_guard(text: str) -> ast.Expression:
    tree = ast.parse(text, mode="eval")
    # Validate the whole tree up front with dummy shapes large enough to index.
    _validate(tree)
    return tree


def _validate(tree: ast.AST) -> None:
    allowed = (
        ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
        ast.Subscript, ast.Call, ast.Attribute, ast.Name, ast.Load, ast.And, ast.Or,
        ast.Not, ast.USub, *_BINARY, *_COMPARE,
    )
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise GuardSyntaxError(f"{type(node).__name__} is not allowed in a guard")
        if isinstance(node, ast.Name) and node.id != "L":
            raise GuardSyntaxError(f"name {node.id!r} is not allowed in a guard")
        if isinstance(node, ast.Attribute) and node.attr != "size":
            raise GuardSyntaxError(f"attribute {node.attr!r} is not allowed in a guard")


class GuardSet:
    """Parsed guards, checked against the shapes of one call."""

    def __init__(self, guards: Sequence[str]):
        self.texts = list(guards)
        self._parsed = [parse_guard(text) for text in self.texts]

    def first_failure(self, shapes: Shapes) -> str | None:
        """The first guard the shapes break, or None when the graph serves them."""
        interpreter = _Interpreter(shapes)
        for text, tree in zip(self.texts, self._parsed):
            try:
                ok = interpreter.run(tree)
            except (IndexError, ZeroDivisionError, TypeError):
                ok = False
            if not ok:
                return text
        return None


def readable(guard: str, paths: Sequence[str]) -> str:
    """Rewrite `L['flat'][0].size()[2]` as `sample.shape[2]` for messages."""
    text = guard
    for index, path in enumerate(paths):
        text = text.replace(f"L['flat'][{index}].size()", f"{path}.shape")
    return text
