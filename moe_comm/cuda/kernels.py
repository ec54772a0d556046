"""Launchers of the CUDA kernels in ``csrc`` (one method per ``extern "C"`` entry point).

``DispatchKernels`` launches ``csrc/dispatch.cu`` (``dispatch``, ``redispatch``) and
``CombineKernels`` launches ``csrc/combine.cu`` (``combine``, ``values_send``, ``values_recv``):
one launch per dispatch, redispatch or combine. ``PermuteKernels`` launches ``csrc/permute.cu``
(``permute_rows``, ``unpermute_rows``), the token-major layout's local conversions, and
``Fp8PackKernels`` ``csrc/fp8.cu``. The protocol each kernel follows is stated at
the top of its ``.cu`` file; the values it shares with this module (block shapes, chunk and layout
sizes, the symmetric regions) are :mod:`moe_comm.protocol`'s. Each class loads every entry point
in its constructor (compiling it through :mod:`moe_comm.cuda.jit` and loading it through
:mod:`moe_comm.cuda.driver` when it is not cached), so a launcher never compiles or loads anything: it
fills the per-call parameters of its kernel's :class:`moe_comm.cuda.kernel_params.KernelParams` (the
fixed ones were set once) and calls ``cuLaunchKernel`` on torch's current stream, which works
eagerly and under CUDA-graph capture alike.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .. import fp8, protocol
from . import driver, jit, nvshmem_build
from .kernel_params import kernel_params
from ..errors import BackendError, InputError

__all__ = [
    "FP8_KERNELS_MIN_ARCH",
    "empty_rows",
    "Fp8PackKernels",
    "fp8_defines",
    "CommArgs",
    "RoutingAddresses",
    "kernel_defines",
    "fp8_dispatch_defines",
    "device_builds",
    "compile_for_configs",
    "DispatchKernels",
    "CombineKernels",
    "permute_builds",
    "PermuteKernels",
]

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_longlong


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _units_per_row(row_bytes: int, vectors_per_lane: int) -> int:
    """csrc RowUnits<VPL>::kPerRow: warps that share one row."""
    return _cdiv(row_bytes // 16, 32 * vectors_per_lane)


def kernel_defines(dtype: torch.dtype, hidden: int, topk: int, *, put_transport: bool = False) -> dict:
    """The compile-time defines of both kernel files for rows of ``hidden`` ``dtype`` and top-``topk``.

    ``put_transport``: remote writes as NVSHMEM puts (``csrc/transport.cuh``); such builds need
    :func:`moe_comm.cuda.nvshmem_build.compile_options` and the module initialisation it names.
    """
    if dtype not in _DTYPE_NAMES:
        raise BackendError(f"dtype {dtype} has no kernels; expected one of {', '.join(map(str, _DTYPE_NAMES))}")
    defines = {"DTYPE": _DTYPE_NAMES[dtype], "HIDDEN": int(hidden), "TOPK": int(topk)}
    if put_transport:
        defines["PUT_TRANSPORT"] = 1
    return defines


def fp8_dispatch_defines(dtype: torch.dtype, hidden: int, topk: int, *, put_transport: bool = False) -> dict:
    """FP8 dispatch's build of ``csrc/dispatch.cu``: slabs and outputs of packed FP8 rows
    (``moe_comm.fp8.pack``, ``FP8_ROWS``), built from ``dtype`` rows as they are sent or copied as given."""
    return {**fp8_defines(dtype, hidden, topk, put_transport=put_transport), "FP8_ROWS": 1}


def device_builds(dtype: torch.dtype, hidden: int, topk: int, *, arch: str, put_transport: bool,
                  fp8_dispatch: bool, token_major: bool = False) -> list[jit.Build]:
    """The kernel builds a device backend of rows of ``hidden`` ``dtype`` and top-``topk`` loads on ``arch``.

    In this order: dispatch and combine (with NVSHMEM's headers for ``put_transport``); with
    ``fp8_dispatch`` then the dispatch build for packed FP8 rows and, from compute capability 8.9
    (``FP8_KERNELS_MIN_ARCH``), the packing kernels of ``csrc/fp8.cu`` that the dispatcher's FP8
    codec loads. ``token_major`` (``Config.receive_layout``): the dispatch and combine builds are the
    ``TOKEN_MAJOR`` ones, and the builds of ``csrc/permute.cu`` (:func:`permute_builds`) follow.

    Raises:
        InputError: ``arch`` is not a real architecture of sm_80 or newer.
    """
    capability = jit.arch_capability(arch)
    toolchain = nvshmem_build.toolchain() if put_transport else jit.Toolchain()
    layout = {"TOKEN_MAJOR": 1} if token_major else {}
    defines = {**kernel_defines(dtype, hidden, topk, put_transport=put_transport), **layout}
    builds = [("dispatch", defines, toolchain), ("combine", defines, toolchain)]
    if fp8_dispatch:
        fp8_rows = {**fp8_dispatch_defines(dtype, hidden, topk, put_transport=put_transport), **layout}
        builds.append(("dispatch", fp8_rows, toolchain))
        if capability >= FP8_KERNELS_MIN_ARCH:
            builds.append(("fp8", fp8_defines(dtype, hidden), jit.Toolchain()))
    if token_major:
        builds += permute_builds(dtype, hidden, topk, fp8_rows=fp8_dispatch)
    return builds


def compile_for_configs(configs, arch: str) -> list:
    """Compile (or find cached) the kernels every config of ``configs`` runs on ``arch``
    (:func:`device_builds`; each distinct build once, all at once); returns the cubin paths. A config
    on the ``nvshmem`` backend with ``transport: put`` gets the put-transport builds (NVSHMEM's
    headers must be installed). No GPU needed.

    NOTE: a process that builds dispatchers of several configs one after the other compiles their
    builds one config at a time; compiling them here first takes about one build's time on a host
    with a core per build (a put-transport build took ~4.5 s on the GPU machines: NVSHMEM's headers).
    """
    builds = []
    for config in configs:
        put = config.backend == "nvshmem" and config.nvshmem.transport == "put"
        builds += device_builds(config.torch_dtype, config.hidden, config.topk, arch=arch, put_transport=put,
                                fp8_dispatch=config.dispatch_dtype is not None, token_major=config.token_major)
    distinct = {(name, jit.canonical_defines(defines), toolchain): (name, defines, toolchain)
                for name, defines, toolchain in builds}
    return jit.compile_many(list(distinct.values()), arch=arch)


FP8_KERNELS_MIN_ARCH = (8, 9)  # csrc/fp8.cu converts with cvt.rn.satfinite.e4m3x2.f32


def fp8_defines(dtype: torch.dtype, hidden: int, topk: int = 1, *, put_transport: bool = False) -> dict:
    """The compile-time defines of a build that quantizes rows of ``hidden`` ``dtype`` (``csrc/fp8.cuh``):
    ``csrc/fp8.cu``'s with the defaults, FP8 dispatch's within :func:`fp8_dispatch_defines`."""
    inv_max_bits = struct.unpack("<I", struct.pack("<f", 1.0 / fp8.FP8_MAX))[0]
    return {**kernel_defines(dtype, hidden, topk, put_transport=put_transport), "FP8_INV_MAX_BITS": inv_max_bits}


def empty_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous ``[rows, cols]`` tensor of ``dtype`` on ``device``: the per-call
    outputs the kernels fill.

    NOTE: ``torch.empty_strided`` with the strides spelled out takes less host time than
    ``torch.empty`` of the same shape (on an H100 machine 5.0 against 7.4 us for dispatch's
    ``out.x`` at T=128), and eager calls at decode sizes are host-bound (docs/design.md, "Handles,
    status and errors").
    """
    return torch.empty_strided((rows, cols), (cols, 1), dtype=dtype, device=device)


class Fp8PackKernels:
    """Launchers of ``csrc/fp8.cu``: rows to and from packed FP8 rows (:func:`moe_comm.fp8.pack`), one pass each.

    ``quantize_pack`` gives ``fp8.pack(*fp8.quantize(x))`` (scales not rounded) bit for bit,
    ``pack_pairs`` gives ``fp8.pack(x_fp8, scales)``, ``dequantize_rows`` gives
    ``fp8.dequantize(*fp8.unpack(packed, H))``; on GPUs of compute capability 8.9 or newer
    (``FP8_KERNELS_MIN_ARCH``). Loads both entry points now (compiling them if not cached).
    """

    _THREADS = 256

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden: int) -> None:
        defines = fp8_defines(dtype, hidden)
        self._quantize_pack = driver.load_function(device, "fp8", "quantize_pack", defines)
        self._pack_pairs = driver.load_function(device, "fp8", "pack_pairs", defines)
        self._dequantize_rows = driver.load_function(device, "fp8", "dequantize_rows", defines)
        self._dtype = dtype
        self._device = device
        self._hidden = hidden
        self._row_bytes = fp8.packed_row_bytes(hidden)
        self._sms = torch.cuda.get_device_properties(device).multi_processor_count
        # Prepared parameter arrays: building them per launch costs more host time than the launch
        # (kernel_params.KernelParams), which eager FP8 dispatch paid on every call.
        self._quantize_params = kernel_params((), (_P, _I, _P))
        self._dequantize_params = kernel_params((), (_P, _I, _P, _P))
        self._pairs_params = kernel_params((), (_P, _P, _I, _P))

    def _grid(self, work_items: int, per_block: int) -> int:
        return max(1, min(_cdiv(work_items, per_block), 8 * self._sms))

    def quantize_pack(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` (the config dtype) -> packed rows ``[T, packed_row_bytes(H)]`` uint8."""
        packed = empty_rows(x.shape[0], self._row_bytes, torch.uint8, self._device)
        units = x.shape[0] * _units_per_row(self._hidden, protocol.FP8_UNIT_VPL)  # a warp each; H e4m3 bytes a row
        grid = self._grid(32 * units, self._THREADS)
        self._quantize_pack.launch(grid, self._THREADS,
                                   self._quantize_params.fill((x.data_ptr(), x.shape[0], packed.data_ptr())))
        return packed

    def dequantize_rows(self, x_fp8: torch.Tensor, end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x_fp8``: the e4m3 view of packed rows (``moe_comm.fp8.unpack``'s first view, row stride
        ``packed_row_bytes(H)``) -> ``[N, H]`` in the rows' dtype, ``float(x) * scale`` rounded.

        ``end``: a one-element int32 tensor on the device (a dispatch output's ``expert_offsets[-1:]``):
        only the rows below it are written, the others are left uninitialised; read by the kernel.
        """
        rows = x_fp8.shape[0]
        out = empty_rows(rows, self._hidden, self._dtype, self._device)
        grid = self._grid(rows * self._hidden * out.element_size() // 16, self._THREADS)
        end_ptr = 0 if end is None else end.data_ptr()
        self._dequantize_rows.launch(grid, self._THREADS,
                                     self._dequantize_params.fill((x_fp8.data_ptr(), rows, end_ptr, out.data_ptr())))
        return out

    def pack_pairs(self, x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x_fp8 [T, H]`` e4m3 and ``scales [T, H/128]`` float32 -> packed rows ``[T, packed_row_bytes(H)]`` uint8."""
        packed = empty_rows(x_fp8.shape[0], self._row_bytes, torch.uint8, self._device)
        grid = self._grid(x_fp8.shape[0] * self._row_bytes // 4, self._THREADS)
        self._pack_pairs.launch(grid, self._THREADS, self._pairs_params.fill(
            (x_fp8.data_ptr(), scales.data_ptr(), x_fp8.shape[0], packed.data_ptr())))
        return packed


class RoutingAddresses(NamedTuple):
    """Device addresses of a routing's tensors (``moe_comm.routing.Routing``): ``send_mask [T, W]``
    bool, ``dest_rank [T, K]`` int32, ``recv_pos [W, M, K]`` int32, ``recv_weight [W, M, K]`` float32."""

    send_mask: int
    dest_rank: int
    recv_pos: int
    recv_weight: int


@dataclass(frozen=True)
class CommArgs:
    """The leading arguments of every kernel: who we are and where the shared state lives.

    peers_ptr: device address of the int64 ``[W]`` peer base addresses; state_ptr: the local u64
    ``[protocol.STATE_WORDS]``; status_ptr: the int64 status word; timeout_ns: bound of every wait.
    """

    peers_ptr: int
    rank: int
    world_size: int
    max_tokens_per_rank: int
    state_ptr: int
    status_ptr: int
    timeout_ns: int

    def prefix(self) -> tuple:
        return (
            (self.peers_ptr, _P),
            (self.rank, _I),
            (self.world_size, _I),
            (self.max_tokens_per_rank, _I),
            (self.state_ptr, _P),
            (self.status_ptr, _P),
            (self.timeout_ns, _L),
        )


class DispatchKernels:
    """Launchers of ``csrc/dispatch.cu`` for one backend (loads the entry points it runs now).

    Both kernels run one block per SM of their budget (their blocks wait for each other, so all
    must be resident at once; 512 threads of up to 128 registers fill an SM, so the grid's blocks
    land on as many SMs and the others stay free); the first ``num_senders`` blocks push rows to peers
    while the others lay out and expand what has landed (every block does both when ``num_senders``
    covers the budget). At world 1, where no row leaves the rank, dispatch is ``dispatch_one_rank``:
    none sends, and every block lays out and expands.

    Args:
        device: the CUDA device (with an index). defines: :func:`kernel_defines`.
        args: the common leading arguments. regions: the symmetric allocation's regions.
        num_experts: E. num_local_experts: L. expert_alignment: A. expert_capacity: C or None.
        zero_padding: whether dispatch zeroes the segments' padding rows (the config's).
        capacity_rows: rows of ``out.x``. num_senders: blocks that push rows to peers (at most ``grid_sms``).
        grid_sms: the SMs the kernels may use, one block each: the config's ``sm_budget``, or the
            device's SM count.
        toolchain: external headers of this build (:class:`moe_comm.cuda.jit.Toolchain`; NVSHMEM's for
            the put transport).
    """

    def __init__(
        self,
        device: torch.device,
        defines: dict,
        args: CommArgs,
        regions: protocol.SymmetricRegions,
        *,
        num_experts: int,
        num_local_experts: int,
        expert_alignment: int,
        expert_capacity: Optional[int],
        zero_padding: bool,
        capacity_rows: int,
        num_senders: int,
        grid_sms: int,
        toolchain: jit.Toolchain = jit.Toolchain(),
    ) -> None:
        # The layout phase keeps per-warp counters and lane sets of every local expert in shared
        # memory, and the one-rank kernel at decode sizes every block its own copy of the positions
        # (csrc/layout.cuh's LayoutShared).
        positions = protocol.LAYOUT_ROWS_PER_BLOCK * regions.topk if args.world_size == 1 else 0
        self._shared = ((2 * (protocol.DISPATCH_THREADS // 32) + 3) * num_local_experts + positions) * 4
        if self._shared > protocol.LAYOUT_SHARED_LIMIT:
            raise BackendError(
                f"num_local_experts={num_local_experts} is too many for the dispatch kernel's shared memory "
                f"({self._shared} B > {protocol.LAYOUT_SHARED_LIMIT} B); use more ranks or fewer experts"
            )
        load = lambda entry: driver.load_function(device, "dispatch", entry, defines, toolchain=toolchain)  # noqa: E731
        # One rank has a kernel of its own: nothing to send or wait for (csrc/dispatch.cu).
        self._dispatch = load("dispatch" if args.world_size > 1 else "dispatch_one_rank")
        self._redispatch = load("redispatch")
        self._grid = grid_sms
        self._num_senders = min(num_senders, grid_sms)
        self._world_size = args.world_size
        self._send_units = _units_per_row(regions.row_bytes, protocol.SEND_VPL)
        prefix = args.prefix()

        # About LAYOUT_ROWS_PER_BLOCK slab rows per layout block; the layout blocks publish their
        # per-expert counts in local scratch, and blocks stamp barriers in barrier_flags [2 * grid + 1]
        # (the layout blocks', the receiving group's, and the word that says the segments are out).
        slab_rows = args.world_size * args.max_tokens_per_rank
        self._layout_blocks = max(1, min(self._grid, _cdiv(slab_rows, protocol.LAYOUT_ROWS_PER_BLOCK)))
        self._block_counts = torch.zeros((self._layout_blocks, num_local_experts), dtype=torch.int32, device=device)
        self._barrier_flags = torch.zeros(2 * self._grid + 1, dtype=torch.int64, device=device)
        capacity = 2**31 - 1 if expert_capacity is None else min(int(expert_capacity), 2**31 - 1)
        chunk_tokens = max(protocol.MIN_CHUNK_TOKENS, _cdiv(args.max_tokens_per_rank, protocol.MAX_CHUNKS))
        # Each kernel's parameters: the ones fixed for this backend first, then the per-call ones.
        self._dispatch_params = kernel_params(
            prefix + (
                (regions.meta_offset, _L), (regions.recv_x_offset, _L), (regions.copy_stride, _L),
                (num_experts, _I), (chunk_tokens, _I),
                (num_local_experts, _I), (expert_alignment, _I), (int(zero_padding), _I), (capacity, _I),
                (self._block_counts.data_ptr(), _P), (self._barrier_flags.data_ptr(), _P), (capacity_rows, _I),
            ),
            (_I, _I, _P, _I, _P, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _P, _I),
        )
        self._redispatch_params = kernel_params(
            prefix + ((regions.recv_x_offset, _L), (regions.copy_stride, _L), (capacity_rows, _I)),
            (_I, _P, _I, _P, _P, _P),
        )

    def clear_scratch(self) -> None:
        """Zero the kernels' local scratch (block counts, barrier stamps), as at construction: a collective
        reset restarts the epochs, and a barrier stamp of an older epoch would let a block pass early."""
        self._block_counts.zero_()
        self._barrier_flags.zero_()

    def _senders(self, num_tokens: int) -> int:
        """Blocks that push rows: at most ``num_senders``, no more than the tokens' units need."""
        return max(1, min(self._num_senders, _cdiv(num_tokens * self._send_units, protocol.DISPATCH_THREADS // 32)))

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        routing: RoutingAddresses,
        expert_offsets: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        out_x: torch.Tensor,
        *,
        quantize: bool = False,
        x_scales: Optional[torch.Tensor] = None,
        call_tag: int = 0,
    ) -> None:
        """One dispatch. In: ``x [T, H]``, ``topk_idx [T, K]`` int32/int64, ``topk_weights [T, K]`` float32.
        Out (filled by the kernel): the routing's four tensors (source side ``send_mask``, ``dest_rank``;
        destination side ``recv_pos``, ``recv_weight``), ``expert_offsets``/``tokens_per_expert [L]``
        int32, ``out_x [capacity_rows, H]``. In an FP8 dispatch build (:func:`fp8_dispatch_defines`)
        ``out_x`` holds packed FP8 rows, and ``x`` too, or with ``quantize`` rows that the kernel
        builds packed rows from as it sends and expands them: rows of the build's dtype, quantized,
        or with ``x_scales [T, H / 128]`` float32 (contiguous) e4m3 rows ``x [T, H]`` (contiguous,
        16-byte aligned), copied with their scales. ``call_tag`` (< ``protocol.CALL_TAG_LIMIT``): every
        peer's call paired with this one must carry it (``protocol.COUNT_BITS``)."""
        num_tokens = x.shape[0]
        # At world 1 no row leaves the rank: no block is held back to send, every one lays out and expands.
        senders = self._senders(num_tokens) if self._world_size > 1 else 0
        # The layout runs on blocks that do not send when there are any (it then overlaps the sends).
        idle = self._grid - senders
        layout_blocks = min(self._layout_blocks, idle) if idle > 0 else self._layout_blocks
        params = self._dispatch_params.fill((
            senders, layout_blocks, x.data_ptr(), int(quantize), 0 if x_scales is None else x_scales.data_ptr(),
            topk_idx.data_ptr(),
            1 if topk_idx.dtype == torch.int64 else 0,
            topk_weights.data_ptr(), num_tokens, routing.send_mask, routing.dest_rank, routing.recv_pos,
            routing.recv_weight, expert_offsets.data_ptr(), tokens_per_expert.data_ptr(), out_x.data_ptr(), call_tag,
        ))
        self._dispatch.launch(self._grid, protocol.DISPATCH_THREADS, params, shared_bytes=self._shared)

    def redispatch(self, x: torch.Tensor, routing: RoutingAddresses, out_x: torch.Tensor) -> None:
        """Rows only, along an existing routing: row ``t`` of ``x [T, H]`` to every rank ``r`` with
        ``send_mask[t, r]``, expanded there into ``out_x [capacity_rows, H]`` along ``recv_pos``."""
        num_tokens = x.shape[0]
        # At world 1 nothing is sent: one block only signals the arrival that the expansion waits for.
        senders = self._senders(num_tokens) if self._world_size > 1 else 1
        params = self._redispatch_params.fill((
            senders, x.data_ptr(), num_tokens, routing.send_mask, routing.recv_pos, out_x.data_ptr(),
        ))
        self._redispatch.launch(self._grid, protocol.DISPATCH_THREADS, params)


class CombineKernels:
    """Launchers of ``csrc/combine.cu`` for one backend (loads the entry points it runs now; at world 1
    combine is ``combine_one_rank``, which writes the result without the slab).

    Args:
        device, defines, args, regions: as for :class:`DispatchKernels`.
        capacity_rows: rows of ``y`` (``out.x``'s layout). num_senders: blocks of the values kernels
            (at most ``grid_sms``).
        toolchain: as for :class:`DispatchKernels`.
        grid_sms: as for :class:`DispatchKernels`: ``combine`` runs one block per SM of it (its
            blocks wait for each other); it reads K expert rows per partial it sends, and bounding
            it to ``num_senders`` made it read-bound, so only a budget bounds it.
    """

    def __init__(
        self,
        device: torch.device,
        defines: dict,
        args: CommArgs,
        regions: protocol.SymmetricRegions,
        *,
        capacity_rows: int,
        num_senders: int,
        grid_sms: int,
        toolchain: jit.Toolchain = jit.Toolchain(),
    ) -> None:
        load = lambda entry: driver.load_function(device, "combine", entry, defines, toolchain=toolchain)  # noqa: E731
        # One rank has a kernel of its own (no slab, nothing to wait for), on as many blocks as its
        # units fill: it has no phase that waits for other blocks.
        self._combine = load("combine" if args.world_size > 1 else "combine_one_rank")
        partial_vpl = protocol.COMBINE_REDUCED_VPL if defines.get("TOKEN_MAJOR") else protocol.COMBINE_SEND_VPL
        self._one_rank_units = _units_per_row(regions.row_bytes, partial_vpl) if args.world_size == 1 else 0
        self._values_send = load("values_send")
        self._values_recv = load("values_recv")
        self._topk = regions.topk
        self._num_senders = min(num_senders, grid_sms)
        self._grid = grid_sms
        prefix = args.prefix()
        rows = args.world_size * args.max_tokens_per_rank
        self._combine_params = kernel_params(
            prefix + ((regions.ret_x_offset, _L), (regions.copy_stride, _L), (regions.stage_x_offset, _L),
                      (capacity_rows, _I)),
            (_P, _P, _P, _I, _P, _I, _P),
        )
        self._capacity = ((capacity_rows, _I),)
        self._values_send_grid = max(1, min(self._num_senders, _cdiv(rows * regions.topk, protocol.VALUES_THREADS)))
        self._values_send_const = prefix + ((regions.ret_vals_offset, _L), (regions.copy_stride, _L))
        self._values_recv_const = prefix + ((regions.ret_vals_offset, _L), (regions.copy_stride, _L))

    def combine(self, y: torch.Tensor, routing: RoutingAddresses, weighted: bool, z: torch.Tensor) -> None:
        """One combine: the destination sends one partial row per carried slab row of ``y [capacity_rows, H]``
        to its source; the source writes ``z [T, H]`` = the sum of its tokens' partial rows in rank order."""
        params = self._combine_params.fill((
            y.data_ptr(), routing.recv_pos, routing.recv_weight, 1 if weighted else 0, routing.send_mask,
            z.shape[0], z.data_ptr(),
        ))
        grid = self._grid
        if self._one_rank_units:
            units = z.shape[0] * self._one_rank_units
            grid = max(1, min(grid, _cdiv(units, protocol.COMBINE_THREADS // 32)))
        self._combine.launch(grid, protocol.COMBINE_THREADS, params)

    def values_send(self, row_vector: torch.Tensor, routing: RoutingAddresses) -> None:
        """Destination side: ``row_vector [capacity_rows]`` float32, read per entry, to each entry's source."""
        self._values_send.launch(
            self._values_send_grid,
            protocol.VALUES_THREADS,
            self._values_send_const + ((row_vector.data_ptr(), _P),) + self._capacity + ((routing.recv_pos, _P),),
        )

    def values_recv(self, routing: RoutingAddresses, out: torch.Tensor) -> None:
        """Source side: ``out [T, K]`` float32, each assignment's value from its destination (0 if none)."""
        num_tokens = out.shape[0]
        grid = max(1, min(self._num_senders, _cdiv(num_tokens * self._topk, protocol.VALUES_THREADS)))
        self._values_recv.launch(
            grid,
            protocol.VALUES_THREADS,
            self._values_recv_const + ((routing.dest_rank, _P), (num_tokens, _I), (out.data_ptr(), _P)),
        )


def permute_builds(dtype: torch.dtype, hidden: int, topk: int, *, fp8_rows: bool) -> list[jit.Build]:
    """The builds of ``csrc/permute.cu`` that :class:`PermuteKernels` of rows of ``hidden`` ``dtype`` and
    top-``topk`` loads: the ``dtype`` rows' (``permute_rows`` and ``unpermute_rows``), and with
    ``fp8_rows`` the packed FP8 rows' (``permute_rows`` only; FP8 dispatch's defines,
    :func:`fp8_dispatch_defines`). Neither needs NVSHMEM's headers: nothing crosses a rank."""
    builds = [("permute", kernel_defines(dtype, hidden, topk), jit.Toolchain())]
    if fp8_rows:
        builds.append(("permute", fp8_dispatch_defines(dtype, hidden, topk), jit.Toolchain()))
    return builds


class PermuteKernels:
    """Launchers of ``csrc/permute.cu``: the token-major layout's rows to and from the expert-major layout,
    on torch's current stream with every SM (no SM budget: they run beside the compute), no sync, capturable.

    ``permute`` gives ``moe_comm.routing.expand_rows`` bit for bit on the rows below
    ``expert_offsets[-1]`` (without ``zero_padding`` on the kept rows); ``unpermute`` gives
    ``moe_comm.routing.reduce_partials`` bit for bit on the slab rows with a kept entry, the partial rows
    combine's send phase sums. Loads its entry points now (compiling them if not cached).

    Args:
        device: the CUDA device (with an index). dtype, hidden, topk: the config's rows and top-k.
        fp8_rows: also load the build that permutes packed FP8 rows (:func:`moe_comm.fp8.pack`).
        num_slab_rows: ``W * M``, the token-major rows. num_local_experts: L.
        zero_padding: whether ``permute`` zeroes the segments' padding rows (the config's).
        capacity_rows: rows of the expert-major layout.
    """

    # Blocks per SM of the grid: as many as fit at once of permute_rows, twice those of unpermute_rows
    # (csrc/permute.cu's __launch_bounds__); neither kernel has a barrier, so the rest start as blocks end.
    _BLOCKS_PER_SM = 4

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden: int, topk: int, *, fp8_rows: bool,
                 num_slab_rows: int, num_local_experts: int, zero_padding: bool, capacity_rows: int) -> None:
        builds = permute_builds(dtype, hidden, topk, fp8_rows=fp8_rows)
        load = lambda entry, build: driver.load_function(device, "permute", entry, build[1])  # noqa: E731
        # permute_rows by the dtype of its rows: packed FP8 rows are uint8.
        self._permute = {dtype: load("permute_rows", builds[0])}
        if fp8_rows:
            self._permute[torch.uint8] = load("permute_rows", builds[1])
        self._unpermute = load("unpermute_rows", builds[0])
        self._dtype = dtype
        self._grid = self._BLOCKS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
        # The padding's segments in dynamic shared memory: end, kept rows and padding of every local expert.
        self._shared = 3 * 4 * num_local_experts if zero_padding else 0
        self._permute_params = kernel_params(
            ((num_slab_rows, _I), (num_local_experts, _I), (int(zero_padding), _I), (capacity_rows, _I)),
            (_P, _P, _P, _P, _P),
        )
        self._unpermute_params = kernel_params(((num_slab_rows, _I), (capacity_rows, _I)), (_P, _P, _P, _P))

    def permute(self, rows: torch.Tensor, recv_pos: int, expert_offsets: torch.Tensor,
                tokens_per_expert: torch.Tensor, out: torch.Tensor) -> None:
        """Token-major ``rows [W * M, H]`` (the config dtype, or packed FP8 rows ``[W * M,
        packed_row_bytes(H)]`` uint8) -> expert-major ``out [capacity_rows, ...]`` of the same dtype.
        ``recv_pos``: the device address of the routing's ``[W * M, K]`` int32 (a
        :class:`RoutingAddresses` field); ``expert_offsets``, ``tokens_per_expert``: ``[L]`` int32.

        Raises:
            InputError: packed FP8 rows without ``fp8_rows``, or rows of another dtype than the config's.
        """
        function = self._permute.get(rows.dtype)
        if function is None:
            raise InputError(
                f"rows: got dtype {rows.dtype}, expected {' or '.join(map(str, self._permute))} "
                "(packed FP8 rows are uint8 and need PermuteKernels(..., fp8_rows=True))"
            )
        params = self._permute_params.fill((rows.data_ptr(), recv_pos, expert_offsets.data_ptr(),
                                            tokens_per_expert.data_ptr(), out.data_ptr()))
        function.launch(self._grid, protocol.PERMUTE_THREADS, params, shared_bytes=self._shared)

    def unpermute(self, y: torch.Tensor, recv_pos: int, weights: int, out: torch.Tensor) -> None:
        """Expert-major ``y [capacity_rows, H]`` (the config dtype) -> ``out [W * M, H]``: row ``g`` the
        sum of its kept entries' rows, weighted by the ``[W * M, K]`` float32 at device address
        ``weights`` (0: unweighted); rows with no kept entry are left as they were. ``recv_pos``: as for
        :meth:`permute`.

        Raises:
            InputError: ``y`` is not of the config's dtype.
        """
        if y.dtype != self._dtype:
            raise InputError(f"y: got dtype {y.dtype}, expected the config's {self._dtype}")
        params = self._unpermute_params.fill((y.data_ptr(), recv_pos, weights, out.data_ptr()))
        self._unpermute.launch(self._grid, protocol.PERMUTE_THREADS, params)
