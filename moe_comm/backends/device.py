"""``DeviceBackend``: dispatch/combine with our own CUDA kernels on symmetric memory.

Every rank holds ONE symmetric allocation (a :class:`moe_comm.symm.base.SymmetricMemory`, e.g.
VMM), carved into the same regions on every rank (:class:`moe_comm.protocol.SymmetricRegions`):
receive slabs ``[W, M, ...]`` written by the sources (token rows and per-row metadata), return
slabs written by the destinations (combine partials, per-entry values), and flags. Kernels
write peers' memory directly (NVLink stores) and synchronise through release/acquire flags with
device-resident epochs, so every per-step call only launches kernels and allocates its outputs
with torch, and a whole step can be captured in a CUDA graph and replayed. The protocol is
stated at the top of ``csrc/dispatch.cu`` and ``csrc/combine.cu``.

NOTE: one call = these launches on the current stream: dispatch 1, combine 1, redispatch 1,
return_entry_values 2. Calls of one backend must be ordered on the device (one stream, or events
between streams): the epochs and done-counters are per backend.
Every rank must run the same sequence of calls (they are collective), eager or replayed.

NOTE: redispatch leaves the rows of its result that no kept entry maps to unspecified (the
reference backend zeroes them): ``Routing`` does not carry the segment ends that would say which
rows are padding, and zeroing all ``capacity_rows`` rows costs a memset of the whole buffer.
Autograd (the only user) reads only mapped rows.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from typing import Any, Callable, Optional

import torch

from .. import fp8, protocol
from ..cuda import driver, jit, kernels
from ..agreement import agree
from ..routing import Routing
from ..config import Config
from ..errors import BackendError
from .base import Backend, DispatchResult
from .concurrency import SmLedger

__all__ = ["DeviceBackend"]

_log = logging.getLogger("moe_comm")


_PIECE_WORDS = 32  # every piece of a packed allocation starts on a 128-byte line
_backend_numbers = itertools.count(1)  # names the backends in the errors of SmLedger


class PackedRouting:
    """The :class:`moe_comm.routing.Routing` of an eager device dispatch: its tensors in one allocation.

    ``send_mask [T, W]`` bool, ``dest_rank [T, K]`` int32, ``recv_pos [W, M, K]`` int32 and
    ``recv_weight [W, M, K]`` float32 (meaning as in ``Routing``) live at fixed word offsets of one
    int32 ``buffer``, which this object keeps alive. Each tensor view is made on first access:
    the kernels take :attr:`addresses` instead, so an eager step that only combines never makes them.

    NOTE: a view costs ~1.5-2 us of host time on the GPU machines (one torch.empty ~4.7 us), and
    eager calls at decode sizes are host-bound: making the four views and two dtype
    reinterpretations per dispatch took ~12 of its ~47 us.
    """

    def __init__(self, num_tokens: int, buffer: torch.Tensor, starts: tuple[int, int, int, int], world: int,
                 max_tokens_per_rank: int, topk: int) -> None:
        self.num_tokens = num_tokens
        self._buffer = buffer
        self._starts = starts
        self._world, self._max_tokens_per_rank, self._topk = world, max_tokens_per_rank, topk
        base = buffer.data_ptr()
        send_mask, dest_rank, recv_pos, recv_weight = starts
        self.addresses = kernels.RoutingAddresses(base + 4 * send_mask, base + 4 * dest_rank, base + 4 * recv_pos,
                                                  base + 4 * recv_weight)

    def _slab(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """Size and stride of a ``[W, M, K]`` slab view."""
        rows_k = self._max_tokens_per_rank * self._topk
        return (self._world, self._max_tokens_per_rank, self._topk), (rows_k, self._topk, 1)

    @functools.cached_property
    def send_mask(self) -> torch.Tensor:
        return self._buffer.view(torch.bool).as_strided((self.num_tokens, self._world), (self._world, 1),
                                                        4 * self._starts[0])

    @functools.cached_property
    def dest_rank(self) -> torch.Tensor:
        return self._buffer.as_strided((self.num_tokens, self._topk), (self._topk, 1), self._starts[1])

    @functools.cached_property
    def recv_pos(self) -> torch.Tensor:
        return self._buffer.as_strided(*self._slab(), self._starts[2])

    @functools.cached_property
    def recv_weight(self) -> torch.Tensor:
        return self._buffer.view(torch.float32).as_strided(*self._slab(), self._starts[3])


def _addresses(routing) -> kernels.RoutingAddresses:
    """Device addresses of a routing's four tensors (a :class:`PackedRouting` has them without views)."""
    if isinstance(routing, PackedRouting):
        return routing.addresses
    return kernels.RoutingAddresses(routing.send_mask.data_ptr(), routing.dest_rank.data_ptr(),
                                    routing.recv_pos.data_ptr(), routing.recv_weight.data_ptr())


