"""Configuration: frozen, validated dataclasses loaded from YAML.

``load_config`` is the one way in: it reads a YAML file, a dict or the embedded
default (``configs/default.yaml``), merges keyword overrides, rejects
unknown keys and checks every value, naming the key, the value and what is
allowed. Values that depend on the process group (``num_experts % world_size``)
are checked by :meth:`Config.check_world` when a ``Dispatcher`` is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Union

import torch
import yaml

from .assets import asset_dir
from . import backend_table, fp8
from .errors import ConfigError
from .footprint import footprint
from .protocol import SLAB_COPIES

__all__ = [
    "BACKENDS",
    "DTYPES",
    "DISPATCH_DTYPES",
    "EXPERT_IMPLS",
    "RECEIVE_LAYOUTS",
    "Config",
    "VmmConfig",
    "NvshmemConfig",
    "NcclConfig",
    "RouterConfig",
    "ROUTER_SCORES",
    "load_config",
    "default_config_text",
]

BACKENDS = ("auto",) + backend_table.BACKEND_NAMES
EXPERT_IMPLS = ("auto", "grouped_mm", "loop")
RECEIVE_LAYOUTS = ("expert_major", "token_major")
DISPATCH_DTYPES = ("float8_e4m3fn",)
ROUTER_SCORES = ("softmax", "sigmoid")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# The largest value of a key that reaches an int32 kernel parameter, and of a row count the kernels index.
INT32_MAX = 2**31 - 1
# The longest timeout_s: the kernels wait timeout_s * 1e9 ns in int64 arithmetic (also as clock
# cycles, a few per ns); 1e6 s (11.6 days) is far from a wrap and far past any useful wait.
MAX_TIMEOUT_S = 1e6
# The most one rank may need at world 1 (one slab and one dispatch output), 1 TiB: more memory
# than any single GPU has, so a config past it cannot run anywhere (a typo, not a wish).
MAX_RANK_BYTES = 1 << 40

# Values in error messages: a bounded repr (reprlib looks at a few items of a few levels), so a
# huge value (a deeply nested list) cannot turn an error into gigabytes of text.
_SHORT = reprlib.Repr()
_SHORT.maxlevel = 3
_SHORT_CHARS = 120


def _short(value: Any) -> str:
    """``repr(value)`` in at most :data:`_SHORT_CHARS` characters (and no digit string of a huge int)."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    text = _SHORT.repr(value)
    return text if len(text) <= _SHORT_CHARS else text[: _SHORT_CHARS - 3] + "..."


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"config key '{key}': got {_short(value)}, expected {allowed}")


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise _fail(key, value, "one of " + ", ".join(repr(c) for c in choices))


