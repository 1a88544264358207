"""The first-use check: a graph's output proven against the model's own before it is trusted.

The first time a graph serves a new set of input shapes (no verdict yet for
them), the pack copies the call's inputs (`snapshot`), runs the graph, runs
the same call eagerly on the copies and compares (`judge`, `compare`). Within the tolerance of the
output's dtype the graph serves those shapes from then on, unchecked; beyond
it, or with a NaN or Inf where eager has a finite value, the graph is retired
for those shapes: the call returns eager's output, the difference is recorded
as a pack error, and later calls with those shapes run eager without
comparing again. A wrong image costs more than any speed, and no test suite
sees every order of shapes a user sends.

The comparison is per sample (dim 0 of each output): the relative L2
difference ||graph - eager|| / ||eager||, so one wrong image in a batch of 8
counts as much as a wrong batch of 1. The tolerances sit far above the
rounding differences of a correct graph (float32 about 1e-6, bfloat16 below
1e-2 over a whole transformer) and far below what a wrong graph gives (0.3
and more).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

# Relative L2 difference per sample allowed between a graph's output and eager's, by output dtype.
TOLERANCE: Dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 2e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}
DEFAULT_TOLERANCE = 4e-2  # any other dtype (float8 outputs, integer outputs)


def tolerance_for(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, DEFAULT_TOLERANCE)


@dataclass(frozen=True)
class Agreement:
    """How a graph's output compares with eager's for one call."""

    relative: float  # the largest per-sample relative L2 difference over the output's tensors
    tolerance: float  # what that tensor's dtype allows
    max_abs: float
    nonfinite: int = 0  # NaN or Inf in the graph's output where eager's is finite
    problem: str = ""  # a structural difference (another number of outputs, shape or dtype)

    @property
    def ok(self) -> bool:
        return not self.problem and not self.nonfinite and self.relative <= self.tolerance

    def describe(self) -> str:
        if self.problem:
            return self.problem
        text = f"relative difference {self.relative:.3g} (allowed {self.tolerance:g}), largest {self.max_abs:.3g}"
        if self.nonfinite:
            text += f", {self.nonfinite} NaN or Inf values where eager has finite ones"
        return text


def compare(output: Any, reference: Any) -> Agreement:
    """How `output` (a graph's) agrees with `reference` (eager's), over their tensor leaves."""
    got = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    want = [leaf for leaf in pytree.tree_leaves(reference) if isinstance(leaf, torch.Tensor)]
    if len(got) != len(want):
        return Agreement(math.inf, 0.0, math.inf, problem=f"the graph returned {len(got)} tensors, eager {len(want)}")
    worst = Agreement(0.0, DEFAULT_TOLERANCE, 0.0)
    worst_margin = -math.inf
    nonfinite = 0
    max_abs = 0.0
    for index, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return Agreement(math.inf, 0.0, math.inf, problem=(
                f"output {index} is {a.dtype} {tuple(a.shape)}, eager's is {b.dtype} {tuple(b.shape)}"))
        if not a.is_floating_point() and not a.is_complex():
            if not torch.equal(a, b):
                return Agreement(math.inf, 0.0, math.inf, problem=f"output {index} (integer) differs from eager's")
            continue
        relative, largest, bad = _difference(a, b)
        nonfinite += bad
        max_abs = max(max_abs, largest)
        tolerance = tolerance_for(a.dtype)
        margin = relative / tolerance if tolerance else math.inf
        if margin > worst_margin:
            worst, worst_margin = Agreement(relative, tolerance, 0.0), margin
    return Agreement(worst.relative, worst.tolerance, max_abs, nonfinite)


def _difference(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, float, int]:
    """(largest per-sample relative L2 difference, largest absolute difference, NaN/Inf only in `a`)."""
    a, b = a.detach().double(), b.detach().double()
    finite = torch.isfinite(b)
    bad = int((finite & ~torch.isfinite(a)).sum())
    both = finite & torch.isfinite(a)
    diff = torch.where(both, a - b, torch.zeros_like(a))
    ref = torch.where(both, b, torch.zeros_like(b))
    if a.dim() == 0 or a.numel() == 0:
        diff, ref = diff.reshape(1, -1), ref.reshape(1, -1)
    else:
        diff, ref = diff.reshape(a.shape[0], -1), ref.reshape(a.shape[0], -1)
    if diff.numel() == 0:
        return 0.0, 0.0, bad
    diff_norm = torch.linalg.vector_norm(diff, dim=1)
    # A sample whose reference is (near) zero is compared against a floor, not divided by zero.
    floor = 1e-6 * math.sqrt(max(1, diff.shape[1]))
    ref_norm = torch.linalg.vector_norm(ref, dim=1).clamp_min(floor)
    return float((diff_norm / ref_norm).max()), float(diff.abs().max()), bad


class Verdicts:
    """Which (graph, input shapes) were compared with eager, and how they came out; shared by a process."""

    def __init__(self, limit: int = 4096):
        self._limit = limit
        self._lock = threading.Lock()
        self._verdicts: Dict[Tuple[str, Hashable], Agreement] = {}

    def get(self, graph_id: str, shapes: Hashable) -> Optional[Agreement]:
        with self._lock:
            return self._verdicts.get((graph_id, shapes))

    def put(self, graph_id: str, shapes: Hashable, agreement: Agreement) -> None:
        with self._lock:
            if len(self._verdicts) >= self._limit:  # forget the agreements first: a retirement must stay
                for key in [k for k, v in self._verdicts.items() if v.ok]:
                    del self._verdicts[key]
            self._verdicts[(graph_id, shapes)] = agreement

    def __len__(self) -> int:
        with self._lock:
            return len(self._verdicts)

    def retired(self) -> Dict[Tuple[str, Hashable], Agreement]:
        with self._lock:
            return {key: value for key, value in self._verdicts.items() if not value.ok}

    def clear(self) -> None:
        with self._lock:
            self._verdicts.clear()


@dataclass
class Snapshot:
    """Copies of a call's arguments, and which tensor each copy was made from."""

    args: tuple
    kwargs: dict
    pairs: List[Tuple[torch.Tensor, torch.Tensor]]

    def restore(self) -> None:
        """Give the caller's tensors the state eager left in the copies (a retired graph's in-place updates
        undone). Paired when copied: eager may have changed the containers since (ComfyUI's UNet pops
        ControlNet residuals from their lists)."""
        for original, copy in self.pairs:
            original.copy_(copy)


