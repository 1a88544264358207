"""A block graph that takes its weights as inputs: one package serves every instance with nothing bound.

Why: block graphs serve many instances (Flux's 19 double blocks) from one runner. Bound as AOTInductor
constants, an instance's weights had to be handed to the runner before each of its calls
(`load_constants(..., user_managed=True)`), and torch's runtime keeps a handle it never frees for every tensor
so bound (aoti_runtime/utils.h `MaybeOwningAtenTensorHandle`, torch 2.11 to 2.14.1; pytorch/pytorch#194480):
measured on this CPU (torch 2.13), a tiny Flux of 5 blocks grew by 3.5 kB a call, 33 bytes a tensor bound, and
the real Flux binds about 1,100 tensors a step, 20 GB over a million steps of a server that never restarts;
under partial loading each per-call tensor's view was kept too. A tensor passed as an input is the caller's
for the call only, as torch.compile passes a module's parameters.

`lift_weights` turns an exported program's lifted weights (parameters, buffers, tensor constants, the parts of a
tensor-subclass weight: whatever the block's trace lifted, under the names a block instance's tensors carry)
into user inputs after the call's own, so the package takes `[*call tensors, *weights]`, in `names` order.
The program is built anew as program_split.py builds its parts (its signature, call spec and examples), from the
traced graph unchanged; the examples of the weights are the weights themselves (no copy; a build process
is sent their layout only, job_folder.light_examples).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree


class CannotLift(Exception):
    """The program has inputs or outputs other than tensors and weights (a mutated buffer, a token): it keeps its
    weights as constants, bound per call as before."""


def lift_weights(program: "torch.export.ExportedProgram") -> Tuple["torch.export.ExportedProgram", List[str]]:
    """(the program with its weights as trailing inputs, their names in input order); CannotLift says why not."""
    from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind, TensorArgument

    signature = program.graph_signature
    weight_kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    users = [spec for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
    lifted = [spec for spec in signature.input_specs if spec.kind in weight_kinds]
    others = [spec.kind.name for spec in signature.input_specs if spec.kind not in weight_kinds + (InputKind.USER_INPUT,)]
    if others:
        raise CannotLift(f"the program takes {', '.join(sorted(set(others)))} inputs")
    outputs = [spec.kind.name for spec in signature.output_specs if spec.kind != OutputKind.USER_OUTPUT]
    if outputs:
        raise CannotLift(f"the program writes {', '.join(sorted(set(outputs)))}")
    if not all(isinstance(spec.arg, TensorArgument) for spec in users + lifted):
        raise CannotLift("the program takes inputs other than tensors")
    if not lifted:
        return program, []
    (call_args, call_kwargs) = program.example_inputs or ((), {})
    if call_kwargs or len(call_args) != 1:
        raise CannotLift("the program's call is not one list of tensors")
    values = []
    for spec in lifted:
        value = program.state_dict.get(spec.target, program.constants.get(spec.target))  # non-persistent: constants
        if not isinstance(value, torch.Tensor):
            raise CannotLift(f"the weight {spec.target} is not a tensor")
        values.append(value)

    graph = program.graph_module.graph
    placeholders = {node.name: node for node in graph.nodes if node.op == "placeholder"}
    written = _written_weight(graph, {placeholders[spec.arg.name]: spec.target for spec in lifted})
    if written is not None:  # torch.export's own IR keeps in-place ops: a weight an input would change the caller's
        raise CannotLift(f"the block writes its tensor {written}")
    # every check is above: from here the traced graph is changed, and a program refused here must stay as traced
    ordered = [placeholders[spec.arg.name] for spec in users + lifted]
    first = next(iter(graph.nodes))
    if ordered[0] is not first:
        first.prepend(ordered[0])
    for before, node in zip(ordered, ordered[1:]):  # placeholders in input order, as the signature lists them
        before.append(node)
    graph.lint()
    program.graph_module.recompile()

    lifted_names = {spec.target for spec in lifted}
    input_specs = users + [InputSpec(kind=InputKind.USER_INPUT, arg=TensorArgument(name=spec.arg.name), target=None)
                           for spec in lifted]
    examples = ((list(call_args[0]), values), {})
    lifted_program = torch.export.ExportedProgram(
        root=program.graph_module, graph=graph,
        graph_signature=ExportGraphSignature(input_specs=input_specs, output_specs=list(signature.output_specs)),
        state_dict={k: v for k, v in program.state_dict.items() if k not in lifted_names},
        range_constraints=dict(program.range_constraints),
        module_call_graph=[ModuleCallEntry("", ModuleCallSignature(
            inputs=[], outputs=[], in_spec=pytree.tree_structure(examples), out_spec=program.call_spec.out_spec))],
        example_inputs=examples,
        constants={k: v for k, v in program.constants.items() if k not in lifted_names},
        verifiers=program.verifiers)  # the traced dialect's (torch.export's own IR keeps in-place ops)
    return lifted_program, [spec.target for spec in lifted]


def _written_weight(graph: "torch.fx.Graph", weights: dict) -> Optional[str]:
    """The name of a weight an in-place operation of `graph` writes (through views of it too), or None."""
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        given = list(zip(schema.arguments, node.args)) + [
            (argument, node.kwargs[argument.name]) for argument in schema.arguments if argument.name in node.kwargs]
        for argument, value in given:
            if argument.alias_info is not None and argument.alias_info.is_write:
                for target in (value if isinstance(value, (list, tuple)) else [value]):
                    root = _viewed(target)
                    if root in weights:
                        return weights[root]
    return None


def _viewed(value: Any) -> Any:
    """The node a view chain starts from (a node itself where it is no view)."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args:
        schema = getattr(value.target, "_schema", None)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None:
            return value
        value = value.args[0]
    return value


def takes_weights(program: "torch.export.ExportedProgram") -> bool:
    """Whether `program` is one `lift_weights` made: its examples are (call tensors, weights)."""
    examples = getattr(program, "example_inputs", None)
    return bool(examples) and len(examples[0]) == 2 and all(isinstance(part, list) for part in examples[0])


def with_weights(inputs: Sequence[torch.Tensor], tensors: Any, names: Sequence[str]) -> List[torch.Tensor]:
    """A lifted graph's runner inputs: the call's tensors, then each weight by name from `tensors` (a mapping);
    KeyError names a weight the module lacks."""
    return [*inputs, *(tensors[name] for name in names)]
