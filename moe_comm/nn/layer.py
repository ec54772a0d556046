"""``MoELayer``: an expert-parallel Mixture-of-Experts layer built on :class:`moe_comm.Dispatcher`.

forward: route (float32, :mod:`moe_comm.nn.router`) -> ``dispatch`` -> SwiGLU experts on the
expert-major rows (:mod:`moe_comm.nn.experts`) -> ``combine`` -> ``[..., H]``, plus the optional
shared experts on the local tokens. With the config's ``receive_layout: token_major`` the experts'
rows are permuted from dispatch's and unpermuted for combine (:mod:`moe_comm.nn.receive_layout`):
the same bits, forward and backward. Gradients reach the input, the router weight (through the
top-k weights and the balancing losses) and the expert weights. A batch of more than
``max_tokens_per_rank`` tokens is routed at once and sent in batch slices (one dispatch/combine pair each).
Load balancing (:mod:`moe_comm.nn.balancing`): the losses the config enables are recorded on the
layer after each training forward, and the aux-loss-free bias is updated by
:meth:`MoELayer.update_expert_bias`.

On a GPU the whole forward and backward is capturable in a CUDA graph: no step reads a device
value on the host and every shape follows from the config (``capacity_rows``), never from the
routing.

Weights are initialised deterministically from ``seed``: the router identically on every
rank, each expert from its *global* id, so :func:`moe_comm.nn.reference.build_dense_weights`
rebuilds every rank's experts in one process and :func:`moe_comm.nn.reference.dense_forward`
computes the whole layer densely as a reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .balancing import balancing_losses, bias_step, expert_counts
from ..config import Config
from ..dispatcher import Dispatcher
from ..errors import ConfigError, InputError
from .experts import (check_padding_for_gradients, grouped_experts, masked_experts, resolve_expert_impl, shared_expert,
                      sliced_experts)
from .receive_layout import combine_rows, expert_rows
from .router import RouterOutput, route, select_experts

__all__ = [
    "MoELayer",
    "MoEWeights",
    "route",
    "check_layer_args",
    "init_router_weight",
    "init_expert_weights",
    "init_shared_weights",
    "moe_aux_loss",
    "update_expert_biases",
]

_MAX_SEED = 2**31


def _generator(seed: int, stream) -> torch.Generator:
    """A CPU generator for one weight: stream 0 is the router, ``e + 1`` global expert ``e``, ``"shared"`` the shared experts.

    The CPU generator (mt19937) keeps only the low 32 bits of its seed, so ``(seed, stream)`` is
    hashed into 32 bits rather than packed side by side (which would drop ``seed``).
    """
    digest = hashlib.sha256(f"moe_comm.nn.layer:{seed}:{stream}".encode()).digest()
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


def init_shared_weights(config: Config, shared_ffn_hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared experts' ``w_gate_up [H, 2S]`` and ``w_down [S, H]``, config dtype, on CPU, the same on every rank."""
    gen = _generator(seed, "shared")
    hidden = config.hidden
    w_gate_up = torch.randn(hidden, 2 * shared_ffn_hidden, generator=gen) / math.sqrt(hidden)
    w_down = torch.randn(shared_ffn_hidden, hidden, generator=gen) / math.sqrt(shared_ffn_hidden)
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

    shared_w_gate_up, shared_w_down: the shared experts (``[H, 2S]`` and ``[S, H]``, the same layouts
        for one always-on MLP of width ``S``; several shared experts are one MLP of their summed
        width, their columns side by side), or None for a layer without them.

    Either every expert's weights (each rank then keeps its own block: global expert
    ``rank * E_local + j`` is local expert ``j``), or only this rank's ``E_local`` experts.
    """

    router: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    shared_w_gate_up: Optional[torch.Tensor] = None
    shared_w_down: Optional[torch.Tensor] = None


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


def _given_shared_width(weights: Optional["MoEWeights"], shared_ffn_hidden: Optional[int]) -> Optional[int]:
    """The shared experts' width: ``shared_ffn_hidden``, or read from ``weights.shared_w_down`` when only they give it."""
    if shared_ffn_hidden is not None or not isinstance(weights, MoEWeights) or weights.shared_w_down is None:
        return shared_ffn_hidden
    down = weights.shared_w_down
    return int(down.shape[0]) if isinstance(down, torch.Tensor) and down.dim() == 2 else -1


