"""The same comparison end to end in a real, headless ComfyUI (needs COMFYUI_PATH).

A txt2img workflow (checkpoint loader, two CLIP text encodes, empty latent,
KSampler, VAE decode, preview) runs over a sweep of 5 resolutions x 3 batch
sizes in four modes, each in a freshly started ComfyUI with an empty
Inductor cache folder:
- none: the workflow as it is;
- torch_compile: ComfyUI's own TorchCompileModel node (backend inductor) on the model;
- ours_cold: KeepFastModelSpeedup on the model, saving each graph it compiles;
- ours_restart: ComfyUI started again, the same workflow: the speedup node
  finds the saved graphs;
- ours_fresh: the same restart on a "fresh machine" (fresh_machine.py: empty
  TMPDIR and Inductor cache, a C++ compiler that records calls and fails),
  up to the first image only; it says which compilers were called and what of
  the pack's was left in TMPDIR after the server was stopped (SIGTERM).
Measured per mode: server start to first image, the first prompt, the sweep,
compiles (ours: the pack's /keepfast/stats; torch.compile: Dynamo's graph
counter read through a small route this module installs in the temporary
ComfyUI folder), steady it/s (steps/s from the time difference between two
step counts at the first size), and the server's peak RSS.

The server listens on 127.0.0.1 only; the checkpoint is the tiny SD1.5-layout
one the integration tests build with ComfyUI's own classes
(benchmarks/comfy/models.py), with random weights.

ComfyUI runs with the attention a user gets without flags (`--comfy-attention
default`: ComfyUI picks, the sub-quadratic one on a CPU) unless another is
asked for; the attention ComfyUI reported in its log goes into bench.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from compiler.settings import TRUST_FILE
from .fresh_machine import FreshMachine
from .models import COMFY_MODES as MODES

REPO = Path(__file__).resolve().parents[1]
KF_MODELS = Path(__file__).resolve().parent / "comfy" / "models.py"
PACK = "keepfast"
CHECKPOINT = "bench-sd15.safetensors"
NODES = {"torch_compile": "TorchCompileModel", "ours_cold": "KeepFastModelSpeedup",
         "ours_restart": "KeepFastModelSpeedup", "ours_fresh": "KeepFastModelSpeedup"}
LABELS = {"none": "no speedup node (eager)", "torch_compile": "TorchCompileModel (inductor)",
          "ours_cold": "KeepFastModelSpeedup, cold (compiles, saves graphs)",
          "ours_restart": "KeepFastModelSpeedup after a restart (saved graphs)",
          "ours_fresh": "KeepFastModelSpeedup after a restart on a fresh machine (empty TMPDIR and Inductor cache, "
                        "no C++ compiler; first image only)"}
PACK_TMP_PREFIXES = ("keepfast-", "aotinductor_")  # the pack's folder, torch's own unpacking folders

# ComfyUI's attention flags. "default" passes none: ComfyUI picks (sub-quadratic on a CPU, pytorch on
# NVIDIA). The integration tests start their servers with these too (tests/comfyui/kf_support.py).
ATTENTION_FLAGS = {
    "default": [],
    "pytorch": ["--use-pytorch-cross-attention"],
    "split": ["--use-split-cross-attention"],
    "quad": ["--use-quad-cross-attention"],
}
_PICKED = re.compile(r"^Using (.+?) (?:optimization for )?attention", re.IGNORECASE | re.MULTILINE)


def picked_attention(log_text: str) -> Optional[str]:
    """The attention ComfyUI says it uses ("sub quadratic", "split", "pytorch", ...), from its start-up log."""
    found = _PICKED.search(log_text)
    return found.group(1) if found else None


COUNTER_NODE = '''"""Written by KeepFast's benchmark into a temporary ComfyUI folder: Dynamo's counters over HTTP."""
from aiohttp import web
from server import PromptServer


@PromptServer.instance.routes.get("/keepfast_bench/dynamo")
async def keepfast_bench_dynamo(request):
    from torch._dynamo.utils import counters

    return web.json_response({str(group): {str(k): int(v) for k, v in values.items()}
                              for group, values in counters.items()})


NODE_CLASS_MAPPINGS = {}
'''


def comfyui_python(root: Path) -> str:
    if os.environ.get("COMFYUI_PYTHON"):
        return os.environ["COMFYUI_PYTHON"]
    for candidate in (root / "venv", root / ".venv", root.parent / (root.name + "-venv")):
        if (candidate / "bin" / "python").exists():
            return str(candidate / "bin" / "python")
    return "python3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ComfyUI's main.py on 127.0.0.1 with --cpu and a --base-directory of our own."""

    def __init__(self, python: str, root: Path, base: Path, env: Dict[str, str], log_name: str,
                 attention: str = "default"):
        self.python, self.root, self.base, self.env = python, root, base, env
        self.attention_args = ATTENTION_FLAGS[attention]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base / f"{log_name}.log"
        self.process: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 600) -> None:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [self.python, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                 "--base-directory", str(self.base), *self.attention_args],
                cwd=str(self.root), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        started = time.time()
        while time.time() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}: {self.log_tail()}")
            try:
                self.get("/system_stats", timeout=2)
                return
            except OSError:
                time.sleep(0.25)
        raise TimeoutError(f"ComfyUI did not start in {timeout:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)
        self.process = None

    def peak_rss_mb(self) -> Optional[float]:
        try:
            for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except (OSError, AttributeError):
            pass
        return None

    def picked_attention(self) -> Optional[str]:
        try:
            return picked_attention(self.log_path.read_text(errors="replace"))
        except OSError:
            return None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def get(self, path: str, timeout: float = 60) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as reply:
            return json.loads(reply.read())

    def post(self, path: str, data: dict, timeout: float = 60) -> Any:
        request = urllib.request.Request(self.url + path, data=json.dumps(data).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"POST {path}: HTTP {error.code}: {error.read()[:2000]!r}") from None

    def run(self, prompt: dict, timeout: float = 3600) -> float:
        """Queue a prompt, wait until it has run; returns its wall time in seconds."""
        started = time.perf_counter()
        prompt_id = self.post("/prompt", {"prompt": prompt, "client_id": str(uuid.uuid4())})["prompt_id"]
        while time.perf_counter() - started < timeout:
            entry = self.get("/history/" + prompt_id).get(prompt_id)
            if entry:
                status = entry.get("status", {})
                if status.get("status_str") == "error":
                    raise RuntimeError("prompt failed: " + json.dumps(status.get("messages"))[:2000])
                if status.get("completed"):
                    return time.perf_counter() - started
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError("ComfyUI exited while running the prompt: " + self.log_tail())
            time.sleep(0.05)
        raise TimeoutError(f"prompt did not finish in {timeout:.0f} s")

    def compiles(self, mode: str) -> Dict[str, Any]:
        """Compiles so far: the pack's counters for our modes, Dynamo's graphs for torch.compile."""
        out: Dict[str, Any] = {}
        try:
            dynamo = self.get("/keepfast_bench/dynamo")
            out["dynamo_unique_graphs"] = int(dynamo.get("stats", {}).get("unique_graphs", 0))
        except (OSError, ValueError):
            out["dynamo_unique_graphs"] = None
        try:
            counts = self.get("/keepfast/stats")["counts"]
            out.update({f"keepfast_{k}": v for k, v in counts.items()})
        except (OSError, ValueError, KeyError):
            pass
        if mode.startswith("ours"):
            out["compiles"] = out.get("keepfast_compiles")
        elif mode == "torch_compile":
            out["compiles"] = out.get("dynamo_unique_graphs")
        else:
            out["compiles"] = out.get("dynamo_unique_graphs", 0)
        return out


def prompt(mode: str, width: int, height: int, batch: int, steps: int, seed: int, speedup: dict) -> dict:
    """The txt2img workflow in API format, with the mode's node between the loader and the sampler."""
    nodes: Dict[str, dict] = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo of a cat on a windowsill", "clip": ["1", 1]}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "6": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}},
        "7": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": steps, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0,
            "model": ["1", 0], "positive": ["4", 0], "negative": ["5", 0], "latent_image": ["6", 0]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["7", 0], "vae": ["1", 2]}},
        "9": {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}},
    }
    if mode == "torch_compile":
        nodes["2"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["1", 0], "backend": "inductor"}}
    elif mode.startswith("ours"):
        nodes["2"] = {"class_type": "KeepFastModelSpeedup", "inputs": {"model": ["1", 0], **speedup}}
    if "2" in nodes:
        nodes["7"]["inputs"]["model"] = ["2", 0]
    return nodes


