"""Graph keys: the one place that says when two calls may share a graph.

A *family* is everything except the shape range: model structure, input
structure, dtype, device kind, backend and torch version. A family may hold
several graphs with different shape ranges; a call picks the first one whose
range and guards serve it. A new input structure is a new family, so it adds
graphs and never replaces another family's.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass, fields

from .shapes import ShapeRange


def _short_hash(payload: object, length: int = 16) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class FamilyKey:
    architecture: str
    structure: str
    signature: str
    dtype: str
    device: str  # environment.device_kind: `cpu`, or a GPU with its generation (`cuda-sm90`)
    backend: str
    torch_version: str

    @classmethod
    def here(cls, architecture: str, structure: str, signature: str, dtype, device, backend: str) -> "FamilyKey":
        """The family of a graph that runs on this machine's torch, from a dtype and device as torch names
        them: the one place where those become key fields (whole models and blocks alike). The same arguments
        give the same key object (every call of a model asks), whose `id` is then hashed once; a GPU named
        without its index ("cuda": whichever is current) is looked up each time."""
        import torch

        named = torch.device(device) if isinstance(device, str) else device
        if isinstance(named, torch.device) and (named.type == "cpu" or named.index is not None):
            return cls._here(architecture, structure, signature, dtype, named, backend)
        return cls._here.__wrapped__(cls, architecture, structure, signature, dtype, device, backend)

    @classmethod
    @functools.lru_cache(maxsize=1024)
    def _here(cls, architecture: str, structure: str, signature: str, dtype, device, backend: str) -> "FamilyKey":
        from ..machine.environment import device_kind, dtype_name, torch_version

        return cls(architecture=architecture, structure=structure, signature=signature, dtype=dtype_name(dtype),
                   device=device_kind(device), backend=backend, torch_version=torch_version())

    @functools.cached_property
    def id(self) -> str:
        return _short_hash(asdict(self))

    @property
    def folder_name(self) -> str:
        """Graphs of one model structure share a folder, whatever their inputs."""
        return f"{self.architecture}-{self.structure[:12]}"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "FamilyKey":
        return cls(**{f.name: str(data[f.name]) for f in fields(cls)})

    def differences(self, wanted: "FamilyKey") -> list[str]:
        """Each field where this (a graph's) key differs from the wanted one."""
        out = []
        for f in fields(self):
            have, want = getattr(self, f.name), getattr(wanted, f.name)
            if have != want:
                out.append(f"{f.name}: graph has {have}, this run needs {want}")
        return out

    def describe(self) -> str:
        return (
            f"{self.architecture} [{self.structure[:12]}] {self.dtype} on {self.device}, "
            f"{self.backend}, torch {self.torch_version}, inputs {self.signature}"
        )


@dataclass(frozen=True)
class GraphKey:
    """One graph: a family, the range it was declared for, and its variant.

    The variant tells apart graphs of one family and range that tracing split
    into regions (e.g. CPU convolutions guard on batch > 1): it is a hash of
    the graph's guards, known once it is built.
    """

    family: FamilyKey
    shape_range: ShapeRange
    variant: str = ""

    @functools.cached_property
    def id(self) -> str:
        suffix = f"-{self.variant}" if self.variant else ""
        return f"{self.family.id}-{_short_hash(self.shape_range.to_json(), 8)}{suffix}"

    def with_variant(self, payload: object) -> "GraphKey":
        return GraphKey(self.family, self.shape_range, _short_hash(payload, 8))
