"""Test support for the ComfyUI integration tests: a headless ComfyUI server, models, workflows.

The server is ComfyUI's own `main.py` started as a subprocess on 127.0.0.1
with `--cpu`, a temporary `--base-directory` whose `custom_nodes/keepfast` is a
link to this repository, and a generated checkpoint. Nothing here imports
ComfyUI; models are built by `benchmarks/comfy/models.py` in ComfyUI's Python.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import urllib.error
import urllib.request

try:  # the server tests need these; the unit tests in this folder do not
    import numpy as np
    from PIL import Image
except ImportError:  # pragma: no cover
    np = Image = None

HERE = Path(__file__).resolve().parent
COMFY_MODELS = HERE.parents[1] / "benchmarks" / "comfy" / "models.py"
REPO = HERE.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.comfy_e2e import ATTENTION_FLAGS, picked_attention  # noqa: E402,F401  (imports no ComfyUI; picked_attention for the tests)
from kf_inprocess import BLOCKING_BUILD  # noqa: E402,F401  (the Speedup nodes' compile-before-the-first-image choice)

WORKFLOWS = REPO / "workflows"
COMFYUI_PATH = os.environ.get("COMFYUI_PATH", "")


def comfyui_python() -> str:
    """ComfyUI's own Python: COMFYUI_PYTHON, else a virtualenv in or beside the checkout, else this one."""
    if os.environ.get("COMFYUI_PYTHON"):
        return os.environ["COMFYUI_PYTHON"]
    if COMFYUI_PATH:
        root = Path(COMFYUI_PATH).resolve()
        for candidate in (root / "venv", root / ".venv", root.parent / (root.name + "-venv")):
            python = candidate / "bin" / "python"
            if python.exists():
                return str(python)
    return sys.executable


PYTHON = comfyui_python()
PACK_NAME = "keepfast"
CHECKPOINT = "v1-5-pruned-emaonly-fp16.safetensors"  # the name the bundled workflows use
OTHER_CHECKPOINT = "other-sd15.safetensors"
LORA = "example_lora.safetensors"
CONTROLNET = "example_controlnet.safetensors"
IMAGE = "example.png"

SKIP_REASON = ("COMFYUI_PATH is not set: the ComfyUI integration tests need a ComfyUI checkout "
               "(COMFYUI_PATH=/path/to/ComfyUI; its Python is taken from COMFYUI_PYTHON, else from a virtualenv "
               "at ComfyUI/venv, ComfyUI/.venv or ComfyUI-venv beside it)")


