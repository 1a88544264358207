"""Remote graph libraries on fsspec's local and memory file systems: layout, fit, signatures, writers.

The graphs are the session's saved tiny pipeline (one compile, shared with
the other test files). The S3 API tests are in tests/remote/test_remote_s3.py.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

pytest.importorskip("fsspec", reason="remote graph libraries need fsspec (requirements.txt)")
pytest.importorskip("cryptography", reason="signed graphs need cryptography (requirements.txt)")

from compiler import GraphRefused, GraphStore, TrustList  # noqa: E402
from compiler.cli import main as cli_main  # noqa: E402
from compiler.remote import (  # noqa: E402
    NotAModel, PullStatus, PushStatus, RemoteLibrary, generate_key, pull, pull_for, push, selector_for_module,
    selector_for_path, warm_up_from_env,
)
from compiler.remote.signing import PublicKey  # noqa: E402
from tests.support.remote_graphs import (  # noqa: E402
    builder_folder, cli_start, layout, other_build, pipeline_folder, race_creates,
)


@pytest.fixture
def worker_trust(tmp_path, monkeypatch) -> TrustList:
    """A worker's own, empty trust list (the builder's is the session's)."""
    path = tmp_path / "worker-trust.json"
    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(path))
    return TrustList(path)


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "builder.key"
    generate_key(path, "builder-1")
    return path


def _trust_builder(trust: TrustList, key: Path) -> PublicKey:
    public = PublicKey.read(str(key) + ".pub")
    trust.add_key(public.key_id, public.line(), public.name)
    return public


def _memory_url() -> str:
    return f"memory://keepfast-{uuid.uuid4().hex[:8]}/lib"


@pytest.fixture
def read_spy(monkeypatch):
    """Every object a file system read whole (what a pull downloads), seen from fsspec, not from the pack."""
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    seen = []
    for cls in (MemoryFileSystem, LocalFileSystem):
        real = cls.cat_file

        def spy(self, path, *args, _real=real, **kwargs):
            data = _real(self, path, *args, **kwargs)
            seen.append((str(path), len(data)))
            return data

        monkeypatch.setattr(cls, "cat_file", spy)
    return seen


def test_push_keeps_the_graphs_folder_layout_and_pull_restores_it_signed_and_trusted(saved_pipe, tmp_path, key,
                                                                                   worker_trust):
    shared = tmp_path / "shared"  # a network folder
    pushed = push(saved_pipe.graphs, str(shared), key)
    assert pushed.ok and pushed.outcomes and all(o.status == PushStatus.PUSHED for o in pushed.outcomes), pushed
    assert layout(shared) == layout(saved_pipe.graphs)  # the store's layout, file for file
    public = PublicKey.read(str(key) + ".pub")
    for manifest in shared.rglob("*.json"):
        assert json.loads(manifest.read_text())["signed"]["key_id"] == public.key_id
    assert not [p for p in shared.rglob(".tmp-*")]

    worker = tmp_path / "worker"
    refused = pull(str(shared), worker)  # the builder's key is not trusted here yet
    assert refused.pulled == [] and len(refused.refused) == len(pushed.outcomes)
    assert all("does not trust" in o.reason and "trust-key" in o.reason for o in refused.refused)
    assert layout(worker) == []

    _trust_builder(worker_trust, key)
    result = pull(str(shared), worker)
    assert result.ok and len(result.pulled) == len(pushed.outcomes), result.summary()
    assert all(o.trusted and o.signer == "builder-1" for o in result.pulled)
    assert layout(worker) == layout(saved_pipe.graphs)
    store = GraphStore(worker)
    assert store.verify() == []
    for stored in store.graphs():
        source = GraphStore(saved_pipe.graphs).get(stored.name)
        assert stored.package_path.read_bytes() == source.package_path.read_bytes()
        assert worker_trust.is_trusted(stored.manifest.package_sha256)
        assert "signed by builder-1" in worker_trust.source_of(stored.manifest.package_sha256)
        assert store.load(stored).key.id == stored.manifest.graph_id  # the loader's own checks pass
    packages = sum(o.bytes for o in result.pulled)
    again = pull(str(shared), worker)
    assert {o.status for o in again.outcomes} == {PullStatus.PRESENT}
    assert again.bytes_downloaded == result.bytes_downloaded - packages  # manifests only, no package


