"""Another compiler on the same model: ComfyUI's TorchCompileModel, and packs that use its helper.

Why: TorchCompileModel (comfy_api/torch_helpers/torch_compile.py) puts an APPLY_MODEL wrapper on the model that,
for each call, swaps the diffusion model (or the blocks named in its keys) for a `torch.compile` of it. Under the
pack's node that compile would trace into the pack's own serving code (the diffusion model's wrapper hook runs
inside its forward): seen on the CPU with ComfyUI's tiny SD1.5, a first call of 374 s (76 s with it skipped),
torch.compile's recompile limit hit in the pack's build code, and graph breaks in its first-use check. Two
compilers on one model cannot both serve it. The pack's node serves it (from its graphs, or uncompiled with its
own stated reason where none serves, as without TorchCompileModel) and runs the rest of the wrapper chain without
the torch.compile wrapper, saying so once: a note, since no call's outcome changes.
"""

from __future__ import annotations

from typing import Any, Callable, List

# comfy_api/torch_helpers/torch_compile.py COMPILE_KEY: the key of TorchCompileModel's APPLY_MODEL wrapper
TORCH_COMPILE_KEY = "torch.compile"
NOTE = ("TorchCompileModel (torch.compile) is also on this model: KeepFast serves the diffusion model and its "
        "torch.compile is skipped (it would compile the pack's own code around the graphs); remove one of the two "
        "nodes")


def torch_compile_wrappers(args: tuple, kwargs: dict) -> List[Callable[..., Any]]:
    """The torch.compile wrappers of this apply_model call (BaseModel.apply_model passes its
    transformer_options sixth), or none."""
    from comfy.patcher_extension import WrappersMP

    options = args[5] if len(args) > 5 else kwargs.get("transformer_options")
    if not isinstance(options, dict):
        return []
    return list(options.get("wrappers", {}).get(WrappersMP.APPLY_MODEL, {}).get(TORCH_COMPILE_KEY, []))


def without(executor, dropped: List[Callable[..., Any]]):
    """An executor standing where `executor` stands (called as a wrapper calls its executor) that runs the wrappers
    after the current one except `dropped`, then the original. Wrappers before the current one have run already:
    the pack's own wrappers are put first (unet._outermost), so a torch.compile wrapper comes after them."""
    rest = [w for w in executor.wrappers[executor.idx + 1:] if not any(w is d for d in dropped)]
    return type(executor)(executor.original, executor.class_obj, [executor.wrappers[executor.idx]] + rest, 0)
