"""Which remote graphs fit: this machine (from the manifest alone) and, if named, one model.

A manifest says everything a graph needs: its key (torch version, device
kind, dtype, backend, model structure, shape range) and `needs` (OS, CPU
architecture and instructions, GPU compute capability). The machine check is
the one a bundle import makes (`bundle.compatibility_problems`, which in turn
asks `machine_fit`); the model check compares the graph's structure hash with
those of the model and its parts, computed by the same `structure_hash` the
compiler keys graphs with, so nothing here re-derives a key.

A model is named by a module in memory (the ComfyUI node's model), a
diffusers model or pipeline folder (its classes are built from their configs
on the meta device: no weights are read), or a structure as `graphs ls`
shows it (`UNet2DConditionModel-1a2b3c4d5e6f`, or a hash prefix).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import FrozenSet, Iterable, List, Optional

import torch

from ..store.bundle import compatibility_problems
from ..store.manifest import Manifest
from ..keys.structure import architecture_name, structure_hash

_MIN_PREFIX = 8  # a structure named by hash: at least this many hex digits


class NotAModel(ValueError):
    """`--for` named something whose model structure cannot be told; the message says what to give."""


@dataclass(frozen=True)
class ModelSelector:
    """The structures a model's graphs can have: the whole model's, its parts' and its blocks'."""

    structures: FrozenSet[str]  # full hashes or prefixes (as `graphs ls` folder names give them)
    label: str
    architecture: Optional[str] = None  # only with a folder name: the architecture it names

    def why_not(self, manifest: Manifest) -> Optional[str]:
        family = manifest.key.family
        if any(family.structure.startswith(s) for s in self.structures):
            if self.architecture is None or self.architecture == family.architecture:
                return None
        return f"it is for another model ({family.architecture} {family.structure[:12]}, not {self.label})"


def structures_of(module: torch.nn.Module, block_family=None) -> FrozenSet[str]:
    """Every structure a graph of `module` may be keyed by.

    The model and each submodule with weights (a pipeline part such as a VAE's
    decoder is compiled on its own), and the model's repeated blocks as its
    block family finds them (a family may ignore settings such as a layer
    index, which changes the hash). `block_family`: the ComfyUI adapter's;
    default, the diffusers family of the model's class, if any.
    """
    out = {structure_hash(module)}
    for _, sub in module.named_modules():
        if sub is not module and any(True for _ in sub.children()) and any(True for _ in sub.parameters()):
            out.add(structure_hash(sub))
    family = block_family
    if family is None:
        try:
            from ..blocks.diffusers_families import diffusers_family

            family = diffusers_family(module)
        except ImportError:
            family = None
    if family is not None:
        from ..blocks.finder import find_blocks

        groups = find_blocks(module, family.block_classes, family.ignored_settings, family.split_stacks)
        out.update(group.structure for group in groups)
    return frozenset(out)


def selector_for_module(module: torch.nn.Module, block_family=None, label: Optional[str] = None) -> ModelSelector:
    return ModelSelector(structures_of(module, block_family), label or architecture_name(module))


def _diffusers_class(name: str):
    import diffusers

    cls = getattr(diffusers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "from_config")):
        return None
    return cls


def _module_from_config(folder: Path) -> Optional[torch.nn.Module]:
    """A diffusers model built from `folder/config.json` on the meta device (no weights read)."""
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    cls = _diffusers_class(str(config.get("_class_name", ""))) if isinstance(config, dict) else None
    if cls is None:
        return None
    with torch.device("meta"):
        return cls.from_config(cls.load_config(str(folder)))


def selector_for_path(target: str) -> ModelSelector:
    """A selector from what a user typed after `--for`: a diffusers folder, or a structure name."""
    path = Path(target)
    if path.is_dir():
        modules = []
        index = path / "model_index.json"
        if index.is_file():  # a pipeline: every diffusers model among its components
            try:
                components = json.loads(index.read_text())
            except ValueError as error:
                raise NotAModel(f"{index} is not JSON ({error})") from None
            for name, value in sorted(components.items()):
                if isinstance(value, list) and len(value) == 2 and (path / name / "config.json").is_file():
                    module = _module_from_config(path / name)
                    if module is not None:
                        modules.append(module)
        else:
            module = _module_from_config(path)
            if module is not None:
                modules.append(module)
        if not modules:
            raise NotAModel(f"{path} holds no diffusers model (no model_index.json or config.json naming a "
                            "diffusers model class)")
        structures: set = set()
        for module in modules:
            structures |= structures_of(module)
        return ModelSelector(frozenset(structures), path.name)
    if path.suffix in (".safetensors", ".ckpt", ".pt", ".pth", ".sft", ".gguf"):
        raise NotAModel(f"{target}: a checkpoint file's model structure is known only once the model is built; "
                        "give its diffusers folder, the structure as `graphs pull --dry-run` or `graphs ls` shows it "
                        "(ARCHITECTURE-STRUCTURE), or load graphs from ComfyUI (Load Graph with a remote library)")
    architecture, _, structure = target.rpartition("-")
    candidate = structure or target
    if len(candidate) >= _MIN_PREFIX and all(c in "0123456789abcdef" for c in candidate):
        return ModelSelector(frozenset({candidate}), target, architecture or None)
    raise NotAModel(f"{target!r} is neither a model folder nor a structure (ARCHITECTURE-STRUCTURE as "
                    "`graphs ls` or `graphs pull --dry-run` shows it, or at least 8 hex digits of a structure hash)")


def fit_problems(manifest: Manifest, selector: Optional[ModelSelector] = None,
                 dtype: Optional[str] = None) -> List[str]:
    """Why a graph does not fit this machine (and the model, if one is named); empty when it does."""
    problems = compatibility_problems(manifest, dtype)
    if manifest.key.family.backend != "aot":
        problems.append(f"its backend {manifest.key.family.backend} keeps no graphs on disk")
    superseded = manifest.superseded()
    if superseded:
        problems.append(f"it was {superseded}")
    if selector is not None:
        reason = selector.why_not(manifest)
        if reason:
            problems.append(reason)
    return problems


def selectors_union(selectors: Iterable[ModelSelector]) -> Optional[ModelSelector]:
    items = list(selectors)
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    structures: set = set()
    for item in items:
        structures |= item.structures
    return ModelSelector(frozenset(structures), ", ".join(item.label for item in items))
