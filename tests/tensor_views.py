"""Tensor views that test the input checks."""

from __future__ import annotations

import torch

__all__ = ["off_boundary"]


def off_boundary(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` whose data starts one element past its storage's start: not
    16-byte aligned, where the device kernels' 16-byte vectors would fault."""
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    view = storage[1:].view(tensor.shape)
    view.copy_(tensor)
    return view
