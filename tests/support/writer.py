"""A second process that writes graphs into a store (for concurrency and crash tests).

python -m tests.support.writer SOURCE_GRAPHS TARGET_GRAPHS ROUNDS [--pause-before-rename]
Loads every graph of SOURCE (trusted: same machine) and saves each into TARGET,
ROUNDS times. With --pause-before-rename it announces "PAUSED" once a package
has been fully written to its temp file and then sleeps before the rename, so
the test can kill it at the worst moment.
"""

from __future__ import annotations

import os
import sys
import time

from compiler import GraphStore
from compiler.store import atomic


def main(source: str, target: str, rounds: int, pause: bool) -> None:
    src = GraphStore(source)
    graphs = [(src.load(stored), stored.manifest.signature) for stored in src.graphs()]
    if pause:
        real_replace = os.replace

        def paused_replace(a, b):
            print("PAUSED", flush=True)
            time.sleep(120)
            real_replace(a, b)

        atomic.os.replace = paused_replace
    dst = GraphStore(target)
    for _ in range(rounds):
        for graph, signature in graphs:
            dst.save(graph, signature)
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), "--pause-before-rename" in sys.argv)
