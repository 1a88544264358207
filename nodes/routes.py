"""The pack's HTTP routes: the graph library (list, verify, delete, trust) and the stats.

They take the graphs folders as a `MultiRootStore` factory, so ComfyUI's
server passes its `models/graphs` folders and the tests pass temporary ones;
nothing here imports ComfyUI, and the tests run these routes with aiohttp's
own test client.

Rules every route keeps, because a graph is native code and a name comes
from a web page:
- a graph is named as the library lists it, `FOLDER/GRAPH_ID`, plus the index
  of its graphs folder; the store's own name check refuses traversal,
  absolute paths and links (400), an unknown graph is 404;
- anything that changes files or the trust list is POST only, and so is
  verify (it hashes every package); a GET there is a 405 that says so;
- every answer is JSON; an error is `{"error": message}` with a 4xx status;
- file work (hashing a package) runs off the server's event loop.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from aiohttp import web

from ..compiler import (MANIFEST_SUFFIX, GraphRefused, GraphStore, MultiRootStore, StoredGraph, torch_version,
                        verify_and_trust)

PREFIX = "/keepfast"
STATS = PREFIX + "/stats"
GRAPHS = PREFIX + "/graphs"
VERIFY = GRAPHS + "/verify"
DELETE = GRAPHS + "/delete"
TRUST = GRAPHS + "/trust"
REMOTE_CHECK = PREFIX + "/remote/check"
REMOTE_PULL = PREFIX + "/remote/pull"
MAX_NAME = 300

StoreFactory = Callable[[], MultiRootStore]


class RouteError(Exception):
    """A request the routes refuse: the status and a message for the page."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# -- pure logic (called in a worker thread) ----------------------------------------

def _manifest_path(path: Path) -> Path:
    return path if path.name.endswith(MANIFEST_SUFFIX) else path.with_name(path.name + MANIFEST_SUFFIX)


def graph_row(where: GraphStore, root: int, path: Path, stored: Optional[StoredGraph],
              problem: Optional[str]) -> Dict[str, Any]:
    """One library row: what the manifest says, plus whether this machine trusts the package."""
    name = f"{path.parent.name}/{path.name[: -len(MANIFEST_SUFFIX)]}"
    if stored is None:
        return {"name": name, "root": root, "folder": str(where.root), "problem": problem or "unreadable manifest"}
    row = stored.manifest.summary()
    row.update(name=stored.name, root=root, folder=str(where.root),
               trusted=where.trust.is_trusted(stored.manifest.package_sha256),
               trust_source=where.trust.source_of(stored.manifest.package_sha256),
               package=stored.manifest.package_file, created_on=stored.manifest.created_on)
    return row


def list_graphs(store: MultiRootStore) -> Dict[str, Any]:
    rows = [graph_row(where, index, path, stored, problem)
            for index, where in enumerate(store.stores)
            for path, stored, problem in where.entries()]
    return {"folders": [str(root) for root in store.roots], "torch_version": torch_version(), "graphs": rows}


def locate(store: MultiRootStore, name: Any, root: Any = None) -> Tuple[int, GraphStore, Path]:
    """(root index, its store, manifest path) of a graph named by the page; RouteError if not one."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise RouteError(400, "give the graph's name as the library lists it (FOLDER/GRAPH_ID)")
    stores = store.stores
    if root is not None and (isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < len(stores)):
        raise RouteError(400, f"root must be the index of a graphs folder (0 to {len(stores) - 1})")
    candidates = [root] if root is not None else range(len(stores))
    for index in candidates:
        where = stores[index]
        try:
            path = _manifest_path(where.resolve(name))
        except ValueError as error:
            raise RouteError(400, str(error)) from None
        if len(path.relative_to(where.root).parts) != 2:
            raise RouteError(400, f"{name!r} is not a graph name (use FOLDER/GRAPH_ID)")
        if path.is_file():
            return index, where, path
    raise RouteError(404, f"no graph named {name!r} in {', '.join(str(stores[i].root) for i in candidates)}")


def _read(where: GraphStore, path: Path) -> Tuple[Optional[StoredGraph], Optional[str]]:
    relative = path.relative_to(where.root).as_posix()
    try:
        return where.get(relative), None
    except GraphRefused as error:
        return None, str(error)


def verify_graphs(store: MultiRootStore, name: Any = None, root: Any = None) -> Dict[str, Any]:
    """Check checksums and sizes: of one graph, or (no name) of every file in every graphs folder."""
    if name is None:
        problems = [{"file": str(file), "problem": problem}
                    for where in store.stores for file, problem in where.verify()]
        return {"ok": not problems, "checked": sum(len(w.entries()) for w in store.stores), "problems": problems}
    index, where, path = locate(store, name, root)
    stored, problem = _read(where, path)
    problems = [problem] if stored is None else where.problems(stored)
    row = graph_row(where, index, path, stored, problem)
    return {"ok": not problems, "name": row["name"], "root": index,
            "problems": [{"file": str(path if stored is None else stored.package_path), "problem": p}
                         for p in problems], "graph": row}


def delete_graph(store: MultiRootStore, name: Any, root: Any = None) -> Dict[str, Any]:
    """Remove a graph's manifest and package (an unreadable manifest alone, since it names nothing)."""
    index, where, path = locate(store, name, root)
    try:
        removed = where.remove(path.relative_to(where.root).as_posix())
    except GraphRefused:  # an unreadable manifest names no package: it goes alone
        path.unlink()
        removed = [path]
    return {"removed": [str(file) for file in removed], "name": name, "root": index}


