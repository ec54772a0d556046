"""``MoELayer``: an expert-parallel Mixture-of-Experts layer built on :class:`moe_comm.Dispatcher`.

forward: route (float32 softmax, top-k) -> ``dispatch`` -> SwiGLU experts on the expert-major
rows (:mod:`moe_comm.experts`) -> ``combine`` -> ``[..., H]``. Gradients reach the input, the
router weight (through the top-k weights) and the expert weights.

On a GPU the whole forward and backward is capturable in a CUDA graph: no step reads a device
value on the host and every shape follows from the config (``capacity_rows``), never from the
routing.

Weights are initialised deterministically from ``seed``: the router identically on every
rank, each expert from its *global* id, so :func:`moe_comm.reference.build_dense_weights`
rebuilds every rank's experts in one process and :func:`moe_comm.reference.dense_forward`
computes the whole layer densely as a reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config
from .dispatcher import Dispatcher
from .errors import ConfigError, InputError
from .experts import grouped_experts, masked_experts, resolve_expert_impl, sliced_experts

__all__ = ["MoELayer", "MoEWeights", "route", "check_layer_args", "init_router_weight", "init_expert_weights"]

_MAX_SEED = 2**31


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one weight: stream 0 is the router, stream ``e + 1`` global expert ``e``.

    The CPU generator (mt19937) keeps only the low 32 bits of its seed, so ``(seed, stream)`` is
    hashed into 32 bits rather than packed side by side (which would drop ``seed``).
    """
    digest = hashlib.sha256(f"moe_comm.layer:{seed}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


def init_router_weight(config: Config, seed: int) -> torch.Tensor:
    """``[E, H]`` float32 on CPU, the same on every rank."""
    gen = _generator(seed, 0)
    return torch.randn(config.num_experts, config.hidden, generator=gen) / math.sqrt(config.hidden)


def init_expert_weights(config: Config, ffn_hidden: int, expert: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ``expert``'s ``w_gate_up [H, 2F]`` and ``w_down [F, H]``, rounded to the config dtype, on CPU."""
    gen = _generator(seed, expert + 1)
    hidden = config.hidden
    w_gate_up = torch.randn(hidden, 2 * ffn_hidden, generator=gen) / math.sqrt(hidden)
    w_down = torch.randn(ffn_hidden, hidden, generator=gen) / math.sqrt(ffn_hidden)
    return w_gate_up.to(config.torch_dtype), w_down.to(config.torch_dtype)


@dataclass(frozen=True)
class MoEWeights:
    """The weights of an MoE layer, in the layouts :class:`MoELayer` holds.

    router: ``[E, H]``, the router's ``nn.Linear`` weight (logits = ``x @ router.T``); kept in float32.
    w_gate_up: ``[E, H, 2F]`` (or ``[E_local, H, 2F]``): expert ``e``'s gate projection in columns
        ``[:F]`` and its up projection in ``[F:]``, applied as ``x @ w_gate_up[e]``. A checkpoint in
        the ``nn.Linear`` layout (``[2F, H]`` per expert, e.g. HuggingFace's ``gate_up_proj``) is
        transposed: ``w.transpose(-1, -2)``; separate gate and up weights are concatenated.
    w_down: ``[E, F, H]`` (or ``[E_local, F, H]``): applied as ``h @ w_down[e]``.

    Either every expert's weights (each rank then keeps its own block: global expert
    ``rank * E_local + j`` is local expert ``j``), or only this rank's ``E_local`` experts.
    """

    router: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def _check_tensor_shape(name: str, tensor, shape: tuple) -> None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise ConfigError(f"MoELayer weights.{name}: expected a float tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ConfigError(f"MoELayer weights.{name}: expected shape {list(shape)}, got {list(tensor.shape)}")


def _local_expert_weights(weights: "MoEWeights", config: Config, rank: int, num_local_experts: int,
                          ffn_hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[E_local, H, 2F]`` and ``[E_local, F, H]`` slices of ``weights`` (global or local)."""
    if not isinstance(weights, MoEWeights):
        raise ConfigError(f"MoELayer weights: expected a moe_comm.MoEWeights, got {type(weights).__name__}")
    hidden, experts = config.hidden, config.num_experts
    _check_tensor_shape("router", weights.router, (experts, hidden))
    given = weights.w_gate_up.shape[0] if isinstance(weights.w_gate_up, torch.Tensor) else None
    if given not in (experts, num_local_experts):
        raise ConfigError(
            f"MoELayer weights.w_gate_up: expected {experts} experts (all) or {num_local_experts} (this rank's) in "
            f"dim 0, got shape {list(weights.w_gate_up.shape) if given is not None else type(weights.w_gate_up).__name__}"
        )
    _check_tensor_shape("w_gate_up", weights.w_gate_up, (given, hidden, 2 * ffn_hidden))
    _check_tensor_shape("w_down", weights.w_down, (given, ffn_hidden, hidden))
    first = rank * num_local_experts if given == experts else 0
    local = slice(first, first + num_local_experts)
    return weights.w_gate_up[local], weights.w_down[local]


def check_layer_args(config: Config, ffn_hidden: int, seed: int) -> None:
    """Raise ``ConfigError`` unless ``config``, ``ffn_hidden`` and ``seed`` are valid :class:`MoELayer` arguments."""
    if not isinstance(config, Config):
        raise ConfigError(f"MoELayer config: expected a moe_comm.Config, got {type(config).__name__}")
    if isinstance(ffn_hidden, bool) or not isinstance(ffn_hidden, int) or ffn_hidden < 1:
        raise ConfigError(f"MoELayer ffn_hidden: got {ffn_hidden!r}, expected an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
        raise ConfigError(f"MoELayer seed: got {seed!r}, expected an integer in [0, 2**31)")


def route(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    topk: int,
    renormalize: bool,
    topk_idx: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router in float32: pick (or take) the top-k experts of every token and their weights.

    Args:
        x: ``[T, H]`` tokens, any float dtype (the logits are computed in float32).
        router_weight: ``[E, H]`` float32.
        topk: K. renormalize: scale each token's K weights to sum to 1.
        topk_idx: ``[T, K]`` expert ids to use instead of the top-k choice (a reference uses the
            routing the layer chose, so near-ties cannot flip between two computations).

    Returns:
        ``topk_idx`` ``[T, K]`` int64 and ``topk_weights`` ``[T, K]`` float32, on ``x.device``;
        the weights are differentiable with respect to ``x`` and ``router_weight``.
    """
    probs = torch.softmax(F.linear(x.float(), router_weight), dim=-1)
    if topk_idx is None:
        topk_weights, topk_idx = probs.topk(topk, dim=-1)
    else:
        topk_idx = topk_idx.to(torch.int64)
        topk_weights = probs.gather(-1, topk_idx)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights


class MoELayer(nn.Module):
    """Expert-parallel MoE layer: a float32 softmax router and SwiGLU experts, ``E / W`` per rank.

    Collective: every rank of the group builds it with the same arguments, in the same order,
    and calls ``forward`` (and ``backward``) the same number of times.

    CUDA graphs: forward, and forward + backward, can be captured (e.g. a whole training step,
    or one decode step per batch size; several graphs may share the layer and its dispatcher).
    Warm up eagerly first (torch's whole-network capture recipe: a few steps on a side stream),
    so that lazily initialised state (cuBLAS handles, optimizer state) exists before capture.

    Args:
        config: the :class:`moe_comm.Config` (num_experts, topk, hidden, dtype, ...).
        ffn_hidden: F, each expert's intermediate width (taken from ``weights`` when they are given).
        group: process group of the expert-parallel ranks (None: the default group); used
            only to build a Dispatcher when ``dispatcher`` is not given.
        renormalize: scale each token's top-k weights to sum to 1.
        dispatcher: a :class:`Dispatcher` to share (several layers may share one; the caller
            closes it). If None the layer builds its own and closes it in :meth:`close`.
        seed: without ``weights``, the weights are drawn from it (router: same on every rank;
            expert ``e``: from ``(seed, e)``).
        weights: a :class:`MoEWeights` to start from (a checkpoint, an existing model): the router
            and either every expert's weights, of which this rank keeps its own, or only this
            rank's. They are copied (to the dispatcher's device, experts in the config dtype).

    Parameters:
        router.weight: ``[E, H]`` float32, replicated (its gradient is this rank's tokens' part:
            sum it over the ranks, as data-parallel training does).
        w_gate_up: ``[E_local, H, 2F]`` config dtype, local expert ``j`` = global ``rank * E_local + j``.
        w_down: ``[E_local, F, H]`` config dtype.

    Buffers:
        expert_ids: ``[E_local]`` int64, the global ids of this rank's experts. It is part of the
            ``state_dict``, and loading a state dict saved by a rank holding other experts is refused.

    Attributes:
        expert_impl: ``"grouped_mm"`` or ``"loop"``, the config's ``experts`` key resolved on this
            device (see :func:`moe_comm.experts.resolve_expert_impl`; an unsupported ``grouped_mm``
            raises ``ConfigError``).
        last_topk_idx, last_topk_weights: the routing of the latest forward (``[T, K]`` int64 and
            float32, detached), for tests and diagnostics.
        timer: None, or an object whose ``phase(name)`` returns a context manager; ``forward``
            wraps ``"dispatch"`` and ``"combine"`` in it (``moe-comm run`` times them this way).
    """

    def __init__(
        self,
        config: Config,
        ffn_hidden: Optional[int] = None,
        group=None,
        *,
        renormalize: bool = True,
        dispatcher: Optional[Dispatcher] = None,
        seed: int = 0,
        weights: Optional[MoEWeights] = None,
    ) -> None:
        super().__init__()
        if ffn_hidden is None:
            if weights is None:
                raise ConfigError("MoELayer ffn_hidden: required unless weights are given (it is their w_down.shape[1])")
            if not isinstance(weights, MoEWeights) or not isinstance(weights.w_down, torch.Tensor):
                raise ConfigError(f"MoELayer weights: expected a moe_comm.MoEWeights, got {type(weights).__name__}")
            ffn_hidden = int(weights.w_down.shape[-2]) if weights.w_down.dim() == 3 else -1
        check_layer_args(config, ffn_hidden, seed)
        if dispatcher is not None:
            if group is not None:
                raise ConfigError("MoELayer: pass either group or dispatcher (whose group is used), not both")
            if dispatcher.config != config:
                raise ConfigError(
                    "MoELayer dispatcher: its config differs from the layer's config; build the layer with "
                    "dispatcher.config"
                )
        self.config = config
        self.ffn_hidden = ffn_hidden
        self.renormalize = renormalize
        self.seed = seed
        self._owns_dispatcher = dispatcher is None
        self.dispatcher = Dispatcher(config, group) if dispatcher is None else dispatcher
        disp = self.dispatcher
        device = disp.device
        first = disp.rank * disp.num_local_experts
        try:
            self.expert_impl = resolve_expert_impl(config, device, ffn_hidden)
            if weights is None:
                router = init_router_weight(config, seed)
                experts = [init_expert_weights(config, ffn_hidden, first + j, seed)
                           for j in range(disp.num_local_experts)]
                w_gate_up, w_down = torch.stack([gu for gu, _ in experts]), torch.stack([d for _, d in experts])
            else:
                w_gate_up, w_down = _local_expert_weights(weights, config, disp.rank, disp.num_local_experts,
                                                          ffn_hidden)
                router = weights.router
        except ConfigError:
            self.close()  # the dispatcher built above would otherwise leak
            raise
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.router.weight.copy_(router.detach())
        # Copies: the layer never writes into the caller's tensors (an optimizer step would).
        self.w_gate_up = nn.Parameter(w_gate_up.detach().to(device=device, dtype=config.torch_dtype, copy=True))
        self.w_down = nn.Parameter(w_down.detach().to(device=device, dtype=config.torch_dtype, copy=True))
        self.register_buffer("expert_ids", torch.arange(first, first + disp.num_local_experts, device=device))
        self.last_topk_idx: Optional[torch.Tensor] = None
        self.last_topk_weights: Optional[torch.Tensor] = None
        self.timer = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        saved = state_dict.get(prefix + "expert_ids")
        if saved is not None and not torch.equal(saved.cpu(), self.expert_ids.cpu()):
            raise ConfigError(
                f"MoELayer state dict: it holds global experts {saved.tolist()}, this rank holds "
                f"{self.expert_ids.tolist()}; load each rank's own state dict (or build from MoEWeights)"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of ``x [T, H]``: ``topk_idx`` ``[T, K]`` int64, ``topk_weights`` ``[T, K]`` float32."""
        return route(x, self.router.weight, self.config.topk, self.renormalize)

    def experts(self, rows: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
        """Apply local expert ``j`` to its segment of ``rows``, as ``expert_impl`` says.

        Args:
            rows: ``[capacity_rows, H]`` config dtype, the dispatch output's ``x``.
            expert_offsets: ``[E_local]`` int32 cumulative segment ends, on the rows' device.

        Returns:
            ``[capacity_rows, H]``; rows past ``expert_offsets[-1]`` are unspecified (combine never reads them).
            On a GPU it reads nothing on the host (graph-capturable) with either implementation.
        """
        if self.expert_impl == "grouped_mm":
            return grouped_experts(rows, expert_offsets, self.w_gate_up, self.w_down)
        # The exact slices read the offsets on the host, which a compiled graph cannot do.
        if rows.device.type == "cpu" and not torch.compiler.is_compiling():
            return sliced_experts(rows, expert_offsets, self.w_gate_up, self.w_down)
        return masked_experts(rows, expert_offsets, self.w_gate_up, self.w_down)

    def _phase(self, name: str):
        return contextlib.nullcontext() if self.timer is None else self.timer.phase(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` (config dtype, on the dispatcher's device; at most ``max_tokens_per_rank`` tokens) -> ``[..., H]``."""
        hidden = self.config.hidden
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != hidden:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"MoELayer x: expected shape [..., {hidden}] (hidden), got {shape}")
        tokens = x.reshape(-1, hidden).contiguous()
        topk_idx, topk_weights = self.route(tokens)
        self.last_topk_idx, self.last_topk_weights = topk_idx, topk_weights.detach()
        with self._phase("dispatch"):
            out = self.dispatcher.dispatch(tokens, topk_idx, topk_weights)
        y = self.experts(out.x, out.expert_offsets)
        with self._phase("combine"):
            z = self.dispatcher.combine(y.contiguous(), out.handle)
        return z.reshape(x.shape)

    def close(self) -> None:
        """Close the dispatcher if this layer built it (a shared one is the caller's); idempotent."""
        if self._owns_dispatcher:
            self.dispatcher.close()

    def __enter__(self) -> "MoELayer":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def extra_repr(self) -> str:
        disp = self.dispatcher
        return (
            f"hidden={self.config.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.config.num_experts}, "
            f"num_local_experts={disp.num_local_experts}, rank={disp.rank}/{disp.world_size}, "
            f"topk={self.config.topk}, renormalize={self.renormalize}, backend={disp.backend_name!r}, "
            f"expert_impl={self.expert_impl!r}"
        )