def _recv_pos_address(routing) -> int:
    """Device address of a routing's ``recv_pos`` (permute and unpermute read nothing else of it: the custom ops
    hand them a ``Routing`` of that tensor alone)."""
    if isinstance(routing, PackedRouting):
        return routing.addresses.recv_pos
    return routing.recv_pos.data_ptr()


def _separate_outputs(num_tokens: int, world: int, max_tokens_per_rank: int, topk: int, num_local_experts: int,
                      device: torch.device) -> tuple:
    """``expert_offsets``, ``tokens_per_expert [L]`` int32 and a ``Routing``, each tensor its own allocation.

    The custom ops (``moe_comm.ops``, torch.compile) need these: their outputs may not alias.
    """
    slab = (world, max_tokens_per_rank, topk)
    routing = Routing(
        num_tokens,
        send_mask=torch.empty((num_tokens, world), dtype=torch.bool, device=device),
        dest_rank=torch.empty((num_tokens, topk), dtype=torch.int32, device=device),
        recv_pos=torch.empty(slab, dtype=torch.int32, device=device),
        recv_weight=torch.empty(slab, dtype=torch.float32, device=device),
    )
    return (torch.empty(num_local_experts, dtype=torch.int32, device=device),
            torch.empty(num_local_experts, dtype=torch.int32, device=device), routing)


