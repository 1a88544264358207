"""An exported program cut into consecutive parts that AOTInductor builds in parallel processes.

Why: one AOTInductor build is one process doing one thing after another (its own trace of the program,
lowering, code generation, the C++ wrapper and kernel compiles), so a whole SD1.5 UNet keeps one core busy
for minutes while the others wait. Measured on this project's 2-core CPU (narrow SD1.5 UNet at the real depth,
docs/benchmarks.md): the whole program built in 110 s; its two halves in 81 s and 69 s each, so built side by
side the graph is ready in about 81 s. On a 16-core GPU machine the parts are more and the gain larger.

The cut is by position in the graph: each part takes the values earlier parts made (activations, the
skip connections a UNet carries across), and the program's inputs and weights it uses. Sizes a part needs
(symbolic ints) are computed again inside it from the sizes of its own inputs, so only tensors cross a cut.
A program that cannot be cut this way (a size expression this module cannot write, a value that is no
tensor) is built whole: `split_program` raises CannotSplit with the reason.

The parts are served one after another from one package (compiler/backends/aot_parts.py); the program's
guards, taken before the cut, are the graph's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.utils._pytree as pytree

from ..settings import GRAPH_PARTS, graph_parts

PARTS_ENV = GRAPH_PARTS.name
NODES_PER_PART = 400  # fewer, and a part's fixed cost (its own C++ wrapper, process start) outweighs the gain


# sympy's (and torch's) two-argument functions a part computes sizes and conditions with.
_BINARY = {"FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod,
           "Equality": operator.eq, "Unequality": operator.ne, "StrictLessThan": operator.lt,
           "LessThan": operator.le, "StrictGreaterThan": operator.gt, "GreaterThan": operator.ge}


class CannotSplit(Exception):
    """The program is built whole; the message says why it could not be cut."""


@dataclass(frozen=True)
class Wiring:
    """Which values each part takes and makes, by name; what the manifest keeps to serve the parts in order."""

    inputs: Tuple[str, ...]  # the program's tensor inputs, in the call's order
    outputs: Tuple[str, ...]  # the program's outputs, in order
    parts: Tuple[Tuple[Tuple[str, ...], Tuple[str, ...]], ...]  # per part: (values it takes, values it makes)

    def to_json(self) -> dict:
        return {"inputs": list(self.inputs), "outputs": list(self.outputs),
                "parts": [{"inputs": list(i), "outputs": list(o)} for i, o in self.parts]}

    @classmethod
    def from_json(cls, data: Any) -> "Wiring":
        try:
            wiring = cls(tuple(map(str, data["inputs"])), tuple(map(str, data["outputs"])),
                         tuple((tuple(map(str, p["inputs"])), tuple(map(str, p["outputs"]))) for p in data["parts"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"the graph's parts are not described right ({error})") from None
        wiring.check()
        return wiring

    def check(self) -> None:
        """ValueError unless every value a part takes is an input or made by an earlier part, and every output
        is made (a manifest from elsewhere must not make the runner read a value that is not there)."""
        known = set(self.inputs)
        for index, (takes, makes) in enumerate(self.parts):
            missing = [name for name in takes if name not in known]
            if missing:
                raise ValueError(f"part {index} of the graph takes {missing[0]}, which no earlier part makes")
            known.update(makes)
        missing = [name for name in self.outputs if name not in known]
        if missing:
            raise ValueError(f"the graph's output {missing[0]} is made by no part")

    def last_uses(self) -> List[List[str]]:
        """Per part, the values no later part (nor the output) needs once it ran: freed then."""
        needed_after = set(self.outputs)
        out: List[List[str]] = [[] for _ in self.parts]
        for index in range(len(self.parts) - 1, -1, -1):
            takes, _ = self.parts[index]
            out[index] = [name for name in dict.fromkeys(takes) if name not in needed_after]
            needed_after.update(takes)
        return out


@dataclass
class Part:
    program: "torch.export.ExportedProgram"
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]


def part_count(program: "torch.export.ExportedProgram", builders: int) -> int:
    """How many parts to build `program` in with `builders` processes at once: KEEPFAST_GRAPH_PARTS, else as
    many as builders can take side by side, at least NODES_PER_PART operations each."""
    configured = graph_parts()
    if configured is not None:
        return configured
    operations = sum(1 for node in program.graph.nodes if node.op == "call_function")
    return max(1, min(builders, operations // NODES_PER_PART))


def _is_scalar(node: torch.fx.Node) -> bool:
    """A node whose value is a size or a condition (recomputed in each part), or a runtime assertion."""
    value = node.meta.get("val")
    if isinstance(value, (torch.SymInt, torch.SymBool, torch.SymFloat, int, bool, float)):
        return True
    return value is None and "assert" in str(node.target)


def _tensor_valued(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class _PartBuilder:
    """One part's graph, made from the program's nodes assigned to it."""

    def __init__(self, program, index: int, assigned: Dict[torch.fx.Node, int], user_inputs: List[torch.fx.Node]):
        self.program, self.index, self.assigned, self.user_inputs = program, index, assigned, user_inputs
        self.graph = torch.fx.Graph()
        self.env: Dict[torch.fx.Node, torch.fx.Node] = {}
        self.taken: List[torch.fx.Node] = []  # original nodes this part takes as inputs, in order first used
        self.sizes: Dict[Any, Any] = {}  # sympy expression -> node (or int) computing it here

    # -- values from outside --------------------------------------------------
    def take(self, node: torch.fx.Node) -> torch.fx.Node:
        if node not in self.env:
            placeholder = self.graph.placeholder(node.name)
            placeholder.meta.update(node.meta)
            self.env[node] = placeholder
            self.taken.append(node)
        return self.env[node]

    def size(self, expression) -> Any:
        """A node computing the size `expression` (a sympy expression of the program's symbols) from this
        part's inputs, taking a program input whose size holds a symbol where none of its inputs does."""
        import sympy

        expression = sympy.sympify(expression)
        if expression in self.sizes:
            return self.sizes[expression]
        if expression.is_Integer:
            return int(expression)
        if isinstance(expression, sympy.Symbol):
            made = self._symbol(expression)
        elif isinstance(expression, (sympy.Add, sympy.Mul)):
            combine = operator.add if isinstance(expression, sympy.Add) else operator.mul
            made = self.size(expression.args[0])
            for term in expression.args[1:]:
                made = self._scalar_op(combine, made, self.size(term))
        elif type(expression).__name__ in _BINARY:
            made = self._scalar_op(_BINARY[type(expression).__name__], self.size(expression.args[0]),
                                   self.size(expression.args[1]))
        elif isinstance(expression, (sympy.And, sympy.Or)):
            combine = operator.and_ if isinstance(expression, sympy.And) else operator.or_
            made = self.size(expression.args[0])
            for term in expression.args[1:]:
                made = self._scalar_op(combine, made, self.size(term))
        elif expression in (sympy.true, sympy.false):
            made = bool(expression)
        else:
            raise CannotSplit(f"a size ({expression}) is written with {type(expression).__name__}, "
                              "which a part cannot compute again")
        self.sizes[expression] = made
        return made

    def _symbol(self, symbol) -> Any:
        candidates = list(self.env) + [node for node in self.user_inputs if node not in self.env]
        for node in candidates:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                continue
            for dim, size in enumerate(value.shape):
                if not isinstance(size, torch.SymInt):
                    continue
                coefficient, rest = size.node.expr.as_coeff_Mul()
                if rest == symbol and coefficient.is_Integer and coefficient > 0:
                    read = self.graph.call_function(torch.ops.aten.sym_size.int, (self.take(node), dim))
                    read.meta["val"] = size
                    if coefficient != 1:
                        read = self._scalar_op(operator.floordiv, read, int(coefficient))
                    return read
        raise CannotSplit(f"no input of a part carries the size {symbol}")

    def _scalar_op(self, op, a, b) -> Any:
        value_a = a.meta["val"] if isinstance(a, torch.fx.Node) else a
        value_b = b.meta["val"] if isinstance(b, torch.fx.Node) else b
        node = self.graph.call_function(op, (a, b))
        node.meta["val"] = op(value_a, value_b)
        return node

    def value(self, node: Any) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        if node in self.env:
            return self.env[node]
        value = node.meta.get("val")
        if node.op == "placeholder" or isinstance(value, torch.Tensor):
            if self.assigned.get(node) == self.index:
                raise CannotSplit(f"{node.name} is used before it is made")  # not in graph order
            return self.take(node)
        if isinstance(value, (torch.SymInt, torch.SymBool)):
            return self.size(value.node.expr)
        if isinstance(value, (int, float, bool)):
            return value
        raise CannotSplit(f"{node.name} ({type(value).__name__}) crosses a cut and is no tensor")

    # -- the part's own nodes ---------------------------------------------------
    def copy(self, node: torch.fx.Node) -> None:
        args = torch.fx.node.map_aggregate(node.args, self.value)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, self.value)
        made = self.graph.call_function(node.target, args, kwargs)
        made.meta.update(node.meta)
        self.env[node] = made