def _shared_weights(weights: "MoEWeights", config: Config, shared_ffn_hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weights``' shared experts, checked: ``[H, 2S]`` and ``[S, H]``."""
    for name in ("shared_w_gate_up", "shared_w_down"):
        if getattr(weights, name) is None:
            raise ConfigError(f"MoELayer weights.{name}: expected the shared experts' weights (shared_ffn_hidden="
                              f"{shared_ffn_hidden}), got None")
    _check_tensor_shape("shared_w_gate_up", weights.shared_w_gate_up, (config.hidden, 2 * shared_ffn_hidden))
    _check_tensor_shape("shared_w_down", weights.shared_w_down, (shared_ffn_hidden, config.hidden))
    return weights.shared_w_gate_up, weights.shared_w_down


def check_layer_args(config: Config, ffn_hidden: int, seed: int, shared_ffn_hidden: Optional[int] = None) -> None:
    """Raise ``ConfigError`` unless these are valid :class:`MoELayer` arguments."""
    if not isinstance(config, Config):
        raise ConfigError(f"MoELayer config: expected a moe_comm.Config, got {type(config).__name__}")
    if isinstance(ffn_hidden, bool) or not isinstance(ffn_hidden, int) or ffn_hidden < 1:
        raise ConfigError(f"MoELayer ffn_hidden: got {ffn_hidden!r}, expected an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
        raise ConfigError(f"MoELayer seed: got {seed!r}, expected an integer in [0, 2**31)")
    if shared_ffn_hidden is not None and (
            isinstance(shared_ffn_hidden, bool) or not isinstance(shared_ffn_hidden, int) or shared_ffn_hidden < 1):
        raise ConfigError(f"MoELayer shared_ffn_hidden: got {shared_ffn_hidden!r}, expected None or an integer >= 1")


class MoELayer(nn.Module):
    """Expert-parallel MoE layer: a float32 router, SwiGLU experts (``E / W`` per rank), optional shared experts.

    Collective: every rank of the group builds it with the same arguments, in the same order,
    and calls ``forward`` (and ``backward``, and :meth:`update_expert_bias`) the same number of
    times. A forward of ``T`` tokens makes ``max over ranks of ceil(T / max_tokens_per_rank)``
    dispatch/combine pairs on every rank (:meth:`Dispatcher.split_batch`), so ranks may pass batches
    of different sizes; under CUDA graph capture and torch.compile the count is the rank's own, and
    every rank must pass as many tokens (a rank making fewer calls leaves its peers waiting until
    ``timeout_s``, reported on every rank).

    CUDA graphs: forward, and forward + backward, can be captured (e.g. a whole training step,
    or one decode step per batch size; several graphs may share the layer and its dispatcher).
    Warm up eagerly first (torch's whole-network capture recipe: a few steps on a side stream),
    so that lazily initialised state (cuBLAS handles, optimizer state) exists before capture.
    Routing, the balancing losses and the bias are device computations and in-place buffer
    updates: replays see the current bias and accumulate the loads.

    Args:
        config: the :class:`moe_comm.Config` (num_experts, topk, hidden, dtype, the ``router``
            section: scores, group-limited top-k, balancing; see :class:`moe_comm.config.RouterConfig`).
        ffn_hidden: F, each expert's intermediate width (taken from ``weights`` when they are given).
        group: process group of the expert-parallel ranks (None: the default group); used
            only to build a Dispatcher when ``dispatcher`` is not given.
        renormalize: scale each token's top-k weights to sum to 1; None takes ``config.router.renormalize``.
        dispatcher: a :class:`Dispatcher` to share (several layers may share one; the caller
            closes it). If None the layer builds its own and closes it in :meth:`close`.
        seed: without ``weights``, the weights are drawn from it (router and shared experts: the
            same on every rank; expert ``e``: from ``(seed, e)``).
        weights: a :class:`MoEWeights` to start from (a checkpoint, an existing model): the router
            and either every expert's weights, of which this rank keeps its own, or only this
            rank's; and the shared experts' if the layer has them. They are copied (to the
            dispatcher's device, experts in the config dtype).
        shared_ffn_hidden: S, the width of the shared experts (one always-on SwiGLU MLP applied to
            every local token and added to the routed output); None: no shared experts, or the
            width of ``weights.shared_w_down`` when it is given.

    Parameters:
        router.weight: ``[E, H]`` float32, replicated (its gradient is this rank's tokens' part:
            sum it over the ranks, as data-parallel training does).
        w_gate_up: ``[E_local, H, 2F]`` config dtype, local expert ``j`` = global ``rank * E_local + j``.
        w_down: ``[E_local, F, H]`` config dtype.
        shared_w_gate_up, shared_w_down: ``[H, 2S]`` and ``[S, H]`` config dtype, replicated like the
            router (sum their gradients over the ranks); None without shared experts.

    Buffers:
        expert_ids: ``[E_local]`` int64, the global ids of this rank's experts. It is part of the
            ``state_dict``, and loading a state dict saved by a rank holding other experts is refused.
        expert_bias: ``[E]`` float32, the aux-loss-free selection bias (in the ``state_dict``), the
            same on every rank; None unless ``router.bias_update_rate > 0``.
        pending_load: ``[E]`` int64, the assignments of this rank's training forwards per global
            expert since the last :meth:`update_expert_bias` (not saved); None without a bias.

    Attributes:
        expert_impl: ``"grouped_mm"`` or ``"loop"``, the config's ``experts`` key resolved on this
            device (see :func:`moe_comm.nn.experts.resolve_expert_impl`; an unsupported ``grouped_mm``
            raises ``ConfigError``).
        last_topk_idx, last_topk_weights: the routing of the latest forward (``[T, K]`` int64 and
            float32, detached), for tests and diagnostics.
        last_tokens_per_expert: ``[E_local]`` int32, the rows this rank's experts received from
            every rank in the latest forward (the dispatch outputs' ``tokens_per_expert``, summed
            over the slices).
        aux_loss: 0-d float32, the sum of the balancing losses of the latest training forward, each
            times its coefficient, differentiable (add it to the training loss; :func:`moe_aux_loss`
            sums every layer's); None in eval mode or when the config gives no loss a coefficient.
        aux_losses: the terms of ``aux_loss`` by name (``aux``, ``seq_aux``, ``z``), for logging.
        timer: None, or an object whose ``phase(name)`` returns a context manager; ``forward``
            wraps ``"dispatch"`` and ``"combine"`` in it (``moe-comm run`` times them this way).
    """

    def __init__(
        self,
        config: Config,
        ffn_hidden: Optional[int] = None,
        group=None,
        *,
        renormalize: Optional[bool] = None,
        dispatcher: Optional[Dispatcher] = None,
        seed: int = 0,
        weights: Optional[MoEWeights] = None,
        shared_ffn_hidden: Optional[int] = None,
    ) -> None:
        super().__init__()
        if ffn_hidden is None:
            if weights is None:
                raise ConfigError("MoELayer ffn_hidden: required unless weights are given (it is their w_down.shape[1])")
            if not isinstance(weights, MoEWeights) or not isinstance(weights.w_down, torch.Tensor):
                raise ConfigError(f"MoELayer weights: expected a moe_comm.MoEWeights, got {type(weights).__name__}")
            ffn_hidden = int(weights.w_down.shape[-2]) if weights.w_down.dim() == 3 else -1
        shared_ffn_hidden = _given_shared_width(weights, shared_ffn_hidden)
        check_layer_args(config, ffn_hidden, seed, shared_ffn_hidden)
        if renormalize is not None and not isinstance(renormalize, bool):
            raise ConfigError(f"MoELayer renormalize: got {renormalize!r}, expected None (the config's "
                              "router.renormalize), True or False")
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
        self.shared_ffn_hidden = shared_ffn_hidden
        self.renormalize = config.router.renormalize if renormalize is None else renormalize
        self.seed = seed
        self._owns_dispatcher = dispatcher is None
        self.dispatcher = Dispatcher(config, group) if dispatcher is None else dispatcher
        # Layers are built in the same order on every rank: the site, and so each call's tag, agree.
        self._call_site = self.dispatcher.new_call_site()
        disp = self.dispatcher
        device = disp.device
        first = disp.rank * disp.num_local_experts
        shared = None
        try:
            self.expert_impl = resolve_expert_impl(config, device, ffn_hidden)
            if weights is None:
                router = init_router_weight(config, seed)
                experts = [init_expert_weights(config, ffn_hidden, first + j, seed)
                           for j in range(disp.num_local_experts)]
                w_gate_up, w_down = torch.stack([gu for gu, _ in experts]), torch.stack([d for _, d in experts])
                if shared_ffn_hidden is not None:
                    shared = init_shared_weights(config, shared_ffn_hidden, seed)
            else:
                w_gate_up, w_down = _local_expert_weights(weights, config, disp.rank, disp.num_local_experts,
                                                          ffn_hidden)
                router = weights.router
                if shared_ffn_hidden is not None:
                    shared = _shared_weights(weights, config, shared_ffn_hidden)
        except ConfigError:
            self.close()  # the dispatcher built above would otherwise leak
            raise
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.router.weight.copy_(router.detach())
        # Copies: the layer never writes into the caller's tensors (an optimizer step would).
        def param(tensor: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(tensor.detach().to(device=device, dtype=config.torch_dtype, copy=True))

        self.w_gate_up = param(w_gate_up)
        self.w_down = param(w_down)
        self.register_parameter("shared_w_gate_up", None if shared is None else param(shared[0]))
        self.register_parameter("shared_w_down", None if shared is None else param(shared[1]))
        self.register_buffer("expert_ids", torch.arange(first, first + disp.num_local_experts, device=device))
        with_bias = config.router.bias_update_rate > 0
        experts_shape = (config.num_experts,)
        self.register_buffer("expert_bias", torch.zeros(experts_shape, device=device) if with_bias else None)
        self.register_buffer("pending_load", torch.zeros(experts_shape, dtype=torch.int64, device=device)
                             if with_bias else None, persistent=False)
        self.last_topk_idx: Optional[torch.Tensor] = None
        self.last_topk_weights: Optional[torch.Tensor] = None
        self.last_tokens_per_expert: Optional[torch.Tensor] = None
        self.aux_loss: Optional[torch.Tensor] = None
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.timer = None

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        saved = state_dict.get(prefix + "expert_ids")
        if saved is not None and not torch.equal(saved.cpu(), self.expert_ids.cpu()):
            raise ConfigError(
                f"MoELayer state dict: it holds global experts {saved.tolist()}, this rank holds "
                f"{self.expert_ids.tolist()}; load each rank's own state dict (or build from MoEWeights)"
            )
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _route(self, x: torch.Tensor) -> RouterOutput:
        logits = F.linear(x.float(), self.router.weight)
        return select_experts(logits, self.config.topk, self.config.router, renormalize=self.renormalize,
                              expert_bias=self.expert_bias)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing of ``x [T, H]``: ``topk_idx`` ``[T, K]`` int64, ``topk_weights`` ``[T, K]`` float32.

        As the config's ``router`` section says, with the current ``expert_bias`` for the choice.
        """
        out = self._route(x)
        return out.topk_idx, out.topk_weights

    @property
    def expert_load(self) -> Optional[torch.Tensor]:
        """``[E]`` int64 on the layer's device: the latest forward's assignments of this rank's tokens per
        global expert (computed on the device from ``last_topk_idx``, no host read); None before a forward.

        Sum it over the ranks (``all_reduce``) for every expert's global load.
        """
        if self.last_topk_idx is None:
            return None
        return expert_counts(self.last_topk_idx, self.config.num_experts)

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Move the aux-loss-free bias towards balance: ``bias += rate * sign(mean load - load)``.

        The load is every rank's ``pending_load`` summed (an ``all_reduce`` over the dispatcher's
        group), so the bias stays the same on every rank; ``pending_load`` is then zeroed. Call it
        once per training step on every rank (a collective), after ``optimizer.step()``. In-place:
        graphs captured before keep reading the updated bias; inside a captured graph it needs a
        group whose all-reduce can be captured (NCCL).

        Raises:
            ConfigError: the config's ``router.bias_update_rate`` is 0 (the layer keeps no bias).
        """
        if self.expert_bias is None:
            raise ConfigError("MoELayer.update_expert_bias: config key 'router.bias_update_rate' is 0, so the layer "
                              "keeps no expert bias; set it > 0 (DeepSeek-V3 uses 0.001)")
        dist.all_reduce(self.pending_load, group=self.dispatcher.group)
        bias_step(self.expert_bias, self.pending_load, self.config.router.bias_update_rate)
        self.pending_load.zero_()

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

    def _balance(self, routed: RouterOutput, seq_len: int) -> None:
        """Record the balancing losses and accumulate the load of one training forward (all on the device)."""
        router = self.config.router
        if self.pending_load is not None:
            with torch.no_grad():
                self.pending_load.add_(expert_counts(routed.topk_idx, self.config.num_experts))
        self.aux_losses = balancing_losses(routed.logits, routed.scores, routed.topk_idx, seq_len, router)
        terms = list(self.aux_losses.values())
        self.aux_loss = sum(terms[1:], terms[0]) if terms else None

    def _dispatch_experts_combine(self, batch_slice: int, tokens: torch.Tensor, topk_idx: torch.Tensor,
                                  topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One dispatch -> experts -> combine of at most ``max_tokens_per_rank`` tokens (batch slice
        ``batch_slice`` of the forward): ``[T, H]`` and ``tokens_per_expert``."""
        disp = self.dispatcher
        # The phases hold what each layout does between the tokens and the experts' rows (token-major: the
        # permute too), and back: moe-comm run's dispatch and combine times compare across layouts.
        with self._phase("dispatch"):
            out = disp.dispatch(tokens, topk_idx, topk_weights,
                                call_tag=Dispatcher.call_tag(self._call_site, batch_slice))
            rows = expert_rows(disp, out)
        # FP8 dispatch: the experts run on the dequantized rows (gradients straight through, see Dispatcher.dequantize).
        y = self.experts(disp.dequantize(rows), rows.expert_offsets)
        with self._phase("combine"):
            z = disp.combine(combine_rows(disp, y.contiguous(), out), out.handle)
        return z, out.tokens_per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` (config dtype, on the dispatcher's device) -> ``[..., H]``.

        Any number of tokens: more than ``max_tokens_per_rank`` go in batch slices of that many, as many
        on every rank (:meth:`Dispatcher.split_batch`: ranks with fewer tokens add empty calls; one small
        all-reduce agrees on the count in eager mode); routing and the balancing losses
        cover the whole batch. The sequence-wise loss takes sequences along dim -2 of a
        ``[..., S, H]`` input (a ``[T, H]`` input is one sequence).
        """
        hidden = self.config.hidden
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != hidden:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(f"MoELayer x: expected shape [..., {hidden}] (hidden), got {shape}")
        if x.dtype != self.config.torch_dtype:
            raise InputError(f"MoELayer x: expected dtype {self.config.dtype} (the config's dtype), got {x.dtype}")
        check_padding_for_gradients(self.config, (self.w_gate_up, self.w_down), "MoELayer")
        tokens = x.reshape(-1, hidden).contiguous()
        routed = self._route(tokens)
        topk_idx, topk_weights = routed.topk_idx, routed.topk_weights
        self.last_topk_idx, self.last_topk_weights = topk_idx, topk_weights.detach()
        if self.training:
            self._balance(routed, max(x.shape[-2], 1) if x.dim() >= 3 else max(tokens.shape[0], 1))
        else:
            self.aux_loss, self.aux_losses = None, {}
        # Batch slices of max_tokens_per_rank, as many on every rank (Dispatcher.split_batch).
        pieces = [self._dispatch_experts_combine(i, *parts)
                  for i, parts in enumerate(self.dispatcher.split_batch(tokens, topk_idx, topk_weights))]
        z = pieces[0][0] if len(pieces) == 1 else torch.cat([piece for piece, _ in pieces])
        counts = [count for _, count in pieces]
        self.last_tokens_per_expert = sum(counts[1:], counts[0])
        if self.shared_w_gate_up is not None:
            z = z + shared_expert(tokens, self.shared_w_gate_up, self.shared_w_down)
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
            f"topk={self.config.topk}, renormalize={self.renormalize}, score={self.config.router.score!r}, "
            f"shared_ffn_hidden={self.shared_ffn_hidden}, backend={disp.backend_name!r}, expert_impl={self.expert_impl!r}"
        )


def moe_aux_loss(model: nn.Module):
    """The sum of the ``aux_loss`` of every :class:`MoELayer` in ``model`` (its latest training forward).

    Add it to the training loss before ``backward``: ``loss = task_loss + moe_aux_loss(model)``.
    A 0-d float32 device tensor, or ``0.0`` when no layer recorded a loss (eval mode, or no
    coefficient in the config), so the addition always works. Reads nothing on the host.
    """
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoELayer) and m.aux_loss is not None]
    return sum(losses[1:], losses[0]) if losses else 0.0


def update_expert_biases(model: nn.Module) -> None:
    """:meth:`MoELayer.update_expert_bias` of every layer of ``model`` that keeps a bias, in module order.

    Collective (an all-reduce per layer): every rank calls it with the same model, once per
    training step, after ``optimizer.step()``.
    """
    for module in model.modules():
        if isinstance(module, MoELayer) and module.expert_bias is not None:
            module.update_expert_bias()
