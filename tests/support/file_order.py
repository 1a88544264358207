"""The order test files run in: the slowest first, so that the two xdist workers finish together.

`pytest -n 2 --dist loadfile` hands out whole files. xdist orders them by their number of tests unless told
not to (`--no-loadscope-reorder`, tests/run_all.sh), which put the files with a few long compiles (the
real-depth UNets, the video VAEs: 3-5 tests, several minutes each) last: one worker ran them alone while
the other had finished. Longest first (the classic LPT rule) ends the run with short files instead.

FILE_SECONDS: what each file took on this 2-core machine (setup and teardown included), from a run's
`--junitxml` file: `python -m tests.support.file_order RUN.xml` prints the table again. Only the order
depends on it; a file not in it counts as DEFAULT_S. Within a file the order is the file's own (module
fixtures are shared by its tests in that order).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from typing import Dict, List

DEFAULT_S = 10.0

# A run of 2026-12-02 (a fresh Inductor cache, as on CI; the build memo on; main suite 2990 s, 5935 s of test time,
# this 2-core machine; test_flat_runner's figure from the run before, it failed early in this one); 15 s and up.
FILE_SECONDS: Dict[str, float] = {
    "tests/test_correctness_matrix.py": 665,
    "tests/test_video_vae.py": 470,
    "tests/test_inductor_backend.py": 348,
    "tests/test_api_sequences.py": 342,
    "tests/test_blocks.py": 311,
    "tests/test_background_builds.py": 303,
    "tests/test_real_depth.py": 300,
    "tests/test_one_multiple_corners.py": 258,
    "tests/test_size_one.py": 232,
    "tests/test_upcast.py": 222,
    "tests/test_graph_parts.py": 208,
    "tests/test_spawned_trace.py": 171,
    "tests/test_input_casts.py": 148,
    "tests/test_build_book.py": 134,
    "tests/test_cold_start.py": 118,
    "tests/test_blocks_half.py": 116,
    "tests/test_compile_turns.py": 114,
    "tests/test_precompiled_headers.py": 100,
    "tests/test_block_weight_inputs.py": 99,
    "tests/test_sharing.py": 93,
    "tests/test_blocks_zimage.py": 83,
    "tests/test_loader_check.py": 81,
    "tests/test_batch_samples.py": 80,
    "tests/test_quiet_output.py": 79,
    "tests/test_forked_trace.py": 75,
    "tests/test_compiler_crash.py": 64,
    "tests/test_cxx_linkage.py": 64,
    "tests/test_remote_s3.py": 62,
    "tests/test_build_claims.py": 62,
    "tests/test_blocks_quantised.py": 58,
    "tests/test_build_memo.py": 50,
    "tests/test_guard_build.py": 49,
    "tests/test_gpu_host_isa.py": 44,
    "tests/test_module_snapshot.py": 28,
    "tests/test_timestep_rows.py": 25,
    "tests/test_weight_release.py": 23,
    "tests/test_verify.py": 23,
    "tests/test_call_overhead.py": 22,
    "tests/test_build_profile.py": 21,
    "tests/test_fresh_process.py": 20,
    "tests/test_export_stack_traces.py": 18,
    "tests/test_blocks_bench.py": 18,
    "tests/test_program_hints.py": 16,
    "tests/test_guard_export.py": 16,
    "tests/test_flat_runner.py": 29,
}


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items: List) -> None:
    """Stable sort by the file's cost, slowest first: every worker collects the same order."""
    position = {}
    for item in items:
        position.setdefault(file_of(item.nodeid), len(position))
    items.sort(key=lambda item: (-FILE_SECONDS.get(file_of(item.nodeid), DEFAULT_S),
                                 position[file_of(item.nodeid)]))


def seconds_per_file(junit_xml: str) -> Dict[str, float]:
    """Per test file, the seconds its tests took in a `--junitxml` report (setup and teardown included)."""
    totals: Dict[str, float] = defaultdict(float)
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        path = case.get("classname", "").split(".")
        # classname is the module path with dots, plus the class for tests in a class
        while path and not path[-1].startswith("test_"):
            path.pop()
        if path:
            totals["/".join(path) + ".py"] += float(case.get("time", 0.0))
    return dict(totals)


if __name__ == "__main__":
    table = seconds_per_file(sys.argv[1])
    for name, seconds in sorted(table.items(), key=lambda kv: -kv[1]):
        print(f'    "{name}": {seconds:.0f},')
