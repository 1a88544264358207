"""Finding a transformer's repeated blocks by structure.

A diffusion transformer is a stack of N blocks of a few kinds (Flux: 19
double-stream and 38 single-stream blocks; Wan: 30-40 identical blocks). Two
blocks share a *block structure* when they have the same class, settings and
parameter shapes (`structure_hash`, which ignores weight values): one graph
compiled for the structure serves every instance of it with that instance's
weights bound per call.

Blocks are the elements of the outermost `ModuleList`s whose element class
occurs more than once in the list (a list of heterogeneous helpers, such as
an attention's `to_out = [Linear, Dropout]`, is not a stack of blocks). A
model may name its block classes (diffusers' `_repeated_blocks`); then only
those classes are taken. An element whose structure occurs once (SD3's last
block, which drops the text stream's output) is still a block of its own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ..keys.structure import structure_hash
from .quantised import structure_key


@dataclass
class BlockGroup:
    """Every instance of one block structure in a model, in call order."""

    structure: str
    class_name: str
    instances: List[Tuple[str, torch.nn.Module]] = field(default_factory=list)

    @property
    def paths(self) -> List[str]:
        return [path for path, _ in self.instances]

    @property
    def modules(self) -> List[torch.nn.Module]:
        return [module for _, module in self.instances]

    def parameter_count(self) -> int:
        first = self.instances[0][1]
        return sum(p.numel() for p in first.parameters())

    def describe(self) -> str:
        first, last = self.paths[0], self.paths[-1]
        where = first if len(self.instances) == 1 else f"{first} .. {last}"
        return f"{self.class_name} x{len(self.instances)} ({where})"


def _has_weights(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _stacks(model: torch.nn.Module, classes: Optional[Sequence[str]]) -> Iterable[Tuple[str, torch.nn.ModuleList]]:
    """Outermost module lists holding repeated blocks (not descending into a stack once found)."""
    found: List[str] = []
    for path, module in model.named_modules():
        if any(path == f or path.startswith(f + ".") for f in found):
            continue
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 1:
            continue
        names = Counter(type(child).__name__ for child in module)
        if classes is not None:
            if not any(type(child).__name__ in classes for child in module):
                continue
        elif max(names.values()) < 2:
            continue
        found.append(path)
        yield path, module


def find_blocks(model: torch.nn.Module, classes: Optional[Sequence[str]] = None,
                ignored_settings: frozenset = frozenset(), split_stacks: bool = False,
                storage_key: Optional[Callable[[torch.nn.Module], str]] = None) -> List[BlockGroup]:
    """The model's repeated blocks grouped by structure, in the order they appear.

    `classes` limits blocks to those class names (diffusers' `_repeated_blocks`);
    by default it is read from the model, else every repeated element class of a
    module list counts. `ignored_settings` are block attributes the family
    knows its forward never reads (see `structure.describe_structure`).
    `split_stacks` keeps blocks of one structure in different stacks apart:
    Lumina 2 runs the same block class on image tokens (`noise_refiner`) and
    on image and text tokens (`layers`), whose token ranges differ.
    `storage_key(block)` describes weights stored in a form the graph converts
    (GGUF quantisation types): blocks stored differently never share a structure.
    """
    if classes is None:
        declared = getattr(model, "_repeated_blocks", None)
        classes = list(declared) if declared else None
    groups: dict = {}
    hashes: dict = {}
    for list_path, stack in _stacks(model, classes):
        counts = Counter(type(child).__name__ for child in stack)
        for index, child in enumerate(stack):
            name = type(child).__name__
            if classes is not None and name not in classes:
                continue
            if classes is None and counts[name] < 2:
                continue
            if not _has_weights(child) or not list(child.children()):
                continue
            path = f"{list_path}.{index}" if list_path else str(index)
            key = id(child)
            if key not in hashes:
                storage = storage_key(child) if storage_key is not None else ""
                hashes[key] = structure_key(structure_hash(child, ignored_settings), storage)
            structure = hashes[key]
            where = (structure, list_path if split_stacks else None)
            group = groups.get(where)
            if group is None:
                group = groups[where] = BlockGroup(structure, name)
            group.instances.append((path, child))
    return list(groups.values())


def block_count(groups: Sequence[BlockGroup]) -> int:
    return sum(len(g.instances) for g in groups)
