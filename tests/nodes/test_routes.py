"""The graph library's HTTP routes (nodes/routes.py), served by aiohttp's test server; no ComfyUI.

The graphs are real store entries: a manifest and a package written through
the store's own import path (the package bytes are arbitrary: these routes
read manifests, hash packages and move files, they never load a graph), plus
the session's compiled graphs for one listing of real ones.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, Optional

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.pack import pack_module

PACK = "keepfast_pack_for_routes"


def _pack_module(name: str):
    return pack_module(PACK, name)


routes = _pack_module("nodes.routes")
adapter = _pack_module("compiler.store.graph_store")
keys = _pack_module("compiler.keys.graph_keys")
manifest_module = _pack_module("compiler.store.manifest")
shapes = _pack_module("compiler.keys.shapes")
base = _pack_module("compiler.backends.base")
trust_module = _pack_module("compiler.store.trust")
atomic = _pack_module("compiler.store.atomic")


def _write_graph(root: Path, trust, architecture: str, dtype: str = "float16", origin: str = "built here",
                 payload: bytes = b"package bytes", spatial=(8, 128), torch_version: str = "2.13.0"):
    """A manifest and package as the store writes them ('built here' puts it on the trust list)."""
    family = keys.FamilyKey(architecture=architecture, structure="abcdef0123456789", signature="sig0",
                            dtype=dtype, device="cpu", backend="aot", torch_version=torch_version)
    key = keys.GraphKey(family, shapes.ShapeRange(batch=(1, 4), spatial=spatial, sequence=(1, 231)))
    sha = atomic.sha256_bytes(payload)
    manifest = manifest_module.Manifest(
        key=key, package_file=f"{key.id}.{sha[:16]}.pt2", package_sha256=sha, package_bytes=len(payload),
        info=base.PackageInfo(guards=[], constant_names=[]), signature={"tensors": [{"path": "x"}]})
    store = adapter.GraphStore(root, trust)
    return store.import_graph(manifest, payload, origin=origin)


class Api:
    """Sync calls to the routes on a fresh aiohttp test server."""

    def __init__(self, store_factory, stats=None):
        self.store_factory = store_factory
        self.stats = stats

    async def _call(self, method: str, path: str, body: Any, raw: Optional[str]):
        app = web.Application()
        table = web.RouteTableDef()
        routes.add_routes(table, self.store_factory, self.stats)
        app.add_routes(table)
        async with TestClient(TestServer(app)) as client:
            kwargs = {"data": raw} if raw is not None else ({"json": body} if body is not None else {})
            response = await client.request(method, path, **kwargs)
            assert response.content_type == "application/json", (response.status, await response.text())
            return response.status, await response.json(), response.headers

    def __call__(self, method: str, path: str, body: Any = None, raw: Optional[str] = None):
        status, data, _ = asyncio.run(self._call(method, path, body, raw))
        return status, data

    def headers(self, method: str, path: str):
        return asyncio.run(self._call(method, path, None, None))[2]


@pytest.fixture
def trust(tmp_path):
    return trust_module.TrustList(tmp_path / "trust" / "trusted.json")


@pytest.fixture
def library(tmp_path, trust):
    """Two graphs folders: the first holds a trusted UNet graph and an imported, untrusted VAE graph."""
    first, second = tmp_path / "graphs", tmp_path / "extra-graphs"
    unet = _write_graph(first, trust, "UNetModel")
    vae = _write_graph(first, trust, "Decoder", dtype="float32", origin="imported from vae.kfgraph",
                       payload=b"other package")
    other = _write_graph(second, trust, "UNetModel", spatial=(8, 64), payload=b"third package")
    store = lambda: adapter.MultiRootStore([first, second], trust)  # noqa: E731
    return {"api": Api(store), "first": first, "second": second, "unet": unet, "vae": vae, "other": other,
            "trust": trust}


def _files(*roots: Path):
    return sorted(str(p) for root in roots for p in root.rglob("*") if p.is_file())


def _by_name(listing: dict) -> dict:
    return {(row["root"], row["name"]): row for row in listing["graphs"]}


def test_the_library_lists_every_graph_with_what_the_page_shows(library):
    status, listing = library["api"]("GET", routes.GRAPHS)
    assert status == 200
    assert listing["folders"] == [str(library["first"]), str(library["second"])]
    rows = _by_name(listing)
    assert set(rows) == {(0, library["unet"].name), (0, library["vae"].name), (1, library["other"].name)}
    unet = rows[(0, library["unet"].name)]
    assert unet["architecture"] == "UNetModel" and unet["dtype"] == "float16" and unet["device"] == "cpu"
    assert unet["shape_range"] == {"batch": [1, 4], "spatial": [8, 128], "sequence": [1, 231]}
    assert unet["bytes"] == len(b"package bytes") and unet["torch_version"] == "2.13.0"
    assert unet["created"] == library["unet"].manifest.created and unet["trusted"] is True
    vae = rows[(0, library["vae"].name)]
    assert vae["architecture"] == "Decoder" and vae["dtype"] == "float32"
    assert vae["trusted"] is False and vae["origin"] == "imported from vae.kfgraph"
    assert rows[(1, library["other"].name)]["shape_range"]["spatial"] == [8, 64]


def test_an_unreadable_manifest_is_listed_with_its_problem_and_can_be_deleted(library):
    broken = library["first"] / library["unet"].manifest_path.parent.name / "broken.json"
    broken.write_text("{not json")
    status, listing = library["api"]("GET", routes.GRAPHS)
    row = _by_name(listing)[(0, f"{broken.parent.name}/broken")]
    assert status == 200 and "cannot read broken.json" in row["problem"]
    status, verified = library["api"]("POST", routes.VERIFY, {"name": row["name"]})
    assert status == 200 and verified["ok"] is False and "cannot read" in verified["problems"][0]["problem"]
    status, refused = library["api"]("POST", routes.TRUST, {"name": row["name"]})
    assert status == 409 and "not trusted" in refused["error"]
    status, deleted = library["api"]("POST", routes.DELETE, {"name": row["name"]})
    assert status == 200 and deleted["removed"] == [str(broken)] and not broken.exists()
    assert library["unet"].manifest_path.exists()


def test_verify_reports_a_changed_package_and_passes_an_intact_one(library):
    api = library["api"]
    status, good = api("POST", routes.VERIFY, {"name": library["unet"].name})
    assert status == 200 and good["ok"] is True and good["problems"] == []
    library["vae"].package_path.write_bytes(b"other packagf")  # same size, other bytes
    status, bad = api("POST", routes.VERIFY, {"name": library["vae"].name})
    assert status == 200 and bad["ok"] is False
    assert "does not match its checksum" in bad["problems"][0]["problem"]
    status, everything = api("POST", routes.VERIFY, {})
    assert status == 200 and everything["ok"] is False and everything["checked"] == 3
    assert [p["file"] for p in everything["problems"]] == [str(library["vae"].package_path)]


def test_trust_adds_an_intact_graph_and_refuses_a_changed_one(library):
    api, trust = library["api"], library["trust"]
    sha = library["vae"].manifest.package_sha256
    assert not trust.is_trusted(sha)
    status, answer = api("POST", routes.TRUST, {"name": library["vae"].name, "root": 0})
    assert status == 200 and answer["trusted"] is True and answer["graph"]["trusted"] is True
    assert trust.is_trusted(sha) and "graph library" in trust.source_of(sha)
    assert _by_name(api("GET", routes.GRAPHS)[1])[(0, library["vae"].name)]["trusted"] is True

    trust.remove(sha)
    library["vae"].package_path.write_bytes(b"tampered!")
    status, refused = api("POST", routes.TRUST, {"name": library["vae"].name})
    assert status == 409 and "bytes" in refused["error"] and not trust.is_trusted(sha)


def test_delete_removes_the_manifest_and_package_and_nothing_else(library):
    api = library["api"]
    before = _files(library["first"], library["second"])
    status, answer = api("POST", routes.DELETE, {"name": library["unet"].name, "root": 0})
    assert status == 200
    gone = {str(library["unet"].manifest_path), str(library["unet"].package_path)}
    assert set(answer["removed"]) == gone
    assert _files(library["first"], library["second"]) == sorted(set(before) - gone)
    assert (0, library["unet"].name) not in _by_name(api("GET", routes.GRAPHS)[1])
    status, again = api("POST", routes.DELETE, {"name": library["unet"].name, "root": 0})
    assert status == 404 and "no graph named" in again["error"]


def test_a_name_in_the_second_folder_is_found_without_a_root(library):
    status, answer = library["api"]("POST", routes.DELETE, {"name": library["other"].name})
    assert status == 200 and answer["root"] == 1 and not library["other"].manifest_path.exists()


BAD_NAMES = ["../outside", "/etc/passwd", "a/../../b", "a/b/c", "..", "", ".hidden", "UNetModel-abcdef012345",
             "x/../../../etc/passwd", "C:\\Windows\\x", 7, None, ["a", "b"], "a" * 400]


@pytest.mark.parametrize("path,name", [(path, name) for path in (routes.DELETE, routes.TRUST, routes.VERIFY)
                                       for name in BAD_NAMES
                                       if not (path == routes.VERIFY and name is None)])  # verify everything
def test_bad_names_are_refused_with_a_message_and_touch_nothing(library, tmp_path, path, name):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    before = _files(tmp_path)
    trusted = library["trust"].path.read_text()
    status, answer = library["api"]("POST", path, {"name": name})
    assert status == 400, answer
    assert isinstance(answer["error"], str) and answer["error"]
    assert _files(tmp_path) == before and library["trust"].path.read_text() == trusted


def test_a_link_out_of_the_graphs_folder_is_refused(library, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "victim.json").write_text("{}")
    (library["first"] / "evil").symlink_to(outside, target_is_directory=True)
    status, answer = library["api"]("POST", routes.DELETE, {"name": "evil/victim"})
    assert status == 400 and "outside" in answer["error"]
    assert (outside / "victim.json").exists()
    assert all(not row["name"].startswith("evil/") for row in library["api"]("GET", routes.GRAPHS)[1]["graphs"])


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", "\"a string\""])
def test_a_body_that_is_not_a_json_object_is_refused(library, raw):
    status, answer = library["api"]("POST", routes.DELETE, raw=raw)
    assert status == 400 and "JSON" in answer["error"]


@pytest.mark.parametrize("root", [5, -1, "0", True, 1.0])
def test_a_bad_root_is_refused(library, root):
    status, answer = library["api"]("POST", routes.DELETE, {"name": library["unet"].name, "root": root})
    assert status == 400 and "root" in answer["error"] and library["unet"].manifest_path.exists()


def test_missing_name_is_refused_for_changes(library):
    for path in (routes.DELETE, routes.TRUST):
        status, answer = library["api"]("POST", path, {})
        assert status == 400 and "FOLDER/GRAPH_ID" in answer["error"]


@pytest.mark.parametrize("path", [routes.DELETE, routes.TRUST, routes.VERIFY])
def test_get_on_a_changing_route_is_405_json_and_changes_nothing(library, path):
    before = _files(library["first"], library["second"])
    status, answer = library["api"]("GET", path + "?name=" + library["unet"].name)
    assert status == 405 and "POST" in answer["error"]
    assert library["api"].headers("GET", path)["Allow"] == "POST"
    assert _files(library["first"], library["second"]) == before


def test_an_empty_or_missing_graphs_folder_lists_nothing(tmp_path, trust):
    api = Api(lambda: adapter.MultiRootStore([tmp_path / "missing"], trust))
    status, listing = api("GET", routes.GRAPHS)
    assert status == 200 and listing["graphs"] == [] and listing["folders"] == [str(tmp_path / "missing")]
    status, answer = api("POST", routes.VERIFY, {})
    assert status == 200 and answer == {"ok": True, "checked": 0, "problems": []}


def test_stats_route_serves_what_it_is_given(trust, tmp_path):
    api = Api(lambda: adapter.MultiRootStore([tmp_path], trust), stats=lambda: {"counts": {"compiles": 3}})
    assert api("GET", routes.STATS) == (200, {"counts": {"compiles": 3}})
    no_stats = Api(lambda: adapter.MultiRootStore([tmp_path], trust))
    status, _ = asyncio.run(_raw_status(no_stats, routes.STATS))
    assert status == 404


async def _raw_status(api: Api, path: str):
    app = web.Application()
    table = web.RouteTableDef()
    routes.add_routes(table, api.store_factory, api.stats)
    app.add_routes(table)
    async with TestClient(TestServer(app)) as client:
        response = await client.get(path)
        return response.status, await response.text()


def test_the_sessions_compiled_graphs_list_and_verify(saved_pipe, tmp_path, trust):
    """Real packages written by save_pipe: listed with their architecture and range, and they verify."""
    graphs = tmp_path / "graphs"
    shutil.copytree(saved_pipe.graphs, graphs)
    api = Api(lambda: adapter.MultiRootStore([graphs], trust))
    status, listing = api("GET", routes.GRAPHS)
    assert status == 200 and len(listing["graphs"]) >= 2
    assert {"UNet2DConditionModel", "Decoder"} <= {row["architecture"] for row in listing["graphs"]}
    for row in listing["graphs"]:
        assert row["bytes"] > 10_000 and row["shape_range"]["spatial"] == [8, 24]
        assert row["trusted"] is False  # another trust list than the one that built them
        status, verified = api("POST", routes.VERIFY, {"name": row["name"]})
        assert status == 200 and verified["ok"] is True, verified


def test_the_page_checks_and_pulls_a_remote_library(library, tmp_path, trust):
    """The page's remote library: Check lists what the library holds and whether it fits here without
    downloading a package; Pull brings the graphs that fit, signed by a trusted builder, into the first graphs
    folder; a library that cannot be read answers 502 with the reason, and no address at all 400."""
    signing = _pack_module("compiler.remote.signing")
    push = _pack_module("compiler.remote.push")
    here = _pack_module("compiler.machine.environment").torch_version()
    builder = tmp_path / "builder-graphs"
    fits = _write_graph(builder, trust, "UNetModel", torch_version=here, payload=b"fits here")
    other = _write_graph(builder, trust, "UNetModel", payload=b"another torch", spatial=(8, 64))
    public = signing.generate_key(tmp_path / "builder.key", "builder")
    remote = tmp_path / "remote-library"
    push.push(builder, str(remote), tmp_path / "builder.key")
    worker = tmp_path / "worker-graphs"
    api = Api(lambda: adapter.MultiRootStore([worker], trust))
    status, checked = api("POST", routes.REMOTE_CHECK, {"url": str(remote)})
    assert status == 200, checked
    # The builder's key is not trusted yet: refused with the command that trusts it; the misfit is skipped.
    assert {g["name"]: g["status"] for g in checked["graphs"]} == {fits.name: "refused", other.name: "skipped"}
    assert "trust-key" in next(g["reason"] for g in checked["graphs"] if g["name"] == fits.name), checked
    trust.add_key(public.key_id, public.line(), "builder")  # the user trusts the builder once
    status, checked = api("POST", routes.REMOTE_CHECK, {"url": str(remote)})
    assert {g["name"]: g["status"] for g in checked["graphs"]} == {fits.name: "fits", other.name: "skipped"}, checked
    assert not worker.exists() or not list(worker.rglob("*.pt2"))  # a check downloads no package
    status, pulled = api("POST", routes.REMOTE_PULL, {"url": str(remote), "names": [fits.name]})
    assert status == 200 and [(g["name"], g["status"]) for g in pulled["graphs"]] == [(fits.name, "pulled")], pulled
    assert "1 pulled" in pulled["summary"] and (worker / f"{fits.name}.json").is_file()
    status, missing = api("POST", routes.REMOTE_CHECK, {"url": str(tmp_path / "no-such-library")})
    assert status == 502 and "not found" in missing["error"], missing
    status, nothing = api("POST", routes.REMOTE_CHECK, {"url": ""})
    assert status == 400 and "library's address" in nothing["error"], nothing
