"""Two ComfyUI servers sharing one models/graphs folder build the UNet's graph once between them (needs
COMFYUI_PATH; compiler/builds/claims.py).

Both run the bundled txt2img workflow with the nodes' defaults (build in the background, default attention)
and Model Speedup's `save_compiled` on, as two ComfyUI processes of one machine (one per GPU) would, sharing
the trust file as one user does. In the order written: A's first run starts the UNet's build and claims it
in the shared folder; B's first run, queued while A's build is in flight, builds no UNet graph (its UNet runs
uncompiled with A's pid in the reason), equal to the workflow without the nodes; A's builds finish and its
second run writes the graph; B's second run loads it and runs its UNet from it, no UNet compile in B, equal
to the workflow without the nodes; no claim file is left.
"""

from __future__ import annotations

import os

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

def txt2img(server, seed: int) -> dict:
    prompt = S.ui_to_api(S.load_workflow("keepfast_txt2img"), server.object_info())
    S.set_inputs(prompt, "KSampler", steps=2, seed=seed)
    S.set_inputs(prompt, "EmptyLatentImage", width=192, height=192, batch_size=1)
    S.set_inputs(prompt, "SaveImage", filename_prefix=S.unique_prefix("shared"))
    S.set_inputs(prompt, "KeepFastModelSpeedup", save_compiled=True)
    return prompt


def run(server, prompt):
    _, images, delta = S.run_counted(server, prompt)
    return images, delta


def _claims(graphs) -> list:
    return sorted(str(p) for p in graphs.rglob(".building-*"))


def _unet_messages(server, kind: str) -> list:
    return [m["reason"] for m in server.stats()["messages"] if m["kind"] == kind and "UNet" in m["reason"]]


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-graphs")
    graphs = root / "graphs"
    graphs.mkdir()
    servers = []
    for name in ("a", "b"):
        base = S.make_base(root / name)
        S.build_models(base)
        (base / "models" / "graphs").symlink_to(graphs, target_is_directory=True)
        temp = base / "tmp"
        temp.mkdir()
        env = {**os.environ, "KEEPFAST_TRUST_FILE": str(root / "trust.json"), "PYTHONUNBUFFERED": "1",
               "TMPDIR": str(temp)}
        servers.append(S.ComfyServer(base, env, attention="default"))
    try:
        for server in servers:
            server.start()
        yield servers[0], servers[1], graphs
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def runs(two_servers):
    a, b, graphs = two_servers
    a_first = run(a, txt2img(a, seed=21))
    claims_during = _claims(graphs)
    holders = [open(path).read().split()[0] for path in claims_during]
    b_prompt = txt2img(b, seed=22)
    b_first = run(b, b_prompt)
    b_background = b.stats()["background"]
    b_fallbacks = [m["reason"] for m in b.stats()["messages"] if m["kind"] == "fallback"]
    S.wait_for_builds(a)
    a_second = run(a, txt2img(a, seed=23))
    claims_after = _claims(graphs)
    b_again = txt2img(b, seed=24)
    b_second = run(b, b_again)
    return dict(a=a, b=b, a_runs=(a_first, a_second), b_runs=(b_first, b_second), b_prompts=(b_prompt, b_again),
                claims_during=claims_during, holders=holders, claims_after=claims_after,
                b_background=b_background, b_fallbacks=b_fallbacks)


def test_the_second_server_builds_no_unet_graph_while_the_first_builds_it(runs):
    a, b = runs["a"], runs["b"]
    assert len(runs["claims_during"]) == 1 and runs["holders"] == [str(a.process.pid)], runs["claims_during"]
    images, delta = runs["b_runs"][0]
    assert delta["unet_graph_calls"] == 0 and delta["unet_eager_calls"] > 0, delta
    owners = [entry["owner"] for entry in runs["b_background"]]
    assert not any("UNet" in owner for owner in owners), owners  # its VAE builds: VAE graphs are not saved
    assert any(f"being built by process {a.process.pid}" in reason for reason in runs["b_fallbacks"]), \
        runs["b_fallbacks"]
    S.same_as_without_the_nodes(b, runs["b_prompts"][0], images)


def test_the_second_server_loads_the_graph_the_first_wrote(runs):
    a, b = runs["a"], runs["b"]
    assert _unet_messages(a, "compile"), a.stats()["messages"]
    assert runs["claims_after"] == []  # written, then released with its file
    images, delta = runs["b_runs"][1]
    assert delta["unet_graph_calls"] > 0 and delta["unet_eager_calls"] == 0 and delta["mismatches"] == 0, delta
    assert _unet_messages(b, "compile") == [] and _unet_messages(b, "load"), b.stats()["messages"]
    S.same_as_without_the_nodes(b, runs["b_prompts"][1], images)
