"""Command line: the demo, the benchmark, graph store upkeep (ls, verify, rm, trust, export, import) and
remote libraries (pull, push, keygen, trust-key, untrust-key, keys; docs/fleet.md).

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

from .store.library import NotAGraphsFolder, graphs_folder, stored_at, trust
from .serving.quiet import third_party_quiet
from .store.graph_store import GraphRefused, GraphStore


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
    from .store.bundle import export_bundle

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
    from .store.bundle import import_bundle
    from .store.graph_store import StoreError

    try:
        stored = import_bundle(GraphStore(args.dir), Path(args.bundle), trust=args.trust, expect_dtype=args.dtype)
    except (GraphRefused, StoreError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    state = "trusted" if args.trust else f"NOT trusted yet: python -m compiler graphs trust {stored.manifest_path}"
    print(f"imported {stored.name} ({state})")
    return 0


def _options(pairs: Optional[List[str]]) -> dict:
    """--option KEY=VALUE pairs as fsspec storage options (VALUE parsed as JSON when it is JSON)."""
    options = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {pair!r}: give KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def _graphs_pull(args) -> int:
    from .remote import NotAModel, pull, selector_for_path
    from .remote.select import selectors_union

    try:
        selector = selectors_union(selector_for_path(target) for target in args.for_ or [])
        options = _options(args.option)
    except (NotAModel, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = pull(args.url, Path(args.dir), selector, args.dtype, options, accept_unsigned=args.unsigned,
                  dry_run=args.dry_run, names=args.name)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        for outcome in result.outcomes:
            detail = f" ({outcome.bytes / 1e6:.1f} MB" + (f", signed by {outcome.signer}" if outcome.signer else "") \
                + ")" if outcome.bytes else ""
            print(f"{outcome.status.value} {outcome.name}{detail}" + (f": {outcome.reason}" if outcome.reason else ""))
        print(result.summary(), file=sys.stderr if result.error else sys.stdout)
    return 0 if result.ok else 1


def _graphs_warm_up(args) -> int:
    """A worker's start: pull from $KEEPFAST_REMOTE_LIBRARY; exit 0 whatever the library does (the worker
    starts, serving eager where no graph came)."""
    from .remote import NotAModel, pull, remote_library_url, selector_for_path
    from .remote.select import selectors_union
    from .remote.warmup import REMOTE_LIBRARY_ENV
    from .settings import remote_unsigned

    url = remote_library_url()
    if url is None:
        print(f"${REMOTE_LIBRARY_ENV} is not set: no remote graph library to pull from")
        return 0
    try:
        selector = selectors_union(selector_for_path(target) for target in args.for_ or [])
    except NotAModel as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = pull(url, Path(args.dir), selector, accept_unsigned=remote_unsigned())
    for outcome in result.refused:
        print(f"refused {outcome.name}: {outcome.reason}", file=sys.stderr)
    print(f"warm-up: {result.summary()}", file=sys.stderr if result.error else sys.stdout)
    return 0


def _graphs_push(args) -> int:
    from .remote import SigningKeyError, push
    from .remote.signing import SIGNING_KEY_ENV
    from .settings import signing_key

    store = _open_store(args.dir)
    if store is None:
        return 2
    key = args.key or signing_key()
    if not key:
        print(f"error: push signs every graph: give --key KEYFILE or set ${SIGNING_KEY_ENV} "
              "(make a key with: python -m compiler graphs keygen KEYFILE)", file=sys.stderr)
        return 2
    try:
        result = push(store.root, args.url, Path(key), names=args.name or None, options=_options(args.option))
    except (SigningKeyError, GraphRefused, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for outcome in result.outcomes:
        print(f"{outcome.status.value} {outcome.name}" + (f": {outcome.reason}" if outcome.reason else ""))
    print(result.summary(), file=sys.stderr if result.error else sys.stdout)
    return 0 if result.ok else 1


def _graphs_keygen(args) -> int:
    from .remote import SigningKeyError, generate_key

    try:
        public = generate_key(Path(args.file), args.name or Path(args.file).stem)
    except SigningKeyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"private key {args.file} (keep it secret), public key {args.file}.pub (key {public.key_id}); "
          f"workers trust it with: python -m compiler graphs trust-key {args.file}.pub")
    return 0


def _graphs_trust_key(args) -> int:
    from .remote import PublicKey, SigningKeyError
    from .store.trust import TrustList

    try:
        public = PublicKey.read(args.key)
    except SigningKeyError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    name = args.name or public.name
    added = TrustList().add_key(public.key_id, PublicKey(public.raw, name).line(), name)
    print(f"{'trusting' if added else 'already trusted:'} key {public.key_id} ({name or 'no name'}): graphs it "
          "signed are trusted when pulled")
    return 0


def _graphs_untrust_key(args) -> int:
    from .store.trust import TrustList

    trust_list = TrustList()
    if args.key_id not in trust_list.keys():
        print(f"error: key {args.key_id} is not on the trust list (graphs keys lists them)", file=sys.stderr)
        return 2
    dropped = trust_list.remove_key(args.key_id)
    print(f"no longer trusting key {args.key_id}, nor the {dropped} packages trusted because of it")
    return 0


def _graphs_keys(args) -> int:
    from .store.trust import TrustList

    keys = TrustList().keys()
    if not keys:
        print("no builder keys trusted (python -m compiler graphs trust-key FILE.pub)")
    for key_id, entry in sorted(keys.items()):
        print(f"{key_id}  {entry.get('name', '')}  added {entry.get('added', '')}")
    return 0


def _add_remote_commands(graph_commands) -> None:
    pull = graph_commands.add_parser("pull", help="copy the graphs of a remote library that fit here (and a model)")
    pull.add_argument("url", help="s3://bucket/prefix, hf://org/repo, gcs://..., or a shared folder")
    pull.add_argument("dir", help="the local graphs folder, e.g. ComfyUI/models/graphs")
    pull.add_argument("--for", dest="for_", action="append", metavar="MODEL",
                      help="only this model's graphs: a diffusers model or pipeline folder, or ARCHITECTURE-STRUCTURE")
    pull.add_argument("--dtype", help="only graphs of this dtype")
    pull.add_argument("--name", action="append", metavar="FOLDER/GRAPH_ID", help="only these graphs")
    pull.add_argument("--option", action="append", metavar="KEY=VALUE", help="fsspec storage option (repeatable)")
    pull.add_argument("--unsigned", action="store_true", help="also pull unsigned graphs (left untrusted)")
    pull.add_argument("--dry-run", action="store_true", help="say what fits; download no package")
    pull.add_argument("--json", action="store_true")
    pull.set_defaults(run=_graphs_pull)
    warm = graph_commands.add_parser("warm-up", help="a worker's start: pull from $KEEPFAST_REMOTE_LIBRARY "
                                     "(exit 0 even when it cannot be read)")
    warm.add_argument("dir", help="the local graphs folder")
    warm.add_argument("--for", dest="for_", action="append", metavar="MODEL", help="as for pull")
    warm.set_defaults(run=_graphs_warm_up)
    push = graph_commands.add_parser("push", help="sign and upload a graphs folder's graphs to a remote library")
    push.add_argument("dir")
    push.add_argument("url")
    push.add_argument("--key", help="the builder's private key (graphs keygen); default $KEEPFAST_SIGNING_KEY")
    push.add_argument("--name", action="append", metavar="FOLDER/GRAPH_ID", help="only these graphs")
    push.add_argument("--option", action="append", metavar="KEY=VALUE", help="fsspec storage option (repeatable)")
    push.set_defaults(run=_graphs_push)
    keygen = graph_commands.add_parser("keygen", help="make a builder's ed25519 signing key (FILE and FILE.pub)")
    keygen.add_argument("file")
    keygen.add_argument("--name", help="the builder's name, shown to those who pull")
    keygen.set_defaults(run=_graphs_keygen)
    trust_key = graph_commands.add_parser("trust-key", help="trust every graph a builder's key signed")
    trust_key.add_argument("key", help="the builder's FILE.pub (or its line)")
    trust_key.add_argument("--name")
    trust_key.set_defaults(run=_graphs_trust_key)
    untrust_key = graph_commands.add_parser("untrust-key", help="stop trusting a key and what it vouched for")
    untrust_key.add_argument("key_id")
    untrust_key.set_defaults(run=_graphs_untrust_key)
    keys = graph_commands.add_parser("keys", help="list trusted builder keys")
    keys.set_defaults(run=_graphs_keys)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="compile, sweep, save and reload a small SD pipeline")
    demo.add_argument("--out", required=True, help="folder for graphs and report.json")
    demo.add_argument("--steps", type=int, default=4)
    demo.add_argument("--load-check", action="store_true", help=argparse.SUPPRESS)
    demo.add_argument("--background", action="store_true",
                      help="build the graphs in a child process while the first image runs uncompiled, then wait "
                           "for them (docs/background.md)")

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
    _add_remote_commands(graph_commands)

    bench = commands.add_parser("bench", help="eager vs plain torch.compile vs KeepFast (see docs/benchmarks.md)")
    benchmarks = _benchmarks()
    if benchmarks is None:
        bench.set_defaults(run=lambda _args: _say_no_benchmarks())
    else:
        benchmarks.add_arguments(bench)
        bench.set_defaults(run=benchmarks.run_from_args)
    return parser


def _benchmarks():
    """The benchmark: the `benchmarks` folder beside this package, outside the library (None where it is absent)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "benchmarks" / "__init__.py").is_file() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import benchmarks
    except ImportError:
        return None
    return benchmarks


def _say_no_benchmarks() -> int:
    print("the benchmark is the `benchmarks` folder of the pack's repository, beside `compiler`; "
          "it is not here", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo.run import run_demo

        return run_demo(Path(args.out), steps=args.steps, load_check=args.load_check, background=args.background)
    with third_party_quiet():  # the notices torch, diffusers and transformers print while a command runs
        return args.run(args)
