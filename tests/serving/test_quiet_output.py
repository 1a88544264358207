"""The demo prints its own lines only: no warning or notice from torch, diffusers or transformers.

The whole demo takes about 5 minutes on a 2-core CPU, so each run here goes
through the demo's real entry point (`python -m compiler demo`, i.e.
`compiler.cli.main` -> `run_demo`) with the demo's body replaced by the calls
that trigger those notices: building the demo's pipeline (diffusers' float32
notice, transformers' torchvision notice) and compiling a small module with
the pack (torch 2.13's LeafSpec FutureWarning, torch's CUDA_HOME line on a
CUDA build without a GPU). The same body run outside the entry point must
print at least one of them, or this test would pass for nothing.
Each run is a fresh process with an empty Inductor cache (a cached compile
skips the step that warns); notices printed "once" are once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path

    import torch

    from compiler import CompileOptions, ShapeRange, compile_module, default_registry
    from compiler.cli import main
    from compiler.demo import run as demo
    from compiler.demo.tiny_models import tiny_sd_pipeline


    def body(out, steps, load_check, background=False):
        print("1/2 building the demo's pipeline ...", flush=True)
        tiny_sd_pipeline(seed=0)
        print("2/2 compiling a small module ...", flush=True)
        module = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.GroupNorm(2, 8)).eval()
        compiled = compile_module(module, CompileOptions(shape_range=ShapeRange(batch=(1, 2), spatial=(8, 16))))
        with torch.no_grad():
            compiled(torch.randn(2, 4, 8, 8))
        print(f"compiles: {len(default_registry().compiles)}", flush=True)
        return 0


    if sys.argv[1] == "demo":
        demo._run_demo = body
        sys.exit(main(["demo", "--out", sys.argv[2]]))
    sys.exit(body(Path(sys.argv[2]), 1, False))
""")

OWN_LINES = ["1/2 building the demo's pipeline ...", "2/2 compiling a small module ...", "compiles: 1"]
KNOWN_NOTICES = ("FutureWarning", "requires torchvision", "should be kept in float32", "No CUDA runtime")


def _run(how: str, tmp_path: Path) -> list:
    work = tmp_path / how
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"),
           "TMPDIR": str(work), "PYTHONWARNINGS": ""}
    done = subprocess.run([sys.executable, "-c", SCRIPT, how, str(work / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 0, "\n".join(lines[-40:])
    return lines


def test_the_demo_prints_no_third_party_warning(tmp_path):
    unquiet = _run("direct", tmp_path)
    assert [line for line in unquiet if any(n in line for n in KNOWN_NOTICES)], (
        "none of the notices this test guards against appeared without the demo's scope:\n" + "\n".join(unquiet))
    assert "compiles: 1" in unquiet

    assert _run("demo", tmp_path) == OWN_LINES