def run_script(script: str, base: Path, *args: str, timeout: int = 1800) -> dict:
    """Run one of the kf_*.py scripts in ComfyUI's Python (the pack, `base` as ComfyUI's base directory, then
    `args`) with its own trust file in `base`; its findings, the JSON it printed after "KEEPFAST-RESULT "."""
    import json
    import subprocess

    result = subprocess.run(
        [PYTHON, str(HERE / script), str(REPO), str(base), *args], cwd=COMFYUI_PATH, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "COMFYUI_PATH": COMFYUI_PATH, "KEEPFAST_TRUST_FILE": str(base / "trust.json")})
    lines = [line for line in result.stdout.splitlines() if line.startswith("KEEPFAST-RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(lines[-1][len("KEEPFAST-RESULT "):])


def run_family_script(script: str, tmp_path_factory, family: str) -> dict:
    """run_script for a kf script taking one family, in a new base directory with an empty graphs folder."""
    base = tmp_path_factory.mktemp(f"{Path(script).stem}-{family}")
    (base / "models" / "graphs").mkdir(parents=True)
    return run_script(script, base, family)


def model_calls_from_graphs(findings: dict, events: dict) -> int:
    """Diffusion model calls served by graphs in `events` (a kf script's counts, served_calls): whole-model graph
    calls, or block graph calls divided by the model's blocks (`findings["blocks"]`)."""
    return events["block_graph_calls"] // findings["blocks"] if findings["blocks"] else events["graph_calls"]


def comfyui_available() -> bool:
    return bool(COMFYUI_PATH) and (Path(COMFYUI_PATH) / "main.py").is_file() and np is not None


UI_ONLY_TYPES = {"Note", "MarkdownNote", "Reroute"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
UPLOAD_FLAGS = ("image_upload", "video_upload", "audio_upload", "animated_image_upload", "upload")


def write_model(base: Path, *args) -> None:
    """benchmarks/comfy/models.py's command line in ComfyUI's Python (what, path, options)."""
    subprocess.run([PYTHON, str(COMFY_MODELS), *map(str, args)], check=True,
                   env={**os.environ, "COMFYUI_PATH": COMFYUI_PATH}, cwd=str(base))


def build_models(base: Path) -> None:
    """Checkpoint, LoRA, ControlNet and input image where ComfyUI looks for them."""
    def run(*args):
        write_model(base, *args)

    checkpoint = base / "models" / "checkpoints" / CHECKPOINT
    run("checkpoint", checkpoint, "--seed", 0)
    run("lora", checkpoint, base / "models" / "loras" / LORA)
    run("controlnet", base / "models" / "controlnet" / CONTROLNET)
    run("image", base / "input" / IMAGE, "--size", 256)


def build_other_checkpoint(base: Path) -> None:
    subprocess.run([PYTHON, str(COMFY_MODELS), "checkpoint",
                    str(base / "models" / "checkpoints" / OTHER_CHECKPOINT), "--seed", "11"],
                   check=True, env={**os.environ, "COMFYUI_PATH": COMFYUI_PATH})


def make_base(base: Path) -> Path:
    for folder in ("models/checkpoints", "models/loras", "models/controlnet", "input", "output", "custom_nodes",
                   "user"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK_NAME
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return base


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromptFailed(AssertionError):
    pass


class Response:
    def __init__(self, status: int, body: bytes):
        self.status_code = status
        self.body = body

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self):
        return json.loads(self.body)

    def raise_for_status(self) -> None:
        if not self.ok:
            raise OSError(f"HTTP {self.status_code}: {self.text[:500]}")


class ComfyServer:
    """ComfyUI's main.py as a subprocess; `run(prompt)` posts to /prompt and waits in /history.

    `attention` is a key of ATTENTION_FLAGS ("default": no flag, ComfyUI picks); the suite's other
    tests run with pytorch attention, the one NVIDIA users get.
    """

    def __init__(self, base: Path, env: Dict[str, str], extra_args: Optional[List[str]] = None,
                 attention: str = "pytorch"):
        self.base = Path(base)
        self.env = env
        self.extra_args = extra_args or []
        self.attention_args = ATTENTION_FLAGS[attention]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: Optional[subprocess.Popen] = None
        self.starts = 0
        self._object_info: Optional[dict] = None

    @property
    def log_path(self) -> Path:
        return self.base / f"server-{self.starts}.log"

    def start(self, timeout: float = 300) -> None:
        self.starts += 1
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port), "--base-directory",
             str(self.base), *self.attention_args, *self.extra_args],
            cwd=COMFYUI_PATH, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        started = time.time()
        while time.time() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if self.get("/system_stats", timeout=2).ok:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"ComfyUI did not start in {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def get(self, path: str, timeout: float = 60) -> "Response":
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as reply:
                return Response(reply.status, reply.read())
        except urllib.error.HTTPError as error:
            return Response(error.code, error.read())

    def post(self, path: str, data: dict, timeout: float = 60) -> "Response":
        request = urllib.request.Request(self.url + path, data=json.dumps(data).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return Response(reply.status, reply.read())
        except urllib.error.HTTPError as error:
            return Response(error.code, error.read())

    def object_info(self) -> dict:
        if self._object_info is None:
            self._object_info = self.get("/object_info").json()
        return self._object_info

    def stats(self) -> dict:
        response = self.get("/keepfast/stats")
        response.raise_for_status()
        return response.json()

    def counts(self) -> dict:
        return self.stats()["counts"]

    def run(self, prompt: dict, timeout: float = 1200) -> dict:
        """Queue a prompt (API format) and return its history entry; raise with ComfyUI's error if it failed."""
        client = str(uuid.uuid4())
        response = self.post("/prompt", {"prompt": prompt, "client_id": client})
        if response.status_code != 200:
            raise PromptFailed(f"POST /prompt {response.status_code}: {response.text[:3000]}")
        prompt_id = response.json()["prompt_id"]
        started = time.time()
        while time.time() - started < timeout:
            history = self.get("/history/" + prompt_id).json()
            if prompt_id in history:
                entry = history[prompt_id]
                status = entry.get("status", {})
                if status.get("status_str") == "error":
                    raise PromptFailed("prompt failed: " + json.dumps(status.get("messages"))[:4000]
                                       + "\n" + self.log_tail(40))
                if status.get("completed"):
                    return entry
            if self.process is not None and self.process.poll() is not None:
                raise PromptFailed("ComfyUI exited while running the prompt:\n" + self.log_tail())
            time.sleep(0.3)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout} s")

    def images(self, entry: dict) -> list:
        out = []
        for node_id in sorted(entry["outputs"], key=_node_order):
            for image in entry["outputs"][node_id].get("images", []):
                if not image["filename"].lower().endswith((".png", ".jpg", ".jpeg", ".webp")):
                    continue  # SaveVideo lists its video file here too
                path = self.base / image.get("type", "output") / image.get("subfolder", "") / image["filename"]
                out.append(np.asarray(Image.open(path).convert("RGB")).astype(np.float32))
        return out

    def texts(self, entry: dict) -> Dict[str, str]:
        """The 'text' ui outputs (reports, stats, Preview as Text) by node id."""
        out = {}
        for node_id, data in entry["outputs"].items():
            if data.get("text"):
                out[node_id] = "\n".join(str(t) for t in data["text"])
        return out


def _node_order(node_id: str):
    return (0, int(node_id)) if str(node_id).isdigit() else (1, str(node_id))


# -- workflows ---------------------------------------------------------------------

def load_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def bundled_workflows() -> List[str]:
    return sorted(p.stem for p in WORKFLOWS.glob("*.json"))


def _input_spec(info: dict) -> List[tuple]:
    """(name, type, options) of a node's inputs in the order the page lays out widgets."""
    out = []
    for section in ("required", "optional"):
        for name, spec in (info.get("input", {}).get(section) or {}).items():
            kind = spec[0]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            out.append((name, kind, options))
    return out


def combo_options(object_info: dict, node: str, name: str) -> List[str]:
    """The choices of a node's combo input (V1 lists them in place, V3 as COMBO with "options")."""
    info = object_info[node]["input"]
    spec = (info.get("required") or {}).get(name) or (info.get("optional") or {})[name]
    if isinstance(spec[0], list):
        return list(spec[0])
    assert spec[0] == "COMBO", spec
    return list(spec[1]["options"])


def _is_widget(kind: Any, options: dict) -> bool:
    if options.get("forceInput") or options.get("rawLink"):
        return False
    return isinstance(kind, list) or kind in WIDGET_TYPES


def ui_to_api(workflow: dict, object_info: dict) -> dict:
    """A workflow as the page saves it -> the prompt /prompt takes (what the page's 'Queue' sends)."""
    links = {}
    for link in workflow.get("links", []):
        if isinstance(link, dict):
            links[link["id"]] = (link["origin_id"], link["origin_slot"])
        else:
            links[link[0]] = (link[1], link[2])
    prompt = {}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in UI_ONLY_TYPES or node.get("mode", 0) in (2, 4):
            if node.get("mode", 0) == 4:
                raise ValueError(f"node {node['id']} ({kind}) is bypassed; bypass is not converted")
            continue
        if kind not in object_info:
            raise KeyError(f"node type {kind} is not installed in this ComfyUI")
        linked = {}
        for entry in node.get("inputs", []) or []:
            if entry.get("link") is not None:
                origin, slot = links[entry["link"]]
                linked[entry["name"]] = [str(origin), slot]
            elif "value" in entry:  # a subgraph's promoted widget, expanded by kf_templates.flatten
                linked[entry["name"]] = entry["value"]
        values = list(node.get("widgets_values") or [])
        inputs: Dict[str, Any] = {}
        for name, spec_kind, options in _input_spec(object_info[kind]):
            if _is_widget(spec_kind, options):
                value = values.pop(0) if values else options.get("default")
                if options.get("control_after_generate") or (spec_kind == "INT" and name in ("seed", "noise_seed")):
                    if values:
                        values.pop(0)
                if any(options.get(flag) for flag in UPLOAD_FLAGS) and values:
                    values.pop(0)
                inputs[name] = linked.get(name, value)
            elif name in linked:
                inputs[name] = linked[name]
        prompt[str(node["id"])] = {"class_type": kind, "inputs": inputs}
    return prompt


def set_inputs(prompt: dict, class_type: str, **values) -> dict:
    """Set widget values on every node of a type (returns the prompt for chaining)."""
    found = False
    for node in prompt.values():
        if node["class_type"] == class_type:
            node["inputs"].update(values)
            found = True
    if not found:
        raise KeyError(f"no {class_type} node in the prompt")
    return prompt


def nodes_of(prompt: dict, class_type: str) -> List[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]


def without_speedup(prompt: dict) -> dict:
    """The same prompt with every KeepFast node bypassed (its MODEL/VAE input wired through)."""
    prompt = copy.deepcopy(prompt)
    passthrough = {}
    for node_id, node in list(prompt.items()):
        if not node["class_type"].startswith("KeepFast") or node["class_type"].startswith("KeepFastTest"):
            continue  # the tests' own tiny loaders (template_nodes) stay
        inputs = node["inputs"]
        if node["class_type"] in ("KeepFastModelSpeedup",):
            passthrough[(node_id, 0)] = inputs["model"]
        elif node["class_type"] == "KeepFastVAESpeedup":
            passthrough[(node_id, 0)] = inputs["vae"]
        elif node["class_type"] in ("KeepFastSaveGraph", "KeepFastLoadGraph", "KeepFastWarmupGraphs"):
            if "model" in inputs:
                passthrough[(node_id, 0)] = inputs["model"]
            if "vae" in inputs:
                passthrough[(node_id, 1)] = inputs["vae"]
        del prompt[node_id]
    for node_id, node in list(prompt.items()):
        for name, value in list(node["inputs"].items()):
            while isinstance(value, list) and len(value) == 2 and (value[0], value[1]) in passthrough:
                value = passthrough[(value[0], value[1])]
            if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and value[0] not in prompt:
                del node["inputs"][name]  # a link to a removed node (e.g. a report into Preview as Text)
                continue
            node["inputs"][name] = value
    # Nodes left without a required link (Preview as Text of a report) are dropped.
    for node_id, node in list(prompt.items()):
        if node["class_type"] in ("PreviewAny",) and "source" not in node["inputs"]:
            del prompt[node_id]
    return prompt


def image_difference(a, b) -> tuple:
    """(mean, max) absolute difference in 0-255 pixel levels."""
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = np.abs(a - b)
    return float(diff.mean()), float(diff.max())


# -- queued runs as the background-build server tests count and compare them -----------------------------

IMAGE_MEAN_TOLERANCE, IMAGE_MAX_TOLERANCE = 0.25, 4.0  # 0-255 pixel levels, as test_comfyui_server.py
_prefixes = {"n": 0}


def unique_prefix(prefix: str) -> str:
    """A SaveImage filename prefix not used before in this test process."""
    _prefixes["n"] += 1
    return f"{prefix}_{_prefixes['n']:03d}"


def run_counted(server, prompt: dict):
    """(history entry, images, change of each stats count) of one queued prompt."""
    before = server.counts()
    entry = server.run(prompt)
    after = server.counts()
    return entry, server.images(entry), {key: after[key] - before[key] for key in after}


def same_as_without_the_nodes(server, prompt: dict, images: list) -> None:
    """The images equal those of the same prompt with the KeepFast nodes taken out (pixel tolerance)."""
    plain = without_speedup(prompt)
    for node_id in nodes_of(plain, "SaveImage"):
        plain[node_id]["inputs"]["filename_prefix"] = unique_prefix("eager")
    reference = server.images(server.run(plain))
    assert len(images) == len(reference)
    for a, b in zip(images, reference):
        mean, largest = image_difference(a, b)
        assert mean < IMAGE_MEAN_TOLERANCE and largest <= IMAGE_MAX_TOLERANCE, (mean, largest)


def wait_for_builds(server, timeout: float = 1200) -> list:
    """Wait until the server's background builds are all done; its stats' `background` list then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        background = server.stats()["background"]
        if all(entry["done"] >= entry["total"] for entry in background):
            return background
        time.sleep(1)
    raise TimeoutError(f"background builds did not finish in {timeout} s: {server.stats()['background']}")
