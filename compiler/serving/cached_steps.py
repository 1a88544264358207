"""Video VAEs that decode (or encode) chunk by chunk with a feature cache, served one chunk at a time.

Wan 2.1 and 2.2's VAE (ComfyUI's `comfy.ldm.wan.vae` / `vae2_2`, diffusers'
`AutoencoderKLWan`; Qwen-Image uses the same class) decode a video one latent
frame at a time and encode it in chunks of 1, 4, 4, ... frames. Between
chunks, each causal convolution keeps its last input frames in a list the
caller owns (`feat_cache`), mutated in place, with `None` for "not yet run"
and the string "Rep" for "repeat the first frame". A graph of the whole
decode would unroll that loop for one frame count; a graph of one chunk does
not: the chunk's shapes are the same at every frame count, and only the state
of the cache differs (the first chunk, the second, then every later one).

So each chunk call is one call of a `CompiledForward` over
`chunk(module, x, cached, state)`: `cached` holds the cache's tensors,
`state` (a constant, so part of the graph's key) says which slots are empty,
"Rep" or a tensor. The graph returns the chunk's output and the new cache,
with the two markers as empty tensors of rank 1 (empty) and 2 ("Rep"), which
`write_back` puts into the caller's list. The spatial sides are dynamic and
a batch of videos runs one video at a time (`chunk_options`); frame counts never reach a graph,
so every video length and batch is served by the same two or three graphs per
operation.

Nothing here imports ComfyUI or diffusers: a module qualifies by its forward
taking `feat_cache` and `feat_idx` (`takes_feature_cache`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from .compiled_forward import CompiledForward, CompileOptions
from ..tracing.flat_module import ForwardFn
from ..store.registry import GraphRegistry
from ..keys.shapes import BATCH, SPATIAL

log = logging.getLogger("keepfast")

CACHE_KWARG, INDEX_KWARG = "feat_cache", "feat_idx"
EXAMPLE_CHUNKS = 3  # an example video of 3 chunks meets every cache state: the first, the second, a later one
REPEAT = "Rep"  # the cache's marker for "no frame before this one: repeat the first"
EMPTY, REPEATED, TENSOR = "N", "R", "T"


def takes_feature_cache(module: Optional[torch.nn.Module]) -> bool:
    """Whether `module`'s forward is a chunk step with a caller-owned feature cache."""
    if not isinstance(module, torch.nn.Module):
        return False
    try:
        parameters = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return CACHE_KWARG in parameters and INDEX_KWARG in parameters


def state_of(cache: Sequence[Any]) -> Optional[str]:
    """One letter per cache slot (N empty, R "Rep", T tensor); None when a slot holds anything else."""
    letters = []
    for entry in cache:
        if entry is None:
            letters.append(EMPTY)
        elif isinstance(entry, str) and entry == REPEAT:
            letters.append(REPEATED)
        elif isinstance(entry, torch.Tensor):
            letters.append(TENSOR)
        else:
            return None
    return "".join(letters)


def _rebuild(state: str, cached: Sequence[torch.Tensor]) -> List[Any]:
    tensors = iter(cached)
    return [None if letter == EMPTY else REPEAT if letter == REPEATED else next(tensors) for letter in state]


