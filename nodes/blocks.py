"""ComfyUI's transformer families served block by block (the compiler's block engine, ComfyUI's classes).

A family here says, for one of ComfyUI's diffusion model classes, which
modules are its repeated blocks, how latent pixels and frames become tokens
and how to make a call of the whole model at given sizes from the model's
own layers (so graphs are prepared, saved and warmed up before any image).
The engine is installed once on the shared diffusion model's blocks and is
`scoped`: blocks run from graphs only inside the APPLY_MODEL hook of a MODEL
that went through a KeepFast node, so clones without the node, other
workflows and ComfyUI's own previews run the blocks as ComfyUI wrote them.

Everything around the blocks (patch embedding, position tables, text and
time embedders, the final layer, and every ComfyUI patch that runs there:
block replacements, post-input patches, ControlNet additions) runs eager
with the real `transformer_options`. Inside a block only attention reads
`transformer_options`: a graph computes ComfyUI's own `attention_pytorch`
(one graph for every size), and a block call carrying an attention override
of its own runs eager with that reason, alone. So does a block whose weights
ComfyUI patches on the fly with a function the pack does not know, or keeps
on another device (offloaded): the rest of the model stays compiled.

GGUF models loaded by ComfyUI-GGUF serve from graphs that dequantise inside
(nodes/gguf.py): the family's `stored_weights` hands the engine the GGUF
forms of a block, whose quantisation types join its structure key. A block
low-VRAM mode patches per call with ComfyUI's LowVramPatch is served with
the patched weights bound for the call (nodes/lowvram.py).

Here: which family a model is (FAMILIES, `family_of`), its range, what makes
one block call run eager (`BlockPolicy`) and the one engine per model
(`engine_for`). What every family shares is in comfy_family.py, the families
themselves in image_families.py and video_families.py.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..compiler import BlockEngine, BlockInstance, BlockOptions, ShapeRange
from .attention import graph_attention
from .comfy_family import ComfyFamily
from .image_families import (AuraFlowFamily, ChromaFamily, Flux2Family, FluxFamily, HiDreamFamily, HunyuanImage21Family,
                             Lumina2Family, QwenImageFamily, SD3Family)
from .lowvram import PATCHED_ON_THE_FLY
from .sizes import PROMPT_TOKENS, latent_range
from .video_families import (HunyuanVideo15Family, HunyuanVideoFamily, Kandinsky5Family, LTX2Family, LTXVFamily,
                             Wan22Family, WanFamily)


def input_dtype(base_model: Any) -> Optional[torch.dtype]:
    """The dtype ComfyUI's BaseModel casts the diffusion model's inputs to: its manual-cast dtype, else the weights'.

    Not a parameter's dtype: some layers stay float32 in a bfloat16 model
    (Wan's patch embedding), and fp8 weights compute in the manual-cast dtype.
    Example calls (ahead of time, and the probes of the first image) must be
    what the sampler sends, or they fail where the sampler would not.
    """
    cast = getattr(base_model, "manual_cast_dtype", None)
    if cast is not None:
        return cast
    weights = getattr(base_model, "get_dtype", None)
    return weights() if weights is not None else None

FAMILIES: Tuple[ComfyFamily, ...] = (  # a variant before the family whose class it shares
    Flux2Family(), FluxFamily(), ChromaFamily(), SD3Family(), AuraFlowFamily(), Wan22Family(), WanFamily(),
    QwenImageFamily(), HunyuanVideo15Family(), HunyuanImage21Family(), HunyuanVideoFamily(), LTXVFamily(),
    LTX2Family(), Kandinsky5Family(), Lumina2Family(), HiDreamFamily())
_BY_CLASS: Dict[str, Tuple[ComfyFamily, ...]] = {}
for _family in FAMILIES:  # variants first, as FAMILIES lists them
    for _name in _family.model_classes:
        _BY_CLASS[_name] = _BY_CLASS.get(_name, ()) + (_family,)


def family_of(module: torch.nn.Module) -> Optional[ComfyFamily]:
    """The block family of a ComfyUI diffusion model, or None (SD-style UNets: whole-model graphs)."""
    return next((f for f in _BY_CLASS.get(type(module).__name__, ()) if f.matches(module)), None)


def block_range(family: ComfyFamily, min_size: int, max_size: int, max_batch: int, max_frames: int) -> ShapeRange:
    """The node's range (pixels, images, video frames) in the family's latent units; text tokens up to 1024 for the
    prompt, plus what the family joins to it."""
    base = latent_range(min_size, max_size, max_batch, scale=family.latent_scale,
                        sequence=(1, PROMPT_TOKENS + family.joined_text_tokens))
    if family.video:
        base = ShapeRange(batch=base.batch, spatial=base.spatial, sequence=base.sequence,
                          frames=(1, family.latent_frames(max_frames)))
    return base


# -- per block: what makes one block call run eager ------------------------------------

class BlockPolicy:
    """The engine's block filter for ComfyUI calls; module walks are cached per instance."""

    def __init__(self):
        self._cast: Dict[int, List[torch.nn.Module]] = {}

    def _castable(self, instance: BlockInstance) -> List[torch.nn.Module]:
        found = self._cast.get(id(instance))
        if found is None:
            found = [m for m in instance.module.modules() if hasattr(m, "weight_function")]
            self._cast[id(instance)] = found
        return found

    def __call__(self, instance: BlockInstance, args: tuple, kwargs: dict) -> Optional[str]:
        options = kwargs.get("transformer_options") or {}
        override = options.get("optimized_attention_override")
        if override is not None and override is not graph_attention:
            return (f"its transformer_options carry an attention override "
                    f"({getattr(override, '__qualname__', type(override).__name__)}), which runs Python inside the "
                    "block")
        family = instance.server.engine.family
        block_reason = getattr(family, "block_reason", None)
        reason = block_reason(args, kwargs) if block_reason is not None else None
        if reason:
            return reason
        lowvram = getattr(family, "lowvram", None)
        if any(sub.weight_function or sub.bias_function for sub in self._castable(instance)):
            reason = lowvram.reason(instance.module) if lowvram is not None else PATCHED_ON_THE_FLY
            if reason:
                return reason
        gguf = getattr(family, "gguf", None)
        if gguf is not None:
            return gguf.patch_reason(instance.module)
        return None


# Weak both ways: the module's blocks hold its engine (each block's forward is the engine's), and an engine
# held strongly here would hold its module (the key), so neither would ever be freed: ComfyUI unloading a
# model must free it, and stop its background builds (the engine's finalizer).
_ENGINES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[BlockEngine]]" = weakref.WeakKeyDictionary()


def _engine_of(module: torch.nn.Module) -> Optional[BlockEngine]:
    ref = _ENGINES.get(module)
    return ref() if ref is not None else None


def engine_for(module: torch.nn.Module, options: BlockOptions, registry,
               dtype: Optional[torch.dtype] = None) -> Optional[BlockEngine]:
    """The one block engine of this diffusion model module (installed on its blocks, scoped), or None.

    `dtype`: what the sampler casts the model's inputs to (`input_dtype`), for its example calls.
    """
    engine = _engine_of(module)
    if engine is not None:
        engine.options = options
        return engine
    family = family_of(module)
    if family is None:
        return None
    engine = BlockEngine(module, family.for_model(module, dtype), options, registry, scoped=True)
    engine.block_filter = BlockPolicy()
    engine.install_blocks()
    _ENGINES[module] = weakref.ref(engine)
    return engine


def existing_engine(module: torch.nn.Module) -> Optional[BlockEngine]:
    return _engine_of(module)