def snapshot(args: tuple, kwargs: dict) -> Snapshot:
    """Copies of the call's tensors (and containers), taken before the graph runs.

    Eager runs on these, not on the caller's tensors: a model may update its
    inputs in place (ComfyUI's Flux blocks: `img += ...`), torch.export keeps
    such updates, so the graph has applied them already and its output may be
    that very tensor. Eager on the originals would start from the graph's
    result and overwrite the output it is compared with.
    """
    pairs: List[Tuple[torch.Tensor, torch.Tensor]] = []

    def copied(tensor: torch.Tensor) -> torch.Tensor:
        copy = tensor.clone()
        pairs.append((tensor, copy))
        return copy

    args_copy, kwargs_copy = pytree.tree_map_only(torch.Tensor, copied, (args, kwargs))
    return Snapshot(args_copy, kwargs_copy, pairs)


def judge(verdicts: Verdicts, graph_id: str, shapes: Hashable, output: Any, reference: Any) -> Optional[Agreement]:
    """Compare a graph's output with eager's on the same inputs and keep the verdict; the disagreement, or None."""
    try:
        agreement = compare(output, reference)
    except Exception as error:  # noqa: BLE001 - an output the pack cannot compare is not trusted
        agreement = Agreement(math.inf, 0.0, math.inf,
                              problem=f"the outputs could not be compared ({type(error).__name__}: {error})")
    verdicts.put(graph_id, shapes, agreement)
    return None if agreement.ok else agreement


def retired_reason(graph_id: str, paths: Sequence[str], shapes: Sequence[Sequence[int]], agreement: Agreement) -> str:
    """The one wording of a retirement, for the event log, the page and the node's report."""
    inputs = ", ".join(f"{path} {list(shape)}" for path, shape in zip(paths, shapes))
    return (f"graph {graph_id} disagrees with eager for inputs {inputs} ({agreement.describe()}); "
            "it is not used for these inputs, which run eager")
