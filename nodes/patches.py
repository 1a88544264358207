"""Which ComfyUI `transformer_options` change what a diffusion model computes.

A compiled graph takes tensors only. ComfyUI passes its diffusion model a
`transformer_options` dict beside them: much of it is bookkeeping (wrappers,
cond/uncond order, sigmas, block indices), but patches (IPAdapter, FreeU,
attention replacements, overrides) run Python inside the model. Those calls
must run eagerly, and the reason names what was found.
"""

from __future__ import annotations

from typing import Any, Optional

# Keys of transformer_options that never change what the model computes: bookkeeping, and state read only by
# wrappers and callbacks around the model (no model under comfy/ldm reads it): ComfyUI's step caches (EasyCache,
# LazyCache: comfy_extras/nodes_easycache.py) keep their state under `easycache` and decide, outside the model's
# call, whether a step calls the model at all; its context windows (comfy/context_windows.py) name the window being
# sampled under `context_window`, the window's latent and conditions being the call's inputs.
NEUTRAL_OPTION_KEYS = frozenset({
    "wrappers", "callbacks", "cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "original_shape",
    "transformer_index", "block", "block_index", "total_blocks", "block_type", "activations_shape",
    "easycache", "context_window",
})
# Keys whose value is a dict of patch lists: only non-empty entries matter.
PATCH_OPTION_KEYS = ("patches", "patches_replace")


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


def side_inputs_reason(side: dict) -> Optional[str]:
    """The diffusion model binder's side policy: the call's side inputs are its `transformer_options`."""
    return options_reason(side.get("transformer_options"))
