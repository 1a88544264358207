"""The pack's page in a real browser: badges, compile progress and the graph library.

Needs COMFYUI_PATH (a ComfyUI checkout with its virtualenv), Debian's
chromium at /usr/bin/chromium and node/npm (`playwright-core` is installed
into tests/comfyui/browser/node_modules on first use; no browser is
downloaded). Each is skipped with the reason printed when missing.

One ComfyUI server with a fresh base folder serves the module; one compile
(the tiny UNet, saved as it compiles) feeds every test. The page queues the
prompt itself, because ComfyUI sends progress and the pack's events to the
client that queued it. Screenshots go to $KEEPFAST_ARTIFACTS (or a pytest
temporary folder); the path is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui

CHROMIUM = "/usr/bin/chromium"
BROWSER_DIR = Path(__file__).resolve().parent / "browser"
SCRIPT = BROWSER_DIR / "keepfast_page.mjs"
MODEL_SPEEDUP, VAE_SPEEDUP, SAMPLER, DECODE, NOTE = 2, 3, 7, 8, 12  # node ids in workflows/keepfast_txt2img.json
PHASE_TIMEOUT_S = 1500


def _playwright_ready() -> str:
    """'' when the browser driver is installed (installing it if needed), else why not."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is absent: install Debian's chromium (apt-get install -y chromium) for the browser tests"
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are needed to drive chromium with playwright-core"
    if (BROWSER_DIR / "node_modules" / "playwright-core" / "package.json").exists():
        return ""
    try:
        done = subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=BROWSER_DIR, capture_output=True,
                              text=True, timeout=600, env={**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"})
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"npm install in {BROWSER_DIR} failed: {error}"
    if done.returncode != 0:
        return f"npm install in {BROWSER_DIR} failed:\n{(done.stdout + done.stderr)[-1500:]}"
    return ""


_WHY_NOT = _playwright_ready()
if _WHY_NOT:
    pytest.skip(_WHY_NOT, allow_module_level=True)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, pytestconfig) -> Path:
    folder = Path(os.environ["KEEPFAST_ARTIFACTS"]) if os.environ.get("KEEPFAST_ARTIFACTS") else \
        tmp_path_factory.mktemp("browser-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\nbrowser test screenshots and page results: {folder}", flush=True)
    return folder


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    """ComfyUI with the pack, a fresh graphs folder and only the tiny checkpoint."""
    base = S.make_base(tmp_path_factory.mktemp("browser-base"))
    subprocess.run([S.PYTHON, str(S.COMFY_MODELS), "checkpoint",
                    str(base / "models" / "checkpoints" / S.CHECKPOINT), "--seed", "0"],
                   check=True, env={**os.environ, "COMFYUI_PATH": S.COMFYUI_PATH}, cwd=str(base))
    trust_file = base / "keepfast-trust.json"
    server = S.ComfyServer(base, {**os.environ, "KEEPFAST_TRUST_FILE": str(trust_file), "PYTHONUNBUFFERED": "1"})
    server.start()
    # A fresh user sees the template browser first; a returning one does not.
    server.post("/settings/Comfy.TutorialCompleted", True).raise_for_status()
    server.trust_file = trust_file
    yield server
    server.stop()


def run_phase(server, artifacts: Path, phase: str, **extra) -> dict:
    config = {"url": server.url, "chromium": CHROMIUM, "artifacts": str(artifacts),
              "result": str(artifacts / f"{phase}.json"), **extra}
    config_path = artifacts / f"{phase}-config.json"
    config_path.write_text(json.dumps(config))
    done = subprocess.run(["node", str(SCRIPT), phase, str(config_path)], cwd=BROWSER_DIR, capture_output=True,
                          text=True, timeout=PHASE_TIMEOUT_S)
    result = json.loads(Path(config["result"]).read_text())
    assert done.returncode == 0 and "error" not in result, (
        f"browser phase {phase} failed: {result.get('error')}\nsteps: {result.get('steps')}\n"
        f"console: {result.get('console')}\n{done.stderr[-2000:]}\nserver log:\n{server.log_tail(40)}")
    ours = [line for line in result["failed_requests"]
            if "/extensions/keepfast/" in line or ("/keepfast/" in line and phase != "badname")]
    assert not ours, ours  # the pack's scripts and routes all answered
    return result