def _assign(program, count: int) -> Dict[torch.fx.Node, int]:
    """Each operation's part: consecutive runs of equal numbers of operations; a tuple's items go with it;
    sizes, conditions and assertions are not assigned (recomputed where used; assertions run in part 0)."""
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    work = [n for n in nodes if not _is_scalar(n) and not (n.target is operator.getitem and not _is_scalar(n))]
    assigned: Dict[torch.fx.Node, int] = {}
    for position, node in enumerate(work):
        assigned[node] = min(count - 1, position * count // max(1, len(work)))
    for node in nodes:
        if node.target is operator.getitem and not _is_scalar(node) and isinstance(node.args[0], torch.fx.Node):
            assigned[node] = assigned.get(node.args[0], 0)
        elif _is_scalar(node) and node.meta.get("val") is None:
            # An assertion: on a tensor (its metadata), where the tensor is made; on sizes, first.
            tensors = [arg for arg in node.all_input_nodes if _tensor_valued(arg) and arg in assigned]
            assigned[node] = max((assigned[arg] for arg in tensors), default=0)
    return assigned


def split_program(program: "torch.export.ExportedProgram", count: int) -> Tuple[List[Part], Wiring]:
    """`program` cut into `count` parts (each an ExportedProgram with its own weights and example inputs) and
    their wiring; CannotSplit says why not."""
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind, OutputSpec,
                                              TensorArgument)

    if count < 2:
        raise CannotSplit("one part")
    signature = program.graph_signature
    specs = {spec.arg.name: spec for spec in signature.input_specs}
    if any(spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.USER_INPUT, InputKind.CONSTANT_TENSOR)
           for spec in specs.values()):
        raise CannotSplit("the program takes inputs of a kind a part cannot take")
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs):
        raise CannotSplit("the program updates its inputs or buffers")
    nodes = list(program.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    user_inputs = [n for n in placeholders if specs[n.name].kind == InputKind.USER_INPUT]
    (output,) = [n for n in nodes if n.op == "output"]
    finals = list(pytree.tree_leaves(output.args[0]))
    if not all(isinstance(n, torch.fx.Node) and _tensor_valued(n) for n in finals):
        raise CannotSplit("an output of the program is no tensor")
    assigned = _assign(program, count)
    builders = [_PartBuilder(program, index, assigned, user_inputs) for index in range(count)]
    for node in nodes:
        if node in assigned:
            builders[assigned[node]].copy(node)
    order = {n: i for i, n in enumerate(nodes)}
    parts: List[Part] = []
    wiring: List[Tuple[Tuple[str, ...], Tuple[str, ...]]] = []
    for builder in builders:
        index = builder.index
        made = [n for n in nodes if assigned.get(n) == index and _tensor_valued(n)
                and (n in finals or any(assigned.get(user, index) != index for user in n.users))]
        if not made:
            raise CannotSplit(f"part {index} makes nothing a later part uses")
        parts.append(_part_program(program, builder, made, specs, order, ExportGraphSignature, InputKind,
                                   InputSpec, OutputKind, OutputSpec, TensorArgument, ModuleCallEntry,
                                   ModuleCallSignature))
        wiring.append((parts[-1].inputs, parts[-1].outputs))
    result = Wiring(tuple(n.name for n in user_inputs), tuple(n.name for n in finals), tuple(wiring))
    try:
        result.check()
    except ValueError as error:
        raise CannotSplit(str(error)) from None
    return parts, result


def _part_program(program, builder: _PartBuilder, made, specs, order, ExportGraphSignature, InputKind, InputSpec,
                  OutputKind, OutputSpec, TensorArgument, ModuleCallEntry, ModuleCallSignature) -> Part:
    weights_kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    builder.graph.output(tuple(builder.env[n] for n in made))

    def rank(node: torch.fx.Node) -> tuple:  # weights first (program order), then program inputs, then values
        if node.op == "placeholder":
            return (0 if specs[node.name].kind in weights_kinds else 1, order[node])
        return (2, order[node])

    taken = sorted(builder.taken, key=rank)
    graph = torch.fx.Graph()  # placeholders first, as an exported program has them
    remap: Dict[torch.fx.Node, torch.fx.Node] = {}
    for node in taken:
        old = builder.env[node]
        remap[old] = graph.placeholder(old.name)
        remap[old].meta.update(old.meta)
    for node in builder.graph.nodes:
        if node.op != "placeholder":
            remap[node] = graph.node_copy(node, lambda arg: remap[arg])
    graph.lint()
    input_specs, state, constants, values = [], {}, {}, []
    for node in taken:
        name = remap[builder.env[node]].name
        spec = specs.get(node.name) if node.op == "placeholder" else None
        if spec is not None and spec.kind in weights_kinds:
            input_specs.append(InputSpec(kind=spec.kind, arg=TensorArgument(name=name), target=spec.target,
                                         persistent=spec.persistent))
            if spec.kind == InputKind.CONSTANT_TENSOR:
                constants[spec.target] = program.constants[spec.target]
            else:
                state[spec.target] = program.state_dict[spec.target]
        else:
            input_specs.append(InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=name), target=None))
            values.append(node)
    output_specs = [OutputSpec(kind=OutputKind.USER_OUTPUT, arg=TensorArgument(name=remap[builder.env[n]].name),
                               target=None) for n in made]
    in_spec = pytree.tree_flatten(((tuple(range(len(values))),), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(made))))[1]
    part = torch.export.ExportedProgram(
        root=program.graph_module, graph=graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=output_specs),
        state_dict=state, range_constraints=dict(program.range_constraints),
        module_call_graph=[ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec,
                                                                   out_spec=out_spec))],
        example_inputs=((tuple(_example(n) for n in values),), {}), constants=constants)
    return Part(part, tuple(n.name for n in values), tuple(n.name for n in made))


def _example(node: torch.fx.Node) -> torch.Tensor:
    """A tensor of the value's dtype at its traced sizes (AOTInductor builds for those as hints)."""
    value = node.meta["val"]
    shape = [int(size.node.hint) if isinstance(size, torch.SymInt) else int(size) for size in value.shape]
    return torch.zeros(shape, dtype=value.dtype, device=value.device)
