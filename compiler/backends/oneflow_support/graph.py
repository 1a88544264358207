"""The `oneflow.nn.Graph` that runs one call structure at one static shape.

Imported only once oneflow imports (it subclasses oneflow.nn.Graph).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence

import oneflow

from ...tracing.flat_module import CallTemplate


def flatten_output(output: Any) -> List[Any]:
    """The tensors of a OneFlow diffusers output, in the order torch's pytree lists them."""
    if output is None:
        return []
    if isinstance(output, oneflow.Tensor):
        return [output]
    if isinstance(output, dict):  # diffusers BaseOutput is an OrderedDict without its None fields
        return [leaf for value in output.values() for leaf in flatten_output(value)]
    if isinstance(output, (tuple, list)):
        return [leaf for item in output for leaf in flatten_output(item)]
    raise TypeError(f"the OneFlow model returned a {type(output).__name__}; graphs return tensors only")


class CallGraph(oneflow.nn.Graph):
    """build(*flat tensors): rebuild the call around them, run the module, return its tensors.

    `forward(module, *args, **kwargs)`, when given, is what runs instead of
    `module(*args, **kwargs)`: a portable forward function (backends.base),
    called with the graph's proxy of the OneFlow module, so the methods it calls
    are the OneFlow copy's.
    """

    def __init__(self, flow_module, template: CallTemplate, bool_inputs: Sequence[int],
                 forward: Optional[Callable[..., Any]] = None):
        super().__init__()
        self.model = flow_module  # a ProxyModule: its parameters become the graph's (shared) variables
        # Plain attributes, kept out of nn.Graph's module bookkeeping.
        self.__dict__["_keepfast_template"] = template
        self.__dict__["_keepfast_bool_inputs"] = tuple(bool_inputs)
        self.__dict__["_keepfast_forward"] = forward

    def build(self, *flat):
        flat = list(flat)
        for index in self.__dict__["_keepfast_bool_inputs"]:
            flat[index] = flat[index].to(oneflow.bool)  # passed as uint8: DLPack has no bool in 0.9.0
        args, kwargs = self.__dict__["_keepfast_template"].rebuild(flat)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "X is called in a nn.Graph, but not registered" for helpers
            forward = self.__dict__["_keepfast_forward"]
            output = self.model(*args, **kwargs) if forward is None else forward(self.model, *args, **kwargs)
        return tuple(flatten_output(output))
