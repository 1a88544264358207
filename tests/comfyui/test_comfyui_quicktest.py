"""ComfyUI's own load check: `main.py --quick-test-for-ci` with the pack installed (needs COMFYUI_PATH)."""

from __future__ import annotations

import subprocess

import pytest

import kf_support as S

if not S.comfyui_available():
    pytest.skip(S.SKIP_REASON, allow_module_level=True)

pytestmark = pytest.mark.comfyui


def test_quick_test_for_ci_imports_the_pack(tmp_path):
    base = S.make_base(tmp_path / "base")
    result = subprocess.run(
        [S.PYTHON, "main.py", "--cpu", "--quick-test-for-ci", "--base-directory", str(base)],
        cwd=S.COMFYUI_PATH, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    (tmp_path / "quicktest.log").write_text(log)
    assert result.returncode == 0, log[-3000:]
    pack = str(base / "custom_nodes" / S.PACK_NAME)
    import_lines = [line for line in log.splitlines() if line.rstrip().endswith(pack)]
    assert import_lines, "the pack is not in ComfyUI's import times:\n" + log[-3000:]
    assert not any("IMPORT FAILED" in line for line in import_lines), import_lines
    ours = [line for line in log.splitlines()
            if ("keepfast" in line.lower() or S.PACK_NAME in line)
            and any(word in line for word in ("Error", "error", "Traceback", "FAILED", "Cannot import"))]
    assert not ours, ours
