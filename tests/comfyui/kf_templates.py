"""ComfyUI's official templates as prompts the template tests can run on this CPU.

A template is fetched from the server as the page's template browser fetches it
(`GET /templates/<name>.json`, the comfyui-workflow-templates packages), its subgraphs
expanded and its bypassed branches dropped as the page does when it queues, then
converted to the API format with `kf_support.ui_to_api`. What a test changes, and only
that:
- loaders whose real files cannot run here are swapped for the test-only nodes of
  `template_nodes/` (a tiny model of the template's family, a text encoder giving that
  family's conditioning); VAELoader stays ComfyUI's, reading a small file written under the
  template's own file name;
- sizes, lengths and steps are cut to fit this CPU, seeds fixed (a node sizing an input image for its model,
  Flux Kontext's, becomes ComfyUI's ImageScale at the test's size);
- KeepFast Model Speedup goes right after the model loader and KeepFast VAE Speedup right
  after the VAE loader, as a user adds them; a SaveImage on each decode keeps the frames
  as lossless PNGs to compare.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

SUBGRAPH_INPUT = -10   # the subgraph's input node in its own links
SUBGRAPH_OUTPUT = -20  # the subgraph's output node
BYPASSED_MODES = (2, 4)  # muted, bypassed

MODEL_SOURCES = {"UNETLoader": 0, "CheckpointLoaderSimple": 0, "KeepFastTestTinyModel": 0, "KeepFastTestCheckpoint": 0}
VAE_SOURCES = {"VAELoader": 0, "CheckpointLoaderSimple": 2, "KeepFastTestCheckpoint": 2}
LATENT_NODES = ("EmptyLatentImage", "EmptySD3LatentImage", "EmptyHunyuanLatentVideo", "EmptyLTXVLatentVideo",
                "Wan22ImageToVideoLatent", "WanImageToVideo", "EmptyFlux2LatentImage")
# Nodes that size an input image to a model's preferred resolutions (Flux Kontext's: about a megapixel, too large for
# this CPU): made ComfyUI's ImageScale at the test's size, so the sampled latent (the image encoded) has that size.
IMAGE_SIZERS = ("FluxKontextImageScale",)
STEP_NODES = ("KSampler", "BasicScheduler", "LTXVScheduler", "Flux2Scheduler")
SEED_INPUTS = ("seed", "noise_seed")
DECODERS = ("VAEDecode", "VAEDecodeTiled")


# -- subgraphs -----------------------------------------------------------------------

def _links(workflow: dict) -> Dict[Any, tuple]:
    out = {}
    for link in workflow.get("links", []) or []:
        if isinstance(link, dict):
            out[link["id"]] = (link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"])
        else:
            out[link[0]] = (link[1], link[2], link[3], link[4])
    return out


def flatten(workflow: dict) -> dict:
    """The workflow with every subgraph instance replaced by its nodes (ids "<instance>:<inner>").

    A link from a subgraph input leads to what the instance's input is linked to, or, where the input is a
    promoted widget, to the instance's widget value (kept on the inner node's input as "value"); a link
    from an instance's output leads to what the subgraph's output is linked to inside. Nested subgraphs
    are expanded from the inside out.
    """
    definitions = {s["id"]: s for s in (workflow.get("definitions") or {}).get("subgraphs", [])}
    nodes, links = _expand(workflow["nodes"], _links(workflow), definitions, prefix="")
    flat = {k: v for k, v in workflow.items() if k not in ("nodes", "links", "definitions")}
    flat["nodes"] = nodes
    flat["links"] = [[link_id, *ends] for link_id, ends in links.items()]
    return flat


def _expand(nodes: List[dict], links: Dict[Any, tuple], definitions: dict, prefix: str):
    """(nodes, links) of one graph level with ids prefixed and subgraph instances expanded."""
    def pid(node_id):
        return f"{prefix}{node_id}"

    out_nodes: List[dict] = []
    out_links: Dict[Any, tuple] = {pid(k): (pid(o), os_, pid(t), ts) for k, (o, os_, t, ts) in links.items()}
    # outputs of instances: (instance id, slot) -> (inner origin, inner slot) once expanded
    instance_outputs: Dict[tuple, Any] = {}
    for node in nodes:
        node = copy.deepcopy(node)
        node["id"] = pid(node["id"])
        for entry in node.get("inputs", []) or []:
            if entry.get("link") is not None:
                entry["link"] = pid(entry["link"])
        definition = definitions.get(node["type"])
        if definition is None:
            out_nodes.append(node)
            continue
        if node.get("mode", 0) in BYPASSED_MODES:
            node["type"] = "__bypassed_subgraph__"
            out_nodes.append(node)
            continue
        inner_prefix = f"{node['id']}:"
        inner_nodes, inner_links = _expand(definition["nodes"], _links(definition), definitions, inner_prefix)
        # the instance's inputs: linked ones by name, the rest promoted widgets with values in proxy order
        linked = {entry["name"]: entry["link"] for entry in node.get("inputs", []) or []
                  if entry.get("link") is not None}
        proxies = (node.get("properties") or {}).get("proxyWidgets") or []
        values = list(node.get("widgets_values") or [])
        promoted = {}
        for (owner, name), value in zip(proxies, values):
            if str(owner) == "-1":
                promoted[name] = value
        sources = {}
        for index, spec in enumerate(definition.get("inputs", [])):
            name = spec["name"]
            if name in linked:
                origin, slot, _, _ = out_links[linked[name]]
                sources[index] = ("link", origin, slot)
            elif name in promoted:
                sources[index] = ("value", promoted[name])
        by_id = {n["id"]: n for n in inner_nodes}
        for link_id, (origin, slot, target, target_slot) in list(inner_links.items()):
            if origin == f"{inner_prefix}{SUBGRAPH_INPUT}":
                source = sources.get(slot)
                del inner_links[link_id]
                target_node = by_id.get(target)
                if target_node is None:
                    continue
                entry = next(e for e in target_node["inputs"] if e.get("link") == link_id)
                if source is None:
                    entry["link"] = None
                elif source[0] == "link":
                    inner_links[link_id] = (source[1], source[2], target, target_slot)
                else:
                    entry["link"] = None
                    entry["value"] = source[1]
        for index, spec in enumerate(definition.get("outputs", [])):
            for link_id in spec.get("linkIds", []) or []:
                key = f"{inner_prefix}{link_id}"
                if key in inner_links:
                    origin, slot, _, _ = inner_links.pop(key)
                    instance_outputs[(node["id"], index)] = (origin, slot)
        out_nodes.extend(inner_nodes)
        out_links.update(inner_links)
        # the links into the instance now lead to the inner nodes that read its inputs (above)
        for link_id in [k for k, ends in out_links.items() if ends[2] == node["id"]]:
            del out_links[link_id]
    for link_id, (origin, slot, target, target_slot) in list(out_links.items()):
        if (origin, slot) in instance_outputs:
            out_links[link_id] = (*instance_outputs[(origin, slot)], target, target_slot)
    return out_nodes, out_links


def drop_bypassed(workflow: dict) -> dict:
    """Drop muted and bypassed nodes that feed only other dropped nodes (a template's optional branch).

    A bypassed node that feeds a node that runs passes through an input of its output's type, as the page
    does: not converted here, so it is refused rather than run differently from the page. One with no such
    input (a bypassed LoadImage: Flux Kontext's second image) passes nothing, and the page queues the
    consumer's input unset (ComfyUI refuses the prompt where that input is required); so does this.
    """
    workflow = copy.deepcopy(workflow)
    links = _links(workflow)
    by_id = {n["id"]: n for n in workflow["nodes"]}
    dropped = {n["id"] for n in workflow["nodes"]
               if n.get("mode", 0) in BYPASSED_MODES or n["type"] == "__bypassed_subgraph__"}
    for link_id, (origin, slot, target, _) in links.items():
        if origin in dropped and target not in dropped and _passes_through(by_id[origin], slot):
            raise ValueError(f"bypassed node {origin} feeds node {target}, which runs: not converted")
    workflow["nodes"] = [n for n in workflow["nodes"] if n["id"] not in dropped]
    workflow["links"] = [[k, *v] for k, v in links.items() if v[0] not in dropped and v[2] not in dropped]
    for node in workflow["nodes"]:
        for entry in node.get("inputs", []) or []:
            if entry.get("link") is not None and links[entry["link"]][0] in dropped:
                entry["link"] = None
    return workflow


def template_prompt(server, name: str) -> dict:
    """The template as the page queues it, in API format."""
    import kf_support as S

    response = server.get(f"/templates/{name}.json")
    response.raise_for_status()
    return S.ui_to_api(drop_bypassed(flatten(response.json())), server.object_info())


def _passes_through(node: dict, slot: int) -> bool:
    """Whether bypassed `node` gives its output `slot` a value: a linked input of that output's type."""
    outputs = node.get("outputs") or []
    kind = outputs[slot].get("type") if slot < len(outputs) else None
    return any(entry.get("link") is not None and entry.get("type") == kind for entry in node.get("inputs") or [])


# -- what a test changes ---------------------------------------------------------------

def use_fixtures(prompt: dict, family: Optional[str], vae_name: Optional[str] = None) -> dict:
    """Swap the loaders that cannot run here for template_nodes' tiny ones (family None: keep them all)."""
    if family is None:
        return prompt
    for node in prompt.values():
        kind = node["class_type"]
        if kind == "UNETLoader":
            node.update(class_type="KeepFastTestTinyModel", inputs={"family": family, "seed": 0})
        elif kind in ("CLIPLoader", "DualCLIPLoader", "TripleCLIPLoader", "QuadrupleCLIPLoader"):
            node.update(class_type="KeepFastTestTextEncoder", inputs={"family": family})
        elif kind == "CLIPVisionLoader":
            node.update(class_type="KeepFastTestCLIPVision", inputs={})
        elif kind == "CheckpointLoaderSimple":
            if vae_name is None:
                raise ValueError("a checkpoint template needs the VAE file the checkpoint would hold")
            node.update(class_type="KeepFastTestCheckpoint", inputs={"family": family, "vae_name": vae_name})
    return prompt


def _defaults(object_info: dict, class_type: str) -> dict:
    out = {}
    for section in ("required", "optional"):
        for name, spec in (object_info[class_type]["input"].get(section) or {}).items():
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if "default" in options:
                out[name] = options["default"]
            elif spec[0] == "COMBO" and options.get("options"):
                out[name] = options["options"][0]
    return out


def _insert_after(prompt: dict, sources: Dict[str, int], class_type: str, input_name: str, settings: dict,
                  object_info: dict, tag: str) -> List[str]:
    """Put a node of class_type after every source output; every consumer of that output reads the node's."""
    added = []
    for node_id, node in list(prompt.items()):
        slot = sources.get(node["class_type"])
        if slot is None:
            continue
        new_id = f"{tag}{node_id}"
        inputs = {k: v for k, v in _defaults(object_info, class_type).items() if not isinstance(v, list)}
        inputs.update(settings)
        inputs[input_name] = [node_id, slot]
        for other in prompt.values():
            for name, value in other["inputs"].items():
                if isinstance(value, list) and len(value) == 2 and value[0] == node_id and value[1] == slot:
                    other["inputs"][name] = [new_id, 0]
        prompt[new_id] = {"class_type": class_type, "inputs": inputs}
        added.append(new_id)
    return added


def add_speedups(prompt: dict, object_info: dict, model: dict, vae: Optional[dict]) -> dict:
    """KeepFast Model Speedup after each model loader, KeepFast VAE Speedup after each VAE loader."""
    assert _insert_after(prompt, MODEL_SOURCES, "KeepFastModelSpeedup", "model", model, object_info, "kfm"), \
        "no model loader in the template"
    if vae is not None:
        assert _insert_after(prompt, VAE_SOURCES, "KeepFastVAESpeedup", "vae", vae, object_info, "kfv"), \
            "no VAE loader in the template"
    return prompt


def shrink(prompt: dict, width: int, height: int, batch: int = 1, length: Optional[int] = None,
           steps: int = 2, seed: int = 42, text: Optional[str] = None) -> dict:
    """Sizes, video length, steps, seeds (and the positive prompt's text) set for a CPU run."""
    for node in prompt.values():
        kind, inputs = node["class_type"], node["inputs"]
        if kind in LATENT_NODES:
            inputs.update(width=width, height=height, batch_size=batch)
            if length is not None and "length" in inputs:
                inputs["length"] = length
        if kind in IMAGE_SIZERS:
            node.update(class_type="ImageScale", inputs={"image": inputs["image"], "upscale_method": "bilinear",
                                                         "width": width, "height": height, "crop": "disabled"})
        if kind in STEP_NODES and "steps" in inputs:
            inputs["steps"] = steps
        for name in SEED_INPUTS:
            if name in inputs and not isinstance(inputs[name], list):
                inputs[name] = seed
        if text is not None and kind in ("CLIPTextEncode", "PrimitiveStringMultiline") \
                and not isinstance(inputs.get("text", inputs.get("value")), list):
            key = "text" if "text" in inputs else "value"
            if inputs.get(key):  # the positive prompt (negatives are often empty)
                inputs[key] = text
    return prompt


def save_frames(prompt: dict, prefix: str) -> dict:
    """A SaveImage on every decode's IMAGE output (video frames too): lossless PNGs to compare."""
    for node_id in [i for i, n in prompt.items() if n["class_type"] in DECODERS]:
        prompt[f"frames{node_id}"] = {"class_type": "SaveImage",
                                      "inputs": {"images": [node_id, 0], "filename_prefix": f"{prefix}_{node_id}"}}
    for node in prompt.values():
        if node["class_type"] in ("SaveImage", "SaveVideo", "SaveAnimatedWEBP") and "filename_prefix" in node["inputs"]:
            if not str(node["inputs"]["filename_prefix"]).startswith(prefix):
                node["inputs"]["filename_prefix"] = f"{prefix}_out"
    return prompt


def insert_lora(prompt: dict, object_info: dict, lora_name: str, strength: float) -> List[str]:
    """A LoraLoaderModelOnly right after each model loader, before whatever took the loader's model (call it
    after add_speedups: the change then sits upstream of KeepFast Model Speedup, as a user's LoRA does)."""
    return _insert_after(prompt, MODEL_SOURCES, "LoraLoaderModelOnly", "model",
                         {"lora_name": lora_name, "strength_model": strength}, object_info, "lora")
