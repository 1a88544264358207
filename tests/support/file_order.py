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

# A run of 2026-12-02 05:05 UTC (a fresh Inductor cache, as on CI; the build memo on; main suite 2665 s, 5278 s of
# test time, 791 passed, this 2-core machine); 15 s and up.
FILE_SECONDS: Dict[str, float] = {
    "tests/serving/test_correctness_matrix.py": 588,
    "tests/serving/test_video_vae.py": 450,
    "tests/api/test_api_sequences.py": 323,
    "tests/builds/test_background_builds.py": 307,
    "tests/backends/test_inductor_backend.py": 297,
    "tests/blocks/test_blocks.py": 293,
    "tests/keys/test_one_multiple_corners.py": 286,
    "tests/serving/test_real_depth.py": 262,
    "tests/keys/test_size_one.py": 185,
    "tests/tracing/test_graph_parts.py": 185,
    "tests/serving/test_upcast.py": 163,
    "tests/machine/test_cold_start.py": 133,
    "tests/tracing/test_spawned_trace.py": 130,
    "tests/serving/test_input_casts.py": 120,
    "tests/blocks/test_blocks_half.py": 108,
    "tests/builds/test_build_claims.py": 97,
    "tests/benchmarks/test_compile_turns.py": 93,
    "tests/build_process/test_precompiled_headers.py": 87,
    "tests/store/test_sharing.py": 87,
    "tests/tracing/test_block_weight_inputs.py": 85,
    "tests/backends/test_loader_check.py": 72,
    "tests/blocks/test_blocks_zimage.py": 71,
    "tests/serving/test_quiet_output.py": 70,
    "tests/serving/test_batch_samples.py": 69,
    "tests/remote/test_remote_s3.py": 68,
    "tests/build_process/test_cxx_linkage.py": 60,
    "tests/build_process/test_interface_object.py": 60,  # new 2026-12-02: 76 s in that day's run on a slower machine
    "tests/tracing/test_forked_trace.py": 59,
    "tests/builds/test_build_book.py": 56,
    "tests/builds/test_compiler_crash.py": 51,
    "tests/blocks/test_blocks_quantised.py": 40,
    "tests/tracing/test_guard_build.py": 35,
    "tests/build_process/test_gpu_host_isa.py": 35,
    "tests/build_process/test_build_memo.py": 26,
    "tests/tracing/test_module_snapshot.py": 26,
    "tests/backends/test_flat_runner.py": 21,
    "tests/benchmarks/test_weight_release.py": 19,
    "tests/tracing/test_guard_export.py": 18,
    "tests/build_process/test_build_profile.py": 18,
    "tests/benchmarks/test_call_overhead.py": 17,
    "tests/serving/test_verify.py": 17,
    "tests/blocks/test_timestep_rows.py": 16,
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
