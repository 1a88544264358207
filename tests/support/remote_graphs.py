"""Helpers for the remote library tests: graphs made to not fit, other builds, a builder's key.

A "graph for another torch version" is the session's real graph with its
key changed (so its id, and the name of its package, change too) and its
package bytes changed (so it is a package of its own that a byte counter can
tell apart). Nothing here loads such a graph; they exist to be skipped or
refused before download.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from compiler import GraphStore, TrustList
from compiler.store.atomic import sha256_bytes
from compiler.keys.graph_keys import GraphKey
from compiler.store.manifest import Manifest

ROOT = Path(__file__).resolve().parent.parent.parent


def _builder_trust(folder: Path) -> TrustList:
    """The builder machine's own trust list (not the worker's the test is checking)."""
    return TrustList(folder.parent / f"{folder.name}-trust.json")


def forge(manifest: Manifest, data: bytes, extra: bytes = b"", needs: Optional[dict] = None,
          variant: Optional[str] = None, **family_changes) -> Tuple[Manifest, bytes]:
    """Another graph from a real one: key fields changed, package bytes changed by `extra`.

    `needs` is not part of a graph's key: a graph with other needs gets another `variant` too, so it is
    a graph of its own rather than a replacement of the real one.
    """
    data = data + extra
    family = dataclasses.replace(manifest.key.family, **family_changes)
    key = GraphKey(family, manifest.key.shape_range, manifest.key.variant if variant is None else variant)
    info = manifest.info if needs is None else dataclasses.replace(manifest.info, needs=needs)
    sha = sha256_bytes(data)
    suffix = Path(manifest.package_file).suffix
    return dataclasses.replace(manifest, key=key, info=info, package_file=f"{key.id}.{sha[:16]}{suffix}",
                               package_sha256=sha, package_bytes=len(data)), data


def builder_folder(saved_graphs: Path, target: Path, misfits: bool = True) -> Dict[str, str]:
    """A builder's graphs folder: the session's graphs, plus (if `misfits`) graphs that fit no worker here.

    Returns {package file name: why it must not be downloaded} for the misfits.
    """
    shutil.copytree(saved_graphs, target)
    store = GraphStore(target, _builder_trust(target))
    if not misfits:
        return {}
    first = sorted(store.graphs(), key=lambda s: s.name)[0]
    data = first.package_path.read_bytes()
    manifest = first.manifest
    needs = dict(manifest.info.needs, cpu_features=[*manifest.info.needs.get("cpu_features", []),
                                                    "keepfast_test_instruction"])
    variants = {
        "torch 1.13.0": forge(manifest, data, b"\0torch", torch_version="1.13.0"),
        "device cuda": forge(manifest, data, b"\0cuda", device="cuda"),
        "keepfast_test_instruction": forge(manifest, data, b"\0cpu", needs=needs, variant="0badc0de"),
        "another model": forge(manifest, data, b"\0model", structure="0" * 24),
    }
    out = {}
    for why, (other, other_data) in variants.items():
        store.import_graph(other, other_data, origin="built here")
        out[other.package_file] = why
    return out


def other_build(folder: Path, target: Path) -> Path:
    """A copy of a graphs folder where every graph is another build (same ids, other package bytes)."""
    shutil.copytree(folder, target)
    store = GraphStore(target, _builder_trust(target))
    for stored in store.graphs():
        other, data = forge(stored.manifest, stored.package_path.read_bytes(), b"\0other build")
        other = dataclasses.replace(other, key=stored.manifest.key,
                                    package_file=f"{stored.manifest.graph_id}.{other.package_sha256[:16]}"
                                                 f"{Path(stored.manifest.package_file).suffix}")
        store.import_graph(other, data, origin="built here")
    return target


def cli(args: List[str], env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m compiler ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "compiler", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def cli_start(args: List[str], env: Optional[dict] = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "compiler", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def layout(folder: Path) -> List[str]:
    """Every file of a graphs folder (or a remote library's copy) as FOLDER/NAME, hidden ones left out."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*")
                  if p.is_file() and not p.name.startswith("."))


def pipeline_folder(pipe, target: Path) -> Path:
    """A diffusers pipeline folder with its configs only (what `--for` reads; no weights)."""
    target.mkdir(parents=True, exist_ok=True)
    pipe.save_config(str(target))
    for name in ("unet", "vae"):
        getattr(pipe, name).save_config(str(target / name))
    return target


def race_creates(remote, name: str = "Model-abc/graph.json", writers: int = 8) -> List[int]:
    """`writers` threads create `name` at once (each its own bytes): the indexes of those whose create won."""
    import threading

    wins: List[int] = []

    def write(index: int) -> None:
        if remote.create(name, f"writer {index}".encode() * 1000):
            wins.append(index)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return wins
