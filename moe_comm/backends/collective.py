"""Collective backends: the routing math of ``moe_comm.routing`` with ``all_to_all_single``.

Every exchange moves fixed ``[W, M, ...]`` slabs (one per peer, ``M = max_tokens_per_rank``
rows), so shapes never depend on the routing and no count has to reach the host. Two backends
are this one class:

* ``reference``: CPU tensors over a gloo group; the yardstick every other backend is compared with.
* ``nccl`` with ``transport: collective``: CUDA tensors over an NCCL group. Works across nodes and
  is captured in a CUDA graph like any NCCL call.

NOTE: what the collective transport costs: it moves whole slabs, ``W * M`` rows each way per
exchange whatever the routing (a padded, capacity-sized all-to-all), plus two small metadata
exchanges in dispatch, and runs the layout as a chain of small torch kernels; the device
kernels of ``vmm``/``nvshmem``/``nccl symmetric`` move only the rows that are sent.

Failures are bounded by ``timeout_s`` (a rank that never makes its matching call):

* ``reference`` (gloo): every exchange waits at most ``timeout_s`` on the host and then raises
  :class:`~moe_comm.errors.CommTimeoutError` from the call, naming the exchange. gloo does not say
  which peer is missing; with two ranks it can only be the other one, which the message names.
* ``nccl`` collective: the exchange runs asynchronously on the GPU, so the call itself returns;
  an NCCL all-to-all whose peer never arrives spins on the GPU forever (NCCL kernels have no
  timeout of their own). torch's own bound is its watchdog: after the process group's timeout
  (``init_process_group(timeout=...)``, 10 min by default) it logs the stuck ``ALLTOALL_BASE``
  and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default (3), kills the whole process;
  ``TORCH_NCCL_BLOCKING_WAIT=1`` would turn the timeout into an exception at the call instead,
  but makes every collective wait on the host and is the user's setting, not ours. So this
  backend bounds the wait itself: each eager exchange records a CUDA event, and
  ``Dispatcher.check()`` (through :meth:`CollectiveBackend.wait_settled`) polls the stream for at
  most ``timeout_s`` after the oldest unfinished exchange was issued. If it is still stuck, the
  group's NCCL communicator is aborted (``ncclCommAbort``, through torch's backend ``abort()``):
  that is the only thing that stops the spinning kernel, so the stream drains and the process
  can exit, and the group, whose ranks are out of step anyway, is unusable afterwards. A stuck
  exchange of a replayed CUDA graph is found the same way (it carries no event, so the error names
  the graph rather than the exchange). Without a ``check()``, torch's watchdog is the only bound.
* After a failed exchange every later call on the backend raises (its ranks' collectives are
  out of step): build a new process group and ``Dispatcher``.
"""

from __future__ import annotations

import collections
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .. import protocol
from ..agreement import agree
from ..routing import (
    Routing,
    expand_rows,
    gather_entry_values,
    gather_send_rows,
    plan_destination,
    plan_source,
    reduce_partials,
    scatter_entry_values,
    sum_returned,
)
from ..config import Config
from ..errors import BackendError, CommTimeoutError
from .base import Backend, DispatchResult

__all__ = ["CollectiveBackend"]


