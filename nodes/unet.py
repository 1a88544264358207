"""The diffusion model side: a DIFFUSION_MODEL wrapper that serves calls from graphs.

The speedup node clones the MODEL and adds two wrappers under the key
`keepfast`; the shared UNet module is never changed. At sampling time the
DIFFUSION_MODEL wrapper binds the call (x, timesteps, context, y, control,
...) to the model's `_forward` parameters, splits off `transformer_options`
(which a graph cannot take) and serves the call through a CompiledForward: a
graph when one serves it, else a compile, else ComfyUI's own call (the
wrapper chain with the real `transformer_options`) with the reason recorded.
`transformer_options` carrying patches (IPAdapter, FreeU, attention
replacements) always runs eagerly, with that reason. Wrappers inside ours
(other packs') still run: the graph takes the place of the model's own
forward at the end of their chain.

Transformer families (Flux, SD3, Wan, ...: `blocks.py`) are served block by
block instead: the APPLY_MODEL wrapper, which every model type has, opens
the block engine's scope around the call, and the DIFFUSION_MODEL wrapper
lets the call through (the glue runs eager, the blocks from graphs).

For whole-model graphs the APPLY_MODEL wrapper notices when the diffusion
model was not reached through the DIFFUSION_MODEL hook (a model type without
it) and says so instead of silently running uncompiled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..compiler import (DEFAULT_BACKEND, BlockEngine, BlockOptions, CallBinder, CompiledForward, CompileOptions,
                        FamilyKey, architecture_name, cuda_graphs_asked_for, portable_forward)
from . import blocks, other_compilers, runtime
from .attention import graph_attention_options
from .patches import side_inputs_reason
from .sizes import clamp, latent_range

KEY = "keepfast"


@dataclass(frozen=True)
class Settings:
    """What a user chose on a node; turned into CompileOptions per module."""

    min_size: int = 64
    max_size: int = 2048
    max_batch: int = 4
    compile_on_miss: bool = True
    autosave: bool = False
    cover_range: bool = True
    backend: str = DEFAULT_BACKEND
    max_frames: int = 81  # video frames (video families turn them into latent frames)
    verify: bool = True  # the first-use check: each graph's first call with new shapes compared with eager
    background: bool = False  # graphs build in a child process while the model runs uncompiled (docs/background.md)
    cuda_graphs: bool = False  # whole-model graphs replay CUDA graphs of the shapes a sampler repeats (cuda_graphs.py)

    def unet_range(self):
        return latent_range(self.min_size, self.max_size, self.max_batch)

    def widened(self, sizes: List[Tuple[int, int]], batches: List[int]) -> "Settings":
        values = [v for size in sizes for v in size]
        return dataclasses.replace(
            self, min_size=min([self.min_size] + values), max_size=max([self.max_size] + values),
            max_batch=max([self.max_batch] + batches),
        )


@portable_forward
def _forward_fn(module, **kwargs):
    """What a graph computes: the model's own forward with empty transformer_options.

    Portable: it reaches the model through its method only, so the oneflow
    backend runs it on the OneFlow copy of the model.
    """
    return module._forward(transformer_options={}, **kwargs)


def _traced_forward_fn(module, **kwargs):
    """_forward_fn with ComfyUI's attention override for the torch backends (aot, inductor)."""
    return module._forward(transformer_options=graph_attention_options(), **kwargs)


def unet_example_call(in_channels: int, context_dim: Optional[int], adm_channels: Optional[int], batch: int,
                      height: int, width: int, sequence: int, dtype: torch.dtype,
                      device: torch.device | str) -> Tuple[tuple, Dict[str, Any]]:
    """A call shaped as ComfyUI's BaseModel.apply_model makes it to an SD-style UNet."""
    options = dict(dtype=dtype, device=device)
    kwargs: Dict[str, Any] = {
        "x": torch.randn(batch, in_channels, height, width, **options),
        "timesteps": torch.full((batch,), 500.0, dtype=torch.float32, device=device),
    }
    if context_dim:
        kwargs["context"] = torch.randn(batch, sequence, context_dim, **options)
    if adm_channels:
        kwargs["y"] = torch.randn(batch, adm_channels, **options)
    return (), kwargs


def call_binder(module: torch.nn.Module) -> CallBinder:
    """Calls bound to the diffusion model's `_forward` (what the DIFFUSION_MODEL hook wraps)."""
    function = getattr(type(module), "_forward", None) or type(module).forward
    return CallBinder(function, side_inputs=("transformer_options",), side_policy=side_inputs_reason)


