"""Calls of several device backends in flight at once on one GPU: which may share it, checked at each call.

Every device kernel runs one block per SM of its grid, and its blocks (and, across ranks, its peers'
kernels) wait for each other: all of them must be resident at once. Two Dispatchers whose calls run
on different streams of one device (two micro-batches in flight) can then deadlock: rank 0 issues A
then B, rank 1 B then A, and if A's grid and B's grid do not fit on the device together, each rank's
first kernel holds the SMs the other rank's first kernel waits for. So a call of a multi-rank device
backend on a stream other than the one another live backend of the device last used is refused
unless the two grids fit on the device side by side (``sm_budget``, the two-batch-overlap recipe in
the README), before it launches anything. Calls on one stream are ordered and always safe. The check
costs nothing while a device has one live backend (the common case), a stream lookup otherwise.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from ..errors import ConfigError

__all__ = ["SmLedger"]

# device index -> the live ledgers of that device (weak: a closed or collected backend leaves).
_LEDGERS: dict[int, "weakref.WeakSet[SmLedger]"] = {}


class SmLedger:
    """One backend's entry in its device's list of multi-rank backends: its grid and its last stream.

    Args:
        device: the backend's CUDA device (with an index). grid_sms: the SMs its kernels' grids take.
        device_sms: the device's SM count. name: how errors name the backend (e.g. its Dispatcher).
    """

    def __init__(self, device: torch.device, grid_sms: int, device_sms: int, name: str) -> None:
        self.device = device
        self.grid_sms = grid_sms
        self.device_sms = device_sms
        self.name = name
        self.last_stream: Optional[int] = None
        self._peers = _LEDGERS.setdefault(device.index, weakref.WeakSet())
        self._peers.add(self)

    def note_call(self) -> None:
        """Record the current stream of this backend's call; raise if it may deadlock with another backend's.

        Raises:
            ConfigError: another live backend of this device last ran on another stream and the two
                grids exceed the device's SMs.
        """
        if len(self._peers) < 2:
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for other in self._peers:
            if other is self or other.last_stream is None or other.last_stream == stream:
                continue
            if other.grid_sms + self.grid_sms > self.device_sms:
                raise ConfigError(
                    f"{self.name} is called on a stream other than the one {other.name} last ran on (two calls in "
                    f"flight on {self.device}), and their kernels take {self.grid_sms} + {other.grid_sms} SMs of "
                    f"the device's {self.device_sms}: kernels whose blocks wait for each other and for their peers "
                    "cannot both be resident, so ranks that issue the two in different orders would deadlock. Give "
                    f"each config sm_budget <= {self.device_sms // 2} (the two-batch overlap recipe), or run both "
                    "on one stream"
                )
        self.last_stream = stream

    def close(self) -> None:
        """Leave the device's list (idempotent)."""
        self._peers.discard(self)
