"""What the Python side and the CUDA kernels share: the device status word and its decoding.

One module owns every value that both sides must agree on; the kernels get them from here.
"""

from __future__ import annotations

import torch

__all__ = [
    "STATUS_FIELDS",
    "STATUS_NUM_INVALID",
    "STATUS_FIRST_INVALID",
    "STATUS_NUM_DROPPED",
    "STATUS_FIRST_DROPPED",
    "STATUS_TIMEOUT_PHASE",
    "STATUS_TIMEOUT_PEER",
    "NO_OFFENDER",
    "TIMEOUT_PHASES",
    "new_status",
]

# Layout of the device status word: int64 [STATUS_FIELDS] on the dispatcher's device.
# The "first" fields hold the smallest ``(rank << 32) | token`` seen, NO_OFFENDER if none.
STATUS_NUM_INVALID = 0     # assignments whose expert id was neither -1 nor in [0, E)
STATUS_FIRST_INVALID = 1   # (source rank, token) of the first invalid assignment
STATUS_NUM_DROPPED = 2     # assignments dropped because their expert was over capacity
STATUS_FIRST_DROPPED = 3   # (source rank, token) of the first dropped assignment
STATUS_TIMEOUT_PHASE = 4   # phase code of the first wait that timed out (0: none)
STATUS_TIMEOUT_PEER = 5    # the peer that wait was waiting for
STATUS_FIELDS = 6
NO_OFFENDER = (1 << 63) - 1

# Phase codes of ``status[STATUS_TIMEOUT_PHASE]`` (mirrored in csrc/common.cuh: TIMEOUT_*). Channel 0
# carries dispatch and redispatch, channel 1 combine and return_entry_values.
TIMEOUT_PHASES = {
    1: "dispatch: waiting for a peer to free its receive slab",
    2: "dispatch: waiting for a peer's tokens",
    3: "combine: waiting for a peer to free its return slab",
    4: "combine: waiting for a peer's partial sums",
    5: "a kernel's blocks waiting for each other (other kernels held the SMs?)",
}



def new_status(device: torch.device) -> torch.Tensor:
    """A cleared status word: int64 ``[STATUS_FIELDS]`` on ``device``."""
    status = torch.zeros(STATUS_FIELDS, dtype=torch.int64, device=device)
    status[STATUS_FIRST_INVALID] = NO_OFFENDER
    status[STATUS_FIRST_DROPPED] = NO_OFFENDER
    return status