def stored_graphs(server) -> list:
    return sorted((server.base / "models" / "graphs").glob("*/*.json"))


def txt2img_phase(server, artifacts: Path, phase: str, model_speedup: dict) -> dict:
    """txt2img (128x128, one step) queued from the page with these Model Speedup widgets, the VAE eager."""
    workflow = artifacts / f"txt2img-{phase}.json"
    shutil.copy(S.WORKFLOWS / "keepfast_txt2img.json", workflow)
    widgets = {
        MODEL_SPEEDUP: {"min_resolution": 64, "max_resolution": 256, "compile": True, **model_speedup},
        VAE_SPEEDUP: {"compile": False},
        6: {"width": 128, "height": 128, "batch_size": 1},
        SAMPLER: {"steps": 1, "seed": 1},
    }
    return run_phase(server, artifacts, phase, workflow=str(workflow), widgets=widgets,
                     watch=[MODEL_SPEEDUP, VAE_SPEEDUP], move_aside=[NOTE],
                     compile_timeout_ms=PHASE_TIMEOUT_S * 1000 - 120_000)


@pytest.fixture(scope="module")
def compiled(page_server, artifacts) -> dict:
    """txt2img queued from the page: the Model Speedup compiles (saving its graph), the VAE runs eager."""
    return txt2img_phase(page_server, artifacts, "compile", {"save_compiled": True, "build": S.BLOCKING_BUILD})


def test_a_compile_shows_progress_then_the_compiled_badge(compiled, page_server):
    assert compiled["done"]["ok"] is True, compiled["done"]
    events = compiled["events"]
    progress = [e for e in events if e["kind"] == "progress"]
    assert progress and all(e["node"] == str(SAMPLER) for e in progress), events
    assert any(0 < e["fraction"] < 1 for e in progress), progress
    model_seen = [s for s in compiled["seen"] if s["node"] == MODEL_SPEEDUP]
    compiling = [s for s in model_seen if s["state"] == "compiling"]
    assert compiling and any(0 < s["fraction"] < 1 for s in compiling), model_seen
    assert model_seen.index(compiling[0]) < len(model_seen) - 1
    badge = compiled["badges"][str(MODEL_SPEEDUP)]
    assert badge["state"] == "compiled" and badge["text"].startswith("compiled ("), badge
    assert any(e["kind"] == "compile" and e["node"] == str(SAMPLER) for e in events), events
    assert "node-compiled.png" in compiled["screenshots"]
    assert page_server.counts()["compiles"] >= 1


def test_an_eager_node_carries_its_reason(compiled):
    badge = compiled["badges"][str(VAE_SPEEDUP)]
    assert badge["state"] == "eager", badge
    assert "compiling is off" in badge["reason"] and badge["text"].startswith("eager: "), badge
    assert any(e["kind"] == "fallback" and e["node"] == str(DECODE) for e in compiled["events"])


def test_the_library_lists_the_saved_graph_and_trusts_it(compiled, page_server, artifacts):
    from compiler.store.manifest import Manifest
    from compiler.store.trust import TrustList

    files = stored_graphs(page_server)
    assert files, "the compile saved no graph"
    manifest = Manifest.read(files[0])
    name = f"{files[0].parent.name}/{manifest.graph_id}"
    trust = TrustList(page_server.trust_file)
    assert trust.is_trusted(manifest.package_sha256)  # built on this machine
    trust.remove(manifest.package_sha256)  # as if it came from elsewhere: the library offers Trust

    result = run_phase(page_server, artifacts, "library", trust=name)
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {f"{f.parent.name}/{Manifest.read(f).graph_id}" for f in files}
    text = rows[name]["text"]
    for expected in (manifest.key.family.architecture, manifest.key.family.dtype, "batch 1–", "spatial 8–",
                     "MB", manifest.key.family.torch_version, "created", "not trusted here"):
        assert expected in text, (expected, text)
    assert result["before_trust"].startswith("not trusted") and result["after_trust"] == "trusted by this machine"
    assert trust.is_trusted(manifest.package_sha256) and "graph library" in trust.source_of(manifest.package_sha256)
    assert "verified" in result["verify_status"], result["verify_status"]
    assert (artifacts / "library.png").stat().st_size > 10_000


