"""torch's CUDA-graph capture recipe as the GPU tests follow it: an eager warm-up on a side stream first."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def warm_up_on_side_stream(warm_up: Callable[[], object], device: Optional[torch.device] = None) -> None:
    """Run ``warm_up()`` on a fresh side stream of ``device`` (default: the current device), after the
    current stream's queued work and before its next: what torch asks before ``torch.cuda.graph``
    (cuBLAS workspaces, NCCL communicators, optimizer state and the allocator's blocks are then made
    outside the capture)."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        warm_up()
    current.wait_stream(side)