class UnetRunner:
    """The wrappers' state: one CompiledForward per diffusion model module."""

    def __init__(self, settings: Settings, base_model, load_device=None):
        self.settings = settings
        self.base_model = base_model
        self.load_device = load_device
        self._forwards: Dict[int, CompiledForward] = {}
        self._block_options: Dict[int, BlockOptions] = {}
        self._hook_seen = False
        self._no_hook_reported = False
        self._torch_compile_reported = False

    # -- the compiled forward ------------------------------------------------
    def options(self) -> CompileOptions:
        s = self.settings
        return CompileOptions(
            backend=s.backend, shape_range=s.unet_range(), compile_on_miss=s.compile_on_miss,
            store=runtime.store(), autosave=s.autosave, cover_range=s.cover_range, counter="unet",
            device=str(self.load_device) if self.load_device is not None else None, verify=s.verify,
            background=s.background, cuda_graphs=s.cuda_graphs or cuda_graphs_asked_for(),
        )

    def forward_for(self, module: torch.nn.Module) -> CompiledForward:
        forward = self._forwards.get(id(module))
        if forward is None or forward.module is not module:
            label = _label(self.base_model, module)
            traced = _forward_fn if self.settings.backend == "oneflow" else _traced_forward_fn
            forward = CompiledForward(module, self.options().with_(label=label), runtime.registry(),
                                      forward_fn=traced, binder=call_binder(module))
            self._forwards[id(module)] = forward
        return forward

    # -- block graphs (transformer families) ---------------------------------------
    def block_options(self, family: blocks.ComfyFamily, module: torch.nn.Module) -> BlockOptions:
        """This node's options for a block engine, made once per module (the APPLY_MODEL hook asks every step)."""
        options = self._block_options.get(id(module))
        if options is None:
            s = self.settings
            options = self._block_options[id(module)] = BlockOptions(
                backend=s.backend, shape_range=blocks.block_range(family, s.min_size, s.max_size, s.max_batch,
                                                                  s.max_frames),
                store=runtime.store(), autosave=s.autosave, compile_on_miss=s.compile_on_miss,
                label=_label(self.base_model, module), verify=s.verify, background=s.background,
                range_advice=RANGE_ADVICE,
            )
        return options

    def block_engine(self, module: Optional[torch.nn.Module]) -> Optional[BlockEngine]:
        """The block engine serving this diffusion model with this node's settings; None: whole-model graphs."""
        family = blocks.family_of(module) if module is not None else None
        if family is None:
            return None
        return blocks.engine_for(module, self.block_options(family, module), runtime.registry(),
                                 dtype=blocks.input_dtype(self.base_model))

    def prepare_blocks(self, engine: BlockEngine, force: bool = False, ahead_of_time: bool = False) -> List[str]:
        """Block graphs found, loaded or compiled now (`force`: look in the graphs folders again), with
        ComfyUI's progress bar (block k of n)."""
        bar = progress_bar(100)

        def progress(text: str, fraction: float) -> None:
            if bar is not None:
                bar.update_absolute(int(100 * fraction), 100)

        return engine.prepare(progress, force=force, ahead_of_time=ahead_of_time)

    # -- wrappers -------------------------------------------------------------
    def apply_model_wrapper(self, executor, *args, **kwargs):
        compile_wrappers = other_compilers.torch_compile_wrappers(args, kwargs)
        if compile_wrappers:
            executor = other_compilers.without(executor, compile_wrappers)
            if not self._torch_compile_reported:
                self._torch_compile_reported = True
                runtime.inform(other_compilers.NOTE)
        engine = self.block_engine(getattr(executor.class_obj, "diffusion_model", None))
        if engine is not None:
            if not engine.prepared:
                self.prepare_blocks(engine)
            with engine.serving():
                return executor(*args, **kwargs)
        self._hook_seen = False
        output = executor(*args, **kwargs)
        if not self._hook_seen and not self._no_hook_reported:
            self._no_hook_reported = True
            model = getattr(executor.class_obj, "diffusion_model", None)
            runtime.note(f"{type(model).__name__} was not called through ComfyUI's diffusion-model "
                                     "wrapper hook (a model type without the hook, or another pack's wrapper "
                                     "answered instead); those calls ran uncompiled")
        return output

    def diffusion_model_wrapper(self, executor, *args, **kwargs):
        self._hook_seen = True
        module = executor.class_obj
        if blocks.family_of(module) is not None:
            return executor(*args, **kwargs)  # served block by block inside the APPLY_MODEL scope
        if executor.idx + 1 < len(executor.wrappers):
            # Wrappers of other packs inside ours run first; we take the model's place at their end.
            from comfy.patcher_extension import WrapperExecutor

            def last(*a, **k):
                return self.run(module, executor.original, a, k)

            return WrapperExecutor.new_class_executor(last, module, executor.wrappers, executor.idx + 1).execute(
                *args, **kwargs)
        return self.run(module, executor.original, args, kwargs)

    def run(self, module, original, args: tuple, kwargs: dict):
        """Serve one diffusion model call; ComfyUI's own call is what runs when no graph can."""
        served = self.forward_for(module).serve(args, kwargs, eager=original, eager_reason=self._eager_reason())
        return served.output

    def _eager_reason(self) -> Optional[str]:
        base = self.base_model
        if getattr(base, "model_lowvram", False) or getattr(base, "lowvram_patch_counter", 0):
            return "the model is only partly loaded (low-VRAM mode patches weights on the fly)"
        return None

    # -- ahead of time ------------------------------------------------------------
    def example_calls(self, model, sizes: List[Tuple[int, int]], batches: List[int],
                      sequence: int = 77) -> Tuple[List[Tuple[tuple, dict]], Optional[str]]:
        """Calls shaped as the sampler makes them (cond and uncond batched), or why there are none."""
        base = model.model
        unet = model.get_model_object("diffusion_model")
        config = getattr(getattr(base, "model_config", None), "unet_config", None) or {}
        if type(unet).__name__ != "UNetModel" or "in_channels" not in config:
            return [], (f"graphs for {type(unet).__name__} are made from the first image, not ahead of time "
                        "(only SD-style UNets have example inputs here)")
        dtype = blocks.input_dtype(base)
        device = model.load_device
        shape_range = self.settings.unet_range()
        calls = []
        for width, height in sizes:
            for batch in batches:
                calls.append(unet_example_call(
                    config["in_channels"], config.get("context_dim"), config.get("adm_in_channels"),
                    clamp(2 * batch, shape_range.batch), max(1, height // 8), max(1, width // 8),
                    clamp(sequence, shape_range.sequence), dtype, device))
        return calls, None


# What widens a block graph's range, by the role a call fell outside of (compiler/blocks/tokens.py's roles).
_LARGER_IMAGES = "a larger max_resolution on Model Speedup covers it: size it for the image and its reference images"
RANGE_ADVICE = {"tokens": _LARGER_IMAGES, "joint": _LARGER_IMAGES,
                "batch": "a larger max_batch_size on Model Speedup covers it",
                "frames": "a larger max_frames on Model Speedup covers it",
                "audio": "a larger max_frames on Model Speedup covers it (the audio range is sized for max_frames "
                         "at 8 frames a second or more)",
                "sequence": "the graphs take prompts up to the range's text tokens; a longer prompt runs uncompiled"}


def _label(base_model, module: torch.nn.Module) -> str:
    """'SDXL UNetModel', 'Flux' (ComfyUI's model type, then the module's class when it says more)."""
    kind, architecture = type(base_model).__name__, architecture_name(module)
    return kind if kind == architecture else f"{kind} {architecture}"


def progress_bar(total: int):
    """ComfyUI's progress bar on the running node (None outside a prompt)."""
    try:
        import comfy.utils

        return comfy.utils.ProgressBar(max(1, total))
    except Exception:
        return None


def runner_of(model) -> Optional[UnetRunner]:
    """The runner behind this model's KeepFast wrapper (model_options are deep-copied on clone: not there)."""
    from comfy.patcher_extension import WrappersMP

    for wrapper in model.get_wrappers(WrappersMP.DIFFUSION_MODEL, KEY):
        runner = getattr(wrapper, "__self__", None)
        if isinstance(runner, UnetRunner):
            return runner
    return None


def speed_up(model, settings: Settings):
    """A clone of `model` whose diffusion model calls go through graphs."""
    from comfy.patcher_extension import WrappersMP

    clone = model.clone()
    clone.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    clone.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, KEY)
    runner = UnetRunner(settings, clone.model, clone.load_device)
    clone.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, runner.apply_model_wrapper)
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, KEY, runner.diffusion_model_wrapper)
    _outermost(clone, WrappersMP.APPLY_MODEL)
    _outermost(clone, WrappersMP.DIFFUSION_MODEL)
    return clone, runner


