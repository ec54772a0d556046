"""The interface every backend implements, and the choice behind ``backend: auto``."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
import torch

from ..config import Config
from ..layout import Routing

__all__ = ["Backend", "DispatchResult", "resolve_backend_name"]

_log = logging.getLogger("moe_comm")


@dataclass
class DispatchResult:
    """What a backend's dispatch returns (tensors on the backend's device).

    x: ``[capacity_rows, H]`` expert-major rows. expert_offsets, tokens_per_expert: ``[L]`` int32.
    routing: kept by the handle for combine and backward.
    """

    x: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    routing: Routing


class Backend(abc.ABC):
    """Moves rows between the ranks of a group; semantics are defined in ``moe_comm.layout``.

    Every method takes validated, contiguous tensors on ``self.device`` and must not read a
    device value on the host. ``status`` is the device status word (``layout.new_status``).
    """

    name: str
    rank: int
    world_size: int
    device: torch.device
    status: torch.Tensor

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> DispatchResult:
        """Send ``x [T, H]`` to the ranks of its experts and lay it out expert-major there."""

    @abc.abstractmethod
    def redispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Send ``x [T, H]`` along an existing routing; returns the unweighted ``[capacity_rows, H]`` expansion."""

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, routing: Routing, weighted: bool = True) -> torch.Tensor:
        """Return ``[T, H]``: per token, the sum of its entries' rows of ``y``, times their weights if ``weighted``."""

    @abc.abstractmethod
    def return_entry_values(self, row_vector: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Bring a per-row float32 value ``[capacity_rows]`` back to its assignment: ``[T, K]`` float32."""

    def close(self) -> None:
        """Release what the backend holds; idempotent."""


def resolve_backend_name(config: Config, device: torch.device) -> str:
    """The backend a config names, with ``auto`` resolved for ``device``; logs the choice and why."""
    if config.backend != "auto":
        return config.backend
    if device.type != "cuda":
        _log.info("backend auto -> reference: the dispatcher's device is %s, not a GPU", device)
        return "reference"
    _log.info("backend auto -> vmm: CUDA device %s; vmm shares memory between the GPUs of one host", device)
    return "vmm"
