"""The README, docs/ and tools/README.md name only what exists: CLI subcommands and options, repository paths,
modules, nodes; docs/results/ holds the numbers docs/benchmarks.md shows.

Read from the markdown itself: every `python -m compiler ...` command (and
`graphs SUBCOMMAND` mentions) against compiler/cli.py's parser; every other
`python -m MODULE` of this repository on disk; every link and image, every
repository path in code (a path whose first part is a top-level entry git
tracks) and every path under compiler/, benchmarks/, tools/, tests/ or nodes/
named in prose, on disk; every "KeepFast ..." node name and the README node
table's inputs against the schemas in nodes/comfy_nodes.py (read with ast:
ComfyUI is not imported). Each docs/results/*.json against the tables of the
docs/benchmarks.md section that links it (and its machine, torch, date and
command given). pyproject.toml's version, dependencies and license against
compiler/version.py, requirements.txt and LICENSE. The last test feeds the
checks a page with one mistake of each kind, so they are known to catch them.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Dict, List, Set

import pytest

from compiler.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md")) + [REPO / "tools" / "README.md"]
RESULTS = REPO / "docs" / "results"
# Paths the docs name that a tool creates, not git: why each is absent from a fresh checkout.
GENERATED = {"tests/comfyui/browser/node_modules": "npm install run by tests/comfyui/test_browser.py"}

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NODE_NAME = re.compile(r"\bKeepFast(?: [A-Z][A-Za-z]*)+|\bKeepFast[A-Z]\w+")
# A path under these folders named in prose (outside code, links and URLs) must exist too.
PROSE_PATH = re.compile(r"(?<![\w/.:-])((?:compiler|benchmarks|tools|tests|nodes)/[\w./-]*\w)")
MODULE = re.compile(r"-m ([A-Za-z_][\w.]*)")


# -- reading the markdown ------------------------------------------------------

def code_spans(text: str) -> List[str]:
    """Lines of fenced blocks (comments cut) and inline code spans (line breaks joined)."""
    spans = [line.split("  #")[0] for block in FENCE.findall(text) for line in block.splitlines()]
    prose = FENCE.sub("", text)
    return spans + [" ".join(span.split()) for span in INLINE.findall(prose)]


def cli_commands(text: str) -> List[List[str]]:
    """The words after `-m compiler` (and bare `graphs SUB` mentions) in every code span."""
    found = []
    for span in code_spans(text):
        for match in re.finditer(r"-m compiler\s+([^|`#]*)", span):
            found.append(match.group(1).split())
        if re.match(r"graphs [a-z]+\b", span):
            found.append(span.split())
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def results_sections(text: str) -> Dict[str, tuple]:
    """{results file stem: (heading, [(columns, rows), ...])}: every section that links docs/results/NAME.json, with
    the markdown tables from its heading to the next heading of its level or above (cells without `**`)."""
    lines = FENCE.sub("", text).splitlines()
    headings = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines)
                for m in [re.match(r"^(#+) (.+)$", line)] if m]
    found = {}
    for i, line in enumerate(lines):
        for name in re.findall(r"\]\(results/([\w.-]+)\.json\)", line):
            start, level, title = max((h for h in headings if h[0] <= i), default=(0, 0, ""))
            end = next((j for j, lv, _ in headings if j > start and lv <= level), len(lines))
            tables, rows = [], []
            for row in lines[start:end] + [""]:
                if row.startswith("|"):
                    rows.append([cell.strip().replace("**", "") for cell in row.strip().strip("|").split("|")])
                elif rows:
                    tables.append((rows[0], [r for r in rows[2:]]))
                    rows = []
            found[name] = (title, tables)
    return found


# -- what exists ---------------------------------------------------------------

def parser_tree():
    """{subcommand: (options, {sub-subcommand: options})} from compiler/cli.py's parser."""
    def subparsers(parser):
        for action in parser._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                return action.choices
        return {}

    tree = {}
    for name, sub in subparsers(build_parser()).items():
        tree[name] = (set(sub._option_string_actions),
                      {child: set(p._option_string_actions) for child, p in subparsers(sub).items()})
    return tree


def tracked_tops() -> Set[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {line.split("/")[0] for line in listed.splitlines() if line}


def node_schemas() -> Dict[str, Set[str]]:
    """Node ids and display names -> the input names written in nodes/comfy_nodes.py (all nodes' inputs)."""
    tree = ast.parse((REPO / "nodes" / "comfy_nodes.py").read_text())
    names, inputs = set(), set()
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        texts = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        keywords = {k.arg: k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)}
        func = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if func == "_graph_tool_schema":
            names.update(texts[:2])
        names.update(v for k, v in keywords.items() if k in ("node_id", "display_name"))
        if func == "Input" and texts:
            inputs.add(texts[0])
    return {name: inputs for name in names if name.startswith("KeepFast")}


# -- the checks ------------------------------------------------------------------

