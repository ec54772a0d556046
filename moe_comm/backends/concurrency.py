"""Device backends that share one GPU: whether their kernels can all be resident when calls overlap.

Every device kernel runs one block per SM of its grid, and its blocks (and, across ranks, its peers'
kernels) wait for each other: all of them must be resident at once. Two Dispatchers whose calls run
on different streams of one device (two micro-batches in flight) deadlock when their grids do not fit
on the device together and the ranks issue the two in different orders: each rank's first kernel
holds the SMs the other rank's first kernel waits for. The kernels' bounded waits turn that into a
timeout on every rank (the abort word), never a wrong number; the supported recipe gives each config
``sm_budget`` at most half the SMs (the README's two-batch overlap). Whether two calls overlap cannot
be told on the host without a sync (streams may be ordered by events), so nothing is refused per
call: :meth:`SmLedger.crowding` names the crowding in the timeout's error instead.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

__all__ = ["SmLedger"]

# device index -> the live ledgers of that device (weak: a closed or collected backend leaves).
_LEDGERS: dict[int, "weakref.WeakSet[SmLedger]"] = {}


class SmLedger:
    """One multi-rank device backend's entry in its device's list: the SMs its kernels' grids take.

    Args:
        device: the backend's CUDA device (with an index). grid_sms: the SMs its kernels' grids take.
        device_sms: the device's SM count. name: how messages name the backend.
    """

    def __init__(self, device: torch.device, grid_sms: int, device_sms: int, name: str) -> None:
        self.device = device
        self.grid_sms = grid_sms
        self.device_sms = device_sms
        self.name = name
        self._peers = _LEDGERS.setdefault(device.index, weakref.WeakSet())
        self._peers.add(self)

    def crowding(self) -> Optional[str]:
        """A hint for a timeout's error when another live backend's grid and this one's exceed the device, else None."""
        others = [other for other in self._peers if other is not self
                  and other.grid_sms + self.grid_sms > self.device_sms]
        if not others:
            return None
        return (f"{self.name} shares {self.device} with {', '.join(other.name for other in others)}, and their "
                f"kernels take {self.grid_sms} + {others[0].grid_sms} SMs of {self.device_sms}: if their calls run "
                "on different streams (two calls in flight), ranks that issue them in different orders deadlock "
                f"until timeout_s; give each config sm_budget <= {self.device_sms // 2} (the two-batch overlap "
                "recipe) or run them on one stream")

    def close(self) -> None:
        """Leave the device's list (idempotent)."""
        self._peers.discard(self)
