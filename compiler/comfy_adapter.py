"""What the ComfyUI nodes need from the compiler core, without importing ComfyUI.

- `ComfyForward`: a CompiledForward whose eager path is the caller's own call
  (ComfyUI's wrapper chain with the real `transformer_options`), and whose
  model-structure hash ignores the flags ComfyUI's ModelPatcher sets on
  modules while loading and patching (`comfy_patched_weights`, ...), so a
  graph saved before the first image has the key the sampler asks for later.
- `bind_call`: a diffusion model call, bound to its forward's parameter names,
  with `transformer_options` split off and unused (None) inputs dropped: the
  same inputs always give the same input structure, however they were passed.
- `options_reason`: whether `transformer_options` carries anything that
  changes the computation (attention patches, block patches, overrides) and
  so must run eagerly; the reason names what it found.
- `MultiRootStore`: one GraphStore over every `graphs` folder ComfyUI knows
  (the models folder and those from extra_model_paths.yaml).
- Graph sets: `<graphs>/<name>.json` lists the graphs Save Graph wrote under
  a user's name, so Load Graph can pick them back by that name.
- Example calls for saving and warming up before any image was generated.
"""

from __future__ import annotations

import datetime as _dt
import inspect
import json
import re
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .atomic import write_bytes
from .compiled_forward import CompiledForward
from .keys import FamilyKey
from .registry import FALLBACK
from .shapes import ShapeRange
from .signature import FlatCall
from .store import GraphStore, StoredGraph, safe_part
from .trust import TrustList

# Keys of transformer_options that carry bookkeeping, never computation.
NEUTRAL_OPTION_KEYS = frozenset({
    "wrappers", "callbacks", "cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "original_shape",
    "transformer_index", "block", "block_index", "total_blocks", "block_type", "activations_shape",
})
# Keys whose value is a dict of patch lists: only non-empty entries matter.
PATCH_OPTION_KEYS = ("patches", "patches_replace")

# Attributes ComfyUI's ModelPatcher sets on modules while loading or patching
# weights: runtime state, not part of the model's structure.


def _is_empty(value: Any) -> bool:
    if value is None or value is False:
        return True
    if isinstance(value, (dict, list, tuple, set)):
        return len(value) == 0
    return False


def options_reason(options: Optional[dict]) -> Optional[str]:
    """None when `transformer_options` changes nothing a graph computes, else why it does."""
    if not options:
        return None
    found = []
    for key, value in options.items():
        if key in NEUTRAL_OPTION_KEYS or _is_empty(value):
            continue
        if key in PATCH_OPTION_KEYS and isinstance(value, dict):
            names = sorted(str(name) for name, entry in value.items() if not _is_empty(entry))
            if names:
                found.append(f"{key} ({', '.join(names)})")
            continue
        found.append(key)
    if not found:
        return None
    return ("transformer_options carries " + "; ".join(found) +
            ", which runs Python code inside the model (attention or block patches such as IPAdapter or FreeU) "
            "that a compiled graph cannot include")


# -- calls -------------------------------------------------------------------

_SIGNATURES: Dict[Any, inspect.Signature] = {}


def forward_signature(function: Callable) -> inspect.Signature:
    """The signature of a bound method or function, cached per underlying function."""
    key = getattr(function, "__func__", function)
    signature = _SIGNATURES.get(key)
    if signature is None:
        signature = inspect.signature(function)
        _SIGNATURES[key] = signature
    return signature


def _contiguous(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t if t.is_contiguous() else t.contiguous(), tree)


def bind_call(signature: inspect.Signature, args: Sequence[Any], kwargs: Dict[str, Any],
              options_name: str = "transformer_options") -> Tuple[Dict[str, Any], dict]:
    """(canonical keyword inputs, transformer_options) of one diffusion model call.

    Raises TypeError when the call does not bind or passes extra positional
    inputs (then it runs eagerly with that as the reason).
    """
    bound = signature.bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    options = arguments.pop(options_name, None) or {}
    merged: Dict[str, Any] = {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            merged.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"{len(value)} extra positional inputs")
        else:
            merged[name] = value
    options = merged.pop(options_name, options) or {}
    canonical = {name: value for name, value in sorted(merged.items()) if value is not None}
    return _contiguous(canonical), options


