"""Two processes sharing a graphs folder never build the same graph at once (compiler/builds/claims.py).

Unit level: a claim is one process's at a time, names its holder, is dropped by the kernel when its holder
is killed, leaves no file when released, and nobody claims where the folder cannot be written.
End to end, with another process (tests/support/claim_builder.py) building into the same store:
- it compiles a tiny SD UNet before its first call while this process's model builds in the background:
  this process builds nothing, runs eager (equal to eager) with the other process named, then loads the
  graph it wrote: 0 compiles here;
- it builds a tiny Flux's block graphs in the background while this process prepares before its first call:
  this process waits for each structure's claim, then loads both graphs: 0 compiles here, outputs equal
  eager's.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from compiler import CompileOptions
from compiler.builds import claims as build_claims
from compiler.builds import package_builds
from compiler.diffusers_api import compile_module
from compiler.store.registry import GraphRegistry
from compiler.store.graph_store import GraphStore
from compiler.demo.tiny_models import tiny_unet

SUPPORT = Path(__file__).resolve().parents[1] / "support"
BUILDER = SUPPORT / "claim_builder.py"
sys.path.insert(0, str(SUPPORT))
from claim_builder import UNET_RANGE, unet_call  # noqa: E402


def _start(mode: str, where: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(BUILDER), mode, str(where)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _claim_files(root: Path):
    return sorted(p.name for p in root.rglob(".building-*"))


def _wait_for_holder(root: Path, pid: int, timeout: float = 300) -> Path:
    """The claim file of `pid` under `root` (written right after the lock is taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in root.rglob(".building-*"):
            if build_claims._read_holder(path).pid == pid:
                return path
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never claimed a build under {root}")


def _finished(process: subprocess.Popen, timeout: float = 900) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_claim_is_one_process_s_at_a_time_and_dies_with_it(tmp_path):
    path = tmp_path / "family" / ".building-x.lock"
    holder = _start("hold", path)
    try:
        assert holder.stdout.readline().strip() == "claimed"
        taken = build_claims.try_claim(path)
        assert isinstance(taken, build_claims.Taken) and taken.holder.pid == holder.pid
        assert f"process {holder.pid}" in taken.reason() and "shares the graphs folder" in taken.reason()
        waits = []
        started = time.monotonic()
        still = build_claims.claim_or_wait(path, on_wait=waits.append, timeout=1.0)
        assert isinstance(still, build_claims.Taken) and len(waits) == 1 and time.monotonic() - started >= 1.0
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    claim = build_claims.try_claim(path)  # the kernel dropped the dead holder's lock; its file is taken over
    assert isinstance(claim, build_claims.Claim)
    assert build_claims._read_holder(path).pid == os.getpid()
    again = build_claims.try_claim(path)  # a second claimant in this process is refused as any other
    assert isinstance(again, build_claims.Taken) and again.holder.describe() == "another model in this process"
    claim.release()
    claim.release()  # idempotent
    assert not path.exists()
    assert isinstance(build_claims.try_claim(path), build_claims.Claim)  # collected: released with its file
    assert not path.exists()


def test_nobody_claims_where_the_folder_cannot_be_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert build_claims.try_claim(blocker / "family" / ".building-x.lock") is None
    assert build_claims.try_claim(None) is None


def test_a_background_model_loads_the_graph_another_process_builds(tmp_path):
    store_root = tmp_path / "graphs"
    other = _start("unet", store_root)
    try:
        _wait_for_holder(store_root, other.pid)
        unet = tiny_unet(seed=3)
        twin = copy.deepcopy(unet)
        registry = GraphRegistry()
        forward = compile_module(unet, CompileOptions(shape_range=UNET_RANGE, store=GraphStore(store_root),
                                                      autosave=True, background=True), registry)
        args, kwargs = unet_call()
        with torch.no_grad():
            got, want = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
        assert float((got - want).abs().max()) == 0.0 and forward.last.eager
        assert f"being built by process {other.pid}" in forward.last.reason, forward.last.reason
        assert forward.builds_pending == 0 and package_builds.live_builds() == 0  # nothing built here
        theirs = _finished(other)
    finally:
        if other.poll() is None:
            other.kill()
    assert theirs == {"compiles": 1, "loads": 0}
    assert _claim_files(store_root) == []  # released with its file once the graph was written
    time.sleep(1.1)  # calls look in the store again once a second while another process builds
    for batch, side, length in ((1, 16, 77), (2, 8, 20), (1, 12, 77)):
        args, kwargs = unet_call(batch, side, length)
        with torch.no_grad():
            got, want = unet(*args, **kwargs)[0], twin(*args, **kwargs)[0]
        assert not forward.last.eager, forward.last.reason
        assert float((got - want).abs().max()) < 1e-4, (batch, side, length)
    assert len(registry.compiles) == 0 and len(registry.loads) == 1 and registry.mismatches == []


def test_blocks_built_before_the_first_call_wait_for_another_process_s_background_builds(tmp_path):
    from compiler import compile_pipe
    from compiler.diffusers_api import compiled_parts
    from tests.support import tiny_transformers as tt

    store_root = tmp_path / "graphs"
    other = _start("flux", store_root)
    try:
        assert other.stdout.readline().strip() == "started"  # its two block structures are claimed
        assert len(_claim_files(store_root)) == 2
        model = tt.build("flux", seed=1)
        pipe = tt.pipe_of(model)
        registry = GraphRegistry()
        shown = []  # what the page's progress shows (progress events reach listeners only)
        registry.add_listener(lambda event: shown.append(event.reason))
        compile_pipe(pipe, shape_range=tt.RANGE, registry=registry, graphs_dir=store_root, autosave=True)
        engine = compiled_parts(pipe)["transformer"]
        with torch.no_grad():
            got, want = tt.call(model, tt.FIRST), tt.reference(engine, tt.FIRST)
        theirs = _finished(other)
    finally:
        if other.poll() is None:
            other.kill()
    assert theirs == {"compiles": 2, "loads": 0}
    assert float((got - want).abs().max()) < 1e-4
    assert len(registry.compiles) == 0 and len(registry.loads) == 2
    assert all(server.ready and server.origin == "loaded" for server in engine.servers)
    waited = [text for text in shown if "waiting for" in text]
    assert waited and f"process {other.pid}" in waited[0], waited
    for dims in tt.sweep("flux")[:3]:
        with torch.no_grad():
            got, want = tt.call(model, dims), tt.reference(engine, dims)
        assert float((got - want).abs().max()) < 1e-4, dims
    assert len(registry.compiles) == 0 and registry.mismatches == [] and _claim_files(store_root) == []