def test_a_bad_name_is_refused_and_shown(compiled, page_server, artifacts):
    before = sorted(p for p in page_server.base.rglob("*") if p.is_file() and "user" not in p.parts)
    names = ["../../keepfast-trust", "/etc/passwd", "a/b/c", "..%2F..%2Fx"]
    result = run_phase(page_server, artifacts, "badname", names=names)
    for attempt in result["attempts"]:
        assert attempt["status"] in (400, 404), attempt
        assert attempt["error"] and attempt["error"] in attempt["shown"], attempt
        assert "kf-error" in attempt["error_class"], attempt
    assert [a["status"] for a in result["attempts"][:3]] == [400, 400, 400]
    assert result["get_delete"]["status"] == 405 and "POST" in result["get_delete"]["body"]["error"]
    after = sorted(p for p in page_server.base.rglob("*") if p.is_file() and "user" not in p.parts)
    assert [p for p in before if p not in after] == []
    assert len(result["rows"]) == len(stored_graphs(page_server))


def test_the_library_pulls_from_a_remote_library(compiled, page_server, artifacts, tmp_path):
    """A worker's page: the graphs a builder pushed signed to a library (a folder here), its key trusted once,
    an empty graphs folder; the library tab's Check lists them as fitting (nothing downloaded), Pull brings
    them in and the local list shows them."""
    files = stored_graphs(page_server)
    assert files
    library, key = tmp_path / "remote-library", tmp_path / "builder.key"
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(page_server.trust_file)}
    for args in (["keygen", key, "--name", "builder"], ["push", page_server.base / "models" / "graphs", library,
                                                         "--key", key], ["trust-key", f"{key}.pub"]):
        done = subprocess.run([sys.executable, "-m", "compiler", "graphs", *map(str, args)], cwd=S.REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
    folder = page_server.base / "models" / "graphs"
    kept = folder.with_name("graphs-kept")
    folder.rename(kept)
    folder.mkdir()
    try:
        result = run_phase(page_server, artifacts, "remote", url_remote=str(library))
        names = {f"{f.parent.name}/{f.stem}" for f in files}
        assert {row["name"]: row["status"] for row in result["checked"]} == dict.fromkeys(names, "fits"), result
        assert {row["name"]: row["status"] for row in result["pulled"]} == dict.fromkeys(names, "pulled"), result
        assert f"{len(names)} pulled" in result["pull_status"], result["pull_status"]
        assert names <= {row["name"] for row in result["rows"]}
        assert {f"{f.parent.name}/{f.stem}" for f in stored_graphs(page_server)} == names
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        kept.rename(folder)


def test_delete_in_the_library_removes_the_files(compiled, page_server, artifacts):
    from compiler.store.manifest import Manifest

    files = stored_graphs(page_server)
    assert files
    manifest = Manifest.read(files[0])
    name = f"{files[0].parent.name}/{manifest.graph_id}"
    package = files[0].parent / manifest.package_file
    assert package.exists()
    result = run_phase(page_server, artifacts, "delete", name=name)
    assert not files[0].exists() and not package.exists()
    assert name not in {row["name"] for row in result["rows"]}
    assert result["status"].startswith(f"deleted {name}"), result["status"]
    listing = page_server.get("/keepfast/graphs").json()
    assert name not in {row["name"] for row in listing["graphs"]}
