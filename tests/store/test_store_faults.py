"""Bad graph files and bad folders: a clear reason, a correct result, nothing half-written."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from compiler import CompileOptions, CompiledForward, GraphRegistry, GraphStore, StoreError
from compiler.cli import main as cli_main
from compiler.keys.graph_keys import GraphKey
from compiler.store.manifest import Manifest
from compiler.demo.tiny_models import tiny_unet
from tests.support.filesystems import small_filesystem
from tests.support.inputs import unet_inputs


@pytest.fixture
def graphs_copy(saved_pipe, tmp_path) -> Path:
    target = tmp_path / "graphs"
    shutil.copytree(saved_pipe.graphs, target)
    return target


def _unet_files(graphs: Path):
    folder = next(graphs.glob("UNet2DConditionModel-*"))
    return sorted(folder.glob("*.json")), sorted(folder.glob("*.pt2"))


def _serve_from(graphs: Path, test_range):
    """A fresh registry serving a fresh UNet from `graphs`, never compiling."""
    registry = GraphRegistry()
    unet = tiny_unet(seed=0)
    options = CompileOptions(shape_range=test_range, store=GraphStore(graphs), compile_on_miss=False)
    compiled = CompiledForward(unet, options, registry)
    args, kwargs = unet_inputs(2, 16, 16)
    with torch.no_grad():
        out = compiled(*args, **kwargs)[0]
        ref = compiled.eager(*args, **kwargs)[0]
    return registry, out, ref


def _refusals(registry):
    return " | ".join(e.reason for e in registry.events if e.kind in ("refused", "fallback"))


def test_an_intact_copy_loads(graphs_copy, test_range):
    registry, out, ref = _serve_from(graphs_copy, test_range)
    assert len(registry.loads) == 1 and not registry.fallbacks, _refusals(registry)
    assert float((out - ref).abs().max()) < 1e-4


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_package_is_refused_before_loading(graphs_copy, test_range, damage, capsys):
    _, packages = _unet_files(graphs_copy)
    for package in packages:
        data = package.read_bytes()
        if damage == "truncate":
            package.write_bytes(data[: len(data) // 2])
        else:
            middle = len(data) // 2
            package.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
    registry, out, ref = _serve_from(graphs_copy, test_range)
    assert torch.equal(out, ref)  # eager: correct
    assert not registry.loads and not registry.compiles
    assert "checksum" in _refusals(registry) and "running eager" in _refusals(registry)
    assert cli_main(["graphs", "verify", str(graphs_copy)]) == 1
    printed = capsys.readouterr().out
    assert all(p.name in printed for p in packages)


@pytest.mark.parametrize("field,value", [("torch_version", "2.0.0"), ("dtype", "float16"), ("device", "cuda")])
def test_a_graph_for_another_environment_is_refused_naming_the_difference(graphs_copy, test_range, field, value):
    manifests, _ = _unet_files(graphs_copy)
    for path in manifests:  # a consistent manifest, as another machine would write it
        manifest = Manifest.read(path)
        family = dataclasses.replace(manifest.key.family, **{field: value})
        manifest.key = GraphKey(family, manifest.key.shape_range, manifest.key.variant)
        path.unlink()
        (path.parent / f"{manifest.graph_id}.json").write_bytes(manifest.dumps())
    registry, out, ref = _serve_from(graphs_copy, test_range)
    assert torch.equal(out, ref)
    reasons = _refusals(registry)
    assert f"{field}: graph has {value}" in reasons, reasons
    assert not registry.loads


def test_a_missing_folder_means_eager_with_a_reason(tmp_path, test_range):
    registry, out, ref = _serve_from(tmp_path / "nowhere", test_range)
    assert torch.equal(out, ref)
    assert "compiling is off" in _refusals(registry)


def test_a_read_only_folder_still_serves_and_refuses_writes_clearly(saved_pipe, test_range, monkeypatch):
    with small_filesystem(16384, read_only=True, prefill=saved_pipe.graphs, monkeypatch=monkeypatch) as folder:
        registry, out, ref = _serve_from(folder, test_range)
        assert len(registry.loads) == 1, _refusals(registry)
        assert float((out - ref).abs().max()) < 1e-4
        before = sorted(p.name for p in folder.rglob("*"))
        graph = registry.graphs()[0]
        with pytest.raises(StoreError, match="read-only"):
            GraphStore(folder).save(graph, {})
        assert sorted(p.name for p in folder.rglob("*")) == before


def test_a_full_disk_leaves_the_store_as_it_was(saved_pipe, test_range, monkeypatch):
    registry = saved_pipe.registry
    graph = next(g for g in registry.graphs() if g.key.family.architecture == "UNet2DConditionModel")
    with small_filesystem(64, monkeypatch=monkeypatch) as folder:
        store = GraphStore(folder / "graphs")
        with pytest.raises(StoreError, match="disk full"):
            store.save(graph, {})
        leftovers = [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
        assert leftovers == []


def test_a_whole_model_graph_written_by_keepfast_0_1_is_not_used_and_says_why(graphs_copy, test_range):
    """0.1.0 could trace a graph at batch 1 that served larger batches wrong; such graphs cannot be told
    apart, so none is used: the call runs eager (compiling is off here) with the reason."""
    import json

    manifests, _ = _unet_files(graphs_copy)
    for path in manifests:
        data = json.loads(path.read_text())
        data["pack_version"] = "0.1.0"
        path.write_text(json.dumps(data))
    registry, out, ref = _serve_from(graphs_copy, test_range)
    assert registry.loads == []
    assert "written by KeepFast 0.1.0" in _refusals(registry) and "serves larger sizes wrongly" in _refusals(registry)
    assert torch.equal(out, ref)  # eager
    stored = GraphStore(graphs_copy)
    from compiler.store.graph_store import GraphRefused

    unet_graph = next(g for g in stored.graphs() if g.manifest.key.family.architecture == "UNet2DConditionModel")
    with pytest.raises(GraphRefused, match="written by KeepFast 0.1.0"):
        stored.load(unet_graph)
