"""Every KEEPFAST_* setting is read in compiler/settings.py and listed in docs/settings.md, and reads as it did.

- No module of compiler/, nodes/ or benchmarks/ but settings.py names a KEEPFAST_ variable as a string of its own
  (a read, or a write for a child process, takes the name from settings.py), nor reads os.environ by a name it
  computes (which could be one).
- The files that run with no package (build_process/interface_object.py as the compiler wrapper script,
  build_process/child_priority.py in a spawned trace process) load settings.py by its path and read the same.
- docs/settings.md's table holds every setting, with settings.py's default, values, purpose and kind, and no other.
- The accessors parse as the reads they replaced did (the old code kept here as the reference), at call time.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from compiler import settings

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"KEEPFAST_[A-Z0-9_]+")
SCANNED = ("compiler", "nodes", "benchmarks")
ROW = re.compile(r"^\| `(KEEPFAST_[A-Z0-9_]+)` \| (.*) \| (.*) \| (.*) \| (user|internal) \|$")


# -- one module reads them -------------------------------------------------------------------------------------

def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def environment_findings(source: str) -> List[str]:
    """Where `source` names a KEEPFAST_ variable itself, or reads the environment by a computed name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            found.append(f"{node.lineno}: names {node.value} (take it from compiler/settings.py)")
        key: Optional[ast.AST] = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            function = node.func
            if (function.attr == "get" and _is_environ(function.value)) or (
                    function.attr == "getenv" and isinstance(function.value, ast.Name) and function.value.id == "os"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        if key is not None and not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
            found.append(f"{node.lineno}: reads the environment by a computed name ({ast.unparse(key)})")
    return found


def test_no_module_but_settings_reads_a_keepfast_variable():
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if path == REPO / "compiler" / "settings.py":
                continue
            found += [f"{path.relative_to(REPO)}:{line}" for line in environment_findings(path.read_text())]
    assert not found, "\n".join(found)


def test_the_scan_catches_each_kind_of_read():
    source = ('import os\nA = os.environ.get("KEEPFAST_X", "")\nB = os.getenv(NAME)\nC = os.environ[NAME]\n'
              'D = {"KEEPFAST_Y": "1"}\nos.environ[NAME] = "1"\nE = os.environ.get("HOME")\n'
              'F = "set KEEPFAST_Z to a folder"\n')
    assert sorted(line.split(":")[0] for line in environment_findings(source)) == ["2", "3", "4", "5"]


def test_settings_is_standard_library_only():
    """Files that run by path load it with no package: it imports nothing of the pack, nor anything installed."""
    imported = set()
    for node in ast.walk(ast.parse((REPO / "compiler" / "settings.py").read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import"
            imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


BY_PATH = """
import importlib.util, json, os, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
wrapper = load("kf_interface_object", "compiler/build_process/interface_object.py")
priority = load("kf_child_priority", "compiler/build_process/child_priority.py")
print(json.dumps({"settings": wrapper._settings().__name__, "same": wrapper._settings() is priority._settings(),
                  "off_env": wrapper.OFF_ENV, "log_env": wrapper.LOG_ENV, "on": wrapper._settings().interface_object(),
                  "log": wrapper._settings().interface_log(), "nice_env": priority.NICE_ENV,
                  "nice": priority.niceness(), "default_nice": priority.DEFAULT_NICENESS,
                  "pack": sorted(m for m in sys.modules if m.startswith(("compiler", "keepfast_compiler")))}))
"""


def test_files_run_by_path_load_settings_by_its_path():
    env = {"PATH": "/usr/bin:/bin", settings.INTERFACE_OBJECT.name: "0", settings.INTERFACE_LOG.name: "/tmp/log",
           settings.BUILD_NICE.name: " 3 "}
    done = subprocess.run([sys.executable, "-S", "-c", BY_PATH], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"settings": "keepfast_settings", "same": True, "off_env": settings.INTERFACE_OBJECT.name,
                    "log_env": settings.INTERFACE_LOG.name, "on": False, "log": "/tmp/log",
                    "nice_env": settings.BUILD_NICE.name, "nice": 3, "default_nice": settings.DEFAULT_BUILD_NICE,
                    "pack": []}


# -- one table lists them --------------------------------------------------------------------------------------

def _table() -> dict:
    rows = {}
    for line in (REPO / "docs" / "settings.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, default, values, purpose, kind = match.groups()
            assert name not in rows, f"{name} twice in docs/settings.md"
            rows[name] = (default, values, purpose, kind == "internal")
        else:
            assert not line.startswith("| `KEEPFAST_"), f"a row docs/settings.md's table cannot read: {line}"
    return rows


def test_the_docs_table_lists_every_setting_as_settings_py_declares_it():
    rows = _table()
    assert set(rows) == set(settings.SETTINGS), (sorted(set(rows) ^ set(settings.SETTINGS)))
    for name, setting in settings.SETTINGS.items():
        assert rows[name] == (setting.default, setting.values, setting.purpose, setting.internal), name


def test_the_internal_settings_are_marked():
    internal = {name for name, setting in settings.SETTINGS.items() if setting.internal}
    assert internal == {"KEEPFAST_PARENT_LIFELINE_FD", "KEEPFAST_SWEEPER", "KEEPFAST_INTERFACE_LOG"}


def test_every_name_the_sources_mention_is_declared():
    """A KEEPFAST_ name in a message or docstring of the pack is one settings.py declares (a typo, or a setting
    read somewhere this file does not scan, would be listed nowhere)."""
    mentioned = set()
    for top in SCANNED:
        for path in (REPO / top).rglob("*.py"):
            mentioned |= set(NAME.findall(path.read_text()))
    assert mentioned - set(settings.SETTINGS) == set()


# -- they parse as before --------------------------------------------------------------------------------------

VALUES = [None, "", "0", "1", " 3 ", "19", "20", "-2", "2.5", "abc", "spawn", "all", "channels_last",
          " Channels_Last ", " s3://bucket/graphs "]


def _old(name: str, value: Optional[str]):
    """The reads as they were written before settings.py, in the modules that made them."""
    environ = {} if value is None else {name: value}
    if name == "KEEPFAST_CLAIM_WAIT_S":
        try:
            return max(0.0, float(environ.get(name, 1800.0)))
        except ValueError:
            return 1800.0
    if name == "KEEPFAST_TRACE_TIMEOUT_S":
        text = environ.get(name, "")
        try:
            return float(text) if text else 300.0
        except ValueError:
            return 300.0
    if name == "KEEPFAST_BUILD_NICE":
        text = environ.get(name, "").strip()
        return int(text) if text.isdigit() and int(text) <= 19 else 10
    if name in ("KEEPFAST_BUILD_PROCESSES", "KEEPFAST_GRAPH_PARTS"):
        text = environ.get(name, "")
        return int(text) if text.isdigit() and int(text) > 0 else None
    if name == "KEEPFAST_BUILD_MEMORY_MB":
        text = environ.get(name, "")
        try:
            if text:
                return float(text)
        except ValueError:
            pass
        return None
    if name == "KEEPFAST_TRACE_PROCESS":
        return (environ.get(name, "1") == "0", environ.get(name) == "spawn")
    if name == "KEEPFAST_CONV_LAYOUT":
        return environ.get(name, "").strip().lower() == "channels_last"
    if name == "KEEPFAST_PERSISTENT_REDUCTIONS":
        return environ.get(name, "").strip() == "1"
    if name == "KEEPFAST_REMOTE_LIBRARY":
        return environ.get(name, "").strip() or None
    if name in ("KEEPFAST_ALIGN", "KEEPFAST_INTERFACE_OBJECT", "KEEPFAST_SPARE_BUILDER"):
        return environ.get(name, "1") != "0"
    if name == "KEEPFAST_CUDA_GRAPHS":
        return environ.get(name, "0") == "1"
    raise AssertionError(name)


NEW = {
    "KEEPFAST_CLAIM_WAIT_S": settings.claim_wait_s, "KEEPFAST_TRACE_TIMEOUT_S": settings.trace_timeout_s,
    "KEEPFAST_BUILD_NICE": settings.build_nice, "KEEPFAST_BUILD_PROCESSES": settings.build_processes,
    "KEEPFAST_GRAPH_PARTS": settings.graph_parts, "KEEPFAST_BUILD_MEMORY_MB": settings.build_memory_mb,
    "KEEPFAST_TRACE_PROCESS": lambda: (settings.trace_process() == "0", settings.trace_process() == "spawn"),
    "KEEPFAST_CONV_LAYOUT": settings.conv_channels_last,
    "KEEPFAST_PERSISTENT_REDUCTIONS": settings.persistent_reductions,
    "KEEPFAST_REMOTE_LIBRARY": settings.remote_library, "KEEPFAST_ALIGN": settings.align,
    "KEEPFAST_INTERFACE_OBJECT": settings.interface_object, "KEEPFAST_SPARE_BUILDER": settings.spare_builder,
    "KEEPFAST_CUDA_GRAPHS": settings.cuda_graphs,
}


@pytest.mark.parametrize("name", sorted(NEW))
def test_an_accessor_reads_as_the_code_it_replaced(name, monkeypatch):
    for value in VALUES:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)  # after import: read at each call
        assert NEW[name]() == _old(name, value), (name, value)


def test_the_modules_read_through_the_accessors(monkeypatch):
    from compiler.build_process import child_priority
    from compiler.builds import claims
    from compiler.tracing import forked_trace

    monkeypatch.delenv(settings.CLAIM_WAIT_S.name, raising=False)
    assert claims.wait_seconds() == 1800.0 == claims.DEFAULT_WAIT_S
    monkeypatch.setenv(settings.CLAIM_WAIT_S.name, "12")
    assert claims.wait_seconds() == 12.0
    monkeypatch.setenv(settings.CLAIM_WAIT_S.name, "soon")
    assert claims.wait_seconds() == 1800.0
    monkeypatch.setenv(settings.TRACE_TIMEOUT_S.name, "7")
    assert forked_trace._timeout() == 7.0
    monkeypatch.setenv(settings.TRACE_PROCESS.name, "0")
    assert forked_trace.general_refusal() == "KEEPFAST_TRACE_PROCESS=0"
    monkeypatch.setenv(settings.BUILD_NICE.name, "25")
    assert child_priority.niceness() == 10


def test_bad_remote_options_say_why_as_before(monkeypatch):
    from compiler.remote.location import RemoteError, storage_options

    assert storage_options(environ={}) == {}
    assert storage_options(environ={settings.REMOTE_OPTIONS.name: ' {"anon": true} '}) == {"anon": True}
    with pytest.raises(RemoteError, match=r"^\$KEEPFAST_REMOTE_OPTIONS is not JSON"):
        storage_options(environ={settings.REMOTE_OPTIONS.name: "{anon"})
    with pytest.raises(RemoteError, match=r"^\$KEEPFAST_REMOTE_OPTIONS must be a JSON object"):
        storage_options(environ={settings.REMOTE_OPTIONS.name: "[1]"})
    monkeypatch.setenv(settings.REMOTE_OPTIONS.name, '{"anon": false}')
    assert storage_options() == {"anon": False}


def test_an_undeclared_name_is_refused():
    with pytest.raises(KeyError):
        settings.get("KEEPFAST_NOT_A_SETTING")
