"""The time left of background builds (compiler/builds/status.py) from this machine's build times
(compiler/builds/times.py): the queue's rules on made-up builds, and the times file kept small and safe."""

from __future__ import annotations

import json

import pytest

from compiler.builds import status as build_status, times as build_times
from compiler.backends.base import BuildLabel
from compiler.builds.package_builds import BUILDING, BUILT, WAITING, BuildView


@pytest.fixture(autouse=True)
def times(tmp_path, monkeypatch):
    path = tmp_path / "config" / "build_times.json"
    monkeypatch.setenv(build_times.TIMES_ENV, str(path))
    return path


def view(what: str, state: str, running_s: float = 0.0) -> BuildView:
    return BuildView(BuildLabel(owner="Flux", what=what, family=what), state, running_s)


def test_no_estimate_before_this_machine_built_anything():
    assert build_times.estimate("UNet") is None
    assert build_status._finish_times([view("a", BUILDING, 3.0), view("b", WAITING)], slots=1) == [None, None]


def test_the_queue_s_rules_give_each_build_its_end(times):
    build_times.record("a", 30.0)
    build_times.record("b", 10.0)
    views = [view("a", BUILDING, 12.0), view("b", WAITING), view("a", WAITING), view("done", BUILT)]
    # One slot: a ends in 18 s, then b (10 s), then another a (30 s); a built one is done.
    assert build_status._finish_times(views, slots=1) == [18.0, 28.0, 58.0, 0.0]
    # Two slots: b starts now in the free slot, the second a when b ends.
    assert build_status._finish_times(views, slots=2) == [18.0, 10.0, 40.0, 0.0]
    # A kind never built here is estimated from the others' latest times.
    assert build_times.estimate("c") == 20.0
    # The time left never reaches 0 while the build runs past its usual time.
    assert build_status._finish_times([view("b", BUILDING, 99.0)], slots=1) == [1.0]


def test_the_file_keeps_the_last_builds_per_kind_and_survives_a_bad_file(times):
    for seconds in range(1, 9):
        build_times.record("a", float(seconds))
    assert json.loads(times.read_text()) == {"a": [4.0, 5.0, 6.0, 7.0, 8.0]}
    assert build_times.estimate("a") == 6.0
    times.write_text("{not json")
    assert build_times.estimate("a") is None  # an unreadable file loses the estimate, nothing else
    build_times.record("a", 2.0)
    assert json.loads(times.read_text()) == {"a": [2.0]}
    assert [p.name for p in times.parent.iterdir()] == ["build_times.json"]  # no temp file left


def test_progress_text_says_which_graph_of_how_many_and_the_time_left():
    entry = build_status.BuildProgress(owner="Flux", owner_id="Flux@1", families=("f1", "f2"), done=1, total=2,
                                       building=("block SingleStreamBlock",), ready=1, failed=0, left_s=31.6)
    assert entry.text() == ("Flux: building in the background: graph 2 of 2 (block SingleStreamBlock), "
                            "about 32 s left")
    done = build_status.BuildProgress(owner="Flux", owner_id="Flux@1", families=(), done=2, total=2, building=(),
                                      ready=1, failed=1, left_s=0.0)
    assert done.text() == "Flux: 1 built, serving from the next call; 1 failed (those inputs run uncompiled)"
    assert done.to_json()["text"] == done.text()
