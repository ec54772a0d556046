"""The rows of a dispatch output's expert segments, as the tests check them."""

from __future__ import annotations

import torch

__all__ = ["padding_rows"]


def padding_rows(out) -> torch.Tensor:
    """The padding rows of a :class:`moe_comm.DispatchOutput` whose offsets are on the CPU: int64
    indices of ``[start_j + tokens_per_expert[j], end_j)`` of every segment ``j``, increasing."""
    ends = out.expert_offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(int(ends[-1]))
    segment = torch.searchsorted(ends, rows, right=True)
    return rows[rows >= starts[segment] + out.tokens_per_expert.long()[segment]]
