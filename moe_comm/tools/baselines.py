"""What users run today instead of moe_comm, computing the same dispatch -> experts -> combine.

Every baseline sends one row per (token, expert) assignment (no deduplication), groups the
received rows by local expert, and on the way back weights and sums the returned rows per token,
as the all-to-all token dispatchers of common training frameworks do:

* :class:`HostSplitAllToAll`: split sizes exchanged and read on the host, then
  ``all_to_all_single`` with those splits. Eager only (it synchronises).
* :class:`PaddedAllToAll`: every destination gets a fixed ``T * K``-row slot (padded), so the
  splits are equal and static and the whole step can be captured in a CUDA graph.
* :class:`SymmMemAllToAll2d`: PyTorch's NVSHMEM ``all_to_all_vdev_2d`` (dispatch, output grouped
  expert-major) and ``all_to_all_vdev_2d_offset`` (the reverse exchange, for combine); the splits
  stay on the GPU, so nothing synchronises with the host.

Expert ids must be valid (``0 <= e < num_experts``): the benchmark draws them so. After
``dispatch``, ``row_expert`` holds the local expert of every returned row (-1 for padding).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import BackendError
from ..symm.torch_symm import _nvshmem_heap_size, _select_provider, _symm_mem

__all__ = ["HostSplitAllToAll", "PaddedAllToAll", "SymmMemAllToAll2d"]


class _AssignmentRouting:
    """Source-side order of the ``T * K`` assignments, sorted by destination chunk (stable).

    A chunk is a block of ``experts_per_chunk`` consecutive experts of one rank (default: all of
    its experts, so the order is by destination rank). ``chunk`` is each assignment's global
    chunk id (``rank * chunks_per_rank + block``) in the original order.
    """

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, world_size: int,
                 experts_per_chunk: Optional[int] = None) -> None:
        self.num_local_experts = num_experts // world_size
        self.topk = topk_idx.shape[1]
        flat = topk_idx.reshape(-1).to(torch.int64)
        self.dest = flat // self.num_local_experts
        self.chunk = self.dest if experts_per_chunk is None else flat // experts_per_chunk
        self.order = torch.sort(self.chunk, stable=True).indices
        self.token_of = self.order // self.topk  # token of each sorted assignment
        self.local_expert = (flat % self.num_local_experts)[self.order]


def _counts(index: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]`` int64 occurrences of each value of ``index`` (``bincount`` without its host sync)."""
    counts = torch.zeros(size, dtype=torch.int64, device=index.device)
    return counts.scatter_add_(0, index, torch.ones_like(index))


def chunks_per_rank(num_local_experts: int, max_chunks: int) -> int:
    """Expert blocks per rank for ``all_to_all_vdev_2d``: the largest divisor of ``num_local_experts`` <= ``max_chunks``."""
    return max(d for d in range(1, min(num_local_experts, max_chunks) + 1) if num_local_experts % d == 0)