class ComfyForward(CompiledForward):
    """A CompiledForward for a module ComfyUI manages; see the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._local = threading.local()

    def eager(self, *args, **kwargs) -> Any:
        run = getattr(self._local, "eager", None)
        if run is not None:
            return run()
        return super().eager(*args, **kwargs)

    def call(self, eager: Callable[[], Any], *args, **kwargs) -> Any:
        """Serve the call from a graph; `eager()` is what runs when none can."""
        previous = getattr(self._local, "eager", None)
        self._local.eager = eager
        try:
            return self(*args, **kwargs)
        finally:
            self._local.eager = previous

    def run_eager(self, reason: str, eager: Callable[[], Any]) -> Any:
        """Run eagerly for a reason found before the call reached the graphs; recorded once per change."""
        self.eager_calls += 1
        status = "eager: " + reason
        if self.last_status != status:
            self.registry.record(FALLBACK, "-", f"{self.label}: {reason}; running eager")
        self.last_status = status
        return eager()

    @property
    def ran_eager(self) -> bool:
        return self.last_status.startswith("eager")


# -- stores ------------------------------------------------------------------

class MultiRootStore(GraphStore):
    """A GraphStore that writes into its first folder and finds graphs in all of them."""

    def __init__(self, roots: Sequence[Path | str], trust: Optional[TrustList] = None):
        if not roots:
            raise ValueError("no graphs folder")
        super().__init__(roots[0], trust)
        self.others = [GraphStore(root, self.trust) for root in roots[1:]]

    @property
    def stores(self) -> List[GraphStore]:
        """Every folder's store, the one written into first."""
        return [self] + self.others

    @property
    def roots(self) -> List[Path]:
        return [store.root for store in self.stores]

    def lookup(self, family: FamilyKey, call: FlatCall) -> Tuple[Optional[StoredGraph], List[str]]:
        found, notes = super().lookup(family, call)
        for store in self.others:
            if found is not None:
                break
            found, more = store.lookup(family, call)
            notes += more
        return found, notes

    def store_for(self, path: Path) -> Tuple[GraphStore, str]:
        """The store holding `path` and the graph's name in it."""
        path = Path(path)
        for store in self.stores:
            root = store.root
            try:
                relative = path.relative_to(root)
            except ValueError:
                try:
                    relative = path.resolve().relative_to(root.resolve())
                except ValueError:
                    continue
            return store, relative.as_posix()
        raise ValueError(f"{path} is not inside a graphs folder ({', '.join(map(str, self.roots))})")

    def all_graphs(self) -> List[Tuple[GraphStore, Path, Optional[StoredGraph], Optional[str]]]:
        out = []
        for store in self.stores:
            for path, stored, problem in store.entries():
                out.append((store, path, stored, problem))
        return out


# -- graph sets ----------------------------------------------------------------

SET_FORMAT = "keepfast-graph-set"
SET_FORMAT_VERSION = 1


class GraphSetError(ValueError):
    """A graph set file is unreadable or not one."""


def set_file_name(name: str) -> str:
    name = (name or "").strip()
    if name.endswith(".json"):
        name = name[: -len(".json")]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._-") or "keepfast"
    return safe_part(name) + ".json"


def write_graph_set(root: Path | str, name: str, graphs: Iterable[str], note: str = "") -> Path:
    """Write `<root>/<name>.json` listing graphs by their store names ('<folder>/<graph_id>')."""
    path = Path(root) / set_file_name(name)
    payload = {
        "format": SET_FORMAT,
        "format_version": SET_FORMAT_VERSION,
        "graphs": sorted(set(graphs)),
        "note": note,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, (json.dumps(payload, indent=1, sort_keys=True) + "\n").encode())
    return path


def read_json(path: Path | str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise GraphSetError(f"cannot read {Path(path).name}: {error}") from error


def is_graph_set(data: Any) -> bool:
    return isinstance(data, dict) and data.get("format") == SET_FORMAT


def graph_set_entries(data: Any, name: str = "graph set") -> List[str]:
    if not is_graph_set(data):
        raise GraphSetError(f"{name} is not a graph set")
    if data.get("format_version") != SET_FORMAT_VERSION:
        raise GraphSetError(f"{name}: set format {data.get('format_version')}, this pack reads {SET_FORMAT_VERSION}")
    graphs = data.get("graphs")
    if not isinstance(graphs, list) or not all(isinstance(g, str) for g in graphs):
        raise GraphSetError(f"{name}: 'graphs' must be a list of graph names")
    return list(graphs)


# -- shapes ------------------------------------------------------------------

def parse_resolutions(text: str) -> List[Tuple[int, int]]:
    """'512x512, 768x512, 1024' -> [(512, 512), (768, 512), (1024, 1024)] as (width, height)."""
    sizes = []
    for part in re.split(r"[,;\s]+", text or ""):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:[xX*](\d+))?", part)
        if not match:
            raise ValueError(f"{part!r} is not a resolution (write WIDTHxHEIGHT, e.g. 512x768)")
        width = int(match.group(1))
        height = int(match.group(2) or width)
        if width <= 0 or height <= 0:
            raise ValueError(f"{part!r}: sizes must be positive")
        sizes.append((width, height))
    return sizes


def parse_batch_sizes(text: str) -> List[int]:
    values = []
    for part in re.split(r"[,;\s]+", text or ""):
        if not part:
            continue
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{part!r} is not a batch size (positive whole numbers, e.g. 1, 2, 4)")
        values.append(int(part))
    return values


def latent_range(min_size: int, max_size: int, max_batch: int, batch_factor: int = 2, scale: int = 8,
                 sequence: Tuple[int, int] = (1, 1024)) -> ShapeRange:
    """The range a diffusion model is compiled for: image sizes in pixels, batches in images.

    `batch_factor` 2: ComfyUI batches the positive and negative prompt together.
    """
    low = max(1, -(-min_size // scale))
    high = max(low, max_size // scale)
    return ShapeRange(batch=(1, max(1, max_batch * batch_factor)), spatial=(low, high), sequence=sequence)


def unet_example_call(in_channels: int, context_dim: Optional[int], adm_channels: Optional[int], batch: int,
                      height: int, width: int, sequence: int, dtype: torch.dtype,
                      device: torch.device | str) -> Tuple[tuple, Dict[str, Any]]:
    """A call shaped as ComfyUI's BaseModel.apply_model makes it to an SD-style UNet (canonical form)."""
    options = dict(dtype=dtype, device=device)
    kwargs: Dict[str, Any] = {
        "x": torch.randn(batch, in_channels, height, width, **options),
        "timesteps": torch.full((batch,), 500.0, dtype=torch.float32, device=device),
    }
    if context_dim:
        kwargs["context"] = torch.randn(batch, sequence, context_dim, **options)
    if adm_channels:
        kwargs["y"] = torch.randn(batch, adm_channels, **options)
    return (), dict(sorted(kwargs.items()))


def clamp(value: int, bounds: Tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])
