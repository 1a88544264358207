"""Command line: the demo, the benchmark, and graph store upkeep (ls, verify, rm, trust, export, import).

The same functions the ComfyUI nodes and the diffusers API use; nothing here
has logic of its own beyond printing.

Exit status of the `graphs` commands: 0 done (verify: every graph verifies);
1 verify found problems, or a graph was refused; 2 the folder given is not a
graphs folder (the message names the folder to give), or a name or file is
wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from .library import NotAGraphsFolder, graphs_folder, stored_at, trust
from .quiet import third_party_quiet
from .store import GraphRefused, GraphStore


def _open_store(folder: str) -> Optional[GraphStore]:
    """The graphs folder's store, or None after saying why it is not one (and which folder to give)."""
    try:
        return GraphStore(graphs_folder(folder))
    except NotAGraphsFolder as error:
        print(f"error: {error}", file=sys.stderr)
        return None


def _graphs_ls(args) -> int:
    store = _open_store(args.dir)
    if store is None:
        return 2
    rows = []
    for path, stored, problem in store.entries():
        if stored is None:
            rows.append({"name": str(path.relative_to(store.root)), "problem": problem})
            continue
        summary = stored.manifest.summary()
        summary["name"] = stored.name
        summary["trusted"] = store.trust.is_trusted(stored.manifest.package_sha256)
        rows.append(summary)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"{store.root}: no graphs")
    for row in rows:
        if "problem" in row:
            print(f"{row['name']}  UNREADABLE: {row['problem']}")
            continue
        ranges = ", ".join(f"{k} {v[0]}-{v[1]}" for k, v in row["shape_range"].items())
        print(f"{row['name']}  {_serves(row)} {row['dtype']} {row['device']} {row['backend']} "
              f"torch {row['torch_version']}  [{ranges}]  {row['bytes'] / 1e6:.1f} MB  "
              f"{'trusted' if row['trusted'] else 'NOT TRUSTED'}  {row['created']}")
    return 0


def _serves(row: dict) -> str:
    """What a graph serves: a model, or the blocks of one ('FluxTransformerBlock x19 of FluxTransformer2DModel')."""
    block = row.get("block")
    if not isinstance(block, dict):
        return row["architecture"]
    return f"{row['architecture']} x{block.get('instances', '?')} of {block.get('model', '?')}"


def _graphs_verify(args) -> int:
    store = _open_store(args.dir)
    if store is None:
        return 2
    bad = store.verify()
    for path, problem in bad:
        print(f"BAD {path}: {problem}")
    print(f"{len(store.graphs())} graphs, {len(bad)} problems")
    return 1 if bad else 0


def _graphs_rm(args) -> int:
    store = _open_store(args.dir)
    if store is None:
        return 2
    try:
        removed = store.remove(args.name)
    except (GraphRefused, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path in removed:
        print(f"removed {path}")
    return 0


def _graphs_trust(args) -> int:
    try:
        where, stored = stored_at(args.file)
    except GraphRefused as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        trust(where, stored, f"trusted by the user from {stored.package_path}")
    except GraphRefused as problem:
        print(f"refused: {problem}", file=sys.stderr)
        return 1
    print(f"trusted {stored.package_path} (sha256 {stored.manifest.package_sha256[:16]}...)")
    return 0


def _graphs_export(args) -> int:
    from .bundle import export_bundle

    store = _open_store(args.dir)
    if store is None:
        return 2
    try:
        path = export_bundle(store, args.name, Path(args.to))
    except (GraphRefused, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {path}")
    return 0


def _graphs_import(args) -> int:
    from .bundle import import_bundle
    from .store import StoreError

    try:
        stored = import_bundle(GraphStore(args.dir), Path(args.bundle), trust=args.trust, expect_dtype=args.dtype)
    except (GraphRefused, StoreError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    state = "trusted" if args.trust else f"NOT trusted yet: python -m compiler graphs trust {stored.manifest_path}"
    print(f"imported {stored.name} ({state})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="compile, sweep, save and reload a small SD pipeline")
    demo.add_argument("--out", required=True, help="folder for graphs and report.json")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--load-check", action="store_true", help=argparse.SUPPRESS)

    graphs = commands.add_parser("graphs", help="inspect and maintain a graphs folder")
    graph_commands = graphs.add_subparsers(dest="graphs_command", required=True)
    ls = graph_commands.add_parser("ls", help="list graphs")
    ls.add_argument("dir")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=_graphs_ls)
    verify = graph_commands.add_parser("verify", help="check every graph; exit 1 naming bad files")
    verify.add_argument("dir")
    verify.set_defaults(run=_graphs_verify)
    rm = graph_commands.add_parser("rm", help="remove a graph (FOLDER/GRAPH_ID as ls shows)")
    rm.add_argument("dir")
    rm.add_argument("name")
    rm.set_defaults(run=_graphs_rm)
    trust = graph_commands.add_parser("trust", help="trust a graph built elsewhere (its .json)")
    trust.add_argument("file")
    trust.set_defaults(run=_graphs_trust)
    export = graph_commands.add_parser("export", help="write one graph as a shareable bundle file")
    export.add_argument("dir")
    export.add_argument("name")
    export.add_argument("to", help="bundle file or folder")
    export.set_defaults(run=_graphs_export)
    imp = graph_commands.add_parser("import", help="add a graph bundle to a graphs folder")
    imp.add_argument("dir")
    imp.add_argument("bundle")
    imp.add_argument("--trust", action="store_true", help="also trust it (it is native code)")
    imp.add_argument("--dtype", help="refuse a graph of another dtype")
    imp.set_defaults(run=_graphs_import)

    from .testing.bench import add_arguments as _bench_arguments, run_from_args as _bench_run

    bench = commands.add_parser("bench", help="eager vs plain torch.compile vs KeepFast (see docs/benchmarks.md)")
    _bench_arguments(bench)
    bench.set_defaults(run=_bench_run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .testing.demo import run_demo

        return run_demo(Path(args.out), steps=args.steps, load_check=args.load_check)
    with third_party_quiet():  # the notices torch, diffusers and transformers print while a command runs
        return args.run(args)
