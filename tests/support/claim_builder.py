"""Another process sharing a graphs folder (tests/builds/test_build_claims.py): it claims, builds and writes graphs.

    python claim_builder.py hold FILE        claim FILE, print "claimed", sleep until killed
    python claim_builder.py unet STORE       compile a tiny SD UNet before its first call, save it, print a line
    python claim_builder.py flux STORE       a tiny Flux whose block graphs build in the background: print
                                             "started" after the first call, wait for the builds, save, print
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiler import CompileOptions, ShapeRange
from compiler.builds import claims as build_claims
from compiler.diffusers_api import compile_module, compile_pipe, compiled_parts  # noqa: E402
from compiler.store.registry import GraphRegistry  # noqa: E402
from compiler.store.graph_store import GraphStore  # noqa: E402
from compiler.demo.tiny_models import prompt_embeds, tiny_unet  # noqa: E402

UNET_RANGE = ShapeRange(batch=(1, 2), spatial=(8, 16), sequence=(1, 77))


def unet_call(batch: int = 1, side: int = 16, length: int = 77):
    latent = torch.randn(batch, 4, side, side, generator=torch.Generator().manual_seed(side + batch))
    return (latent, torch.tensor(500.0), prompt_embeds(batch, length)), {"return_dict": False}


def main(mode: str, where: str) -> None:
    if mode == "hold":
        claim = build_claims.try_claim(Path(where))
        print("claimed" if isinstance(claim, build_claims.Claim) else f"not claimed: {claim}", flush=True)
        time.sleep(3600)
    registry = GraphRegistry()
    if mode == "unet":
        unet = tiny_unet(seed=3)
        compile_module(unet, CompileOptions(shape_range=UNET_RANGE, store=GraphStore(where), autosave=True), registry)
        args, kwargs = unet_call()
        with torch.no_grad():
            unet(*args, **kwargs)
    elif mode == "flux":
        from tests.support import tiny_transformers as tt

        model = tt.build("flux", seed=0)
        pipe = tt.pipe_of(model)
        compile_pipe(pipe, shape_range=tt.RANGE, registry=registry, graphs_dir=where, autosave=True, background=True)
        with torch.no_grad():
            tt.call(model, tt.FIRST)
        print("started", flush=True)
        compiled_parts(pipe)["transformer"].wait_for_builds()
    print(json.dumps({"compiles": len(registry.compiles), "loads": len(registry.loads)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
