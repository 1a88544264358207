"""Graph files are native code: integrity, trust, names, concurrency, crashes, bundles."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compiler import GraphRefused, GraphStore
from compiler.store.atomic import remove_stale_temps, sha256_bytes
from compiler.backends.aot import AotBackend
from compiler.store.bundle import export_bundle, import_bundle, read_bundle
from compiler.cli import main as cli_main
from compiler.keys.graph_keys import GraphKey

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def graphs_copy(saved_pipe, tmp_path) -> Path:
    target = tmp_path / "graphs"
    shutil.copytree(saved_pipe.graphs, target)
    return target


@pytest.fixture
def load_spy(monkeypatch):
    """Records every package that reaches the loader (i.e. is treated as code)."""
    seen = []
    real = AotBackend.load_bytes

    def spy(self, data, key, info):
        seen.append(key.id)
        return real(self, data, key, info)

    monkeypatch.setattr(AotBackend, "load_bytes", spy)
    return seen


def _first(store: GraphStore):
    return sorted(store.graphs(), key=lambda s: s.name)[0]


def test_a_tampered_package_is_refused_before_it_is_loaded(graphs_copy, load_spy):
    store = GraphStore(graphs_copy)
    stored = _first(store)
    data = bytearray(stored.package_path.read_bytes())
    data[len(data) // 3] ^= 0x01
    stored.package_path.write_bytes(bytes(data))
    with pytest.raises(GraphRefused, match="checksum"):
        store.load(stored)
    # An attacker who also rewrites the manifest's checksum is stopped by trust.
    stored.manifest.package_sha256 = sha256_bytes(bytes(data))
    stored.manifest_path.write_bytes(stored.manifest.dumps())
    store = GraphStore(graphs_copy)
    with pytest.raises(GraphRefused, match="not trusted"):
        store.load(store.get(stored.name))
    assert load_spy == []


def test_an_untrusted_graph_is_refused_until_trusted(graphs_copy, tmp_path, monkeypatch, load_spy):
    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(tmp_path / "other-machine-trust.json"))
    store = GraphStore(graphs_copy)
    stored = _first(store)
    with pytest.raises(GraphRefused) as refused:
        store.load(stored)
    message = str(refused.value)
    assert "not trusted" in message and f"graphs trust {stored.manifest_path}" in message
    assert load_spy == []
    assert cli_main(["graphs", "trust", str(stored.manifest_path)]) == 0
    graph = GraphStore(graphs_copy).load(stored)
    assert graph.key.id == stored.manifest.graph_id and load_spy == [graph.key.id]


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "a/../../b", "a/b/c", "..", "", ".hidden"])
def test_path_traversal_names_are_refused(graphs_copy, name, capsys):
    store = GraphStore(graphs_copy)
    before = sorted(graphs_copy.rglob("*"))
    with pytest.raises((ValueError, GraphRefused)):
        store.remove(name)
    assert cli_main(["graphs", "rm", str(graphs_copy), name]) == 2
    assert "error" in capsys.readouterr().err
    assert sorted(graphs_copy.rglob("*")) == before


def test_a_link_out_of_the_graphs_folder_is_refused(graphs_copy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.json").write_text("{}")
    (graphs_copy / "evil").symlink_to(outside, target_is_directory=True)
    store = GraphStore(graphs_copy)
    with pytest.raises(ValueError, match="outside"):
        store.resolve("evil/x")
    assert all("evil" not in s.name for s in store.graphs())


def _writer(source: Path, target: Path, rounds: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.writer", str(source), str(target), str(rounds), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_two_processes_writing_the_same_graphs_leave_one_valid_copy(saved_pipe, tmp_path):
    target = tmp_path / "shared"
    writers = [_writer(saved_pipe.graphs, target, 4) for _ in range(2)]
    for writer in writers:
        out, err = writer.communicate(timeout=600)
        assert writer.returncode == 0, err[-2000:]
    store = GraphStore(target)
    assert store.verify() == []
    source_ids = sorted(s.manifest.graph_id for s in GraphStore(saved_pipe.graphs).graphs())
    assert sorted(s.manifest.graph_id for s in store.graphs()) == source_ids
    packages = [p for p in target.rglob("*.pt2")]
    assert len(packages) == len(source_ids)
    assert not [p for p in target.rglob(".tmp-*")]


def test_a_writer_killed_mid_save_leaves_nothing_that_looks_valid(saved_pipe, tmp_path):
    target = tmp_path / "crashed"
    writer = _writer(saved_pipe.graphs, target, 1, "--pause-before-rename")
    line = writer.stdout.readline()
    assert line.strip() == "PAUSED", writer.stderr.read()[-2000:]
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=60)
    store = GraphStore(target)
    assert store.graphs() == []
    assert not list(target.rglob("*.json")) and not list(target.rglob("*.pt2"))
    assert list(target.rglob(".tmp-*"))  # the half-written file is there, hidden and unused
    assert remove_stale_temps(target, older_than_s=0) >= 1
    # The store still works afterwards.
    done = _writer(saved_pipe.graphs, target, 1)
    assert done.wait(timeout=600) == 0
    assert GraphStore(target).verify() == [] and GraphStore(target).graphs()


def test_bundles_round_trip_untrusted_and_refuse_other_environments(saved_pipe, tmp_path, monkeypatch, load_spy):
    source = GraphStore(saved_pipe.graphs)
    stored = _first(source)
    bundle = export_bundle(source, stored.name, tmp_path)
    assert bundle.exists() and bundle.suffix == ".kfgraph"

    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(tmp_path / "receiver-trust.json"))
    receiver = GraphStore(tmp_path / "receiver")
    imported = import_bundle(receiver, bundle)
    assert "imported from" in imported.manifest.origin
    with pytest.raises(GraphRefused, match="not trusted"):
        receiver.load(imported)
    assert cli_main(["graphs", "import", str(tmp_path / "receiver"), str(bundle), "--trust"]) == 0
    assert receiver.load(receiver.get(imported.name)).key.id == stored.manifest.graph_id

    manifest, data = read_bundle(bundle)
    for field, value, words in [("torch_version", "1.13.0", "torch 1.13.0"), ("device", "xpu", "device xpu")]:
        family = dataclasses.replace(manifest.key.family, **{field: value})
        other = dataclasses.replace(manifest, key=GraphKey(family, manifest.key.shape_range, manifest.key.variant))
        forged = tmp_path / f"other-{field}.kfgraph"
        import zipfile

        with zipfile.ZipFile(forged, "w") as archive:
            archive.writestr("manifest.json", other.dumps())
            archive.writestr("package", data)
        with pytest.raises(GraphRefused, match=words):
            import_bundle(GraphStore(tmp_path / f"r-{field}"), forged)
    needs = dict(manifest.info.needs, cpu_features=[*manifest.info.needs["cpu_features"], "keepfast_test_instruction"])
    other = dataclasses.replace(manifest, info=dataclasses.replace(manifest.info, needs=needs))
    forged = tmp_path / "other-cpu.kfgraph"
    with zipfile.ZipFile(forged, "w") as archive:
        archive.writestr("manifest.json", other.dumps())
        archive.writestr("package", data)
    with pytest.raises(GraphRefused, match="CPU lacks: keepfast_test_instruction"):
        import_bundle(GraphStore(tmp_path / "r-cpu"), forged)
    assert not (tmp_path / "r-cpu").exists() or not GraphStore(tmp_path / "r-cpu").graphs()
    with pytest.raises(GraphRefused, match="dtype"):
        import_bundle(GraphStore(tmp_path / "r-dtype"), bundle, expect_dtype="float16")
    broken = tmp_path / "broken.kfgraph"
    broken.write_bytes(bundle.read_bytes()[:-100])
    with pytest.raises(GraphRefused):
        import_bundle(GraphStore(tmp_path / "r-broken"), broken)
    assert load_spy == [stored.manifest.graph_id]