def trust_graph(store: MultiRootStore, name: Any, root: Any = None) -> Dict[str, Any]:
    """Add a verified graph's package to this machine's trust list; a graph that fails verification is refused."""
    index, where, path = locate(store, name, root)
    stored, problem = _read(where, path)
    if stored is None:
        raise RouteError(409, f"not trusted: {problem}")
    try:
        verify_and_trust(where, stored, f"trusted by the user in the graph library ({stored.package_path})")
    except GraphRefused as problem:
        raise RouteError(409, f"not trusted: {problem}") from None
    return {"trusted": True, "graph": graph_row(where, index, path, stored, None)}


def remote_library(store: MultiRootStore, url: Any, names: Any = None, dry_run: bool = True) -> Dict[str, Any]:
    """A remote graph library (docs/fleet.md) as the page sees it: what fits this machine (dry_run: nothing
    downloaded but manifests), or pull it (only `names`, FOLDER/GRAPH_ID, when given) into the first graphs
    folder. A library that cannot be read answers 502 with the reason."""
    from ..compiler import pull_remote, remote_library_url

    if not isinstance(url, str) or not url.strip():
        url = remote_library_url()
        if not url:
            raise RouteError(400, "give the library's address: s3://bucket/prefix, hf://org/repo or a folder "
                                  "(or set KEEPFAST_REMOTE_LIBRARY)")
    if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
        raise RouteError(400, "names must be a list of FOLDER/GRAPH_ID")
    result = pull_remote(url.strip(), store.root, trust=store.trust, names=names, dry_run=dry_run)
    if result.error:
        raise RouteError(502, result.error)
    return {**result.to_json(), "summary": result.summary()}


# -- aiohttp ------------------------------------------------------------------------

async def _body(request: web.Request) -> Dict[str, Any]:
    try:
        data = json.loads(await request.text() or "{}")
    except ValueError:
        raise RouteError(400, "the request body must be JSON: {\"name\": \"FOLDER/GRAPH_ID\"}") from None
    if not isinstance(data, dict):
        raise RouteError(400, "the request body must be a JSON object")
    return data


async def _answer(work: Callable[[], Dict[str, Any]]) -> web.Response:
    try:
        return web.json_response(await asyncio.to_thread(work))
    except RouteError as error:
        return error_response(error.status, error.message)
    except OSError as error:
        return error_response(500, f"{type(error).__name__}: {error.strerror or error}")


def add_routes(routes: web.RouteTableDef, store: StoreFactory,
               stats: Optional[Callable[[], Dict[str, Any]]] = None) -> web.RouteTableDef:
    """Add the library routes (and the stats route, when `stats` is given) to `routes`.

    `store` is called per request, so graphs folders added after start-up
    (extra_model_paths.yaml) are seen.
    """
    if stats is not None:
        @routes.get(STATS)
        async def keepfast_stats(request: web.Request) -> web.Response:  # noqa: ARG001
            return web.json_response(stats())

    @routes.get(GRAPHS)
    async def keepfast_graphs(request: web.Request) -> web.Response:  # noqa: ARG001
        return await _answer(lambda: list_graphs(store()))

    def action(path: str, work: Callable[..., Dict[str, Any]], everything: bool = False) -> None:
        async def post(request: web.Request) -> web.Response:
            try:
                data = await _body(request)
            except RouteError as error:
                return error_response(error.status, error.message)
            name = data.get("name")
            if name is None and not everything:
                return error_response(400, "give the graph's name as the library lists it (FOLDER/GRAPH_ID)")
            return await _answer(lambda: work(store(), name, data.get("root")))

        async def refuse_get(request: web.Request) -> web.Response:  # noqa: ARG001
            response = error_response(405, f"{path} takes POST only, with a JSON body "
                                                 f"{{\"name\": \"FOLDER/GRAPH_ID\"}}")
            response.headers["Allow"] = "POST"
            return response

        routes.post(path)(post)
        routes.get(path)(refuse_get)

    for path, dry_run in ((REMOTE_CHECK, True), (REMOTE_PULL, False)):
        async def remote_post(request: web.Request, dry_run: bool = dry_run) -> web.Response:
            try:
                data = await _body(request)
            except RouteError as error:
                return error_response(error.status, error.message)
            return await _answer(lambda: remote_library(store(), data.get("url"), data.get("names"), dry_run))

        routes.post(path)(remote_post)

    action(VERIFY, verify_graphs, everything=True)
    action(DELETE, delete_graph)
    action(TRUST, trust_graph)
    return routes