def _marker(entry: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(entry, torch.Tensor):
        return entry
    if entry is None:
        return like.new_empty((0,))
    if isinstance(entry, str) and entry == REPEAT:
        return like.new_empty((0, 0))
    raise TypeError(f"a chunk left a {type(entry).__name__} in its feature cache")


def chunk(module: torch.nn.Module, x: torch.Tensor, cached: Tuple[torch.Tensor, ...], state: str, **options):
    """What a graph computes: one chunk through the module's own forward, on a cache rebuilt from `state`.

    A caller whose module needs something changed while it is traced (ComfyUI's VAE attention, which
    slices by free memory) passes ChunkServer its own function that wraps this one.
    """
    cache = _rebuild(state, cached)
    out = type(module).forward(module, x, feat_cache=cache, feat_idx=[0], **options)
    return out, tuple(_marker(entry, x) for entry in cache)


def _is_marker(entry: torch.Tensor) -> bool:
    """Whether a returned cache entry is the marker for empty (rank 1) or "Rep" (rank 2), not frames."""
    return entry.numel() == 0 and entry.dim() in (1, 2)


def write_back(cache: List[Any], markers: Sequence[torch.Tensor]) -> None:
    """Put a chunk's new cache (tensors, and the markers for empty and "Rep") into the caller's list."""
    for slot, marker in enumerate(markers):
        if _is_marker(marker):
            cache[slot] = None if marker.dim() == 1 else REPEAT
        else:
            cache[slot] = marker


def chunk_options(options: CompileOptions) -> CompileOptions:
    """Chunk graphs compile for the shapes met, not for the range's corners up front.

    Every op of these VAEs works on each video alone (causal convolutions, per-pixel norms, attention
    within a frame), so chunks are traced from one video and a chunk of several videos is served one
    video at a time where a graph does not take the batch whole (samples.py; on CPU a chunk traced at 2
    serves 2 and up only: torch's fake Conv3d picks its backend with a `batch > 1` guard). Qwen-Image's
    images are one-frame videos: one graph per cache state for every batch size.
    """
    return options.with_(role_policy=chunk_roles, cover_range=False, samples_independent=True)


def example_frames(decoding: bool) -> int:
    """Frames of an example video with EXAMPLE_CHUNKS chunks: latent frames to decode (one per chunk), pixel
    frames to encode (Wan encodes the first frame alone, then 4 at a time)."""
    return EXAMPLE_CHUNKS if decoding else 1 + 4 * (EXAMPLE_CHUNKS - 1)


def chunk_roles(path: str, tensor: torch.Tensor) -> Dict[int, str]:
    """Chunks and cached frames are [batch, channels, frames, height, width]: frames stay static."""
    if tensor.dim() == 5:
        return {0: BATCH, 3: SPATIAL, 4: SPATIAL}
    return {0: BATCH} if tensor.dim() > 0 else {}


class ChunkServer:
    """Installed on one chunk module (a decoder or encoder); serves its calls while `active()`.

    Outside that scope the module runs as it always did: the module may be
    shared with a VAE that has no speedup (ComfyUI's VAE copy shares its
    submodules with the original).
    """

    is_keepfast_dispatcher = True  # installed as the module's forward: traces want the module itself

    def __init__(self, module: torch.nn.Module, options: CompileOptions, registry: GraphRegistry,
                 traced: ForwardFn = chunk):
        self.module = module
        # `traced` is what graphs compute; eager runs `chunk` itself (the model's own choices, e.g. attention)
        self.forward = CompiledForward(module, chunk_options(options), registry, forward_fn=traced)
        self.depth = 0
        self.always = False
        self.capture: Optional[List[Tuple[tuple, dict]]] = None

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.forward

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    @contextlib.contextmanager
    def capturing(self) -> Iterator[List[Tuple[tuple, dict]]]:
        """Run eagerly and record one example call per chunk state and shape (for Save Graph and warmup)."""
        found = self.capture = []
        try:
            with self.active():
                yield found
        finally:
            self.capture = None

    def __call__(self, x, feat_cache=None, feat_idx=None, **options):
        own = type(self.module).forward
        index = feat_idx if feat_idx is not None else [0]
        if not (self.always or self.depth) or feat_cache is None or not isinstance(x, torch.Tensor):
            return own(self.module, x, feat_cache=feat_cache, feat_idx=index, **options)
        state = state_of(feat_cache)
        if state is None:
            return own(self.module, x, feat_cache=feat_cache, feat_idx=index, **options)
        cached = tuple(entry for entry in feat_cache if isinstance(entry, torch.Tensor))
        out, markers = self._step(x, cached, state, options)
        # `feat_idx` is the forward's cursor into the cache: every caller (ComfyUI's Wan VAEs, diffusers'
        # AutoencoderKLWan) passes a fresh [0] per chunk and never reads it back, so a graph leaves it alone.
        write_back(feat_cache, markers)
        return out

    def _step(self, x: torch.Tensor, cached: Tuple[torch.Tensor, ...], state: str, options: dict) -> tuple:
        """(output, new cache markers) of one chunk: from a graph, or eager while capturing example calls."""
        args = (x, cached, state)
        if self.capture is not None:
            if not any(_same_call(args, options, seen) for seen in self.capture):
                self.capture.append(((x.clone(), tuple(t.clone() for t in cached), state), dict(options)))
            return chunk(self.module, x, cached, state, **options)
        served = self.forward.serve(args, options, eager=lambda *a, **k: chunk(self.module, *a, **k))
        return served.output

def chunk_server(module: torch.nn.Module, options: CompileOptions, registry: GraphRegistry,
                 always: bool = False, traced: ForwardFn = chunk) -> ChunkServer:
    """The one server installed on `module` (made, or the installed one with these options).

    `always`: serve every call (diffusers: the pipeline owns the VAE), not only inside `active()`
    (ComfyUI: the module is shared with a VAE that has no speedup).
    """
    server = installed_chunk_server(module)
    if server is None or server.forward.registry is not registry:
        server = ChunkServer(module, options, registry, traced)
        server.install()
    else:
        server.forward.options = chunk_options(options)
    server.always = server.always or always
    return server


def installed_chunk_server(module: torch.nn.Module) -> Optional[ChunkServer]:
    installed = module.__dict__.get("forward")
    return installed if isinstance(installed, ChunkServer) else None


def _same_call(args: tuple, options: dict, seen: Tuple[tuple, dict]) -> bool:
    (x, cached, state), seen_options = args, seen[1]
    seen_x, seen_cached, seen_state = seen[0]
    return (state == seen_state and options == seen_options and x.shape == seen_x.shape
            and [t.shape for t in cached] == [t.shape for t in seen_cached])
