"""CUDA graphs of a loaded package's calls, replayed for the input shapes a sampler repeats.

Why: an AOTInductor package launches each of its kernels from its C++
wrapper on every call, hundreds for a UNet step. Where the kernels are short
(SD1.5 at 512x512) the launches, not the kernels, set the step time; the
fastest peers (stable-fast, TensorRT) capture a step once and replay it, and
flux-fast measured AOTInductor without CUDA graphs about 5% slower than
torch.compile (docs/peers.md). A sampler calls the model at one shape for
every step, so one capture serves them all.

A replay reads the very addresses it was captured with, so:
- its inputs are copied into buffers of its own before each replay;
- the weights are those bound when it was captured: the runner's bound token
  (whose tensors, at which addresses) is part of the key, and a new token
  releases the captures made with another;
- its outputs are its own buffers, copied out for the caller (the next
  replay overwrites them).

A shape is captured on its second call (the first warms cuBLAS, cuDNN and
the allocator), at most KEPT shapes per runner: each capture keeps its
activations' memory, the least recently used is released first. A capture
that raises, or whose replay differs from the plain run of the same inputs,
turns replay off for the runner with the reason (`reason`); the call is
served by the plain run either way. Whole-model graphs only: a block graph
binds another instance's weights for every block call, so a capture would
never be replayed. Measured on and off by the device check
(variant `ours_aot_load_cg`); off unless asked for (`CompileOptions.cuda_graphs`,
or KEEPFAST_CUDA_GRAPHS=1).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..settings import CUDA_GRAPHS, cuda_graphs

log = logging.getLogger("keepfast")

ENV = CUDA_GRAPHS.name
KEPT = 2  # captured shapes per runner: a sampler's cond+uncond batch, and one other (a hires pass)
CAPTURE_ON_CALL = 2  # the call of a shape that is captured (the first warms the libraries' lazy state)

Runner = Callable[[List[torch.Tensor]], Sequence[torch.Tensor]]


def asked_for() -> bool:
    """Whether KEEPFAST_CUDA_GRAPHS asks for replays by default."""
    return cuda_graphs()


@dataclass
class Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: List[torch.Tensor]  # the buffers the replay reads
    outputs: List[torch.Tensor]  # the buffers the replay writes

    def replay(self, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        for buffer, value in zip(self.inputs, inputs):
            buffer.copy_(value)
        self.graph.replay()
        return [output.clone() for output in self.outputs]


def _listed(outputs: Any) -> List[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def _key(inputs: Sequence[torch.Tensor]) -> Tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in inputs)


def _differs(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> Optional[str]:
    """How a replay's outputs differ from the plain run's of the same inputs (the same kernels: equal), or None."""
    if len(got) != len(want):
        return f"{len(got)} outputs, the plain run gave {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i} is {tuple(a.shape)} {a.dtype}, the plain run's {tuple(b.shape)} {b.dtype}"
        if not torch.equal(a, b):
            worst = float((a.float() - b.float()).abs().max()) if a.is_floating_point() else float("nan")
            return f"output {i} differs from the plain run's by up to {worst:.3g}"
    return None


class Replays:
    """The CUDA graphs of one runner (one package loaded for one device), by bound weights and input shapes."""

    def __init__(self, kept: int = KEPT):
        self.kept = max(1, kept)
        self.reason: Optional[str] = None  # why replay is off for this runner
        self.captures = 0
        self.replays = 0
        self._captured: "OrderedDict[Tuple, Captured]" = OrderedDict()
        self._calls: Dict[Tuple, int] = {}
        self._bound: object = None

    def run(self, runner: Runner, inputs: List[torch.Tensor], bound: object) -> List[torch.Tensor]:
        """`runner(inputs)`, replayed from a capture where there is one for these weights and shapes."""
        if self.reason is not None:
            return _listed(runner(inputs))
        if bound != self._bound:  # other weights bound: the captures read the old ones' addresses
            self.release()
            self._bound = bound
        key = _key(inputs)
        captured = self._captured.get(key)
        if captured is None:
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            if calls < CAPTURE_ON_CALL:
                return _listed(runner(inputs))
            captured = self._capture(runner, inputs)
            if captured is None:
                return _listed(runner(inputs))
            self._captured[key] = captured
            while len(self._captured) > self.kept:
                self._captured.popitem(last=False)
        else:
            self._captured.move_to_end(key)
        self.replays += 1
        return captured.replay(inputs)

    def release(self) -> None:
        """Drop every capture (their memory goes back to the allocator)."""
        self._captured.clear()
        self._calls.clear()

    def _capture(self, runner: Runner, inputs: Sequence[torch.Tensor]) -> Optional[Captured]:
        device = inputs[0].device if inputs else torch.device("cuda")
        try:
            with torch.cuda.device(device):
                static = [t.clone() for t in inputs]
                # warmed up on a side stream, as torch's CUDA graph docs capture: lazy initialisations stay out
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    want = [o.clone() for o in _listed(runner(static))]
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outputs = _listed(runner(static))
                captured = Captured(graph, static, outputs)
                got = captured.replay(static)
        except Exception as error:  # noqa: BLE001 - the plain run serves; replay stays off with the reason
            self._off(f"capturing a CUDA graph failed: {type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}")
            return None
        differs = _differs(got, want)
        if differs:
            self._off(f"a CUDA graph's replay differs from the plain run: {differs}")
            return None
        self.captures += 1
        return captured

    def _off(self, reason: str) -> None:
        self.reason = reason
        self.release()
        log.warning("keepfast: CUDA graph replay off for this graph: %s", reason)