def test_pull_downloads_only_the_graphs_that_fit_this_machine_and_the_model(saved_pipe, tmp_path, key,
                                                                          worker_trust, read_spy):
    builder = tmp_path / "builder"
    misfits = builder_folder(saved_pipe.graphs, builder)
    url = _memory_url()
    assert push(builder, url, key).ok
    _trust_builder(worker_trust, key)
    model = selector_for_path(str(pipeline_folder(saved_pipe.pipe, tmp_path / "pipe")))
    read_spy.clear()
    worker = tmp_path / "worker"
    result = pull(url, worker, selector=model)
    assert result.ok, result.summary()
    skipped = result.having(PullStatus.SKIPPED)
    reasons = [o.reason for o in skipped]
    assert len(skipped) == len(misfits), reasons
    for why in misfits.values():
        assert sum(why in reason for reason in reasons) == 1, (why, reasons)
    for outcome in skipped:
        assert outcome.bytes == 0
    read_names = [Path(path).name for path, _ in read_spy]
    assert not set(read_names) & set(misfits), "a package that does not fit was downloaded"
    real = {s.manifest.package_file for s in GraphStore(saved_pipe.graphs).graphs()}
    assert real <= set(read_names) and len(result.pulled) == len(real)
    assert layout(worker) == layout(saved_pipe.graphs)
    assert result.bytes_downloaded == sum(size for _, size in read_spy)

    read_spy.clear()
    half = pull(url, tmp_path / "fp16-worker", selector=model, dtype="float16")
    assert half.pulled == [] and {o.status for o in half.outcomes} == {PullStatus.SKIPPED}
    assert sum("dtype float32, float16 was asked for" in o.reason for o in half.outcomes) == len(real) + len(misfits)
    assert not [p for p, _ in read_spy if p.endswith(".pt2")]

    unet_only = pull(url, tmp_path / "unet-worker", selector=selector_for_module(saved_pipe.pipe.unet))
    unet_folder = {o.name.split("/")[0] for o in unet_only.pulled}
    assert len(unet_folder) == 1 and next(iter(unet_folder)).startswith("UNet2DConditionModel-")


