"""Shared by the guard tests: sympy's verdict on recorded shape facts, and shapes to try.

A record (tests/guard_data/*.json, written by tests/guard_data/capture.py)
holds what torch.export said about one export: each input dimension, each
symbol's range and each guard as the sympy expression torch printed it from.
`sympy_serves` decides from those expressions alone whether a call's shapes
meet them, the way torch's own input check does (sizes unify with symbols,
ranges, derived sizes, then every guard), without the pack's printing or
interpreter.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import sympy

DATA = Path(__file__).resolve().parents[1] / "guard_data"


def _namespace() -> Dict[str, Any]:
    from torch.utils._sympy import functions

    return {name: getattr(functions, name) for name in dir(functions) if not name.startswith("_")}


def parse(text: str):
    """A sympy expression back from `srepr` (with torch's own sympy functions)."""
    return sympy.sympify(text, locals=_namespace())


class Record:
    def __init__(self, path: Path):
        self.path = path
        self.name = path.stem
        data = json.loads(path.read_text())
        self.data = data
        self.example: List[List[int]] = data["example"]
        self.dims = [[d if isinstance(d, int) else parse(d) for d in dims] for dims in data["dims"]]
        self.ranges = {parse(k): (v[0], v[1]) for k, v in data["ranges"].items()}
        self.guard_code: List[str] = data["guard_code"]
        self.guard_exprs = [parse(e) for e in data["guard_exprs"]]
        self.sources = {parse(k): tuple(v) for k, v in data["sources"].items()}

    def exported_shapes(self):
        from compiler.tracing.export_guards import ExportedShapes

        return ExportedShapes(dims=self.dims, ranges=self.ranges, guard_code=self.guard_code)

    def symbols(self) -> List[Any]:
        """The symbols that are some input's size, in input order."""
        seen: List[Any] = []
        for dims in self.dims:
            for d in dims:
                if isinstance(d, sympy.Symbol) and d not in seen:
                    seen.append(d)
        return seen

    def example_values(self) -> Dict[Any, int]:
        values = {}
        for dims, shape in zip(self.dims, self.example):
            for d, size in zip(dims, shape):
                if isinstance(d, sympy.Symbol):
                    values.setdefault(d, size)
        return values


def records() -> List[Record]:
    return [Record(path) for path in sorted(DATA.glob("*.json"))]


def _truth(value: Any) -> bool:
    if value is sympy.true or value is True:
        return True
    if value is sympy.false or value is False:
        return False
    return bool(value)  # a number; an undecided relation raises TypeError


def sympy_serves(record: Record, shapes: Sequence[Sequence[int]]) -> bool:
    """Whether the recorded export serves these shapes, decided by sympy on torch's own expressions."""
    if len(shapes) != len(record.dims):
        return False
    values: Dict[Any, sympy.Integer] = {}
    derived: List[Tuple[Any, int]] = []
    for dims, shape in zip(record.dims, shapes):
        if len(dims) != len(shape):
            return False
        for d, size in zip(dims, shape):
            if isinstance(d, int):
                if d != size:
                    return False
            elif isinstance(d, sympy.Symbol):
                if d in values and values[d] != size:
                    return False
                values[d] = sympy.Integer(size)
            else:
                derived.append((d, size))
    try:
        for expr, size in derived:
            if expr.xreplace(values) != size:
                return False
        for key, (low, high) in record.ranges.items():
            if not key.free_symbols <= set(values):
                continue  # no input holds it: torch cannot check it either
            value = key.xreplace(values)
            if value < low or (high is not None and value > high):
                return False
        # A guard reads sizes through its own symbols (an input's size, as torch's guard code does).
        sizes = {symbol: sympy.Integer(shapes[leaf][dim]) for symbol, (leaf, dim) in record.sources.items()}
        return all(_truth(expr.xreplace(sizes)) for expr in record.guard_exprs)
    except (ZeroDivisionError, TypeError, IndexError):
        return False


def shapes_for(record: Record, values: Dict[Any, int], rng: random.Random,
               perturb: float = 0.0) -> List[List[int]]:
    """The inputs' shapes for these symbol values (fixed and derived sizes now and then off by one)."""
    shapes = []
    known = {s: sympy.Integer(v) for s, v in values.items()}
    for dims in record.dims:
        shape = []
        for d in dims:
            if isinstance(d, int):
                size = d
            elif isinstance(d, sympy.Symbol):
                size = values[d]
            else:
                size = int(d.xreplace(known))
            if not isinstance(d, sympy.Symbol) and rng.random() < perturb:
                size = max(1, size + rng.choice((-1, 1)))
            shape.append(size)
        shapes.append(shape)
    return shapes


def random_values(symbols: Sequence[Any], ranges: Dict[Any, Tuple[int, Optional[int]]],
                  example: Dict[Any, int], rng: random.Random) -> Dict[Any, int]:
    """Symbol values: the example's, with some moved inside, to, or just past their range."""
    values = dict(example)
    moved = rng.sample(list(symbols), k=rng.randint(0, min(3, len(symbols))))
    for symbol in moved:
        low, high = ranges.get(symbol, (1, None))
        high = high if high is not None else max(4 * example[symbol], 64)
        low = max(1, low)
        here = example[symbol]
        values[symbol] = max(1, rng.choice([
            rng.randint(low, high), rng.randint(low, high), low, high, low - 1, high + 1, high + rng.randint(2, 64),
            here + 1, here - 1, here * 2, here // 2, here + 8, here - 8, 2 * rng.randint(max(1, low // 2), high // 2),
        ]))
    return values
