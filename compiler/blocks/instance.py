"""One block of a model, served by its structure's block server (server.py): the stand-in for its forward."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from .binding import InstanceWeights


class Serves(Protocol):
    """What an instance calls: its structure's server (BlockServer.call)."""

    def call(self, instance: "BlockInstance", args: tuple, kwargs: dict) -> Any: ...


class BlockInstance:
    """One block of the model; its `forward` is replaced by this object."""

    is_keepfast_dispatcher = True  # installed as the block's forward: traces want the block itself

    def __init__(self, server: Serves, index: int, path: str, module: torch.nn.Module):
        self.server = server
        self.index = index
        self.path = path
        self.module = module
        self.original = module.__dict__.get("forward")  # an instance-level forward someone else set
        self.weights: Optional[InstanceWeights] = None
        self.checked_version: Any = None  # (weights' version, call device) the reason below was found for
        self.weights_reason: Optional[str] = None
        self.graph_calls = 0
        self.eager_calls = 0
        self.last_status = "not run yet"

    def __call__(self, *args, **kwargs) -> Any:
        return self.server.call(self, args, kwargs)

    def eager(self, args: tuple, kwargs: dict) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def install(self) -> None:
        self.module.forward = self

    def uninstall(self) -> None:
        if self.module.__dict__.get("forward") is self:
            if self.original is not None:
                self.module.forward = self.original
            else:
                del self.module.forward