def test_a_changed_manifest_a_changed_package_and_an_untrusted_signer_are_refused_before_loading(
        saved_pipe, tmp_path, key, worker_trust, read_spy):
    url = _memory_url()
    assert push(saved_pipe.graphs, url, key).ok
    _trust_builder(worker_trust, key)
    remote = RemoteLibrary.open(url, writable=True)
    names = remote.manifest_names()
    assert len(names) >= 2
    edited = json.loads(remote.read(names[0]))
    edited["created_on"] = "Linux-evil"  # any change after signing
    remote.put(names[0], json.dumps(edited).encode())
    changed = json.loads(remote.read(names[1]))["package"]
    folder = names[1].split("/")[0]
    package = bytearray(remote.read(f"{folder}/{changed['file']}"))
    package[len(package) // 2] ^= 0x01
    remote.put(f"{folder}/{changed['file']}", bytes(package))

    read_spy.clear()
    worker = tmp_path / "worker"
    result = pull(url, worker)
    by_name = {o.name + ".json": o for o in result.outcomes}
    assert by_name[names[0]].status == PullStatus.REFUSED
    assert "does not match its contents (changed after it was signed)" in by_name[names[0]].reason
    edited_package = edited["package"]["file"]
    assert not [p for p, _ in read_spy if p.endswith(edited_package)]  # refused before download
    assert by_name[names[1]].status == PullStatus.REFUSED and "checksum" in by_name[names[1]].reason
    assert not worker_trust.is_trusted(changed["sha256"])
    assert not any(name.endswith(changed["file"]) or name.endswith(edited_package) for name in layout(worker))
    assert not result.ok

    other_key = tmp_path / "stranger.key"
    generate_key(other_key, "stranger")
    stranger_url = _memory_url()
    assert push(saved_pipe.graphs, stranger_url, other_key).ok
    read_spy.clear()
    stranger = pull(stranger_url, tmp_path / "w2")
    assert stranger.pulled == [] and all("'stranger'" in o.reason and "does not trust" in o.reason
                                         for o in stranger.outcomes)
    assert not [p for p, _ in read_spy if p.endswith(".pt2")]


def test_unsigned_graphs_are_refused_unless_asked_for_and_then_stay_untrusted(saved_pipe, tmp_path, worker_trust):
    url = _memory_url()
    remote = RemoteLibrary.open(url, writable=True)
    for stored in GraphStore(saved_pipe.graphs).graphs():  # an unsigned library: the store's files as they are
        folder = stored.manifest_path.parent.name
        remote.put(f"{folder}/{stored.manifest.package_file}", stored.package_path.read_bytes())
        remote.put(f"{folder}/{stored.manifest_path.name}", stored.manifest_path.read_bytes())
    refused = pull(url, tmp_path / "w1")
    assert refused.pulled == [] and all("not signed" in o.reason for o in refused.refused)
    taken = pull(url, tmp_path / "w2", accept_unsigned=True)
    assert taken.pulled and all(not o.trusted and "graphs trust" in o.reason for o in taken.pulled)
    store = GraphStore(tmp_path / "w2")
    with pytest.raises(GraphRefused, match="not trusted"):
        store.load(store.graphs()[0])


def test_push_refuses_a_graph_that_does_not_verify_and_uploads_nothing_for_it(saved_pipe, tmp_path, key):
    builder = tmp_path / "builder"
    builder_folder(saved_pipe.graphs, builder, misfits=False)
    broken = sorted(GraphStore(builder).graphs(), key=lambda s: s.name)[0]
    data = bytearray(broken.package_path.read_bytes())
    data[10] ^= 0xFF
    broken.package_path.write_bytes(bytes(data))
    shared = tmp_path / "shared"
    result = push(builder, str(shared), key)
    outcome = {o.name: o for o in result.outcomes}[broken.name]
    assert outcome.status == PushStatus.REFUSED and "does not verify" in outcome.reason and not result.ok
    assert not any(broken.manifest.graph_id in name for name in layout(shared))


def test_create_only_writes_let_exactly_one_writer_win(tmp_path):
    for url in (str(tmp_path / "shared"), _memory_url()):
        remote = RemoteLibrary.open(url, writable=True)
        wins = race_creates(remote)
        assert len(wins) == 1, url
        assert remote.read("Model-abc/graph.json") == f"writer {wins[0]}".encode() * 1000
    assert layout(tmp_path / "shared") == ["Model-abc/graph.json"]  # no temp file left
    assert not [p for p in (tmp_path / "shared").rglob(".tmp-*")]
    read_only = RemoteLibrary.open(str(tmp_path / "shared"))
    with pytest.raises(Exception, match="read-only"):
        read_only.put("Model-abc/x", b"x")


def test_two_builders_pushing_the_same_graphs_at_once_leave_one_complete_graph_each(saved_pipe, tmp_path, key,
                                                                                  worker_trust):
    first = tmp_path / "builder-a"
    builder_folder(saved_pipe.graphs, first, misfits=False)
    second = other_build(first, tmp_path / "builder-b")  # same graph ids, other package bytes
    shared = tmp_path / "shared"
    pushers = [cli_start(["graphs", "push", str(folder), str(shared), "--key", str(key)]) for folder in (first, second)]
    for pusher in pushers:
        out, err = pusher.communicate(timeout=300)
        assert pusher.returncode == 0, err[-2000:]
    ids = sorted(s.manifest.graph_id for s in GraphStore(first).graphs())
    manifests = sorted(shared.rglob("*.json"))
    assert sorted(p.stem for p in manifests) == ids  # one manifest per graph
    packages = sorted(p.name for p in shared.rglob("*.pt2"))
    named = sorted(json.loads(p.read_text())["package"]["file"] for p in manifests)
    assert packages == named  # every package named by a manifest, no loser's package left
    assert not [p for p in shared.rglob(".tmp-*")]
    _trust_builder(worker_trust, key)
    result = pull(str(shared), tmp_path / "worker")
    assert result.ok and len(result.pulled) == len(ids)
    assert GraphStore(tmp_path / "worker").verify() == []


def test_keys_are_trusted_explicitly_from_the_command_line(saved_pipe, tmp_path, worker_trust, capsys):
    key = tmp_path / "team.key"
    assert cli_main(["graphs", "keygen", str(key), "--name", "ci-builder"]) == 0
    assert (key.stat().st_mode & 0o777) == 0o600 and Path(str(key) + ".pub").is_file()
    assert cli_main(["graphs", "keygen", str(key)]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err
    shared = tmp_path / "shared"
    assert cli_main(["graphs", "push", str(saved_pipe.graphs), str(shared), "--key", str(key)]) == 0
    worker = tmp_path / "worker"
    assert cli_main(["graphs", "pull", str(shared), str(worker)]) == 1  # not trusted yet
    assert "does not trust" in capsys.readouterr().out and layout(worker) == []
    assert cli_main(["graphs", "trust-key", str(key) + ".pub"]) == 0
    public = PublicKey.read(str(key) + ".pub")
    assert cli_main(["graphs", "keys"]) == 0 and public.key_id in capsys.readouterr().out
    assert cli_main(["graphs", "pull", str(shared), str(worker), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {g["status"] for g in report["graphs"]} == {"pulled"} and report["seconds"] > 0
    shas = [s.manifest.package_sha256 for s in GraphStore(worker).graphs()]
    assert shas and all(worker_trust.is_trusted(sha) for sha in shas)
    assert cli_main(["graphs", "untrust-key", public.key_id]) == 0
    assert not any(worker_trust.is_trusted(sha) for sha in shas)  # what the key vouched for goes with it
    bad = tmp_path / "bad.pub"
    bad.write_text("ssh-ed25519 AAAA nothing")
    assert cli_main(["graphs", "trust-key", str(bad)]) == 2
    assert "not a KeepFast public key" in capsys.readouterr().err
    assert cli_main(["graphs", "push", str(saved_pipe.graphs), str(shared)]) == 2  # no key: nothing unsigned
    assert "--key" in capsys.readouterr().err


def test_models_are_named_by_folder_or_structure_and_a_checkpoint_file_says_what_to_give(saved_pipe, tmp_path):
    stored = GraphStore(saved_pipe.graphs).graphs()
    selector = selector_for_path(str(pipeline_folder(saved_pipe.pipe, tmp_path / "pipe")))
    assert all(selector.why_not(s.manifest) is None for s in stored)  # built from configs on meta, no weights
    folder = stored[0].manifest_path.parent.name
    by_name = selector_for_path(folder)
    assert [s.name for s in stored if by_name.why_not(s.manifest) is None] == \
        [s.name for s in stored if s.manifest_path.parent.name == folder]
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"\0" * 16)
    with pytest.raises(NotAModel, match="diffusers folder"):
        selector_for_path(str(checkpoint))
    with pytest.raises(NotAModel):
        selector_for_path("not-a-model")
    assert cli_main(["graphs", "pull", str(tmp_path), str(tmp_path / "w"), "--for", str(checkpoint)]) == 2


def test_a_missing_library_is_a_clear_message_and_writes_nothing(tmp_path, monkeypatch):
    worker = tmp_path / "worker"
    for url in (str(tmp_path / "no-such-folder"), "memory://keepfast-missing/lib"):
        result = pull(url, worker)
        assert result.error and "not found" in result.error and "check the bucket" in result.error
        assert not worker.exists()
    import torch

    failed = pull_for(str(tmp_path / "no-such-folder"), worker, module=torch.nn.Linear(2, 2))
    assert failed.error and not worker.exists()  # never raises: the node serves eager
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:
        missing_client = pull("gcs://keepfast-test-bucket/lib", worker)
        assert missing_client.error and "needs gcsfs: python -m pip install gcsfs" in missing_client.error
    hub = RemoteLibrary.open("hf://keepfast-test/graphs")
    assert type(hub.fs).__name__ == "HfFileSystem" and hub.root == "keepfast-test/graphs"
    offline = pull("hf://keepfast-test/graphs", worker)  # no such repository; or no network, as here
    assert offline.error and any(words in offline.error for words in ("cannot reach", "not found", "credentials",
                                                                      "access denied")), offline.error
    assert not worker.exists()


def test_worker_warm_up_from_the_environment_variable(saved_pipe, tmp_path, key, worker_trust, monkeypatch):
    shared = tmp_path / "shared"
    assert push(saved_pipe.graphs, str(shared), key).ok
    _trust_builder(worker_trust, key)
    assert warm_up_from_env(tmp_path / "w", environ={}) is None
    result = warm_up_from_env(tmp_path / "w", module=saved_pipe.pipe.unet,
                              environ={"KEEPFAST_REMOTE_LIBRARY": str(shared)})
    assert result is not None and result.ok and result.seconds > 0
    assert [o.name.split("/")[0].split("-")[0] for o in result.pulled] == ["UNet2DConditionModel"]


def test_a_graph_this_folder_holds_is_not_downloaded_and_its_own_build_is_kept(saved_pipe, tmp_path, key,
                                                                             worker_trust, read_spy):
    url = _memory_url()
    assert push(saved_pipe.graphs, url, key).ok
    _trust_builder(worker_trust, key)
    worker = tmp_path / "worker"
    builder_folder(saved_pipe.graphs, tmp_path / "mine", misfits=False)
    other_build(tmp_path / "mine", worker)  # this machine built the same graphs itself (other bytes)
    before = {name: (worker / name).read_bytes() for name in layout(worker)}
    read_spy.clear()
    result = pull(url, worker)
    assert {o.status for o in result.outcomes} == {PullStatus.PRESENT}
    assert all("its own build" in o.reason for o in result.outcomes)
    assert not [p for p, _ in read_spy if p.endswith(".pt2")]
    assert {name: (worker / name).read_bytes() for name in layout(worker)} == before

    stored = GraphStore(saved_pipe.graphs).graphs()
    unet = next(s for s in stored if s.name.startswith("UNet2DConditionModel"))
    exact = pull_for(url, tmp_path / "exact", structures=[unet.manifest.key.family.structure])
    assert [o.name for o in exact.pulled] == [unet.name]  # what a node that knows its structures asks for
    named = pull(url, tmp_path / "named", names=[unet.name])
    assert [o.name for o in named.outcomes] == [unet.name] and named.pulled


def test_a_signed_manifest_naming_another_graphs_package_is_refused(saved_pipe, tmp_path, key, worker_trust):
    from compiler.remote import load_private_key
    from compiler.remote.signing import sign

    url = _memory_url()
    assert push(saved_pipe.graphs, url, key).ok
    _trust_builder(worker_trust, key)
    remote = RemoteLibrary.open(url, writable=True)
    names = remote.manifest_names()
    victim = json.loads(remote.read(names[1]))["package"]["file"]
    hostile = json.loads(remote.read(names[0]))
    hostile["package"]["file"] = victim  # would overwrite another graph's package in the worker's folder
    remote.put(names[0], json.dumps(sign(hostile, *load_private_key(key))).encode())
    result = pull(url, tmp_path / "worker")
    outcome = {o.name + ".json": o for o in result.outcomes}[names[0]]
    assert outcome.status == PullStatus.REFUSED and "not one of its graph's names" in outcome.reason
    assert GraphStore(tmp_path / "worker").verify() == []


def test_the_trust_list_keeps_packages_and_keys_apart_and_reads_its_old_format(tmp_path):
    path = tmp_path / "trusted.json"
    path.write_text(json.dumps({"format": 1, "trusted": {"a" * 64: {"source": "old", "added": "2025"}}}))
    trust = TrustList(path)
    assert trust.is_trusted("a" * 64) and trust.keys() == {}  # a list written before keys existed
    public = PublicKey(b"\1" * 32, "team")
    assert trust.add_key(public.key_id, public.line(), "team") and not trust.add_key(public.key_id, "x", "y")
    trust.add("b" * 64, "signed by team", key_id=public.key_id)
    trust.add("c" * 64, "by hand")
    trust.remove("a" * 64)
    assert set(trust.keys()) == {public.key_id}  # package edits keep the keys
    assert trust.remove_key(public.key_id) == 1  # and a key takes what it vouched for with it
    assert not trust.is_trusted("b" * 64) and trust.is_trusted("c" * 64) and trust.keys() == {}
    assert json.loads(path.read_text())["format"] == 1


def test_the_warm_up_command_pulls_from_the_variable_and_never_stops_a_worker(saved_pipe, tmp_path, key,
                                                                              worker_trust, monkeypatch, capsys):
    shared = tmp_path / "shared"
    assert push(saved_pipe.graphs, str(shared), key).ok
    _trust_builder(worker_trust, key)
    monkeypatch.delenv("KEEPFAST_REMOTE_LIBRARY", raising=False)
    assert cli_main(["graphs", "warm-up", str(tmp_path / "w")]) == 0
    assert "not set" in capsys.readouterr().out and not (tmp_path / "w").exists()
    monkeypatch.setenv("KEEPFAST_REMOTE_LIBRARY", str(tmp_path / "missing"))
    assert cli_main(["graphs", "warm-up", str(tmp_path / "w")]) == 0
    assert "not found" in capsys.readouterr().err and not (tmp_path / "w").exists()
    monkeypatch.setenv("KEEPFAST_REMOTE_LIBRARY", str(shared))
    assert cli_main(["graphs", "warm-up", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert f"warm-up: {len(GraphStore(saved_pipe.graphs).graphs())} pulled" in out and " s)" in out
    assert layout(tmp_path / "w") == layout(saved_pipe.graphs)
