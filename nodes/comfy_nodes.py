"""The V3 node schemas. Imported only from the pack's comfy_entrypoint (needs ComfyUI)."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import ComfyExtension, io

from ..compiler import DEFAULT_BACKEND, backend_names
from .sizes import parse_batch_sizes, parse_resolutions
from . import graph_loading, operations, reports, runtime
from .reports import Report
from .unet import Settings

CATEGORY = "KeepFast"


def _range_inputs():
    return [
        io.Int.Input("min_resolution", default=64, min=64, max=16384, step=8,
                     tooltip="Smallest image side (pixels) the graphs serve."),
        io.Int.Input("max_resolution", default=2048, min=64, max=16384, step=8,
                     tooltip="Largest image side (pixels) the graphs serve; larger images run uncompiled."),
        io.Int.Input("max_batch_size", default=4, min=1, max=64,
                     tooltip="Most images per batch the graphs serve."),
        io.Boolean.Input("compile", default=True,
                         tooltip="Compile when no graph in memory or in models/graphs serves a call "
                                 "(the first one takes a while); off: such calls run uncompiled."),
    ]


def _verify_input():
    # optional: API-format prompts written before this input existed leave it out (the default, on, serves them)
    return io.Boolean.Input("verify", default=True, optional=True,
                            tooltip="Check each graph the first time it serves a new size against the model run "
                                    "uncompiled (one extra uncompiled step per new size); a graph that disagrees "
                                    "is not used for that size, and the difference is shown.")


BUILD_BEFORE, BUILD_BACKGROUND = "before the first image", "in the background"


def _build_input():
    # optional: API-format prompts written before this input existed leave it out (the default serves them)
    return io.Combo.Input("build", options=[BUILD_BACKGROUND, BUILD_BEFORE], default=BUILD_BACKGROUND, optional=True,
                          tooltip="When a graph must be compiled: in the background (the default: the first images "
                                  "run uncompiled while graphs build in a separate process, each serving from the "
                                  "step after it is ready), or before the first image (it waits for the compile).")


def _backend_input():
    choices = runtime.backend_choices()
    # optional: API-format prompts written before this input existed leave it out (the default serves them)
    return io.Combo.Input("backend", options=choices, default=choices[0], tooltip=runtime.backend_tooltip(),
                          optional=True)


def _validate_backend(backend: str) -> bool | str:
    """Any registered backend passes, offered here or not: a workflow from a machine with OneFlow still runs
    here, its model passing through uncompiled with the reason (ComfyUI's own check would stop the workflow).
    The input is optional (see _backend_input), so `backend` may not be passed at all."""
    if backend in backend_names():
        return True
    return f"unknown backend {backend!r}; choose one of {', '.join(runtime.backend_choices())}"


def _cuda_graphs_input():
    # optional: API-format prompts written before this input existed leave it out (off, as before)
    return io.Boolean.Input("cuda_graphs", default=False, optional=True,
                            tooltip="Replay each step as a CUDA graph once a size repeats (NVIDIA GPUs; whole-model "
                                    "graphs: SD1.5, SDXL): fewer kernel launches a step, at the cost of the memory "
                                    "of up to two captured sizes. Transformers served by blocks ignore it.")


def _settings(min_resolution, max_resolution, max_batch_size, compile, backend, autosave=False,
              verify=True, build=BUILD_BACKGROUND, cuda_graphs=False) -> Settings:
    if build not in (BUILD_BACKGROUND, BUILD_BEFORE):
        raise ValueError(f"build must be {BUILD_BACKGROUND!r} or {BUILD_BEFORE!r}, not {build!r}")
    low, high = sorted((int(min_resolution), int(max_resolution)))
    return Settings(min_size=low, max_size=high, max_batch=int(max_batch_size), compile_on_miss=bool(compile),
                    autosave=bool(autosave), backend=str(backend), verify=bool(verify),
                    background=build == BUILD_BACKGROUND, cuda_graphs=bool(cuda_graphs))


def _ui(text: str) -> dict:
    return {"text": [text]}


def _graph_tool_schema(node_id: str, display_name: str, description: str, inputs: list) -> io.Schema:
    """Save, Load and Warmup Graph: MODEL and/or VAE in and out (served by graphs), plus a report."""
    return io.Schema(
        node_id=node_id, display_name=display_name, category=CATEGORY, description=description,
        inputs=[io.Model.Input("model", optional=True), io.Vae.Input("vae", optional=True)] + inputs,
        outputs=[io.Model.Output(), io.Vae.Output(), io.String.Output(display_name="report")],
        is_output_node=True,
    )


def _reported(model_out, vae_out, report: Report) -> io.NodeOutput:
    text = report.text()
    return io.NodeOutput(model_out, vae_out, text, ui=_ui(text))


class KeepFastModelSpeedup(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KeepFastModelSpeedup",
            display_name="KeepFast Model Speedup",
            category=CATEGORY,
            description="Serve the diffusion model from compiled graphs: the graphs build in the background while "
                        "the first images run uncompiled (or load from models/graphs); every resolution, batch "
                        "size and prompt length in the range runs compiled once they are in. LoRA and ControlNet "
                        "keep working; patches that need Python run uncompiled, with the reason shown.",
            inputs=[io.Model.Input("model")] + _range_inputs() + [
                io.Boolean.Input("save_compiled", default=False,
                                 tooltip="Write each graph compiled here into models/graphs right away."),
                _backend_input(),
                io.Int.Input("max_frames", default=81, min=1, max=1025, optional=True,
                             tooltip="Video models (Wan, HunyuanVideo, LTXV): most video frames the graphs "
                                     "serve; frames are their own axis, never height or width. Image models "
                                     "ignore it."),
                _verify_input(),
                _build_input(),
                _cuda_graphs_input(),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def validate_inputs(cls, backend: str = DEFAULT_BACKEND) -> bool | str:
        return _validate_backend(backend)

    @classmethod
    def execute(cls, model, min_resolution, max_resolution, max_batch_size, compile, save_compiled,
                backend=DEFAULT_BACKEND, max_frames=81, verify=True, build=BUILD_BACKGROUND,
                cuda_graphs=False) -> io.NodeOutput:
        runtime.setup()
        report = Report("KeepFast Model Speedup")
        settings = _settings(min_resolution, max_resolution, max_batch_size, compile, backend, save_compiled,
                             verify, build, cuda_graphs)
        out, _ = operations.model_speedup(model, dataclasses.replace(settings, max_frames=int(max_frames)), report)
        return io.NodeOutput(out, ui=_ui(report.text()))


class KeepFastVAESpeedup(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KeepFastVAESpeedup",
            display_name="KeepFast VAE Speedup",
            category=CATEGORY,
            description="Serve VAE decode and encode (tiled decode included) from compiled graphs. The input "
                        "VAE is not changed.",
            inputs=[io.Vae.Input("vae")] + _range_inputs() + [
                _backend_input(), _verify_input(),
                io.Int.Input("max_frames", default=81, min=1, max=1025, optional=True,
                             tooltip="Video VAEs served whole (LTX-Video's): most video frames the graphs "
                                     "serve, frames their own axis. Image VAEs and Wan's (a frame at a time) "
                                     "ignore it."),
                _build_input(),
            ],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def validate_inputs(cls, backend: str = DEFAULT_BACKEND) -> bool | str:
        return _validate_backend(backend)

    @classmethod
    def execute(cls, vae, min_resolution, max_resolution, max_batch_size, compile,
                backend=DEFAULT_BACKEND, verify=True, max_frames=81, build=BUILD_BACKGROUND) -> io.NodeOutput:
        runtime.setup()
        report = Report("KeepFast VAE Speedup")
        settings = _settings(min_resolution, max_resolution, max_batch_size, compile, backend, verify=verify,
                             build=build)
        out, _ = operations.vae_speedup(vae, dataclasses.replace(settings, max_frames=int(max_frames)), report)
        return io.NodeOutput(out, ui=_ui(report.text()))


class KeepFastSaveGraph(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _graph_tool_schema(
            "KeepFastSaveGraph", "KeepFast Save Graph",
            "Compile now (no image needed) and write the graphs of the model and/or VAE into models/graphs, "
            "listed under NAME for Load Graph. Graphs hold no weights.",
            [io.String.Input("name", default="keepfast", tooltip="The graph set's name in models/graphs.")],
        )

    @classmethod
    def execute(cls, name, model=None, vae=None) -> io.NodeOutput:
        runtime.setup()
        report = Report(f"KeepFast Save Graph '{name}'")
        if model is None and vae is None:
            report.add("connect a MODEL and/or a VAE")
        model_out, vae_out = operations.save(model, vae, name, report)
        return _reported(model_out, vae_out, report)


class KeepFastLoadGraph(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _graph_tool_schema(
            "KeepFastLoadGraph", "KeepFast Load Graph",
            "Serve the model and/or VAE from graphs in models/graphs, loaded now: a graph set written by Save "
            "Graph, one graph, or every stored graph that fits. A graph of another architecture, dtype, torch "
            "version or device is refused with the reason; the workflow goes on (compiling, or uncompiled).",
            [
                io.Combo.Input("graph", options=graph_loading.graph_choices(), default=graph_loading.AUTO),
                io.Boolean.Input("compile_if_missing", default=True,
                                 tooltip="Compile calls no loaded graph serves; off: they run uncompiled."),
                io.Boolean.Input("trust_graph", default=False,
                                 tooltip="Add the chosen graphs to this machine's trust list (graphs are native "
                                         "code; ones built elsewhere load only when trusted)."),
                # optional: API-format prompts written before this input existed leave it out
                io.String.Input("library", default="", optional=True,
                                tooltip="A remote graph library to pull this model's graphs from first (only those "
                                        "that fit this machine; signed by a builder key you trust): "
                                        "s3://bucket/prefix, hf://org/repo or a shared folder. Empty: "
                                        "$KEEPFAST_REMOTE_LIBRARY, if set (docs/fleet.md)."),
            ],
        )

    @classmethod
    def execute(cls, graph, compile_if_missing, trust_graph, model=None, vae=None, library="") -> io.NodeOutput:
        runtime.setup()
        report = Report(f"KeepFast Load Graph '{graph}'")
        model_out, vae_out = graph_loading.load(model, vae, graph, compile_if_missing, trust_graph, report,
                                             library=library)
        return _reported(model_out, vae_out, report)


class KeepFastWarmupGraphs(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return _graph_tool_schema(
            "KeepFastWarmupGraphs", "KeepFast Warmup Graphs",
            "Make sure graphs serve these resolutions and batch sizes before the first image (compiling or "
            "loading now), so no image waits for a compile.",
            [
                io.String.Input("resolutions", default="512x512, 768x768",
                                tooltip="WIDTHxHEIGHT, comma-separated."),
                io.String.Input("batch_sizes", default="1", tooltip="Images per batch, comma-separated."),
                io.Boolean.Input("vae_encode", default=False,
                                 tooltip="Also make VAE Encode graphs (img2img, inpainting); decode is always "
                                         "included."),
            ],
        )

    @classmethod
    def validate_inputs(cls, resolutions: str, batch_sizes: str) -> bool | str:
        try:
            if not parse_resolutions(resolutions):
                return "give at least one resolution, e.g. 512x512"
            if not parse_batch_sizes(batch_sizes):
                return "give at least one batch size, e.g. 1"
        except ValueError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, resolutions, batch_sizes, vae_encode, model=None, vae=None) -> io.NodeOutput:
        runtime.setup()
        sizes, batches = parse_resolutions(resolutions), parse_batch_sizes(batch_sizes)
        report = Report("KeepFast Warmup Graphs")
        ops = ("decode", "encode") if vae_encode else ("decode",)
        model_out, vae_out = operations.warm(model, vae, sizes, batches, report, vae_ops=ops)
        return _reported(model_out, vae_out, report)


class KeepFastGraphStats(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="KeepFastGraphStats",
            display_name="KeepFast Graph Stats",
            category=CATEGORY,
            description="What KeepFast did in this ComfyUI process: graphs in memory, hits, compiles and loads "
                        "with their reasons and times, calls that ran uncompiled and why. Connect anything to "
                        "'after' to read the stats once that has run.",
            inputs=[io.AnyType.Input("after", optional=True)],
            outputs=[io.String.Output(display_name="stats")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # always run: the stats change without the inputs changing

    @classmethod
    def execute(cls, after=None) -> io.NodeOutput:
        runtime.setup()
        text = reports.stats_text()
        return io.NodeOutput(text, ui=_ui(text))


NODES = [KeepFastModelSpeedup, KeepFastVAESpeedup, KeepFastSaveGraph, KeepFastLoadGraph, KeepFastWarmupGraphs,
         KeepFastGraphStats]


class KeepFastExtension(ComfyExtension):
    async def get_node_list(self):
        return list(NODES)
