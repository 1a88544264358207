"""compile_pipe / save_pipe / load_pipe for diffusers pipelines.

The wrapped modules keep their class and attributes (pipelines read
`unet.config`, `vae.dtype`, ...): only their `forward` is replaced, on the
instance, by a CompiledForward. `save_pipe` needs no generated image: it
builds example calls from the models' configs, compiles for the declared
range and writes the graphs, in every dtype the pipeline will run each part
in (`run_dtypes`: a float16 VAE decodes upcast to float32, a float32 VAE in a
bfloat16 img2img pipeline decodes in bfloat16), because dtype is part of the key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .backends import DEFAULT_BACKEND, get_backend
from .blocks import BlockEngine, BlockOptions, compile_blocks
from .serving.cached_steps import (
    ChunkServer, chunk_server, example_frames, installed_chunk_server, takes_feature_cache,
)
from .serving.compiled_forward import CompiledForward, CompileOptions
from .machine.environment import dtype_from_name, dtype_name
from .store.library import GraphLibrary
from .store.registry import FALLBACK, GraphRegistry, default_registry
from .keys.shapes import DEFAULT_RANGE, ShapeRange
from .store.graph_store import GraphRefused, GraphStore, StoreError
from .keys.structure import module_device, module_dtype

log = logging.getLogger("keepfast")

TARGETS = ("unet", "transformer", "transformer_2", "vae.decoder", "vae.encoder")
BLOCK_TARGETS = ("transformer", "transformer_2")  # served block by block (compiler.blocks)
_ATTRIBUTE = "_keepfast"


@dataclass
class PipeReport:
    saved: List[str] = field(default_factory=list)
    loaded: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"saved {s}" for s in self.saved] + [f"loaded {s}" for s in self.loaded]
        return "\n".join(lines + [f"problem: {p}" for p in self.problems]) or "nothing to do"


def _resolve(pipe, target: str) -> Optional[torch.nn.Module]:
    obj = pipe
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.nn.Module) else None


def compiled_parts(pipe) -> Dict[str, CompiledForward | BlockEngine]:
    return dict(getattr(pipe, _ATTRIBUTE, {}))


def compile_module(module: torch.nn.Module, options: Optional[CompileOptions] = None,
                   registry: Optional[GraphRegistry] = None) -> CompiledForward:
    """Route `module`'s calls through a CompiledForward (undo with `uncompile_module`).

    Called again on a compiled module (load_pipe after compile_pipe), it
    changes the options only: the binder, and so every key, stays the same.
    """
    existing = module.__dict__.get("forward")
    if isinstance(existing, CompiledForward):
        existing.options = options or existing.options
        return existing
    compiled = CompiledForward(module, options or CompileOptions(), registry)
    module.forward = compiled
    return compiled


def uncompile_module(module: torch.nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), (CompiledForward, ChunkServer)):
        del module.forward


def compile_pipe(
    pipe,
    *,
    backend: str = DEFAULT_BACKEND,
    shape_range: ShapeRange = DEFAULT_RANGE,
    ignores: Iterable[str] = (),
    graphs_dir: Optional[str | Path] = None,
    autosave: bool = False,
    compile_on_miss: bool = True,
    registry: Optional[GraphRegistry] = None,
    verify: bool = True,
    background: bool = False,
):
    """Compile the pipeline's UNet or transformer(s) and VAE (decoder and encoder) in place; returns `pipe`.

    A `transformer` / `transformer_2` (Flux, SD3, Wan, Qwen-Image) is served
    block by block (`compiler.blocks`): one graph per distinct block structure.
    `verify`: the first-use check (compiler/serving/verify.py) compares each graph's
    first call with new input shapes against eager; on by default.
    `background`: the UNet's and VAE's graphs build in a child process while
    the pipeline runs eager, and serve from the call after they land
    (docs/background.md); a transformer's blocks likewise, one build per block structure.
    """
    ignores = set(ignores)
    unknown = ignores - set(TARGETS)
    if unknown:
        raise ValueError(f"unknown targets to ignore: {sorted(unknown)}; targets are {TARGETS}")
    store = GraphStore(graphs_dir) if graphs_dir is not None else None
    parts = compiled_parts(pipe)
    for target in TARGETS:
        module = _resolve(pipe, target)
        if target in ignores or module is None:
            continue
        if target in BLOCK_TARGETS:
            engine = compile_blocks(module, BlockOptions(
                backend=backend, shape_range=shape_range, store=store, autosave=autosave,
                compile_on_miss=compile_on_miss, label=target, verify=verify, background=background),
                registry or default_registry())
            if engine is None:
                (registry or default_registry()).record(
                    FALLBACK, "-", f"{target}: {type(module).__name__} is not a transformer family KeepFast "
                    "knows (Flux, SD3, Wan, Qwen-Image); running eager")
            else:
                parts[target] = engine
            continue
        options = CompileOptions(
            backend=backend, shape_range=target_range(pipe, target, shape_range), store=store, autosave=autosave,
            compile_on_miss=compile_on_miss, label=target, verify=verify,
            samples_independent=target.startswith("vae."),  # a VAE decodes and encodes each image alone
            background=background,
        )
        if takes_feature_cache(module):  # a video VAE (AutoencoderKLWan): served chunk by chunk
            parts[target] = chunk_server(module, options, registry or default_registry(), always=True).forward
            continue
        parts[target] = compile_module(module, options, registry or default_registry())
    setattr(pipe, _ATTRIBUTE, parts)
    return pipe


def example_calls(pipe, target: str, shape_range: ShapeRange, batch: int = 2,
                  sequence: int = 77) -> List[Tuple[tuple, dict]]:
    """Calls shaped as the pipeline makes them, inside the declared range."""
    module = _resolve(pipe, target)
    dtype, device = module_dtype(module), module_device(module)
    batch = min(max(batch, shape_range.batch[0]), shape_range.batch[1])
    low, high = shape_range.spatial
    side = min(max(64, low), high)
    side = max(low, side - side % 8) if side >= 8 else side
    sequence = min(max(sequence, shape_range.sequence[0]), shape_range.sequence[1])
    options = dict(dtype=dtype, device=device)
    if target == "unet":
        config = module.config
        sample = torch.randn(batch, config.in_channels, side, side, **options)
        kwargs = {
            "encoder_hidden_states": torch.randn(batch, sequence, config.cross_attention_dim, **options),
            "return_dict": False,
        }
        if config.addition_embed_type == "text_time":
            time_dim = config.addition_time_embed_dim
            text_dim = config.projection_class_embeddings_input_dim - 6 * time_dim
            kwargs["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch, text_dim, **options),
                "time_ids": torch.randn(batch, 6, **options),
            }
        timestep = torch.tensor(500.0, device=device)
        return [((sample, timestep), kwargs)]
    vae = pipe.vae
    server = installed_chunk_server(module)
    if server is not None:  # one video: a batch of several is served by its graphs one video at a time
        return _chunk_calls(vae, target, server, shape_range.batch[0], side, options)
    if target == "vae.decoder":
        channels = vae.config.latent_channels
        return [((torch.randn(1, channels, side, side, **options),), {})]
    if target == "vae.encoder":
        scale = vae_scale(vae)
        return [((torch.randn(1, vae.config.in_channels, side * scale, side * scale, **options),), {})]
    raise ValueError(f"unknown target {target!r}")


def vae_scale(vae) -> int:
    """Image pixels per latent pixel."""
    ratio = getattr(vae, "spatial_compression_ratio", None)
    return int(ratio) if isinstance(ratio, int) and ratio > 0 else 2 ** (len(vae.config.block_out_channels) - 1)


def target_range(pipe, target: str, declared: ShapeRange) -> ShapeRange:
    """The range a target's graphs serve: the declared one (latent pixels), in image pixels for the encoder."""
    if target != "vae.encoder":
        return declared
    scale = vae_scale(pipe.vae)
    low, high = declared.spatial
    return replace(declared, spatial=(low * scale, high * scale))


