"""The interface every backend implements, and the host identity that tells ranks on one host apart."""

from __future__ import annotations

import abc
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import protocol
from ..config import Config
from ..errors import BackendError
from ..routing import Routing
from .fp8_codec import Fp8Codec

__all__ = ["Backend", "DispatchResult", "host_identity"]


@dataclass
class DispatchResult:
    """What a backend's dispatch returns (tensors on the backend's device).

    x: ``[capacity_rows, H]`` expert-major rows, or with the config's ``receive_layout`` ``token_major``
        ``[W * M, H]`` token-major rows (:meth:`Backend.permute`'s input).
    expert_offsets, tokens_per_expert: ``[L]`` int32 (the expert-major segments in either layout).
    routing: kept by the handle for combine and backward.
    """

    x: torch.Tensor
    expert_offsets: torch.Tensor
    tokens_per_expert: torch.Tensor
    routing: Routing


class Backend(abc.ABC):
    """Moves rows between the ranks of a group; semantics are defined in ``moe_comm.routing``.

    Every method takes validated, contiguous tensors on ``self.device`` and must not read a
    device value on the host. ``status`` is the device status word (``protocol.new_status``).
    """

    def __init__(self, config: Config, group, device: torch.device, name: str) -> None:
        """The state every backend has: the config, group, device, sizes and a cleared status word."""
        self.name = name
        self.config = config
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.num_local_experts = config.num_local_experts(self.world_size)
        self.capacity_rows = config.capacity_rows(self.world_size)
        self.status = protocol.new_status(device)
        # Config.receive_layout token_major: dispatch and redispatch return token-major rows [W * M, ...]
        # and combine takes rows reduced per slab row (unpermute's), [W * M, H].
        self.token_major = config.token_major
        self.num_slab_rows = self.world_size * config.max_tokens_per_rank
        # Dispatch/redispatch calls the constructor made itself (a warm-up): the status word's call
        # numbers count them, the user's calls come after.
        self.warm_up_calls = 0
        # The call tag of the next dispatch (protocol.CALL_TAG_LIMIT): the Dispatcher sets it before each
        # call; a peer's paired call must carry the same one, or the call fails on every rank.
        self.call_tag = 0
        # Whether dispatch takes quantize=True (its kernels build FP8 rows as they send them, from
        # config-dtype rows or from a pre-quantized pair).
        self.quantizes_fp8 = False
        # With the config's dispatch_dtype: the packing and dequantizing of FP8 rows (_load_fp8_codec).
        self.fp8_codec: Optional[Fp8Codec] = None

    def _load_fp8_codec(self) -> None:
        """Load the FP8 codec a config with ``dispatch_dtype`` needs (each backend, once its own kernels are loaded)."""
        if self.config.dispatch_dtype is not None:
            self.fp8_codec = Fp8Codec(self.config, self.device)

    @abc.abstractmethod
    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *, separate_outputs: bool = False,
        quantize: bool = False, x_scales: Optional[torch.Tensor] = None,
    ) -> DispatchResult:
        """Send ``x [T, H]`` to the ranks of its experts and lay it out expert-major there.

        ``x`` is in the config dtype, or, with the config's ``dispatch_dtype`` set, packed FP8 rows
        ``[T, moe_comm.fp8.packed_row_bytes(H)]`` uint8, moved as bytes (the result's ``x`` is then
        packed rows too). ``quantize`` (only where ``quantizes_fp8``): ``x`` is in the config dtype
        and the result holds its packed FP8 rows (``fp8.pack(*fp8.quantize(x))``, built on the way);
        with ``x_scales [T, H / 128]`` float32 too, ``x`` holds e4m3 rows and the result their packed
        rows (``fp8.pack(x, x_scales)``, built on the way: both contiguous, ``x`` 16-byte aligned).

        ``separate_outputs``: every returned tensor has its own storage (torch custom ops may not
        return aliasing tensors); otherwise a backend may pack small outputs into one allocation.
        """

    def dispatch_fp8(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, *, separate_outputs: bool = False) -> DispatchResult:
        """FP8 dispatch of config-dtype ``x [T, H]`` (``x_scales`` None) or of the pair ``x [T, H]`` e4m3
        and ``x_scales [T, H/128]`` float32 (contiguous, ``x`` 16-byte aligned: the Dispatcher's checks);
        the result's ``x`` holds packed rows.

        The dispatch kernels build the packed rows as they send them where they can (``quantizes_fp8``
        on a GPU that runs the FP8 kernels; config-dtype rows only with scales not rounded); otherwise
        the rows are packed first (:meth:`Fp8Codec.pack`). No autograd graph is recorded: the kernels
        read ``x`` by address, and packing runs without one. A pair's scales are its own, so
        ``dispatch_round_scale`` concerns only config-dtype rows.
        """
        codec = self.fp8_codec
        if self.quantizes_fp8 and codec.has_kernels and (x_scales is not None or not self.config.dispatch_round_scale):
            return self.dispatch(x, topk_idx, topk_weights, separate_outputs=separate_outputs, quantize=True,
                                 x_scales=x_scales)
        return self.dispatch(codec.pack(x, x_scales), topk_idx, topk_weights, separate_outputs=separate_outputs)

    def dequantize_fp8(self, x_fp8: torch.Tensor, x_scales: torch.Tensor,
                       end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, H]`` in the config dtype: an FP8 dispatch output's rows dequantized (:meth:`Fp8Codec.dequantize`;
        ``end``: its ``expert_offsets[-1:]``, past which rows may be left unspecified)."""
        return self.fp8_codec.dequantize(x_fp8, x_scales, end)

    @abc.abstractmethod
    def redispatch(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Send ``x [T, H]`` along an existing routing; returns the unweighted ``[capacity_rows, H]`` expansion
        (token-major: the ``[W * M, H]`` rows, each slab row with a kept entry once; the others unspecified)."""

    @abc.abstractmethod
    def combine(self, y: torch.Tensor, routing: Routing, weighted: bool = True) -> torch.Tensor:
        """Return ``[T, H]``: per token, the sum of its entries' rows of ``y``, times their weights if ``weighted``.

        Token-major: ``y [W * M, H]`` holds each slab row's partial already (:meth:`unpermute`'s), and ``z[t]``
        is the sum of the partials of its ranks in rank order (``weighted`` plays no part; a slab row with no
        kept entry counts as zeros, whatever it holds), bitwise the expert-major combine of the same rows.
        """

    @abc.abstractmethod
    def permute(self, rows: torch.Tensor, routing: Routing, expert_offsets: torch.Tensor,
                tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Token-major rows ``[W * M, R]`` (config dtype, or packed FP8 rows uint8) -> the expert-major
        ``[capacity_rows, R]`` rows along ``routing.recv_pos``: local, on the current stream.

        Each kept entry's row is its slab row's; with the config's ``zero_padding`` the segments' padding
        rows (``expert_offsets``, ``tokens_per_expert [L]`` int32) are zeros; rows at or past
        ``expert_offsets[-1]`` are unspecified. Bitwise what an expert-major dispatch writes. Reads only
        ``routing.recv_pos`` of the routing (the custom ops pass nothing else).
        """

    @abc.abstractmethod
    def unpermute(self, y: torch.Tensor, routing: Routing, weights: Optional[torch.Tensor]) -> torch.Tensor:
        """Expert-major rows ``y [capacity_rows, H]`` (config dtype) -> ``[W * M, H]``: each slab row with a kept
        entry gets ``dtype(sum over kept k, increasing, of w_k * y[recv_pos[g, k]])`` in float32 (the partial
        an expert-major combine sends; ``weights [W * M, K]`` float32, None for 1); other rows unspecified.
        Reads only ``routing.recv_pos`` of the routing."""

    @abc.abstractmethod
    def return_entry_values(self, row_vector: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Bring a per-row float32 value ``[capacity_rows]`` back to its assignment: ``[T, K]`` float32."""

    def wait_settled(self) -> Optional[tuple[str, Optional[int]]]:
        """Wait, at most about ``timeout_s``, until the device has finished this backend's calls so far.

        Called by ``Dispatcher.check`` before it reads the status word (a host sync that must not
        block forever). Returns None when the calls finished, else ``(phase, peer)`` of the first
        one still waiting on another rank (``peer`` None when the transport cannot tell which).
        The device kernels bound every wait themselves and report it in the status word, so by
        default there is nothing to wait for here.
        """
        return None

    def crowding_hint(self) -> Optional[str]:
        """Why this backend's kernels may not all have been resident (another backend on its GPU), or None.

        Added to the error of a timeout: it names a likely cause the host cannot check per call.
        """
        return None

    def reset(self) -> None:
        """Collective: bring every rank's protocol state back to that of a fresh backend after a failure.

        Called by ``Dispatcher.reset`` on every rank. Backends that cannot recover raise
        :class:`~moe_comm.errors.BackendError` saying what to rebuild.
        """
        raise BackendError(f"backend {self.name!r} cannot be reset after a failure: build a new Dispatcher")

    def close(self) -> None:
        """Release what the backend holds; idempotent."""


def host_identity() -> tuple[str, str]:
    """``(hostname, boot id)`` of this machine: ranks with equal identities share a host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot_id = handle.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id

