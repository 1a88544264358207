"""How long graph builds took on this machine: the basis of "about N s left" while graphs build in the background.

A background build's time left can only be estimated from earlier builds of
the same graph kind on the same machine (AOTInductor's time is mostly the C++
compile of its wrapper and kernels, which follows the graph, the cores and the
compiler). Each finished build's wall time is kept, the last few per kind, in
a small JSON file beside the trust list (outside any graphs folder: a shared
folder must not tell this machine how fast it is). Nothing here is needed for
a correct image; a file that cannot be read or written only loses the estimate.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from statistics import mean
from typing import Dict, List, Optional

from ..store.atomic import write_bytes
from ..settings import BUILD_TIMES_FILE, build_times_file
from ..store.trust import default_trust_path

TIMES_ENV = BUILD_TIMES_FILE.name
KEPT = 5  # builds remembered per kind: recent enough to follow a machine's load, enough to smooth one outlier
_lock = threading.Lock()


def times_path() -> Path:
    """KEEPFAST_BUILD_TIMES_FILE, else build_times.json in the folder of the trust list."""
    configured = build_times_file()
    return Path(configured) if configured else default_trust_path().with_name("build_times.json")


def _read(path: Path) -> Dict[str, List[float]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(kind): [float(s) for s in seconds if isinstance(s, (int, float)) and s > 0]
            for kind, seconds in data.items() if isinstance(seconds, list)}


def record(kind: str, seconds: float) -> None:
    """Remember that a build of `kind` ("UNetModel", "block DoubleStreamBlock") took `seconds` here."""
    if not kind or seconds <= 0:
        return
    path = times_path()
    with _lock:
        data = _read(path)
        data[kind] = (data.get(kind, []) + [round(float(seconds), 2)])[-KEPT:]
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(path, json.dumps(data, indent=1, sort_keys=True).encode())
        except OSError:
            pass  # an estimate lost, nothing else


def measured() -> Dict[str, List[float]]:
    """Every kind's recent build times here (read once per status update, not once per build)."""
    return _read(times_path())


def estimate(kind: str, data: Optional[Dict[str, List[float]]] = None) -> Optional[float]:
    """Seconds a build of `kind` takes here: the mean of its recent builds, else of the recent builds of every
    kind (a first block structure is about as long as another), else None (never built here). `data`: what
    `measured()` read, for several estimates from one read."""
    data = measured() if data is None else data
    if data.get(kind):
        return mean(data[kind])
    latest = [seconds[-1] for seconds in data.values() if seconds]
    return mean(latest) if latest else None