def _outermost(model, wrapper_type: str) -> None:
    """Put the pack's wrapper first among the model's wrappers of `wrapper_type` (ComfyUI runs them in order, the
    first outermost).

    Why: a wrapper outside ours may answer a call without calling the next one (EasyCache's skipped steps), so
    ours would not see that call and could not tell it from a model type without the hook; and TorchCompileModel's
    apply_model wrapper, outside ours, would have swapped the model for its torch.compile before ours could skip
    it (other_compilers.py). First, ours sees every call and runs the other packs' wrappers inside it, with the
    graph in the model's place at their end (`diffusion_model_wrapper`): what they compute, and in which order, is
    unchanged."""
    wrappers = model.wrappers.get(wrapper_type)
    if wrappers and KEY in wrappers:
        model.wrappers[wrapper_type] = {KEY: wrappers[KEY], **{k: v for k, v in wrappers.items() if k != KEY}}


def family_here(model, signature: str) -> FamilyKey:
    """The key a graph needs to serve this model (signature from the graph): the forward's own key path."""
    unet = model.get_model_object("diffusion_model")
    runner = runner_of(model) or UnetRunner(Settings(), model.model, model.load_device)
    return runner.forward_for(unet).expected_family(signature)


def load_to_device(model) -> None:
    """Weights (with their LoRA patches) where sampling will use them, so graphs bind them."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
