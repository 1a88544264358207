"""The graph manifest: a JSON file that says what a package is and where it may run.

JSON only: nothing in a graph store is ever unpickled. The manifest carries
the full key (so a graph is refused on another torch version, device kind,
dtype, backend or model structure, naming the field), the package's sha256
(checked before the package is read as code), the shape guards and the
output layout needed to serve calls without tracing anything again, and
(format 2) what the package needs of the machine that loads it: OS, CPU
architecture and instructions, GPU architecture (compiler/machine/machine_fit.py), and
(format 3, written only for such graphs) a graph built in parts: which values
each part takes and makes (compiler/tracing/program_split.py), and (format 4, written only for such graphs) a
block graph that takes its weights as inputs, by name (compiler/tracing/weight_inputs.py): a pack that reads
no further than 3 would run it without them, so it refuses it.
Format 1 manifests are still read; their packages are checked against the
vector ISA the package itself names.
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from ..backends.base import PackageInfo
from ..machine.environment import machine
from ..keys.graph_keys import FamilyKey, GraphKey
from ..keys.shapes import ShapeRange
from ..version import FIRST_SIZE_SAFE_VERSION, __version__

FORMAT = "keepfast-graph"
FORMAT_VERSION = 2
PARTS_FORMAT_VERSION = 3  # a graph built in parts (program_split.py): a pack that reads 2 only refuses it
WEIGHT_INPUTS_FORMAT_VERSION = 4  # a graph that takes its weights as inputs: a pack that reads 3 only refuses it
READABLE_VERSIONS = (1, 2, 3, 4)  # 1: before "needs"; 3: "parts"; 4: "weight_inputs"
MANIFEST_SUFFIX = ".json"


class ManifestError(ValueError):
    """A manifest is unreadable or not ours; the message says why."""


def _needs(value: Any) -> Dict[str, Any]:
    if not isinstance(value, dict) or not isinstance(value.get("cpu_features", []), list):
        raise ValueError("'needs' is not a mapping with a list of cpu_features")
    return dict(value)


def _wiring(value: Any) -> Optional[Dict[str, Any]]:
    """A graph's parts, checked (every value a part takes is made before it) and kept as JSON."""
    if value is None:
        return None
    from ..tracing.program_split import Wiring

    return Wiring.from_json(value).to_json()


@dataclass
class Manifest:
    key: GraphKey
    package_file: str
    package_sha256: str
    package_bytes: int
    info: PackageInfo
    signature: Dict[str, Any]
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    created_on: str = field(default_factory=machine)
    pack_version: str = __version__
    origin: str = "built here"

    @property
    def graph_id(self) -> str:
        return self.key.id

    def to_json(self) -> dict:
        data = {
            "format": FORMAT,
            "format_version": self.format_version,
            "graph_id": self.graph_id,
            "family": self.key.family.to_json(),
            "family_id": self.key.family.id,
            "shape_range": self.key.shape_range.to_json(),
            "variant": self.key.variant,
            "package": {"file": self.package_file, "sha256": self.package_sha256, "bytes": self.package_bytes},
            "guards": self.info.guards,
            "out_spec": self.info.out_spec,
            "constant_names": self.info.constant_names,
            "input_paths": self.info.input_paths,
            "needs": self.info.needs,
            "signature": self.signature,
            "created": self.created,
            "created_on": self.created_on,
            "pack_version": self.pack_version,
            "origin": self.origin,
        }
        if self.info.wiring:
            data["parts"] = self.info.wiring
        if self.info.weight_inputs:
            data["weight_inputs"] = self.info.weight_inputs
        return data

    @property
    def format_version(self) -> int:
        """The oldest format that says everything this graph needs (an older pack reads it right or refuses it)."""
        if self.info.weight_inputs:
            return WEIGHT_INPUTS_FORMAT_VERSION
        return PARTS_FORMAT_VERSION if self.info.wiring else FORMAT_VERSION

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: Any) -> "Manifest":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ManifestError("not a graph manifest")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ManifestError(f"manifest format {version}, this pack reads formats "
                                f"{', '.join(map(str, READABLE_VERSIONS))} (written by a newer KeepFast?)")
        try:
            key = GraphKey(FamilyKey.from_json(data["family"]), ShapeRange.from_json(data["shape_range"]),
                           str(data.get("variant", "")))
            package = data["package"]
            manifest = cls(
                key=key,
                package_file=str(package["file"]),
                package_sha256=str(package["sha256"]),
                package_bytes=int(package["bytes"]),
                info=PackageInfo(
                    guards=[str(g) for g in data["guards"]],
                    out_spec=data.get("out_spec"),
                    constant_names=[str(n) for n in data["constant_names"]],
                    input_paths=[str(p) for p in data.get("input_paths", [])],
                    needs=_needs(data.get("needs") if version >= 2 else {}),
                    wiring=_wiring(data.get("parts")) if version >= 3 else None,
                    weight_inputs=[str(n) for n in data.get("weight_inputs", [])] if version >= 4 else [],
                ),
                signature=dict(data.get("signature") or {}),
                created=str(data.get("created", "")),
                created_on=str(data.get("created_on", "")),
                pack_version=str(data.get("pack_version", "")),
                origin=str(data.get("origin", "")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"manifest is missing or has a bad field: {error}") from error
        if data.get("graph_id") != manifest.graph_id:
            raise ManifestError("manifest's graph id does not match its key (edited by hand?)")
        if "/" in manifest.package_file or "\\" in manifest.package_file or manifest.package_file.startswith("."):
            raise ManifestError(f"manifest names an unsafe package file {manifest.package_file!r}")
        return manifest

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ManifestError(f"cannot read {Path(path).name}: {error}") from error
        return cls.from_json(data)

    @property
    def is_block_graph(self) -> bool:
        return bool(self.signature.get("block"))

    def superseded(self) -> Optional[str]:
        """Why this graph must not be used although it verifies, or None.

        Whole-model aot graphs written before KeepFast 0.2.0 may have been
        traced at a size of 1 and give wrong outputs for larger sizes; block
        graphs were always traced at sizes of 2 or more.
        """
        if self.is_block_graph or self.key.family.backend != "aot":
            return None
        if _version_tuple(self.pack_version) >= FIRST_SIZE_SAFE_VERSION:
            return None
        return (f"written by KeepFast {self.pack_version or 'before 0.2'}, which could trace a graph at a size of 1 "
                "that then serves larger sizes wrongly; it is not used (a new graph is built or loaded in its place)")

    def summary(self) -> Dict[str, Any]:
        family = self.key.family
        return {
            "graph_id": self.graph_id,
            "architecture": family.architecture,
            "structure": family.structure,
            "dtype": family.dtype,
            "device": family.device,
            "backend": family.backend,
            "torch_version": family.torch_version,
            "shape_range": self.key.shape_range.to_json(),
            "inputs": [t.get("path") for t in self.signature.get("tensors", [])],
            "block": self.signature.get("block"),  # a block graph: {class, instances, paths, model}; else None
            "bytes": self.package_bytes,
            "needs": self.info.needs,
            "created": self.created,
            "origin": self.origin,
        }


def _version_tuple(text: str) -> tuple:
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts) if parts else (0,)
