"""The bundled txt2img workflow queued as a user queues it, with the Speedup nodes' default `build` (in the
background), on a real ComfyUI server with its default attention (needs COMFYUI_PATH).

In the order written: queued once, then ComfyUI stopped with SIGTERM (how services and containers stop it,
no exit handler runs) while the graphs build: no build process, no trace fork and no file of the pack is
left in its TMPDIR. Started again and queued twice: the first run finishes uncompiled with builds in flight (the stats
route and Graph Stats say which), equal to the workflow without the KeepFast nodes; once the builds are done,
the second run takes the graphs in and runs the UNet and the VAE decode from them, equal to the workflow
without the nodes; a third run at another size and batch compiles nothing.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import kf_support as S

from tests.support.background import gone, processes

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    base = S.make_base(tmp_path_factory.mktemp("background-server"))
    S.build_models(base)
    temp = base / "tmp"
    temp.mkdir()
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(base / "trust.json"), "PYTHONUNBUFFERED": "1",
           "TMPDIR": str(temp)}
    server = S.ComfyServer(base, env, attention="default")
    server.start()
    yield server, temp
    server.stop()


def txt2img(server, width=192, height=192, batch=1, seed=11) -> dict:
    """The workflow as the page queues it; a new seed each queue, as its "randomize" control gives (the same
    prompt again would be ComfyUI's cached result, the model not called)."""
    prompt = S.ui_to_api(S.load_workflow("keepfast_txt2img"), server.object_info())
    S.set_inputs(prompt, "KSampler", steps=2, seed=seed)
    S.set_inputs(prompt, "EmptyLatentImage", width=width, height=height, batch_size=batch)
    S.set_inputs(prompt, "SaveImage", filename_prefix=S.unique_prefix("bg"))
    for kind in ("KeepFastModelSpeedup", "KeepFastVAESpeedup"):
        # The workflow does not set it: the page fills in the node's default.
        assert all(prompt[i]["inputs"].get("build") in (None, "in the background") for i in S.nodes_of(prompt, kind))
    return prompt


def _builds_of(temp: Path) -> list:
    """Processes building a graph for a server that uses `temp` as its TMPDIR."""
    return [pid for pid, state, _, command in processes() if state not in ("Z", "X")
            and b"build_process/run.py" in command and str(temp).encode() in command]


def _traces_of(server_pid: int) -> list:
    """The server's forked trace processes (compiler/tracing/forked_trace.py): its children running its own
    command line."""
    command = Path(f"/proc/{server_pid}/cmdline").read_bytes()
    return [pid for pid, state, parent, line in processes() if state not in ("Z", "X")
            and parent == server_pid and line == command]


def _alive(pids: list) -> list:
    return [pid for pid in pids if not gone(pid)]


@pytest.fixture(scope="module")
def stopped(comfy):
    server, temp = comfy
    entry, images, delta = S.run_counted(server, txt2img(server))
    during = server.stats()["background"]
    # In flight: build processes, or (on a CPU) the forks still tracing the programs they will build.
    traces = _traces_of(server.process.pid)
    building = _builds_of(temp) + traces
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(60)
    server.process = None
    deadline = time.monotonic() + 30
    while (_builds_of(temp) or _alive(traces) or list(temp.rglob("run-*"))) and time.monotonic() < deadline:
        time.sleep(0.2)
    # The pack's files in TMPDIR: its run folder (unpacked graphs, build folders) and lock, under keepfast-<uid>.
    left = dict(processes=_builds_of(temp) + _alive(traces),
                files=sorted(str(p) for p in temp.glob("keepfast-*/**/*")))
    server.start()
    return dict(during=during, building=building, left=left, delta=delta)


def test_stopping_comfyui_mid_build_leaves_no_build_process_and_no_files(stopped):
    assert stopped["during"] and stopped["building"], stopped  # builds were in flight when it stopped
    assert stopped["left"] == {"processes": [], "files": []}, stopped["left"]


@pytest.fixture(scope="module")
def queued_twice(comfy, stopped):
    server, _ = comfy
    prompt = txt2img(server)
    first = S.run_counted(server, prompt)
    first_stats = server.stats()
    first_texts = server.texts(first[0])
    background = S.wait_for_builds(server)
    again = txt2img(server, seed=12)
    second = S.run_counted(server, again)
    third_prompt = txt2img(server, width=256, height=192, batch=2, seed=13)
    third = S.run_counted(server, third_prompt)
    return dict(server=server, prompts=(prompt, again, third_prompt), runs=(first, second, third),
                first_stats=first_stats, first_texts=first_texts, background=background)


def test_the_first_run_finishes_uncompiled_with_the_builds_in_flight(queued_twice):
    server, (prompt, _, _) = queued_twice["server"], queued_twice["prompts"]
    _, images, delta = queued_twice["runs"][0]
    assert delta["compiles"] == 0 and delta["unet_graph_calls"] == 0 and delta["unet_eager_calls"] > 0, delta
    owners = {entry["owner"] for entry in queued_twice["first_stats"]["background"]}
    assert any("UNet" in owner for owner in owners) and any("VAE decode" in owner for owner in owners), owners
    stats_text = next(t for t in queued_twice["first_texts"].values() if "unet_graph_calls" in t)
    assert "building in the background:" in stats_text, stats_text
    S.same_as_without_the_nodes(server, prompt, images)


def test_the_second_run_takes_the_graphs_in_and_runs_from_them(queued_twice):
    server, (_, again, _) = queued_twice["server"], queued_twice["prompts"]
    assert all(entry["ready"] >= 1 and entry["failed"] == 0 for entry in queued_twice["background"])
    _, images, delta = queued_twice["runs"][1]
    assert delta["compiles"] >= 2 and delta["mismatches"] == 0, delta  # the UNet's and the VAE decode's
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert delta["vae_graph_calls"] > 0 and delta["vae_eager_calls"] == 0, delta
    compiles = [m["reason"] for m in server.stats()["messages"] if m["kind"] == "compile"]
    assert compiles and all("built in the background" in reason for reason in compiles), compiles
    S.same_as_without_the_nodes(server, again, images)


def test_a_third_run_at_another_size_and_batch_compiles_nothing(queued_twice):
    server, (_, _, third_prompt) = queued_twice["server"], queued_twice["prompts"]
    _, images, delta = queued_twice["runs"][2]
    assert delta["compiles"] == 0 and delta["fallbacks"] == 0, delta
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0, delta
    assert server.stats()["background"] == []
    S.same_as_without_the_nodes(server, third_prompt, images)
