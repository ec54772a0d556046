"""What users run today instead of moe_comm, computing the same dispatch -> experts -> combine.

Both baselines send one row per (token, expert) assignment (no deduplication), group the
received rows by local expert, and on the way back weight and sum the returned rows per token,
as the all-to-all token dispatchers of common training frameworks do:

* :class:`HostSplitAllToAll`: split sizes exchanged and read on the host, then
  ``all_to_all_single`` with those splits. Eager only (it synchronises).
* :class:`PaddedAllToAll`: every destination gets a fixed ``T * K``-row slot (padded), so the
  splits are equal and static and the whole step can be captured in a CUDA graph.

Expert ids must be valid (``0 <= e < num_experts``): the benchmark draws them so. After
``dispatch``, ``row_expert`` holds the local expert of every returned row (-1 for padding).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["HostSplitAllToAll", "PaddedAllToAll"]


class _AssignmentRouting:
    """Source-side order of the ``T * K`` assignments, sorted by destination rank (stable)."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, world_size: int) -> None:
        self.local_experts = num_experts // world_size
        self.topk = topk_idx.shape[1]
        flat = topk_idx.reshape(-1).to(torch.int64)
        self.dest = flat // self.local_experts
        self.order = torch.sort(self.dest, stable=True).indices
        self.token_of = self.order // self.topk  # token of each sorted assignment
        self.local_expert = (flat % self.local_experts)[self.order]


def _weighted_sum(num_tokens: int, token_of: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``z[t] = sum of weights[a] * rows[a]`` over the assignments ``a`` of token ``t``, float32, then rows' dtype."""
    z = torch.zeros((num_tokens, rows.shape[1]), dtype=torch.float32, device=rows.device)
    z.index_add_(0, token_of, rows.float() * weights[:, None])
    return z.to(rows.dtype)


class _AllToAllBaseline:
    """What both baselines share: the group, and the bookkeeping between dispatch and combine.

    Subclasses implement ``_send_rows(rows)`` (source order -> received order, the rows of the last
    dispatch's routing) and ``_return_rows(rows)`` (the way back, into source order).
    """

    name: str

    def __init__(self, num_experts: int, group=None) -> None:
        self.num_experts = num_experts
        self.group = group
        self.world_size = dist.get_world_size(group)

    def _group_by_expert(self, received: torch.Tensor, received_expert: torch.Tensor, routing: _AssignmentRouting,
                         topk_weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Sort the received rows by local expert (stable; -1 padding last) and keep what combine needs."""
        key = torch.where(received_expert >= 0, received_expert, routing.local_experts)
        self._by_expert = torch.sort(key, stable=True).indices
        self.row_expert = received_expert[self._by_expert]
        self._routing = routing
        self._weights = topk_weights.reshape(-1)[routing.order]
        self._num_tokens = num_tokens
        return received[self._by_expert]

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: the expert outputs ``y`` (rows as ``dispatch`` returned them) weighted and summed per token."""
        back = torch.empty_like(y)
        back[self._by_expert] = y
        return _weighted_sum(self._num_tokens, self._routing.token_of, self._return_rows(back), self._weights)


class HostSplitAllToAll(_AllToAllBaseline):
    """Permute by destination, exchange split sizes (host sync), ``all_to_all_single``, permute by expert.

    Args:
        num_experts: E. group: the process group (NCCL for CUDA tensors, gloo for CPU).
    """

    name = "nccl all_to_all, host splits"

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
        dist.all_to_all_single(out, rows, recv, send, group=self.group)
        return out

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Rows ``[received assignments, H]`` grouped by local expert (in source-rank order inside a group)."""
        routing = _AssignmentRouting(topk_idx, self.num_experts, self.world_size)
        send_counts = torch.bincount(routing.dest, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        self._send, self._recv = send_counts.tolist(), recv_counts.tolist()  # the host sync
        received = self._exchange(x[routing.token_of], self._send, self._recv)
        received_expert = self._exchange(routing.local_expert, self._send, self._recv)
        return self._group_by_expert(received, received_expert, routing, topk_weights, x.shape[0])

    def _return_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._exchange(rows, self._recv, self._send)


class PaddedAllToAll(_AllToAllBaseline):
    """Equal, static splits: each destination gets a padded slot of ``T * K`` rows. Graph-capturable.

    Every rank must dispatch the same ``T`` (the slots are ``T * K`` rows everywhere).

    Args:
        num_experts: E. group: the process group.
    """

    name = "nccl all_to_all, padded"

    def _exchange(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(rows)
        dist.all_to_all_single(out, rows, group=self.group)
        return out

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Rows ``[W * T * K, H]`` sorted by local expert, padding (expert id -1 there) last."""
        routing = _AssignmentRouting(topk_idx, self.num_experts, self.world_size)
        slot_rows = topk_idx.numel()
        counts = torch.zeros(self.world_size, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, routing.dest, torch.ones_like(routing.dest))
        first = torch.cumsum(counts, 0) - counts
        sorted_dest = routing.dest[routing.order]
        rank_in_dest = torch.arange(slot_rows, device=x.device) - first[sorted_dest]
        self._slot = sorted_dest * slot_rows + rank_in_dest
        send = x.new_zeros((self.world_size * slot_rows, x.shape[1]))
        send[self._slot] = x[routing.token_of]
        send_expert = torch.full((self.world_size * slot_rows,), -1, dtype=torch.int64, device=x.device)
        send_expert[self._slot] = routing.local_expert
        received = self._exchange(send)
        return self._group_by_expert(received, self._exchange(send_expert), routing, topk_weights, x.shape[0])

    def _return_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self._exchange(rows)[self._slot]