def problems(page: Path, text: str) -> List[str]:
    found = []
    tree = parser_tree()
    for words in cli_commands(text):
        command = words[0] if words else ""
        if command not in tree:
            found.append(f"`python -m compiler {' '.join(words)}`: no subcommand {command!r}")
            continue
        options, children = tree[command]
        if children:
            child = words[1] if len(words) > 1 else ""
            if child not in children:
                found.append(f"`{' '.join(words)}`: {command} has no subcommand {child!r}")
                continue
            options = children[child]
        found += [f"`{' '.join(words)}`: no option {flag}" for flag in re.findall(r"(?<![\w-])--[\w-]+", " ".join(words))
                  if flag not in options]

    for target in LINK.findall(INLINE.sub("", FENCE.sub("", text))):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            found.append(f"link to {target}: {path} does not exist")
        elif anchor and path.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", FENCE.sub("", path.read_text()), re.M)}
            if anchor not in headings:
                found.append(f"link to {target}: no heading with that anchor in {path.name}")

    tops = tracked_tops()
    for span in code_spans(text):
        for word in span.split():
            word = word.strip("\"'(),;:[]").rstrip(".")
            if re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", word) and word.split("/")[0] in tops and word != ".":
                if not (REPO / word).exists() and word.rstrip("/") not in GENERATED:
                    found.append(f"path {word}: not in the repository")

    for span in code_spans(text):
        for module in MODULE.findall(span):
            parts = module.split(".")
            if parts[0] in tops and parts[0] != "compiler":
                base = REPO.joinpath(*parts)
                if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                    found.append(f"`python -m {module}`: no such module in the repository")

    prose = re.sub(r"\]\([^)]*\)", "]", INLINE.sub("", FENCE.sub("", text)))
    for word in PROSE_PATH.findall(re.sub(r"https?://\S+", "", prose)):
        if not (REPO / word).exists() and word.rstrip("/") not in GENERATED:
            found.append(f"path {word}: not in the repository")

    schemas = node_schemas()
    for name in set(NODE_NAME.findall(text)):
        if name not in schemas:
            found.append(f"node {name!r}: no such node in nodes/comfy_nodes.py")
    for row in re.findall(r"^\| (KeepFast [^|]+) \| ([^|]+) \|", text, re.M):
        for word in re.findall(r"`(\w+)`", row[1]):
            if word not in schemas.get(row[0].strip(), set()):
                found.append(f"node table: {row[0].strip()} has no input {word!r}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_page_names_only_what_exists(page):
    assert problems(page, page.read_text()) == []


def test_readme_is_short_and_the_docs_pages_exist():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150
    for name in ("how-it-works", "families", "attention", "sharing-and-trust", "oneflow", "machines", "benchmarks",
                 "gpu"):
        assert (REPO / "docs" / f"{name}.md") in PAGES, name


def test_results_files_hold_the_tables_benchmarks_md_shows():
    sections = results_sections((REPO / "docs" / "benchmarks.md").read_text())
    assert sections, "docs/benchmarks.md links no results file"
    assert {p.stem for p in RESULTS.glob("*.json")} == set(sections)
    for name, (heading, tables) in sections.items():
        data = json.loads((RESULTS / f"{name}.json").read_text())
        for key in ("run", "machine", "torch", "date", "command", "source"):
            assert isinstance(data.get(key), str) and data[key], (name, key)
        assert data["run"] == heading, name
        assert [(t["columns"], t["rows"]) for t in data["tables"]] == [(c, r) for c, r in tables], name


def test_pyproject_matches_the_version_and_the_requirements():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    version_file = ast.parse((REPO / "compiler" / "version.py").read_text())
    version = next(n.value.value for n in version_file.body if isinstance(n, ast.Assign)
                   and getattr(n.targets[0], "id", "") == "__version__")
    assert project["project"]["version"] == version
    requirements = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    assert project["project"]["dependencies"] == [line for line in requirements if line]
    assert {"PublisherId", "DisplayName", "Icon"} <= set(project["tool"]["comfy"])
    assert "Repository" in project["project"]["urls"]
    assert "web" not in project["tool"]["comfy"]  # ComfyUI would serve web/ under the project name, not the folder's
    assert "GNU GENERAL PUBLIC LICENSE" in (REPO / "LICENSE").read_text()[:200]
    assert project["project"]["license"] == {"text": "GPL-3.0-only"}


def test_the_checks_catch_each_kind_of_mistake(tmp_path):
    page = tmp_path / "page.md"
    text = "\n".join([
        "Run `python -m compiler graphs lss DIR` and `python -m compiler demo --out x --fast`.",
        "```bash", "python -m compiler benchmark --out x", "```",
        "See [gone](nowhere.md), [bad anchor](" + str(REPO / "README.md") + "#no-such-heading) and `compiler/gone.py`.",
        "Run `python -m benchmarks.gone_probe` as compiler/testing/gone.py says.",
        "Drag **KeepFast Model Sppedup** or `KeepFastNoSuchNode` in.",
        "| KeepFast Save Graph | `model`; `nmae` | writes |",
    ])
    page.write_text(text)
    found = "\n".join(problems(page, text))
    for expected in ("no subcommand 'lss'", "no option --fast", "no subcommand 'benchmark'", "nowhere.md",
                     "no heading with that anchor", "path compiler/gone.py", "'KeepFast Model Sppedup'",
                     "'KeepFastNoSuchNode'", "no input 'nmae'", "`python -m benchmarks.gone_probe`: no such module",
                     "path compiler/testing/gone.py"):
        assert expected in found, (expected, found)
