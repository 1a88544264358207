"""A remote graph library on a real S3 API (moto's server on localhost, started here).

The builder pushes from one process; a worker pulls in another with an empty
TMPDIR, an empty Inductor cache, no C++ compiler and a trust list of its own
(benchmarks.fresh_machine, the cold-start bar's conditions) and
serves with 0 compiles. The server counts the bytes it sends per object, so
"not downloaded" is seen from the server's side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

for _module, _why in (("moto", "the S3 tests need moto[server] (requirements-dev.txt)"),
                      ("s3fs", "S3 libraries need s3fs (requirements.txt)"),
                      ("cryptography", "signed graphs need cryptography (requirements.txt)")):
    pytest.importorskip(_module, reason=_why)

from compiler import GraphStore, TrustList  # noqa: E402
from compiler.remote import PullStatus, PushStatus, RemoteLibrary, generate_key, pull, push  # noqa: E402
from compiler.remote.signing import PublicKey  # noqa: E402
from benchmarks.fresh_machine import FreshMachine  # noqa: E402
from tests.support.remote_graphs import (  # noqa: E402
    ROOT, builder_folder, cli, cli_start, layout, other_build, pipeline_folder, race_creates,
)
from tests.support.s3_server import S3Server  # noqa: E402

BUCKET = "keepfast-graphs"


@pytest.fixture(scope="module")
def s3():
    server = S3Server().start()
    server.make_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "builder.key"
    generate_key(path, "builder-1")
    return path


@pytest.fixture
def s3_env(s3, monkeypatch) -> dict:
    """This process talks to the server as the worker's and builder's processes do."""
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    return {**os.environ, **s3.env()}


def _worker_trust(path: Path, key: Path) -> TrustList:
    trust = TrustList(path)
    public = PublicKey.read(str(key) + ".pub")
    trust.add_key(public.key_id, public.line(), public.name)
    return trust


def test_a_worker_pulls_what_fits_from_s3_and_serves_with_zero_compiles(saved_pipe, s3, s3_env, key, tmp_path):
    builder = tmp_path / "builder"
    misfits = builder_folder(saved_pipe.graphs, builder)
    url = f"s3://{BUCKET}/fleet-a"
    pushed = cli(["graphs", "push", str(builder), url, "--key", str(key)], env=s3_env)
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    assert [line.split()[0] for line in pushed.stdout.splitlines()[:-1]] == ["pushed"] * (2 + len(misfits)), \
        pushed.stdout
    # The bucket holds the graphs folder's layout under the prefix.
    assert [f"fleet-a/{name}" for name in layout(builder)] == s3.objects(BUCKET)

    machine = FreshMachine(tmp_path / "worker-machine").setup()
    env = machine.env(s3_env)
    env["KEEPFAST_TRUST_FILE"] = str(tmp_path / "worker-trust.json")
    _worker_trust(Path(env["KEEPFAST_TRUST_FILE"]), key)  # the team trusts the builder's key, once
    pipe_folder = pipeline_folder(saved_pipe.pipe, tmp_path / "pipe")
    worker = tmp_path / "worker" / "graphs"
    s3.traffic.clear()
    started = time.perf_counter()
    pulled = cli(["graphs", "pull", url, str(worker), "--for", str(pipe_folder), "--json"], env=env)
    wall = time.perf_counter() - started
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    report = json.loads(pulled.stdout)
    statuses = sorted(g["status"] for g in report["graphs"])
    assert statuses == ["pulled"] * 2 + ["skipped"] * len(misfits), report

    got = s3.traffic.got()
    for package, why in misfits.items():
        assert not [path for path in got if path.endswith(package)], f"the {why} package was downloaded"
    real = {s.manifest.package_file: s.manifest.package_bytes for s in GraphStore(saved_pipe.graphs).graphs()}
    for package, size in real.items():
        assert sum(n for path, n in got.items() if path.endswith(package)) == size
    manifests = sum(n for path, n in got.items() if path.endswith(".json"))
    assert s3.traffic.total_get() - manifests - sum(real.values()) < 64 * 1024  # the rest: bucket listings
    assert report["bytes_downloaded"] == manifests + sum(real.values())
    print(f"\npull from S3 (moto, localhost): {report['seconds']:.2f} s in the pack, {wall:.2f} s for the "
          f"process; {report['bytes_downloaded'] / 1e6:.2f} MB read")

    served = subprocess.run([sys.executable, "-m", "tests.support.load_check", str(worker)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert served.returncode == 0, served.stderr[-3000:]
    result = json.loads(served.stdout.strip().splitlines()[-1])
    assert result["compiles"] == 0 and result["loads"] >= 2 and result["problems"] == [], result
    assert result["max_diff"] < 1e-4, result
    assert machine.compiler_calls() == []
    assert layout(worker) == layout(saved_pipe.graphs)


def test_tampered_objects_and_bad_signatures_on_s3_are_refused_before_the_package_is_fetched(
        saved_pipe, s3, s3_env, key, tmp_path, monkeypatch):
    url = f"s3://{BUCKET}/fleet-b"
    assert push(saved_pipe.graphs, url, key).ok
    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(tmp_path / "worker-trust.json"))
    _worker_trust(tmp_path / "worker-trust.json", key)
    remote = RemoteLibrary.open(url, writable=True)
    names = remote.manifest_names()
    edited = json.loads(remote.read(names[0]))
    edited["guards"] = edited["guards"][:-1]  # a guard dropped after signing
    remote.put(names[0], json.dumps(edited).encode())
    second = json.loads(remote.read(names[1]))["package"]
    folder = names[1].split("/")[0]
    data = bytearray(remote.read(f"{folder}/{second['file']}"))
    data[-20] ^= 0x01
    remote.put(f"{folder}/{second['file']}", bytes(data))

    s3.traffic.clear()
    worker = tmp_path / "worker"
    result = pull(url, worker)
    by_name = {o.name + ".json": o for o in result.outcomes}
    assert by_name[names[0]].status == PullStatus.REFUSED and "changed after it was signed" in by_name[names[0]].reason
    assert not s3.traffic.got(edited["package"]["file"])  # never fetched
    assert by_name[names[1]].status == PullStatus.REFUSED and "checksum" in by_name[names[1]].reason
    assert layout(worker) == []  # nothing written, nothing half-written
    assert not TrustList(tmp_path / "worker-trust.json").is_trusted(second["sha256"])


def test_two_builders_pushing_to_s3_at_once_leave_one_complete_graph_each(saved_pipe, s3, s3_env, key, tmp_path,
                                                                        monkeypatch):
    first = tmp_path / "builder-a"
    builder_folder(saved_pipe.graphs, first, misfits=False)
    second = other_build(first, tmp_path / "builder-b")
    url = f"s3://{BUCKET}/fleet-c"
    pushers = [cli_start(["graphs", "push", str(folder), url, "--key", str(key)], env=s3_env)
               for folder in (first, second)]
    outputs = [pusher.communicate(timeout=300) for pusher in pushers]
    assert [p.returncode for p in pushers] == [0, 0], [err[-1500:] for _, err in outputs]
    objects = [name for name in s3.objects(BUCKET) if name.startswith("fleet-c/")]
    manifests = [name for name in objects if name.endswith(".json")]
    ids = sorted(s.manifest.graph_id for s in GraphStore(first).graphs())
    assert sorted(Path(name).stem for name in manifests) == ids
    remote = RemoteLibrary.open(url)
    named = sorted(f"fleet-c/{name.split('/')[1]}/{json.loads(remote.read(name.split('/', 1)[1]))['package']['file']}"
                   for name in manifests)
    assert sorted(name for name in objects if name.endswith(".pt2")) == named  # the loser's package is gone
    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(tmp_path / "worker-trust.json"))
    _worker_trust(tmp_path / "worker-trust.json", key)
    result = pull(url, tmp_path / "worker")
    assert result.ok and len(result.pulled) == len(ids)
    assert GraphStore(tmp_path / "worker").verify() == []
    again = push(first, url, key)  # a later push of a graph the library has: left as it is
    assert {o.status for o in again.outcomes} == {PushStatus.PRESENT}


def test_conditional_puts_on_s3_let_exactly_one_writer_win(s3, s3_env):
    remote = RemoteLibrary.open(f"s3://{BUCKET}/race", writable=True)
    wins = race_creates(remote)
    assert len(wins) == 1
    assert remote.read("Model-abc/graph.json") == f"writer {wins[0]}".encode() * 1000
    assert [name for name in s3.objects(BUCKET) if name.startswith("race/")] == ["race/Model-abc/graph.json"]


def test_s3_failures_say_what_to_do_and_leave_the_graphs_folder_empty(saved_pipe, s3, s3_env, key, tmp_path,
                                                                      monkeypatch):
    worker = tmp_path / "worker"
    missing = pull(f"s3://no-such-bucket-{os.getpid()}/lib", worker)
    assert missing.error and "not found" in missing.error and "check the bucket" in missing.error

    started = time.perf_counter()
    dead = pull(f"s3://{BUCKET}/lib", worker, options={"endpoint_url": "http://127.0.0.1:9"})
    assert dead.error and "cannot reach" in dead.error and time.perf_counter() - started < 60

    env = {name: value for name, value in s3_env.items() if not name.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", KEEPFAST_TRUST_FILE=str(tmp_path / "t.json"))
    anonymous = cli(["graphs", "pull", f"s3://{BUCKET}/fleet-a", str(worker)], env=env)
    assert anonymous.returncode == 1 and "no credentials" in anonymous.stderr, anonymous.stderr[-2000:]

    url = f"s3://{BUCKET}/fleet-d"
    assert push(saved_pipe.graphs, url, key).ok
    monkeypatch.setenv("KEEPFAST_TRUST_FILE", str(tmp_path / "worker-trust.json"))
    _worker_trust(tmp_path / "worker-trust.json", key)
    s3.truncate.update(s.manifest.package_file for s in GraphStore(saved_pipe.graphs).graphs())
    try:
        cut = pull(url, worker)
    finally:
        s3.truncate.clear()
    assert cut.refused and all("cut short" in o.reason and "nothing written" in o.reason for o in cut.refused), \
        [o.reason for o in cut.outcomes]
    assert not worker.exists() or layout(worker) == []
    healed = pull(url, worker)  # the next pull, with the network back
    assert healed.ok and len(healed.pulled) == len(cut.refused)
