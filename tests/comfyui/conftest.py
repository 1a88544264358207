"""Fixtures for the ComfyUI integration tests (see kf_support.py).

Every test module that needs ComfyUI skips itself at import when
COMFYUI_PATH is not set. One ComfyUI server (and so one compile of the tiny
model) serves the whole session; tests read the pack's counters from
/keepfast/stats before and after what they run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kf_support  # noqa: E402

@pytest.fixture(scope="session")
def comfy_base(tmp_path_factory) -> Path:
    if not kf_support.comfyui_available():
        pytest.skip(kf_support.SKIP_REASON)
    base = kf_support.make_base(tmp_path_factory.mktemp("comfy-base"))
    kf_support.build_models(base)
    return base


@pytest.fixture(scope="session")
def server(comfy_base):
    env = {**os.environ, "KEEPFAST_TRUST_FILE": str(comfy_base / "keepfast-trust.json"), "PYTHONUNBUFFERED": "1"}
    srv = kf_support.ComfyServer(comfy_base, env)
    srv.start()
    yield srv
    srv.stop()