def settings(quick: bool) -> Dict[str, Any]:
    if quick:
        sizes = [(128, 128), (192, 192), (256, 256), (192, 256), (256, 128)]
        return {"sizes": sizes, "batches": [1, 2, 3], "steps": 2, "rate_steps": (2, 8), "rate_reps": 3}
    sizes = [(256, 256), (320, 320), (384, 384), (320, 384), (384, 256)]
    return {"sizes": sizes, "batches": [1, 2, 4], "steps": 4, "rate_steps": (4, 12), "rate_reps": 3}


def _prepare(work: Path, python: str, root: Path) -> Path:
    base = work / "comfy-base"
    for folder in ("models/checkpoints", "input", "output", "custom_nodes/keepfast_bench", "user"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    link = base / "custom_nodes" / PACK
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    (base / "custom_nodes" / "keepfast_bench" / "__init__.py").write_text(COUNTER_NODE)
    checkpoint = base / "models" / "checkpoints" / CHECKPOINT
    if not checkpoint.exists():
        subprocess.run([python, str(KF_MODELS), "checkpoint", str(checkpoint), "--seed", "0"], check=True,
                       env={**os.environ, "COMFYUI_PATH": str(root)}, cwd=str(base), capture_output=True, timeout=900)
    return base


def _run_mode(mode: str, server: Server, config: Dict[str, Any], speedup: dict, seed0: int,
              first_only: bool = False) -> Dict[str, Any]:
    out: Dict[str, Any] = {"mode": mode, "label": LABELS[mode]}
    spawned = time.time()
    server.start()
    out["server_start_s"] = time.time() - spawned
    node = NODES.get(mode)
    if node and not server.get(f"/object_info/{node}"):
        out["error"] = f"node {node} is not installed in this ComfyUI"
        return out
    seed = seed0
    shapes = [(w, h, b) for (w, h) in config["sizes"] for b in config["batches"]]
    times: List[dict] = []
    before = server.compiles(mode)
    for index, (width, height, batch) in enumerate(shapes):
        seed += 1
        seconds = server.run(prompt(mode, width, height, batch, config["steps"], seed, speedup))
        times.append({"width": width, "height": height, "batch": batch, "s": seconds})
        if index == 0:
            out["first_prompt_s"] = seconds
            out["start_to_first_image_s"] = time.time() - spawned
            out["compiles_first_image"] = (server.compiles(mode).get("compiles") or 0) - (before.get("compiles") or 0)
            if first_only:
                final = server.compiles(mode)
                out["counters"] = final
                out["compiles"] = out["compiles_first_image"]
                out["peak_rss_mb"] = server.peak_rss_mb()
                return out
    out["sweep"] = times
    out["sweep_wall_s"] = sum(t["s"] for t in times)
    after_sweep = server.compiles(mode)
    out["compiles_sweep_after_first"] = (after_sweep.get("compiles") or 0) - (before.get("compiles") or 0) \
        - out["compiles_first_image"]
    # steady it/s from the time difference between two step counts, at the first size, batch 1; in the
    # modes with a node, alternating with the same prompt without it in the same server (the loader's
    # model is left as it is by both nodes), so a change of load on the machine hits both alike
    low, high = config["rate_steps"]
    width, height = config["sizes"][0]
    runs: Dict[Tuple[str, int], List[float]] = {}
    kinds = [mode] if mode == "none" else [mode, "none"]
    for rep in range(config["rate_reps"]):
        order = [(kind, steps) for kind in kinds for steps in (low, high)]
        for kind, steps in (order if rep % 2 == 0 else order[::-1]):
            seed += 1
            runs.setdefault((kind, steps), []).append(
                server.run(prompt(kind, width, height, 1, steps, seed, speedup)))

    def rate(kind: str) -> Optional[float]:
        difference = statistics.median(runs[(kind, high)]) - statistics.median(runs[(kind, low)])
        return (high - low) / difference if difference > 0 else None

    out["steady_it_s"] = rate(mode)
    out["steady_prompt_s"] = {f"{kind} {steps} steps": statistics.median(times) for (kind, steps), times in runs.items()}
    if mode != "none":
        out["eager_it_s_same_server"] = rate("none")
        if out["steady_it_s"] and out["eager_it_s_same_server"]:
            out["steady_vs_eager_same_server"] = out["steady_it_s"] / out["eager_it_s_same_server"]
    final = server.compiles(mode)
    out["counters"] = final
    out["compiles"] = (final.get("compiles") or 0) - (before.get("compiles") or 0)
    out["peak_rss_mb"] = server.peak_rss_mb()
    return out


def run_comfy(work: Path, quick: bool = False, keep: bool = False, modes=MODES,
              attention: str = "default") -> Dict[str, Any]:
    path = os.environ.get("COMFYUI_PATH")
    if not path:
        return {"run": False, "why": "COMFYUI_PATH is not set (point it at a ComfyUI checkout with its own venv)"}
    root = Path(path)
    if not (root / "main.py").is_file():
        return {"run": False, "why": f"COMFYUI_PATH={root} has no main.py"}
    if not KF_MODELS.is_file():
        return {"run": False, "why": f"{KF_MODELS} (builds the checkpoint with ComfyUI's classes) is missing"}
    python = comfyui_python(root)
    config = settings(quick)
    flags = ATTENTION_FLAGS[attention]
    print(f"ComfyUI end to end ({root}, {python}): sizes {config['sizes']} x batches {config['batches']}, "
          f"{config['steps']} steps, attention flags: {' '.join(flags) or 'none (ComfyUI picks)'}", flush=True)
    try:
        base = _prepare(work, python, root)
    except (subprocess.SubprocessError, OSError) as error:
        return {"run": False, "why": f"building the checkpoint failed: {error}"}
    widths = [v for size in config["sizes"] for v in size]
    speedup = {"min_resolution": min(widths), "max_resolution": max(widths),
               "max_batch_size": max(config["batches"]), "compile": True, "backend": "aot"}
    result: Dict[str, Any] = {
        "run": True, "comfyui_path": str(root), "python": python, "config": {k: v for k, v in config.items()},
        "description": (f"txt2img, tiny SD1.5-layout checkpoint built with ComfyUI's classes (13.6M-parameter UNet, "
                        f"TAESD), {config['steps']} steps, cfg 7 (the UNet sees batch 2x); sweep "
                        f"{', '.join(f'{w}x{h}' for w, h in config['sizes'])} at batch sizes "
                        f"{', '.join(map(str, config['batches']))}; steady it/s at {config['sizes'][0][0]}x"
                        f"{config['sizes'][0][1]} batch 1 from {config['rate_steps'][0]} vs {config['rate_steps'][1]} "
                        f"steps. Each mode in a freshly started ComfyUI with an empty Inductor cache. Only the "
                        f"diffusion model is compiled in every mode (the VAE runs eager)."),
        "modes": [],
        "attention": {"flags": flags, "picked": None},
    }
    trust = work / "comfy-trust.json"
    for index, mode in enumerate(MODES):
        if mode not in modes:
            continue
        cache = work / f"comfy-cache-{mode}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), TRUST_FILE.name: str(trust),
               "PYTHONUNBUFFERED": "1"}
        machine = FreshMachine(work / "comfy-fresh-machine").setup() if mode == "ours_fresh" else None
        if machine is not None:
            env = machine.env(env)
        mode_speedup = {**speedup, "save_compiled": mode == "ours_cold"}
        server = Server(python, root, base, env, f"server-{mode}", attention)
        try:
            entry = _run_mode(mode, server, config, mode_speedup, seed0=1000 * (index + 1),
                              first_only=machine is not None)
        except Exception as error:  # record it and go on with the next mode
            entry = {"mode": mode, "label": LABELS[mode], "error": f"{type(error).__name__}: {str(error)[:1500]}",
                     "log_tail": server.log_tail()}
        finally:
            server.stop()
        entry["attention"] = server.picked_attention()
        result["attention"]["picked"] = result["attention"]["picked"] or entry["attention"]
        if machine is not None:
            entry["compiler_calls"] = machine.compiler_calls()
            entry["pack_files_in_tmpdir_after_sigterm"] = [
                name for name in machine.tmpdir_entries() if name.split("/")[0].startswith(PACK_TMP_PREFIXES)]
        if mode.startswith("ours") and not entry.get("error"):
            counters = entry.get("counters", {})
            entry["note"] = (f"unet graph calls {counters.get('keepfast_unet_graph_calls')}, eager calls "
                             f"{counters.get('keepfast_unet_eager_calls')}, loads {counters.get('keepfast_loads')}")
            if machine is not None:
                entry["note"] += (f"; compiler calls {len(entry['compiler_calls'])}; files of the pack in TMPDIR "
                                  f"after SIGTERM {len(entry['pack_files_in_tmpdir_after_sigterm'])} (swept by the "
                                  f"next start)")
        if mode == "torch_compile" and not entry.get("error"):
            entry["note"] = "compiles = Dynamo graphs compiled in the server process"
        result["modes"].append(entry)
        line = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in entry.items()
                if k in ("start_to_first_image_s", "first_prompt_s", "sweep_wall_s", "compiles", "steady_it_s", "error")}
        print(f"  comfyui/{mode}: {line}", flush=True)
    picked = result["attention"]["picked"]
    result["description"] += (f" Attention: ComfyUI started with {' '.join(flags) or 'no attention flag'}; its log "
                              f"says it used {picked + ' attention' if picked else 'an attention it did not name'}.")
    return result