class CollectiveBackend(Backend):
    """Dispatch/combine with ``torch.distributed.all_to_all_single`` on padded slabs.

    Args:
        config: the validated config. group: the process group (gloo for CPU tensors, NCCL
            for CUDA tensors). device: where the tensors live.
        name: the backend name users chose (``reference`` or ``nccl``).

    Raises:
        BackendError: the group cannot move tensors of ``device`` (e.g. CPU tensors on an
            NCCL-only group).
    """

    def __init__(self, config: Config, group, device: torch.device, name: str) -> None:
        needed = "gloo" if device.type == "cpu" else "nccl"
        group_backend = str(dist.get_backend(group))
        if needed not in group_backend:
            raise BackendError(
                f"backend {name!r} moves {device.type} tensors and needs a process group with {needed}; the group's "
                f"backend is {group_backend!r} (pass group=torch.distributed.new_group(backend={needed!r}))"
            )
        super().__init__(config, group, device, name)
        # The number of the current dispatch/redispatch call (the device kernels' CH_TO_DEST epoch),
        # on the device so that replayed graphs count too.
        self._call = torch.zeros(1, dtype=torch.int64, device=device)
        # Set when an exchange failed or stalled: the ranks' collectives are out of step from then on.
        self._failure: Optional[str] = None
        # Eager CUDA exchanges not yet seen complete, oldest first: (phase, event after it, host time issued).
        self._in_flight: collections.deque = collections.deque()
        self._load_fp8_codec()
        if device.type == "cuda":
            # NCCL calls are captured into a CUDA graph only after they ran once on the stream;
            # one empty step here keeps that warm-up out of the user's first capture.
            self._warm_up()

    def _warm_up(self) -> None:
        cfg = self.config
        empty = torch.empty((0, cfg.hidden), dtype=cfg.torch_dtype, device=self.device)
        result = self.dispatch(empty, torch.empty((0, cfg.topk), dtype=torch.int64, device=self.device),
                               torch.empty((0, cfg.topk), dtype=torch.float32, device=self.device))
        self.combine(result.x, result.routing)
        self.warm_up_calls = 1  # the dispatch above
        torch.cuda.synchronize(self.device)

    def _peer(self) -> Optional[int]:
        """The peer a stuck exchange waits for, when the world size tells (two ranks); else None."""
        return 1 - self.rank if self.world_size == 2 else None

    def _describe_peer(self) -> str:
        peer = self._peer()
        if peer is not None:
            return f"peer rank {peer}"
        others = [r for r in range(self.world_size) if r != self.rank]
        return f"one of peer ranks {others}: a collective does not say which one is missing"

    def _exchange(self, slabs: torch.Tensor, phase: str) -> torch.Tensor:
        """Send slab ``r`` of ``slabs [W, ...]`` to rank ``r``; slab ``s`` of the result came from rank ``s``.

        ``phase`` names the exchange in errors, e.g. ``"dispatch: all_to_all_single of expert ids"``.
        """
        if self._failure is not None:
            raise BackendError(
                f"backend {self.name!r} on rank {self.rank} cannot run {phase}: an earlier exchange failed "
                f"({self._failure}); the ranks' collectives are out of step, so build a new process group "
                "and Dispatcher"
            )
        received = torch.empty_like(slabs)
        if self.device.type == "cpu":
            # gloo runs the exchange on its own thread: wait for it at most timeout_s.
            sent = slabs.contiguous()
            held_before = (sent._use_count(), received._use_count())
            work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
            try:
                work.wait(timeout=timedelta(seconds=self.config.timeout_s))
            except RuntimeError as exc:
                self._raise_failed(phase, exc)
            del work
            self._wait_released((sent, received), held_before)
        else:
            dist.all_to_all_single(received, slabs.contiguous(), group=self.group)
            if not torch.cuda.is_current_stream_capturing():
                self._track(phase)
        return received

    def reset(self) -> None:
        """Collective: clear the status; after a failed exchange raise instead (the group must be rebuilt)."""
        def local() -> None:
            if self._failure is not None:
                raise BackendError(
                    f"backend {self.name!r} cannot be reset after a failed exchange ({self._failure}): its process "
                    "group's collectives are out of step; build a new process group and Dispatcher"
                )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.status.copy_(protocol.new_status(self.device))

        agree(self.group, local, error=BackendError, what="reset")

    def _wait_released(self, tensors: tuple[torch.Tensor, ...], use_counts: tuple[int, ...]) -> None:
        """Give gloo's worker thread the GIL until it has dropped its references to ``tensors`` (at most ``timeout_s``).

        NOTE: gloo's worker destroys a finished exchange after ``wait`` has returned, and dropping its
        references to tensors that Python holds needs the GIL. Had the main thread returned, a short
        script could reach interpreter finalization while the worker still waits for the GIL; the
        worker is then ended inside a C++ destructor and the process aborts ("terminate called
        without an active exception", SIGABRT) after a successful run. Waiting here, with the GIL
        released, leaves the worker nothing of ours to drop later. Most waits end at once (median 7 us);
        a dispatch+combine pair (2 ranks, 64 tokens) took 3.6-3.8 ms with them against 3.5-3.6 without.
        """
        deadline = time.monotonic() + self.config.timeout_s
        while any(t._use_count() > count for t, count in zip(tensors, use_counts)) and time.monotonic() < deadline:
            time.sleep(1e-4)

    def _raise_failed(self, phase: str, exc: RuntimeError) -> None:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timed out" in detail.lower()
        what = f"timed out after {self.config.timeout_s} s" if timed_out else "failed"
        self._failure = f"rank {self.rank} {what} in {phase} ({self._describe_peer()}): {detail}"
        if timed_out:
            self._failure += ("; the peer is slow or dead, or it made fewer calls: every rank must make the same calls "
                              "in the same order (e.g. generate the same number of tokens)")
        raise (CommTimeoutError if timed_out else BackendError)(self._failure) from exc

    def _forget_finished(self) -> None:
        """Drop the oldest tracked exchanges that have finished (an event query each, no sync)."""
        while self._in_flight and self._in_flight[0][1].query():
            self._in_flight.popleft()

    def _track(self, phase: str) -> None:
        """Remember an eager CUDA exchange until it is seen complete."""
        self._forget_finished()
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((phase, event, time.monotonic()))

    def wait_settled(self) -> Optional[tuple[str, Optional[int]]]:
        """Poll the stream for at most ``timeout_s`` after the oldest unfinished exchange; abort the group if stuck.

        Returns None when every exchange finished (always on CPU: gloo exchanges finish or raise in
        the call), else ``(phase, peer)`` of the first stuck exchange; the group's NCCL
        communicator is then aborted (see the module docstring).
        """
        if self.device.type != "cuda" or self._failure is not None:
            return None
        done = torch.cuda.Event()
        done.record()
        self._forget_finished()  # the deadline runs from the oldest exchange still running
        started = self._in_flight[0][2] if self._in_flight else time.monotonic()
        deadline = started + self.config.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                return self._stalled()
            time.sleep(0.001)
        self._in_flight.clear()
        return None

    def _stalled(self) -> tuple[str, Optional[int]]:
        stuck = [phase for phase, event, _ in self._in_flight if not event.query()]
        phase = stuck[0] if stuck else "an all_to_all_single of a replayed CUDA graph"
        self._failure = f"rank {self.rank} timed out after {self.config.timeout_s} s in {phase} ({self._describe_peer()})"
        group = self.group if self.group is not None else dist.group.WORLD
        # The only way to stop an NCCL kernel that waits for a peer that never comes; without it the
        # stream never drains and the process cannot exit.
        group._get_backend(self.device).abort()
        return f"{phase}; the group's NCCL communicator was aborted so this process can go on: rebuild the " \
               "process group to communicate again", self._peer()

    def _send_tokens(self, rows: torch.Tensor, send_mask: torch.Tensor, phase: str) -> torch.Tensor:
        return self._exchange(gather_send_rows(rows, send_mask, self.config.max_tokens_per_rank), phase)

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, separate_outputs: bool = False,
        quantize: bool = False, x_scales: Optional[torch.Tensor] = None,
    ) -> DispatchResult:
        del separate_outputs  # every output below is its own allocation
        if quantize or x_scales is not None:
            raise BackendError(f"the {self.name} backend moves FP8 rows packed beforehand (moe_comm.fp8.pack), "
                               "it does not quantize them itself")
        cfg = self.config
        self._call.add_(1)
        send_mask, dest_rank, slab_expert = plan_source(
            topk_idx, cfg.num_experts, self.world_size, self.rank, self.status, self._call
        )
        num_tokens = x.shape[0]
        # One row more than the slab's M: the call tag, which every peer's paired call must carry.
        expert_slabs = torch.full(
            (self.world_size, cfg.max_tokens_per_rank + 1, cfg.topk), -1, dtype=torch.int32, device=x.device
        )
        expert_slabs[:, :num_tokens] = slab_expert
        expert_slabs[:, -1] = self.call_tag
        received = self._exchange(expert_slabs, "dispatch: all_to_all_single of expert ids")
        recv_expert = received[:, :-1]
        self._check_call_tags(received[:, -1, 0])
        recv_weight = self._send_tokens(topk_weights, send_mask, "dispatch: all_to_all_single of router weights")
        recv_rows = self._send_tokens(x, send_mask, "dispatch: all_to_all_single of token rows")
        plan = plan_destination(
            recv_expert, self.num_local_experts, cfg.expert_alignment, cfg.expert_capacity, self.status, self._call
        )
        routing = Routing(num_tokens, send_mask, dest_rank, plan.recv_pos, recv_weight)
        return DispatchResult(self._received_rows(recv_rows, plan.recv_pos), plan.expert_offsets,
                              plan.tokens_per_expert, routing)

    def _received_rows(self, recv_rows: torch.Tensor, recv_pos: torch.Tensor) -> torch.Tensor:
        """What dispatch and redispatch return of the received slabs ``[W, M, R]``: their rows ``[W * M, R]``
        (token-major), or the expert-major ``[capacity_rows, R]`` expansion along ``recv_pos``."""
        if self.token_major:
            return recv_rows.reshape(self.num_slab_rows, recv_rows.shape[-1])
        return expand_rows(recv_rows, recv_pos, self.capacity_rows, self.config.zero_padding)

    def _check_call_tags(self, peer_tags: torch.Tensor) -> None:
        """Record the first peer whose paired call carried another tag than this call's (on the device, no sync).

        ``peer_tags``: ``[W]`` int32, each rank's call tag. The result of such a call is invalid on every
        rank (each sees the other's tag), which ``Dispatcher.check`` reports.
        """
        differs = peer_tags != self.call_tag
        # Index with a device tensor (index_select): indexing by a 0-d tensor reads it on the host, which a
        # CUDA graph capture refuses.
        peer = torch.argmax(differs.to(torch.int32)).reshape(1)
        word = protocol.encode_call_mismatch(peer.to(torch.int64), peer_tags.index_select(0, peer).to(torch.int64),
                                             self.call_tag)
        field = self.status[protocol.STATUS_CALL_MISMATCH:protocol.STATUS_CALL_MISMATCH + 1]
        field.copy_(torch.where(differs.any() & (field == 0), word, field))

    def redispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self._call.add_(1)
        recv_rows = self._send_tokens(x, routing.send_mask, "redispatch: all_to_all_single of token rows")
        return self._received_rows(recv_rows, routing.recv_pos)

    def combine(self, y: torch.Tensor, routing: Routing, weighted: bool = True) -> torch.Tensor:
        if self.token_major:
            # A slab row whose entries were all dropped sends zeros, as the expert-major partial of no row.
            kept = (routing.recv_pos >= 0).any(dim=-1, keepdim=True)
            partials = torch.where(kept, y.view(routing.recv_pos.shape[:2] + (y.shape[-1],)), torch.zeros_like(y[:1]))
        else:
            partials = reduce_partials(y, routing.recv_pos, routing.recv_weight if weighted else None)
        returned = self._exchange(partials, "combine: all_to_all_single of partial sums")
        return sum_returned(returned, routing.send_mask)

    def permute(self, rows: torch.Tensor, routing: Routing, expert_offsets: torch.Tensor,
                tokens_per_expert: torch.Tensor) -> torch.Tensor:
        del expert_offsets, tokens_per_expert  # expand_rows fills every row no kept entry maps to
        slabs = rows.view(routing.recv_pos.shape[:2] + (rows.shape[-1],))
        return expand_rows(slabs, routing.recv_pos, self.capacity_rows, self.config.zero_padding)

    def unpermute(self, y: torch.Tensor, routing: Routing, weights: Optional[torch.Tensor]) -> torch.Tensor:
        shape = routing.recv_pos.shape
        partials = reduce_partials(y, routing.recv_pos, None if weights is None else weights.view(shape))
        return partials.reshape(self.num_slab_rows, y.shape[-1])

    def return_entry_values(self, row_vector: torch.Tensor, routing: Routing) -> torch.Tensor:
        entry_values = scatter_entry_values(row_vector, routing.recv_pos)
        returned = self._exchange(entry_values, "return_entry_values: all_to_all_single of entry values")
        return gather_entry_values(returned, routing.dest_rank)