def _check_int(key: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(key, value, f"an integer >= {minimum}")
    if value > maximum:
        raise _fail(key, value, f"an integer from {minimum} to {maximum}")


def _check_seconds(key: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0
            or value > MAX_TIMEOUT_S):
        raise _fail(key, value, f"a positive number of seconds, at most {MAX_TIMEOUT_S:g}")


def _check_number(key: str, value: Any, allowed: str, positive: bool) -> None:
    """A finite int or float, > 0 if ``positive`` else >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(key, value, allowed)
    if value < 0 or (positive and value == 0):
        raise _fail(key, value, allowed)


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _fail(key, value, "true or false")


@dataclass(frozen=True)
class VmmConfig:
    """Settings of the ``vmm`` backend (CUDA VMM memory shared between the processes of one host).

    fd_passing: how the POSIX file descriptors of ``cuMemCreate`` allocations reach the peers.
        ``scm_rights`` sends them over a Unix-domain socket and works for any user;
        ``pidfd`` uses ``pidfd_getfd``, which needs root or a permissive ptrace scope.
    """

    fd_passing: str = "scm_rights"

    def __post_init__(self) -> None:
        _check_choice("vmm.fd_passing", self.fd_passing, ("scm_rights", "pidfd"))


@dataclass(frozen=True)
class NvshmemConfig:
    """Settings of the ``nvshmem`` backend.

    transport: ``p2p`` moves rows with loads/stores on peer pointers inside the NVLink
        domain; ``put`` forces device-initiated NVSHMEM puts (the path used across nodes).
    heap_size_mb: size of the NVSHMEM symmetric heap in MiB; None sizes it from the buffers
        this configuration needs.
    """

    transport: str = "p2p"
    heap_size_mb: Optional[int] = None

    def __post_init__(self) -> None:
        _check_choice("nvshmem.transport", self.transport, backend_table.transports("nvshmem"))
        if self.heap_size_mb is not None:
            _check_int("nvshmem.heap_size_mb", self.heap_size_mb, 1, MAX_RANK_BYTES >> 20)


@dataclass(frozen=True)
class NcclConfig:
    """Settings of the ``nccl`` backend.

    transport: ``collective`` exchanges capacity-sized, padded buffers with
        ``all_to_all_single`` (works across nodes); ``symmetric`` uses NCCL symmetric
        memory windows and the device kernels (one NVLink domain).
    """

    transport: str = "collective"

    def __post_init__(self) -> None:
        _check_choice("nccl.transport", self.transport, backend_table.transports("nccl"))


@dataclass(frozen=True)
class RouterConfig:
    """How :class:`moe_comm.MoELayer` routes tokens and balances the experts' load (the Dispatcher ignores it).

    The defaults are a float32 softmax, the top-k of its probabilities, renormalised, with no
    balancing. Every rank must use the same values (they are part of the config fingerprint).

    score: ``softmax`` (probabilities over the experts) or ``sigmoid`` (an independent score per
        expert, as DeepSeek-V3).
    softmax_after_topk: pick the top-k logits first, then take the softmax over those K only
        (Mixtral's order); false takes the top-k of the softmax over all experts. Only with
        ``score: softmax`` (a sigmoid is per expert, so the order makes no difference).
    renormalize: scale each token's K weights to sum to 1. ``MoELayer(renormalize=...)`` overrides it.
    routed_scaling_factor: multiplies the routed experts' weights after renormalisation (DeepSeek-V3: 2.5).
    n_group, topk_group: group-limited top-k (DeepSeek-V3's ``n_group`` / ``topk_group``): the
        experts form ``n_group`` groups of ``num_experts / n_group`` consecutive ids; a group's score
        is the sum of its two best selection scores (its one best in groups of one expert); each
        token keeps its ``topk_group`` best groups and takes its top-k among their experts.
        ``n_group: 1`` is plain top-k.
    aux_loss_coef: coefficient of the Switch/GShard load-balancing loss over each forward's tokens
        (``E * sum_e f_e * P_e``: ``f_e`` the fraction of assignments to expert ``e``, ``P_e`` its mean
        probability); 0 leaves it out.
    seq_aux_loss_coef: coefficient of DeepSeek-V3's sequence-wise balancing loss (the same term
        per sequence, averaged over the sequences; a sequence is dim -2 of a ``[..., S, H]`` input);
        0 leaves it out.
    z_loss_coef: coefficient of the router z-loss (ST-MoE: mean squared logsumexp of the logits); 0 leaves it out.
    bias_update_rate: aux-loss-free balancing (DeepSeek-V3): a per-expert bias is added to the
        scores to choose the experts (never to their weights), and
        ``MoELayer.update_expert_bias()`` moves it by this rate towards the mean load; 0 keeps no bias.
    """

    score: str = "softmax"
    softmax_after_topk: bool = False
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    aux_loss_coef: float = 0.0
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("router.score", self.score, ROUTER_SCORES)
        _check_bool("router.softmax_after_topk", self.softmax_after_topk)
        if self.softmax_after_topk and self.score != "softmax":
            raise _fail("router.softmax_after_topk", self.softmax_after_topk,
                        f"false with router.score '{self.score}' (only a softmax has an order to choose)")
        _check_bool("router.renormalize", self.renormalize)
        _check_number("router.routed_scaling_factor", self.routed_scaling_factor, "a positive number", True)
        _check_int("router.n_group", self.n_group, 1)
        _check_int("router.topk_group", self.topk_group, 1)
        if self.topk_group > self.n_group:
            raise _fail("router.topk_group", self.topk_group, f"at most router.n_group ({self.n_group})")
        for key in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            _check_number(f"router.{key}", getattr(self, key), "a number >= 0 (0 turns it off)", False)

    @property
    def balancing_losses(self) -> bool:
        """True when any balancing loss has a coefficient (the layer then records ``aux_loss``)."""
        return bool(self.aux_loss_coef or self.seq_aux_loss_coef or self.z_loss_coef)

    def check_experts(self, num_experts: int, topk: int) -> None:
        """Check the group settings against ``num_experts`` and ``topk``; raise ``ConfigError`` naming the key."""
        if num_experts % self.n_group:
            raise _fail("router.n_group", self.n_group, f"a divisor of num_experts ({num_experts})")
        kept = self.topk_group * (num_experts // self.n_group)
        if topk > kept:
            raise _fail("router.topk_group", self.topk_group,
                        f"enough groups for topk ({topk}): {self.topk_group} groups of "
                        f"{num_experts // self.n_group} experts hold {kept}")


_SECTIONS = {"vmm": VmmConfig, "nvshmem": NvshmemConfig, "nccl": NcclConfig, "router": RouterConfig}


@dataclass(frozen=True)
class Config:
    """Everything a ``Dispatcher`` needs to know before it allocates.

    backend: ``vmm`` | ``nvshmem`` | ``nccl`` | ``reference`` | ``auto``. ``auto`` picks
        ``reference`` on CPU and the best GPU backend the machine supports.
    num_experts: global number of experts E; expert ``e`` lives on rank
        ``e // (E // world_size)``, so E must be a multiple of the world size.
    topk: experts per token K (columns of ``topk_idx``).
    hidden: width H of every token row.
    max_tokens_per_rank: upper bound of T (rows of ``x``) in every dispatch call; the
        receive buffers are sized from it.
    dtype: ``bfloat16`` | ``float16`` | ``float32``, the dtype of ``x`` and of expert outputs.
    expert_alignment: every expert segment of the dispatch output starts at a multiple of
        this many rows (e.g. 16 or 128 for grouped GEMMs). Any value >= 1 works with
        ``torch._grouped_mm`` (rows are 16-byte aligned whatever the offsets): checked on H200 with
        torch 2.11 at 1, 2, 3, 4, 8 and 16, outputs and input gradients bitwise equal to the
        per-expert loop; the weights' gradients are bitwise equal at multiples of 8 and within
        bf16 rounding (7e-4 relative at 1) otherwise, so prefer a multiple of 8 for training.
    expert_capacity: rows kept per local expert per call; assignments past it are dropped
        and counted in the device status. None is lossless.
    zero_padding: what dispatch writes into each segment's padding rows (past the expert's
        ``tokens_per_expert`` rows, up to the alignment). ``true``: zeros, which training needs
        (the experts' weight gradients multiply those rows, and a stale row may hold NaN).
        ``false``: nothing; the rows keep whatever the buffer held (stale rows), as DeepEP's
        low-latency layout leaves them. For inference whose GEMMs need aligned segments
        (``expert_alignment`` 16, or 128 for DeepGEMM's contiguous layout) it saves the padding's
        bytes, most of dispatch's at decode sizes. :class:`moe_comm.MoELayer` and ``expert_parallel``
        refuse to build gradients through their experts with it off; the ``reference`` and
        ``nccl`` backends fill those rows with 0xFF bytes (NaN in every row format) so that a
        consumer that reads them shows.
    receive_layout: what ``Dispatcher.dispatch`` returns. ``expert_major`` (the decode path): rows grouped
        by local expert, aligned, ready for ``torch._grouped_mm``; the comm kernels write every kept
        (token, expert) row. ``token_major``: each arriving token once per rank (``[W * M, H]``,
        rank-major slab rows, with its local expert ids and weights); ``Dispatcher.permute`` then
        builds the expert-major rows on the caller's stream with every SM, ``Dispatcher.unpermute``
        reduces the experts' rows to one row per (token, rank), and ``combine`` takes those. Same bits
        as ``expert_major``; the comm kernels move a K-th of the rows, so they need fewer SMs
        (a small ``sm_budget`` beside the GEMMs, DeepEP normal's and Megatron's layout).
    expert_impl: how :class:`moe_comm.MoELayer` computes its local experts (the Dispatcher ignores
        it). ``grouped_mm``: two ``torch._grouped_mm`` calls on the expert-major rows and
        ``expert_offsets``; torch runs them without a host sync only with ``bfloat16`` on CUDA GPUs
        of compute capability 9.x or 10.x (elsewhere it reads the offsets on the host), so
        anything else is refused when the layer is built. ``loop``: one GEMM chain per local
        expert, any device and dtype; on CUDA every expert runs over all ``capacity_rows`` rows and
        keeps its own segment (static shapes, graph-capturable, ``E_local`` times the FLOPs), on
        CPU each expert runs on its exact rows. ``auto``: ``grouped_mm`` where it is supported,
        else ``loop``.
    sm_budget: the SMs every kernel of dispatch and combine (forward and backward) may use: their
        grids are this many blocks of one SM each, so the rest of the GPU stays free for work on
        other streams (compute overlapping the communication). None: the whole device.
    num_senders: blocks (one per SM) of the kernels that push token rows to peers (dispatch's and
        redispatch's senders), within ``sm_budget``; the receiving side's layout, expansion and
        combine, which mostly read and write local memory, use every SM of the budget, and
        dispatch's senders join the expansion of arrived rows once their own rows are out. With
        a budget and several ranks, fewer senders than the budget let the expansion start while
        rows travel (2x H100, T=4096, ``sm_budget: 24``: dispatch 517-539 us with 8 senders,
        626-628 with 24); at or above the budget every block sends first. On the whole device 48:
        FP8 dispatch's senders quantize as they send, and more of them move its rows sooner (2x
        H200, T=4096: 165 us with 24, 149 with 32, 142 with 48), while bf16's, bound by the link,
        take the same time with 24 to 48. At world 1 no row leaves the rank and dispatch runs no
        senders.
    slab_copies: copies of the device backends' receive slabs in the symmetric allocation. ``2``:
        one per call parity, so a call never waits for its peers to acknowledge the previous call
        (a sender only overwrites what its peers read two calls ago, and each call already waits
        for every peer's signal of the call before); ``1``: half the slab memory, and every call
        first waits for each peer's acknowledgement of the last one (a flag round per kernel: ~3 us
        more per dispatch+combine at decode sizes on one H200). ``moe-comm info --config`` gives
        the bytes.
    dispatch_dtype: ``null`` (dispatch moves rows in ``dtype``) or ``float8_e4m3fn``: dispatch
        moves e4m3 rows with one float32 scale per 128 channels (:mod:`moe_comm.fp8`; ``hidden`` a
        multiple of 128) and returns ``out.x`` in e4m3 with ``out.x_scales``; combine stays in
        ``dtype``, and gradients pass straight through the quantization in ``dtype``
        (``Dispatcher.dequantize``).
    dispatch_round_scale: with ``float8_e4m3fn``, power-of-two (UE8M0) scales, as DeepEP's
        ``round_scale``.
    timeout_s: longest wait on another rank before the wait gives up and reports the peer
        and the phase.
    check_every_step: read the device status after every call and raise on a fault (a host
        sync per call; for debugging).
    vmm, nvshmem, nccl: backend-specific sections (see their classes).
    router: how :class:`moe_comm.MoELayer` routes and balances (see :class:`RouterConfig`).
    """

    backend: str = "auto"
    num_experts: int = 16
    topk: int = 4
    hidden: int = 1024
    max_tokens_per_rank: int = 256
    dtype: str = "bfloat16"
    expert_alignment: int = 16
    expert_capacity: Optional[int] = None
    zero_padding: bool = True
    expert_impl: str = "auto"
    receive_layout: str = "expert_major"
    sm_budget: Optional[int] = None
    num_senders: int = 48
    slab_copies: int = 2
    dispatch_dtype: Optional[str] = None
    dispatch_round_scale: bool = False
    timeout_s: float = 30.0
    check_every_step: bool = False
    vmm: VmmConfig = field(default_factory=VmmConfig)
    nvshmem: NvshmemConfig = field(default_factory=NvshmemConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, BACKENDS)
        _check_int("num_experts", self.num_experts, 1)
        _check_int("topk", self.topk, 1)
        if self.topk > self.num_experts:
            raise _fail("topk", self.topk, f"at most num_experts ({self.num_experts})")
        _check_int("hidden", self.hidden, 1)
        _check_int("max_tokens_per_rank", self.max_tokens_per_rank, 1)
        _check_choice("dtype", self.dtype, tuple(DTYPES))
        row_bytes = self.hidden * DTYPES[self.dtype].itemsize
        if row_bytes % 16:
            raise _fail("hidden", self.hidden, f"a width whose rows are a multiple of 16 bytes ({self.dtype} rows of "
                        f"{row_bytes} bytes are not); rows move as 16-byte vectors")
        _check_int("expert_alignment", self.expert_alignment, 1)
        if self.expert_capacity is not None:
            _check_int("expert_capacity", self.expert_capacity, 1)
        _check_bool("zero_padding", self.zero_padding)
        _check_choice("expert_impl", self.expert_impl, EXPERT_IMPLS)
        _check_choice("receive_layout", self.receive_layout, RECEIVE_LAYOUTS)
        if self.sm_budget is not None:
            _check_int("sm_budget", self.sm_budget, 1)
        _check_int("num_senders", self.num_senders, 1)
        if type(self.slab_copies) is not int or self.slab_copies not in SLAB_COPIES:
            raise _fail("slab_copies", self.slab_copies, "1 or 2")
        if self.dispatch_dtype is not None:
            _check_choice("dispatch_dtype", self.dispatch_dtype, DISPATCH_DTYPES)
            if self.hidden % fp8.BLOCK:
                raise _fail("hidden", self.hidden, f"a multiple of {fp8.BLOCK} with dispatch_dtype "
                            f"{self.dispatch_dtype} (one scale per {fp8.BLOCK} channels)")
        _check_bool("dispatch_round_scale", self.dispatch_round_scale)
        _check_seconds("timeout_s", self.timeout_s)
        if not isinstance(self.check_every_step, bool):
            raise _fail("check_every_step", self.check_every_step, "true or false")
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise _fail(name, getattr(self, name), f"a {cls.__name__}")
        self.router.check_experts(self.num_experts, self.topk)
        self._check_rank_memory()

    def _check_rank_memory(self) -> None:
        """What one rank needs at world 1 (the least at any world size) must fit int32 row counts,
        :data:`MAX_RANK_BYTES`, and the current CUDA device where this process already uses CUDA."""
        rows = self.capacity_rows(1)
        if self.max_tokens_per_rank * self.topk > INT32_MAX or rows > INT32_MAX:
            raise _fail("max_tokens_per_rank", self.max_tokens_per_rank,
                        f"a value whose assignments (times topk {self.topk}) and dispatch rows ({rows:,}) fit "
                        f"the kernels' int32 counts (at most {INT32_MAX:,})")
        least = footprint(self, 1, "reference")
        need = least.slab_bytes + least.out_x_bytes
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        limit, where = MAX_RANK_BYTES, f"{MAX_RANK_BYTES:,} bytes, more than any GPU has"
        if device is not None:
            memory = torch.cuda.get_device_properties(device).total_memory
            limit, where = min(limit, memory), f"the {memory:,} bytes of cuda:{device}"
        if need > limit:
            raise _fail("max_tokens_per_rank", self.max_tokens_per_rank,
                        f"a size that fits one rank: with hidden {self.hidden} ({self.dtype}) one rank needs at least "
                        f"{need:,} bytes (a [max_tokens_per_rank, hidden] slab and a dispatch output), over {where}")

    @property
    def token_major(self) -> bool:
        """Whether ``receive_layout`` is ``token_major``."""
        return self.receive_layout == "token_major"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by ``dtype``."""
        return DTYPES[self.dtype]

    def num_local_experts(self, world_size: int) -> int:
        """Local experts per rank for ``world_size`` ranks (after :meth:`check_world`)."""
        return self.num_experts // world_size

    def check_world(self, world_size: int) -> None:
        """Check the values that depend on the process group; raise ``ConfigError`` if they do not fit."""
        if self.num_experts % world_size:
            raise _fail("num_experts", self.num_experts,
                        f"a multiple of the world size ({world_size}) so every rank holds the same number of experts")
        rows = self.capacity_rows(world_size)
        if rows > INT32_MAX:
            raise _fail("max_tokens_per_rank", self.max_tokens_per_rank,
                        f"a value whose dispatch output at {world_size} ranks ({rows:,} rows) fits the kernels' "
                        f"int32 row counts (at most {INT32_MAX:,})")

    def capacity_rows(self, world_size: int) -> int:
        """Rows of the dispatch output ``out.x`` on every rank: room for every kept assignment plus alignment padding.

        Lossless: every source may send ``max_tokens_per_rank`` tokens, each with up to ``topk``
        assignments to this rank, and each of the local expert segments may add up to
        ``expert_alignment - 1`` padding rows. With ``expert_capacity`` each local expert keeps at
        most that many rows, rounded up to the alignment.
        """
        local = self.num_local_experts(world_size)
        align = self.expert_alignment
        lossless = world_size * self.max_tokens_per_rank * self.topk + local * (align - 1)
        if self.expert_capacity is None:
            return lossless
        return min(lossless, local * (-(-self.expert_capacity // align) * align))

    def to_dict(self) -> dict:
        """Plain nested dict of every field (round-trips through :func:`load_config`)."""
        return dataclasses.asdict(self)


def default_config_text() -> str:
    """The text of the embedded default configuration (``configs/default.yaml``)."""
    return asset_dir("configs").joinpath("default.yaml").read_text(encoding="utf-8")


class _AliasError(yaml.YAMLError):
    """A config used a YAML anchor or alias."""


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without anchors and aliases: a config needs none, and a few hundred bytes of
    nested aliases expand to billions of values ("billion laughs")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _AliasError(f"line {event.start_mark.line + 1}: YAML anchors and aliases (&name, *name) are not "
                              "allowed in a moe_comm config; write each value out")
        return super().compose_node(parent, index)


def _parse_yaml(stream: Any) -> Any:
    return yaml.load(stream, Loader=_NoAliasLoader)


def _read_source(source: Union[None, str, os.PathLike, Mapping[str, Any]]) -> dict:
    if source is None:
        data = _parse_yaml(default_config_text())
    elif isinstance(source, Mapping):
        data = dict(source)
    elif isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as handle:
                data = _parse_yaml(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {os.fspath(source)!r} does not exist") from None
        except _AliasError as exc:
            raise ConfigError(f"config file {os.fspath(source)!r}, {exc}") from None
        except (yaml.YAMLError, ValueError) as exc:  # ValueError: an int past Python's digit limit
            raise ConfigError(f"config file {os.fspath(source)!r} is not valid YAML: {exc}") from None
        if data is None:
            # An empty file is more often a mistake (a wrong path, a truncated write) than a wish for
            # the defaults, which load_config(None) gives.
            raise ConfigError(f"config file {os.fspath(source)!r} is empty; write the keys it should set, or "
                              "load the embedded default with load_config(None) (no --config)")
    else:
        raise ConfigError(f"load_config source: got {type(source).__name__}, expected a YAML path, a dict or None")
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: got a top-level {type(data).__name__}, expected a mapping of keys to values")
    return data


def _build(cls: type, data: Mapping[str, Any], prefix: str):
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ConfigError(f"config key {_short(prefix + str(key))} is unknown; "
                              f"known keys: {', '.join(sorted(known))}")
    values = {}
    for key, value in data.items():
        section = _SECTIONS.get(key) if cls is Config else None
        if section is not None:
            if isinstance(value, section):
                values[key] = value
                continue
            if value is None:
                value = {}
            if not isinstance(value, Mapping):
                raise _fail(prefix + key, value, "a mapping of that section's keys")
            values[key] = _build(section, value, f"{prefix}{key}.")
        else:
            values[key] = value
    return cls(**values)


# Keys renamed so that one concept has one name (docs/glossary.md): the old name still loads for one
# release, with a DeprecationWarning naming the new one. ``num_sms`` was DeepEP's name for the whole
# SM budget; here it only ever meant the senders inside ``sm_budget``.
RENAMED_KEYS = {"num_sms": "num_senders", "experts": "expert_impl"}


def _renamed(data: Mapping[str, Any], where: str) -> dict:
    """``data`` with each key of :data:`RENAMED_KEYS` under its new name (a DeprecationWarning for each).

    Raises:
        ConfigError: a key is given under both its old and its new name.
    """
    data = dict(data)
    for old, new in RENAMED_KEYS.items():
        if old not in data:
            continue
        if new in data:
            raise ConfigError(f"config keys '{old}' and '{new}' are both given{where}; '{old}' is the old name of "
                              f"'{new}': keep '{new}' alone")
        # stacklevel 3: the warning points at the caller of load_config.
        warnings.warn(f"config key '{old}' is deprecated and will be removed in the next release; use '{new}'",
                      DeprecationWarning, stacklevel=3)
        data[new] = data.pop(old)
    return data


def load_config(source: Union[None, str, os.PathLike, Mapping[str, Any]] = None, **overrides: Any) -> Config:
    """Load and validate a configuration.

    Args:
        source: a YAML file path, a dict of keys, or None for the embedded default.
        **overrides: keys that replace the source's values; a backend section may be given
            as a dict (``nccl={"transport": "symmetric"}``) and is merged key by key.

    Returns:
        A frozen :class:`Config`.

    Raises:
        ConfigError: an unknown key, a wrong type or an impossible value, naming the key.

    A key of :data:`RENAMED_KEYS` loads under its new name, with a DeprecationWarning.
    """
    data = _renamed(_read_source(source), "")
    for key, value in _renamed(overrides, " as keyword arguments").items():
        if key in _SECTIONS and isinstance(value, Mapping) and isinstance(data.get(key), Mapping):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return _build(Config, data, "")