def declared_range(pipe, target: str, served: ShapeRange) -> ShapeRange:
    """The declared range (latent pixels) a target's served range came from (`target_range` undone)."""
    if target != "vae.encoder":
        return served
    scale = vae_scale(pipe.vae)
    low, high = served.spatial
    return replace(served, spatial=(max(1, low // scale), max(1, high // scale)))


def _chunk_calls(vae, target: str, server: ChunkServer, batch: int, side: int, options: dict):
    """The chunk calls of one example video (every cache state: first chunk, second, later), run eagerly."""
    with torch.no_grad(), server.capturing() as found:
        if target == "vae.decoder":
            vae.decode(torch.randn(batch, vae.config.z_dim, example_frames(True), side, side, **options))
        else:
            scale = vae_scale(vae)
            vae.encode(torch.randn(batch, 3, example_frames(False), side * scale, side * scale, **options))
    return found


def run_dtypes(pipe, target: str, module: torch.nn.Module) -> List[torch.dtype]:
    """The dtypes the pipeline will run `target` in, its own first: what save_pipe builds and load_pipe loads.

    A denoiser runs in its own dtype. A VAE follows diffusers' pipelines:
    latents reach the decoder in the denoiser's dtype (img2img casts the VAE
    to it after encoding), except that a `force_upcast` VAE decodes float16
    latents in float32; the encoder runs in float32 when `force_upcast` is
    set, else in the pipeline's dtype.
    """
    own = module_dtype(module)
    vae = getattr(pipe, "vae", None)
    if not target.startswith("vae.") or vae is None:
        return [own]
    denoiser = _resolve(pipe, "unet") or _resolve(pipe, "transformer")
    compute = module_dtype(denoiser) if denoiser is not None else own
    upcast = bool(getattr(vae.config, "force_upcast", False))
    if target == "vae.decoder":
        runs = torch.float32 if upcast and torch.float16 in (own, compute) else compute
    else:
        runs = torch.float32 if upcast else compute
    return list(dict.fromkeys([own, runs]))


def save_pipe(
    pipe,
    graphs_dir: str | Path,
    *,
    shape_range: Optional[ShapeRange] = None,
    backend: str = DEFAULT_BACKEND,
    ignores: Iterable[str] = (),
    registry: Optional[GraphRegistry] = None,
) -> PipeReport:
    """Compile (if needed) for the declared range and write every graph into `graphs_dir`."""
    parts = compiled_parts(pipe)
    if not parts:
        compile_pipe(pipe, backend=backend, shape_range=shape_range or DEFAULT_RANGE,
                     ignores=ignores, graphs_dir=graphs_dir, registry=registry)
        parts = compiled_parts(pipe)
    store = GraphStore(graphs_dir)
    report = PipeReport()
    for target, compiled in parts.items():
        if target in set(ignores):
            continue
        compiled.options = compiled.options.with_(
            store=store, **({"shape_range": target_range(pipe, target, shape_range)} if shape_range else {}))
        if isinstance(compiled, BlockEngine):
            saved, problems = compiled.save(store)
            report.saved += [f"{target}: {line}" for line in saved]
            report.problems += [f"{target}: {line}" for line in problems]
            continue
        for dtype in run_dtypes(pipe, target, compiled.module):
            report.saved += _save_target(pipe, target, compiled, store, dtype, report)
    return report


def _save_target(pipe, target, compiled: CompiledForward, store: GraphStore, dtype, report) -> List[str]:
    module = compiled.module
    original = module_dtype(module)
    if dtype != original:
        module.to(dtype)
    try:
        calls = example_calls(pipe, target, declared_range(pipe, target, compiled.options.shape_range))
        with torch.no_grad():
            results = compiled.warmup(calls)
        problems = [result.describe() for result in results if result.eager]
        if problems:
            report.problems.append(f"{target}: " + "; ".join(problems))
        library = GraphLibrary(store, compiled.registry)
        saved = []
        for args, kwargs in calls:
            call = compiled.flatten(args, kwargs)
            family = compiled.family_for(call)
            for graph in compiled.registry.family_graphs(family):
                if not graph.persistent:
                    reason = get_backend(family.backend).persist_unavailable_reason()
                    report.problems.append(f"{target}: {reason or 'its graphs cannot be saved'}")
                    continue
                try:
                    stored = library.save(graph, call.signature.to_json(), target)
                except StoreError as error:
                    report.problems.append(f"{target}: {error}")
                    continue
                saved.append(f"{target} ({family.dtype}) -> {stored.package_path}")
        return saved
    finally:
        if dtype != original:
            module.to(original)


def load_pipe(
    pipe,
    graphs_dir: str | Path,
    *,
    compile_on_miss: bool = True,
    shape_range: ShapeRange = DEFAULT_RANGE,
    ignores: Iterable[str] = (),
    registry: Optional[GraphRegistry] = None,
    verify: bool = True,
) -> PipeReport:
    """Serve the pipeline from the graphs in `graphs_dir` (loaded now, verified and trusted)."""
    report = PipeReport()
    folder = Path(graphs_dir)
    if not folder.is_dir():
        report.problems.append(f"graphs folder {folder} does not exist; "
                               + ("graphs will be compiled" if compile_on_miss else "running eager"))
    compile_pipe(pipe, backend=DEFAULT_BACKEND, shape_range=shape_range, ignores=ignores,
                 graphs_dir=graphs_dir, compile_on_miss=compile_on_miss, registry=registry, verify=verify)
    stored_graphs = GraphStore(graphs_dir).graphs() if folder.is_dir() else []
    for target, compiled in compiled_parts(pipe).items():
        if isinstance(compiled, BlockEngine):
            loaded, problems = compiled.load()
            report.loaded += [f"{target}: {line}" for line in loaded]
            report.problems += [f"{target}: {line}" for line in problems]
            continue
        library = compiled.library
        # A VAE may run in other dtypes than its own (an upcast decode, img2img's cast to the pipeline's dtype).
        dtypes = {dtype_name(dtype) for dtype in run_dtypes(pipe, target, compiled.module)}
        structure = compiled.structure()
        for stored in stored_graphs:
            family = stored.manifest.key.family
            if family.structure != structure:
                continue
            if library.in_memory(stored.manifest.graph_id) is not None:
                report.loaded.append(f"{target}: {stored.name} (already in memory)")
                continue
            dtype = dtype_from_name(family.dtype) if family.dtype in dtypes else None
            try:
                library.load(stored, compiled.expected_family(family.signature, dtype), target)
            except GraphRefused as error:
                report.problems.append(f"{target}: {error}")
                continue
            report.loaded.append(f"{target}: {stored.name}")
    return report