def covered_rows(splits_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows]`` bool: the rows inside one of the chunks of ``splits_offsets``.

    ``splits_offsets``: ``[2, C]`` int64 (row 0 chunk lengths, row 1 chunk starts), chunks disjoint
    and ending at or before ``num_rows``; computed on the tensor's device without a host sync.
    """
    lengths, starts = splits_offsets[0], splits_offsets[1]
    delta = torch.zeros(num_rows + 1, dtype=torch.int64, device=splits_offsets.device)
    delta.scatter_add_(0, starts, torch.ones_like(starts))
    delta.scatter_add_(0, starts + lengths, -torch.ones_like(starts))
    return torch.cumsum(delta[:num_rows], 0) > 0


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
        key = torch.where(received_expert >= 0, received_expert, routing.num_local_experts)
        self._by_expert = torch.sort(key, stable=True).indices
        self.row_expert = received_expert[self._by_expert]
        self._routing = routing
        self._weights = topk_weights.reshape(-1)[routing.order]
        self._num_tokens = num_tokens
        return received[self._by_expert]

    def _return_buffer(self, y: torch.Tensor) -> torch.Tensor:
        """Where combine puts ``y`` back into received order (a subclass may hand out its own buffer)."""
        return torch.empty_like(y)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """``[T, H]``: the expert outputs ``y`` (rows as ``dispatch`` returned them) weighted and summed per token."""
        back = self._return_buffer(y)
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
        counts = _counts(routing.dest, self.world_size)
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


class SymmMemAllToAll2d(_AllToAllBaseline):
    """PyTorch's NVSHMEM ``all_to_all_vdev_2d`` (dispatch) and ``all_to_all_vdev_2d_offset`` (combine).

    Dispatch writes this rank's rows in (destination rank, expert block) order with their counts
    (``in_splits``, computed on the GPU); the op exchanges the counts on the GPU and writes the
    received rows expert-block-major (each block's rows from rank 0, then rank 1, ...; an empty
    block still takes one row, torch's default ``major_align`` of 1), with the chunk lengths and
    starts in ``out_splits_offsets``. Combine passes those to ``all_to_all_vdev_2d_offset``, the
    reverse exchange, which returns every row to its source in the order it was sent. Nothing
    synchronises with the host, so the step can be captured in a CUDA graph if torch allows it.

    NOTE: torch 2.11's ``all_to_all_vdev_2d`` takes at most 16 chunks per rank (``NUM_TILES``,
    512 threads / 32, in ``nvshmem_extension.cu``), while the headline workload has 128 experts
    per rank. Both ops also launch ``min(splits, 64)`` blocks (8 above 8 ranks) that loop over the
    ``world * chunks`` splits, and block 0 overwrites the source offsets with the output offsets
    while other blocks may still be reading them: with more splits than blocks the received rows
    came out wrong (8x H200, 8 ranks x 16 chunks: combine relative error 1.0). So at most
    ``64 // world`` chunks per rank and at most 8 ranks. A chunk is a block of consecutive local
    experts (:func:`chunks_per_rank`; one expert per chunk when there are few enough), and every row
    carries its local expert id in 8 bytes appended to it, so that the receiver sorts by expert
    without a second exchange (the NCCL baselines send the ids with a second ``all_to_all_single``).

    All buffers are NVSHMEM symmetric tensors allocated once, here (collective), for ``max_tokens_per_rank``.

    Args:
        num_experts: E (a multiple of the world size). topk: K. max_tokens_per_rank: the largest T dispatched.
        hidden: H. dtype: the dtype of ``x``. device: this rank's CUDA device, with an index.
        group: the process group (None: the default group).

    Raises:
        BackendError: torch cannot give NVSHMEM symmetric memory here (see :meth:`unavailable_reason`),
            or this process already uses another symmetric-memory provider.
    """

    name = "torch all_to_all_vdev_2d (NVSHMEM)"
    # torch 2.11's limits (nvshmem_extension.cu): chunks per rank of all_to_all_vdev_2d, and the
    # blocks both ops launch on up to 8 ranks (each split needs its own block: see the NOTE).
    MAX_CHUNKS_PER_RANK = 16
    MAX_SPLITS = 64
    MAX_WORLD_SIZE = 8
    _ID_BYTES = 8  # the int64 local expert id appended to every sent row

    @staticmethod
    def unavailable_reason(num_experts: int, device: torch.device, group=None) -> Optional[str]:
        """Why this baseline cannot run here (None if it can); local checks only, no collective."""
        world_size = dist.get_world_size(group)
        if device.type != "cuda":
            return "needs CUDA GPUs (NVSHMEM)"
        if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d_offset"):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.all_to_all_vdev_2d_offset"
        try:
            if not _symm_mem().is_nvshmem_available():
                return "NVSHMEM is not available to torch here (symm_mem.is_nvshmem_available() is False)"
        except BackendError as exc:
            return str(exc)
        if not 2 <= world_size <= SymmMemAllToAll2d.MAX_WORLD_SIZE:
            return f"needs 2 to {SymmMemAllToAll2d.MAX_WORLD_SIZE} ranks, got {world_size}"
        if num_experts % world_size:
            return f"num_experts={num_experts} is not a multiple of the world size {world_size}"
        return None

    def __init__(self, num_experts: int, topk: int, max_tokens_per_rank: int, hidden: int, dtype: torch.dtype,
                 device: torch.device, group=None) -> None:
        super().__init__(num_experts, group)
        self.device = device
        num_local_experts = num_experts // self.world_size
        self.num_chunks = chunks_per_rank(num_local_experts, min(self.MAX_CHUNKS_PER_RANK,
                                                             self.MAX_SPLITS // self.world_size))
        self._experts_per_chunk = num_local_experts // self.num_chunks
        self._hidden, self._dtype = hidden, dtype
        self._row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
        self.max_rows = max_tokens_per_rank * topk  # rows this rank sends at most
        recv_rows = self.world_size * self.max_rows + self.num_chunks
        num_splits = self.world_size * self.num_chunks
        payload = self._row_bytes + self._ID_BYTES
        nbytes = (self.max_rows + recv_rows) * (payload + self._row_bytes) + 5 * num_splits * 8
        self._group_name = self._open_symmetric_memory()
        with _nvshmem_heap_size(nbytes, None):  # the first allocation starts NVSHMEM
            self._send = self._empty((self.max_rows, payload), torch.uint8)
            self._recv = self._empty((recv_rows, payload), torch.uint8)
            self._in_splits = self._empty((num_splits,), torch.int64)
            self._out_splits_offsets = self._empty((2, num_splits), torch.int64)
            self._back_in = self._empty((recv_rows, hidden), dtype)
            self._back_out = self._empty((self.max_rows, hidden), dtype)
            self._back_splits_offsets = self._empty((2, num_splits), torch.int64)

    def _open_symmetric_memory(self) -> str:
        """Pick torch's NVSHMEM allocator; returns the group name."""
        self._symm_mem = _symm_mem()
        with torch.cuda.device(self.device):
            _select_provider(self._symm_mem, "NVSHMEM")
        return (self.group if self.group is not None else dist.group.WORLD).group_name

    def _empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed symmetric tensor, rendezvoused now so that the ops only look it up (collective)."""
        tensor = self._symm_mem.empty(shape, dtype=dtype, device=self.device).zero_()
        self._symm_mem.rendezvous(tensor, self._group_name)
        return tensor

    def _exchange_2d(self, rows, out, in_splits, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(rows, out, in_splits, out_splits_offsets, self._group_name)

    def _exchange_2d_offset(self, rows, out, in_splits_offsets, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(rows, out, in_splits_offsets, out_splits_offsets,
                                                     self._group_name)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Rows ``[W * T * K + num_chunks, H]`` sorted by local expert, rows of no chunk (expert id -1) last."""
        num_rows = topk_idx.numel()
        if num_rows > self.max_rows or tuple(x.shape[1:]) != (self._hidden,) or x.dtype != self._dtype:
            raise ValueError(f"{self.name}: built for up to {self.max_rows} rows of [{self._hidden}] {self._dtype}, "
                             f"got {num_rows} rows of {list(x.shape[1:])} {x.dtype}")
        routing = _AssignmentRouting(topk_idx, self.num_experts, self.world_size, self._experts_per_chunk)
        self._in_splits.copy_(_counts(routing.chunk, self._in_splits.numel()))
        send = self._send[:num_rows]
        send[:, : self._row_bytes] = x[routing.token_of].view(torch.uint8)
        send[:, self._row_bytes:] = routing.local_expert.view(torch.uint8).view(num_rows, self._ID_BYTES)
        self._exchange_2d(self._send, self._recv, self._in_splits, self._out_splits_offsets)
        recv = self._recv[: self.world_size * num_rows + self.num_chunks]
        ids = recv[:, self._row_bytes:].contiguous().view(torch.int64).view(-1)
        received_expert = torch.where(covered_rows(self._out_splits_offsets, recv.shape[0]), ids, -1)
        self._num_rows = num_rows
        return self._group_by_expert(recv[:, : self._row_bytes].view(self._dtype), received_expert, routing,
                                     topk_weights, x.shape[0])

    def _return_buffer(self, y: torch.Tensor) -> torch.Tensor:
        return self._back_in[: y.shape[0]]  # the reverse exchange reads the symmetric buffer itself

    def _return_rows(self, rows: torch.Tensor) -> torch.Tensor:
        self._exchange_2d_offset(self._back_in, self._back_out, self._out_splits_offsets, self._back_splits_offsets)
        return self._back_out[: self._num_rows]
