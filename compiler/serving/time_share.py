"""How much of the time spent in the diffusion model and the VAE ran from graphs: the reports' shares.

Counters are the registry's (`EventLog.add_time`): `blocks.model` is the whole
time of DiT model calls served block by block, `blocks.graph` / `blocks.eager`
the time its blocks took from graphs and eagerly; what is left of a model call
is glue (embedders, position tables, final layer), which runs eager.
`unet.*` and `vae.*` are whole-model graphs (SD UNets) and VAEs. Host wall
time: exact on a CPU; on a GPU a call returns when its kernels are queued, so
the shares are of the time the host spent, not of the GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping


@dataclass(frozen=True)
class TimeShare:
    blocks_graph_s: float = 0.0
    blocks_eager_s: float = 0.0
    blocks_model_s: float = 0.0
    unet_graph_s: float = 0.0
    unet_eager_s: float = 0.0
    vae_graph_s: float = 0.0
    vae_eager_s: float = 0.0

    @classmethod
    def from_seconds(cls, seconds: Mapping[str, float]) -> "TimeShare":
        return cls(**{f"{name.replace('.', '_')}_s": float(seconds.get(name, 0.0)) for name in
                      ("blocks.graph", "blocks.eager", "blocks.model", "unet.graph", "unet.eager", "vae.graph",
                       "vae.eager")})

    @property
    def glue_s(self) -> float:
        return max(0.0, self.blocks_model_s - self.blocks_graph_s - self.blocks_eager_s)

    @property
    def model_s(self) -> float:
        return self.blocks_model_s + self.unet_graph_s + self.unet_eager_s

    @property
    def model_compiled(self) -> float:
        """Share of the diffusion model's time that ran from graphs (0 when it has not run)."""
        return _share(self.blocks_graph_s + self.unet_graph_s, self.model_s)

    @property
    def vae_compiled(self) -> float:
        return _share(self.vae_graph_s, self.vae_graph_s + self.vae_eager_s)

    def to_json(self) -> dict:
        return {"model_s": round(self.model_s, 4), "model_compiled": round(self.model_compiled, 4),
                "blocks_graph_s": round(self.blocks_graph_s, 4), "blocks_eager_s": round(self.blocks_eager_s, 4),
                "glue_s": round(self.glue_s, 4), "unet_graph_s": round(self.unet_graph_s, 4),
                "unet_eager_s": round(self.unet_eager_s, 4), "vae_s": round(self.vae_graph_s + self.vae_eager_s, 4),
                "vae_compiled": round(self.vae_compiled, 4)}

    def describe(self) -> str:
        """One line for a report; empty before anything ran."""
        parts: List[str] = []
        if self.blocks_model_s > 0:
            parts.append(f"diffusion model {_pct(self.model_compiled)} from graphs (blocks "
                         f"{_pct(_share(self.blocks_graph_s, self.blocks_model_s))} from graphs, "
                         f"{_pct(_share(self.blocks_eager_s, self.blocks_model_s))} eager; glue "
                         f"{_pct(_share(self.glue_s, self.blocks_model_s))} eager)")
        elif self.unet_graph_s + self.unet_eager_s > 0:
            parts.append(f"diffusion model {_pct(self.model_compiled)} from graphs")
        if self.vae_graph_s + self.vae_eager_s > 0:
            parts.append(f"VAE {_pct(self.vae_compiled)} from graphs")
        return ("time served: " + "; ".join(parts)) if parts else ""


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _pct(value: float) -> str:
    return f"{100 * value:.0f}%"