@functools.lru_cache(maxsize=None)
def _packed_starts(num_tokens: int, world: int, max_tokens_per_rank: int, topk: int,
                   num_local_experts: int) -> tuple[int, tuple[int, ...]]:
    """Words of a packed output allocation and the word offset of each piece: ``expert_offsets``,
    ``tokens_per_expert``, then the routing's ``send_mask``, ``dest_rank``, ``recv_pos``, ``recv_weight``.

    Cached: an eager step at decode sizes is host-bound, and the arithmetic depends only on its
    arguments (a few distinct token counts per dispatcher).
    """
    slab_words = world * max_tokens_per_rank * topk
    sizes = (num_local_experts, num_local_experts, -(-num_tokens * world // 4), num_tokens * topk, slab_words,
             slab_words)
    starts = []
    words = 0
    for size in sizes:
        starts.append(words)
        words += -(-size // _PIECE_WORDS) * _PIECE_WORDS
    return words, tuple(starts)


def _packed_outputs(num_tokens: int, world: int, max_tokens_per_rank: int, topk: int, num_local_experts: int,
                    device: torch.device) -> tuple:
    """``expert_offsets``, ``tokens_per_expert [L]`` int32 and a :class:`PackedRouting`, all in one allocation."""
    words, starts = _packed_starts(num_tokens, world, max_tokens_per_rank, topk, num_local_experts)
    buffer = torch.empty(words, dtype=torch.int32, device=device)
    routing = PackedRouting(num_tokens, buffer, starts[2:], world, max_tokens_per_rank, topk)
    return (buffer.as_strided((num_local_experts,), (1,), starts[0]),
            buffer.as_strided((num_local_experts,), (1,), starts[1]), routing)


class DeviceBackend(Backend):
    """Dispatch/combine with the kernels of ``csrc`` on one symmetric allocation per rank.

    Collective: every rank of ``group`` constructs it with the same config, in the same order. The
    constructor allocates and maps the symmetric memory, compiles and loads every kernel, and runs
    every kernel once (a warm-up step with no tokens), so nothing is compiled, loaded or allocated
    symmetrically afterwards and any per-step call may be captured in a CUDA graph.

    Args:
        config: the validated config. group: the process group (its host-side collectives carry
            the setup; every rank must be on this host). device: this rank's CUDA device.
        memory_factory: makes the symmetric allocation, called as
            ``memory_factory(group, device, nbytes, timeout_s=...)`` (a ``SymmetricMemory``).
        name: the backend name users chose (``vmm``, ``nvshmem``, ``nccl``).
        put_transport: build the kernels for NVSHMEM puts (``csrc/transport.cuh``); the memory
            factory must then give every rank's own (symmetric) address as each peer's entry.

    Raises:
        BackendError: the sizes do not fit the kernels, a kernel does not compile on some rank, or
            the warm-up step did not complete (a peer did not answer within ``timeout_s``).
    """

    def __init__(
        self, config: Config, group, device: torch.device, memory_factory: Callable[..., Any], name: str,
        *, put_transport: bool = False,
    ) -> None:
        if not isinstance(device, torch.device) or device.type != "cuda":
            raise BackendError(f"DeviceBackend needs a CUDA device, got {device!r}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        super().__init__(config, group, device, name)
        self.dtype = config.torch_dtype
        self._memory = None
        self._closed = False
        self._ledger: Optional[SmLedger] = None
        self._put_transport = put_transport
        self._fp8_row_bytes = fp8.packed_row_bytes(config.hidden)  # FP8 dispatch's rows (eager calls: host-bound)
        self._check_sizes()

        row_bytes = config.hidden * self.dtype.itemsize
        self.regions = protocol.SymmetricRegions.plan(
            self.world_size, config.max_tokens_per_rank, config.topk, row_bytes, put_transport=put_transport,
            slab_copies=config.slab_copies,
        )
        # u64 state words (epochs, done-counters): zero, like the flags of a fresh allocation.
        self._state = torch.zeros(protocol.STATE_WORDS, dtype=torch.int64, device=device)
        self._memory = memory_factory(group, device, self.regions.nbytes, timeout_s=config.timeout_s)
        try:
            self._setup_kernels()
            self._warm_up()
        except BaseException:
            self.close()
            raise
        if self.world_size > 1:
            # One rank's kernels wait for nobody else: only multi-rank calls in flight can deadlock.
            self._ledger = SmLedger(device, self._grid_sms, self._device_sms,
                                    f"Dispatcher #{next(_backend_numbers)} ({name}, sm_budget {config.sm_budget})")

    # ------------------------------------------------------------------ setup

    def _check_sizes(self) -> None:
        cfg = self.config
        if self.world_size > protocol.MAX_WORLD:
            raise BackendError(
                f"the device kernels handle at most {protocol.MAX_WORLD} ranks, the group has {self.world_size}"
            )
        if cfg.topk > protocol.MAX_TOPK:
            raise BackendError(f"the device kernels handle topk <= {protocol.MAX_TOPK}, the config has {cfg.topk}")
        if cfg.max_tokens_per_rank >= 1 << protocol.COUNT_BITS:
            raise BackendError(
                f"the device kernels handle max_tokens_per_rank < {1 << protocol.COUNT_BITS} (a count word holds T in "
                f"{protocol.COUNT_BITS} bits beside the call tag), the config has {cfg.max_tokens_per_rank}"
            )
        entries = self.world_size * cfg.max_tokens_per_rank * cfg.topk
        if self.capacity_rows >= 2**31 or entries >= 2**31:
            raise BackendError(
                f"capacity_rows={self.capacity_rows} and world_size * max_tokens_per_rank * topk={entries} must "
                "stay below 2**31 (int32 row indices); lower max_tokens_per_rank or set expert_capacity"
            )

    def _setup_kernels(self) -> None:
        """Compile (cached) and load every kernel; all ranks learn whether any rank failed."""
        agree(self.group, self._load_kernels, error=BackendError, what="kernel setup")

    def _load_kernels(self) -> None:
        """Compile (cached, every build at once) and load every kernel on this rank."""
        cfg = self.config
        arch = driver.arch_of(self.device)
        builds = kernels.device_builds(self.dtype, cfg.hidden, cfg.topk, arch=arch, put_transport=self._put_transport,
                                       fp8_dispatch=cfg.dispatch_dtype is not None, token_major=self.token_major)
        # A cold cache compiles every build at once here; the loads below then find them.
        jit.compile_many(builds, arch=arch)
        _, defines, toolchain = builds[0]
        args = kernels.CommArgs(
            peers_ptr=self._memory.peer_ptrs_tensor.data_ptr(),
            rank=self.rank,
            world_size=self.world_size,
            max_tokens_per_rank=cfg.max_tokens_per_rank,
            state_ptr=self._state.data_ptr(),
            status_ptr=self.status.data_ptr(),
            timeout_ns=int(cfg.timeout_s * 1e9),
        )
        device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        grid_sms = device_sms if cfg.sm_budget is None else min(cfg.sm_budget, device_sms)
        self._device_sms, self._grid_sms = device_sms, grid_sms

        def dispatch_kernels(row_defines: dict, regions: protocol.SymmetricRegions) -> kernels.DispatchKernels:
            return kernels.DispatchKernels(
                self.device, row_defines, args, regions, num_experts=cfg.num_experts,
                num_local_experts=self.num_local_experts, expert_alignment=cfg.expert_alignment,
                # Token-major dispatch zeroes no padding: it writes no segment (permute does).
                expert_capacity=cfg.expert_capacity, zero_padding=cfg.zero_padding and not self.token_major,
                capacity_rows=self.capacity_rows,
                num_senders=cfg.num_senders, grid_sms=grid_sms, toolchain=toolchain,
            )

        self._dispatch_kernels = dispatch_kernels(defines, self.regions)
        # FP8 dispatch moves packed rows (moe_comm.fp8.pack): a build of the same kernels whose slabs
        # and outputs hold such rows, in the same (larger) slabs, with the same epochs; it takes them
        # packed, or quantizes config-dtype rows as it sends them.
        self._fp8_dispatch_kernels = None
        if cfg.dispatch_dtype is not None:
            _, fp8_defines, _ = builds[2]
            self._fp8_dispatch_kernels = dispatch_kernels(
                fp8_defines, dataclasses.replace(self.regions, row_bytes=self._fp8_row_bytes))
            self.quantizes_fp8 = True
        self._combine_kernels = kernels.CombineKernels(
            self.device, defines, args, self.regions, capacity_rows=self.capacity_rows, num_senders=cfg.num_senders,
            grid_sms=grid_sms, toolchain=toolchain,
        )
        self._permute_kernels = None
        if self.token_major:
            self._permute_kernels = kernels.PermuteKernels(
                self.device, self.dtype, cfg.hidden, cfg.topk, fp8_rows=cfg.dispatch_dtype is not None,
                num_slab_rows=self.num_slab_rows, num_local_experts=self.num_local_experts,
                zero_padding=cfg.zero_padding, capacity_rows=self.capacity_rows,
            )
        self._load_fp8_codec()

    def _warm_up(self) -> None:
        """Run every kernel once with no tokens (collective); raises if a wait timed out."""
        cfg = self.config
        x = torch.empty((0, cfg.hidden), dtype=self.dtype, device=self.device)
        idx = torch.empty((0, cfg.topk), dtype=torch.int64, device=self.device)
        weights = torch.empty((0, cfg.topk), dtype=torch.float32, device=self.device)
        result = self.dispatch(x, idx, weights)
        if self.token_major:  # local kernels: run once here so that a fault shows at construction
            rows = self.permute(result.x, result.routing, result.expert_offsets, result.tokens_per_expert)
            self.unpermute(rows, result.routing, None)
        self.combine(result.x, result.routing, weighted=True)
        self.redispatch(x, result.routing)
        self.warm_up_calls = 2  # the dispatch and the redispatch above
        self.return_entry_values(
            torch.zeros(self.capacity_rows, dtype=torch.float32, device=self.device), result.routing
        )
        torch.cuda.synchronize(self.device)
        report = protocol.decode_status(self.status.tolist())
        problem = None
        if report.timeout_phase:
            problem = (
                f"rank {self.rank} timed out after {cfg.timeout_s} s: "
                f"{report.timeout_phase} (peer rank {report.timeout_peer})"
            )

        def report() -> None:
            if problem is not None:
                raise BackendError(
                    f"the warm-up step of the device kernels did not complete: {problem}; "
                    "is every rank constructing its Dispatcher at the same time?"
                )

        agree(self.group, report, error=BackendError, what="the warm-up step of the device kernels")

    # ------------------------------------------------------------------ per step

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, separate_outputs: bool = False,
        quantize: bool = False, x_scales: Optional[torch.Tensor] = None,
    ) -> DispatchResult:
        cfg = self.config
        device = self.device
        num_tokens = x.shape[0]
        outputs = _separate_outputs if separate_outputs else _packed_outputs
        expert_offsets, tokens_per_expert, routing = outputs(
            num_tokens, self.world_size, cfg.max_tokens_per_rank, cfg.topk, self.num_local_experts, device
        )
        rows = self._received_rows
        # FP8 rows (given packed as uint8, or built on the way) go through their own build.
        if quantize or x.dtype == torch.uint8:
            launcher = self._fp8_dispatch_kernels
            out_x = kernels.empty_rows(rows, self._fp8_row_bytes, torch.uint8, device)
        else:
            launcher = self._dispatch_kernels
            out_x = kernels.empty_rows(rows, x.shape[1], x.dtype, device)
        launcher.dispatch(x, topk_idx, topk_weights, _addresses(routing), expert_offsets, tokens_per_expert, out_x,
                          quantize=quantize, x_scales=x_scales, call_tag=self.call_tag)
        return DispatchResult(out_x, expert_offsets, tokens_per_expert, routing)

    @property
    def _received_rows(self) -> int:
        """Rows of what dispatch and redispatch return: one per slab row (token-major), else ``capacity_rows``."""
        return self.num_slab_rows if self.token_major else self.capacity_rows

    def redispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = kernels.empty_rows(self._received_rows, self.config.hidden, self.dtype, self.device)
        self._dispatch_kernels.redispatch(x, _addresses(routing), out)
        return out

    def permute(self, rows: torch.Tensor, routing: Routing, expert_offsets: torch.Tensor,
                tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = kernels.empty_rows(self.capacity_rows, rows.shape[1], rows.dtype, self.device)
        self._permute_kernels.permute(rows, _recv_pos_address(routing), expert_offsets, tokens_per_expert, out)
        return out

    def unpermute(self, y: torch.Tensor, routing: Routing, weights: Optional[torch.Tensor]) -> torch.Tensor:
        out = kernels.empty_rows(self.num_slab_rows, self.config.hidden, self.dtype, self.device)
        weights_address = 0 if weights is None else weights.data_ptr()
        self._permute_kernels.unpermute(y, _recv_pos_address(routing), weights_address, out)
        return out

    def combine(self, y: torch.Tensor, routing: Routing, weighted: bool = True) -> torch.Tensor:
        z = kernels.empty_rows(routing.num_tokens, self.config.hidden, self.dtype, self.device)
        self._combine_kernels.combine(y, _addresses(routing), weighted, z)
        return z

    def return_entry_values(self, row_vector: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = kernels.empty_rows(routing.num_tokens, self.config.topk, torch.float32, self.device)
        k, addresses = self._combine_kernels, _addresses(routing)
        k.values_send(row_vector.contiguous(), addresses)
        k.values_recv(addresses, out)
        return out

    # ------------------------------------------------------------------ failures

    def crowding_hint(self) -> Optional[str]:
        return None if self._ledger is None else self._ledger.crowding()

    def reset(self) -> None:
        """Collective: every rank's symmetric allocation, state words, status and kernel scratch back to zeros.

        Every rank first waits for its device (each wait in the kernels is bounded, and once the abort
        word is raised they end at once), then the ranks meet, each zeroes its own memory (the flags,
        the abort word and the tagged metadata words among it: a stale tag of an older call must not
        match an epoch counted again from 1), and the ranks meet again before any of them may write a
        peer's memory. CUDA graphs captured before stay valid: they hold addresses, and the epochs they
        read live in the state words, which restart on every rank alike.

        Raises:
            BackendError: a rank failed to reset (every rank raises, naming it).
        """
        def settle() -> None:
            torch.cuda.synchronize(self.device)

        def clear() -> None:
            words = self.regions.nbytes // 8
            self._memory.tensor(self.rank, 0, (words,), torch.int64).zero_()
            self._state.zero_()
            self.status.copy_(protocol.new_status(self.device))
            for launcher in (self._dispatch_kernels, self._fp8_dispatch_kernels):
                if launcher is not None:
                    launcher.clear_scratch()
            torch.cuda.synchronize(self.device)

        agree(self.group, settle, error=BackendError, what="reset: waiting for every rank's device")
        # agree's exchange after clear() is the second meeting: no rank returns before every rank cleared.
        agree(self.group, clear, error=BackendError, what="reset: clearing every rank's protocol state")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Release the symmetric memory (after the device finished using it); idempotent, local."""
        if self._closed:
            return
        self._closed = True
        if self._ledger is not None:
            self._ledger.close()
        memory, self._memory = self._memory, None
        if memory is not None:
            memory.close()
