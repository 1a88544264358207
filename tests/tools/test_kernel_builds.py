"""tools/kernel_builds/kernel_builds.py: Triton build seconds per configuration against concurrency.

The machine facts are read from fake /proc and /sys trees, the level maths from given numbers, the budget from a
fake clock and a fake worker pool; one real run captures a 3-op module's Inductor kernels (kernel_sources.py) and
builds them for sm_90 on this CPU at concurrency 1 and 2. That run needs Triton: this interpreter's, or the
Python named by KEEPFAST_TRITON_PYTHON (e.g. .venv-torch211/bin/python); otherwise it is skipped.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import time
from pathlib import Path

import pytest

from tools.kernel_builds import kernel_builds as kb
from tests.support.triton_python import triton_python

pytestmark = pytest.mark.usefixtures("no_build_memo")  # the build process is the subject: every build compiles

ROOT = Path(__file__).resolve().parents[2]


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_machine(root: Path, cgroup: str = "v2") -> None:
    """2 sockets x 2 cores x 2 threads: CPUs n and n+4 are siblings, as Linux numbers them."""
    blocks = []
    for cpu in range(8):
        package, core = (cpu % 4) // 2, cpu % 2
        blocks.append(f"processor\t: {cpu}\nmodel name\t: Fake Xeon 9000\nphysical id\t: {package}\n"
                      f"core id\t\t: {core}\ncpu MHz\t\t: {2000.0 + 100 * cpu:.3f}\n")
        topology = f"sys/devices/system/cpu/cpu{cpu}/topology"
        _write(root, f"{topology}/thread_siblings_list", f"{cpu % 4},{cpu % 4 + 4}\n")
        _write(root, f"{topology}/physical_package_id", f"{package}\n")
        _write(root, f"{topology}/core_id", f"{core}\n")
    _write(root, "proc/cpuinfo", "\n".join(blocks) + "\n")
    _write(root, "sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", "3500000\n")
    _write(root, "sys/devices/system/cpu/smt/active", "1\n")
    if cgroup == "v2":
        _write(root, "proc/self/cgroup", "0::/kubepods/pod1\n")
        _write(root, "sys/fs/cgroup/cpu.max", "max 100000\n")
        _write(root, "sys/fs/cgroup/kubepods/cpu.max", "600000 100000\n")
        _write(root, "sys/fs/cgroup/kubepods/pod1/cpu.max", "400000 100000\n")
        _write(root, "sys/fs/cgroup/kubepods/pod1/cpuset.cpus.effective", "0-3\n")
        _write(root, "sys/fs/cgroup/kubepods/pod1/cpu.stat",
               "usage_usec 100\nnr_periods 40\nnr_throttled 7\nthrottled_usec 2500000\n")
    else:
        _write(root, "proc/self/cgroup", "4:cpu,cpuacct:/\n")
        _write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "150000\n")
        _write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
        _write(root, "sys/fs/cgroup/cpu,cpuacct/cpu.stat", "nr_periods 10\nnr_throttled 2\nthrottled_time 500000000\n")


def test_machine_facts_read_topology_clock_and_the_tightest_cgroup_v2_quota(tmp_path):
    _fake_machine(tmp_path, "v2")
    facts = kb.machine_facts(tmp_path)
    topology, cgroup = facts["topology"], facts["cgroup"]
    assert (topology["logical_cpus"], topology["threads_per_core"], topology["cores_per_socket"],
            topology["sockets"]) == (8, 2, 2, 2)
    assert topology["model_name"] == "Fake Xeon 9000"
    assert topology["mhz"] == {"min": 2000.0, "mean": 2350.0, "max": 2700.0}
    assert topology["max_mhz"] == 3500.0 and topology["smt_active"] == "1"
    assert cgroup["version"] == 2 and cgroup["quota_cpus"] == 4.0  # the pod's 4, not its parent's 6
    assert cgroup["cpuset"] == {"cpus": "0-3", "count": 4}
    assert cgroup["throttling"] == {"nr_periods": 40, "nr_throttled": 7, "throttled_s": 2.5}
    assert "cpu_count" not in facts  # this process's own view only for the real root
    assert "8 logical CPUs (2 socket(s) x 2 cores x 2 threads)" in kb.describe_machine(facts)


def test_machine_facts_read_a_cgroup_v1_quota_and_no_quota(tmp_path):
    _fake_machine(tmp_path, "v1")
    cgroup = kb.machine_facts(tmp_path)["cgroup"]
    assert cgroup["version"] == 1 and cgroup["quota_cpus"] == 1.5
    assert cgroup["throttling"]["throttled_s"] == 0.5
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    assert kb.machine_facts(tmp_path)["cgroup"]["quota_cpus"] is None


def test_machine_facts_survive_an_empty_tree(tmp_path):
    facts = kb.machine_facts(tmp_path)
    assert facts["topology"]["logical_cpus"] is None and facts["cgroup"]["quota_cpus"] is None
    assert kb.parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]


def test_the_sample_visits_every_kernel_before_any_kernels_second_config():
    assert kb.round_robin([2, 1, 3], 5) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1)]
    assert kb.round_robin([2, 1, 3], 2) == [(0, 0), (1, 0)]
    assert len(kb.round_robin([2, 1, 3], 100)) == 6  # all there are


def _results(seconds, failures=0):
    rows = [{"task": i, "ok": True, "s": s, "cpu_self_s": s / 2, "cpu_children_s": s / 4, "cache_hit": False,
             "stages_ms": {"cubin": 1000 * s / 4}} for i, s in enumerate(seconds)]
    rows += [{"task": len(seconds) + i, "ok": False, "error": f"CompilationError: bad {i}"} for i in range(failures)]
    return rows


def test_a_levels_median_mean_cpu_and_rate_and_its_ratios_to_concurrency_one():
    single = kb.summarize_level("dynamic", 1, _results([0.1, 0.3, 0.2, 0.4]), wall_s=1.0)
    eight = kb.summarize_level("dynamic", 8, _results([0.5, 0.5, 0.6, 0.4], failures=1), wall_s=0.25, planned=5)
    static = kb.summarize_level("static", 1, _results([0.1, 0.2, 0.2, 0.3]), wall_s=0.8)
    assert single["per_config_s"] == {"median": 0.25, "mean": 0.25}
    assert single["cpu_s"] == 0.75 and single["cpu_per_config_s"] == 0.1875 and single["configs_per_s"] == 4.0
    assert single["stages_ms_median"] == {"cubin": 62.5}
    assert (eight["configs"], eight["planned"], eight["failures"]) == (4, 5, 1)
    assert eight["first_error"] == "CompilationError: bad 0"
    assert eight["configs_per_s"] == 16.0 and eight["build_s_per_wall_s"] == 8.0
    levels = [single, eight, static]
    assert kb.add_ratios(levels) is single
    assert eight["vs_c1"]["per_config_median"] == 2.0 and eight["vs_c1"]["per_config_mean"] == 2.0
    assert eight["vs_c1"]["cpu_per_config"] == 2.0
    assert eight["vs_c1"]["paired_median"] == 2.333  # each configuration's own: 5, 1.67, 3 and 1
    assert single["vs_c1"]["per_config_median"] == 1.0
    assert static["dynamic_over_static"]["per_config_median"] == 1.25
    line = kb.describe_level(eight, single)
    assert "dynamic concurrency 8: 4 configs in 0.25 s wall, 0.5 s per config (2.00x the single-process" in line
    assert "1 failed: CompilationError: bad 0" in line
    assert kb.add_ratios([eight]) is None  # no concurrency-1 level: no ratios


def test_no_level_starts_after_the_budget():
    now = [100.0]
    ran = []

    def run_level(set_name, width):
        ran.append((set_name, width))
        now[0] += 10.0
        return {"set": set_name, "concurrency": width}

    seen = []
    done, skipped = kb.run_levels([("dynamic", 1), ("dynamic", 4), ("dynamic", 8), ("dynamic", 16), ("static", 1)],
                                  run_level, budget_s=25.0, clock=lambda: now[0], started=95.0, on_level=seen.append)
    assert ran == [("dynamic", 1), ("dynamic", 4)]  # started at 5 s and 15 s; at 25 s the budget is spent
    assert seen == done and len(done) == 2
    assert [(s["set"], s["concurrency"]) for s in skipped] == [("dynamic", 8), ("dynamic", 16), ("static", 1)]
    assert "budget of 25.0 s spent" in skipped[0]["reason"]


class _InstantPool:
    """Stands for WorkerPool: every build request is answered at once with a 0.1 s build."""

    def __init__(self, workers):
        self.alive = set(range(workers))
        self.events = queue.Queue()
        self.procs = []
        self.sent = []

    def send(self, index, message):
        self.sent.append((index, message["task"]))
        self.events.put((index, {"kind": "result", "task": message["task"], "ok": True, "s": 0.1,
                                 "cpu_self_s": 0.05, "cpu_children_s": 0.02}))
        return True

    def kill(self, index):
        self.alive.discard(index)


def test_a_level_hands_out_no_configuration_after_the_budget(tmp_path):
    pool = _InstantPool(4)
    now = time.monotonic()
    cut = kb._run_level(pool, "dynamic", 2, 10, tmp_path / "a", soft_deadline=now - 1, hard_deadline=now + 60,
                        root=tmp_path, stat_path=None)
    assert cut["cut"] and cut["configs"] == 2 and cut["planned"] == 10 and cut["workers"] == 2
    pool = _InstantPool(4)
    whole = kb._run_level(pool, "dynamic", 2, 10, tmp_path / "b", soft_deadline=now + 60, hard_deadline=now + 60,
                          root=tmp_path, stat_path=None)
    assert not whole["cut"] and whole["configs"] == 10
    assert sorted(task for _, task in pool.sent) == list(range(10)) and {i for i, _ in pool.sent} == {0, 1}


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    """(python, env, the 3-op module's kernel sources file, both sets), captured once for the module's runs."""
    python = triton_python()
    if python is None:
        pytest.skip("Triton is not importable in this interpreter (and KEEPFAST_TRITON_PYTHON is not set): "
                    "the kernels can be neither captured nor built")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sources = tmp_path_factory.mktemp("kernels") / "tiny_kernels.json"
    subprocess.run([python, "-m", "tools.kernel_builds.kernel_sources", "--model", "tiny", "--out", str(sources)],
                   check=True, cwd=str(ROOT), env=env, timeout=300)
    return python, env, sources


def test_a_real_run_builds_a_3_op_modules_kernels_for_sm90_at_concurrency_1_and_2(tiny_sources, tmp_path):
    python, env, sources = tiny_sources
    out = tmp_path / "out"
    captured = json.loads(sources.read_text())
    assert captured["sets"]["static"] and captured["sets"]["dynamic"]
    assert all("type='cuda'" in k["source"] and "set_driver_to_gpu()" in k["source"]
               for k in captured["sets"]["dynamic"])
    run = subprocess.run([python, "-m", "tools.kernel_builds.kernel_builds", "--sources", str(sources),
                          "--out", str(out), "--concurrency", "1,2", "--configs", "3", "--target", "cuda:90"],
                         cwd=str(ROOT), env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "kernel_builds.json").read_text())
    levels = {(lv["set"], lv["concurrency"]): lv for lv in doc["levels"]}
    assert set(levels) == {("dynamic", 1), ("dynamic", 2), ("static", 1)}, doc["skipped"]
    for level in levels.values():
        assert level["configs"] == level["planned"] == 3
        assert level["failures"] == 0 and level["cache_hits"] == 0, level["first_error"]
        assert level["per_config_s"]["median"] > 0 and level["wall_s"] > 0
    assert levels[("dynamic", 2)]["workers"] == 2
    assert levels[("dynamic", 2)]["vs_c1"]["per_config_median"] > 0
    assert doc["target"] == "cuda:90" and doc["machine"]["cpu_count"] == os.cpu_count()
    assert "dynamic concurrency 2: 3 configs in" in run.stdout
    assert not (out / "work").exists()  # caches and logs go unless --keep


def test_a_configuration_that_does_not_build_is_counted_and_the_run_goes_on(tiny_sources, tmp_path):
    python, env, captured = tiny_sources
    sources, out = tmp_path / "broken_kernels.json", tmp_path / "out"
    doc = json.loads(captured.read_text())
    good = doc["sets"]["dynamic"][0]
    lines = good["source"].splitlines()
    body = next(i for i, line in enumerate(lines) if line.startswith("def ")) + 1
    lines.insert(body, "    broken = no_such_name_anywhere + 1")
    doc["sets"]["dynamic"].insert(0, {"name": good["name"], "source": "\n".join(lines)})
    sources.write_text(json.dumps(doc))
    run = subprocess.run([python, "-m", "tools.kernel_builds.kernel_builds", "--sources", str(sources),
                          "--out", str(out), "--concurrency", "1", "--configs", "2", "--no-static"],
                         cwd=str(ROOT), env=env, timeout=300, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    (level,) = json.loads((out / "kernel_builds.json").read_text())["levels"]
    assert (level["configs"], level["failures"], level["planned"]) == (1, 1, 2)
    assert "no_such_name_anywhere" in level["first_error"]
    assert "1 failed:" in run.stdout
