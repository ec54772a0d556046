"""``MoELayer``: an expert-parallel Mixture-of-Experts layer built on :class:`moe_comm.Dispatcher`.

forward: route (float32 softmax, top-k) -> ``dispatch`` -> SwiGLU experts on the expert-major
rows -> ``combine`` -> ``[..., H]``. Gradients reach the input, the router weight (through the
top-k weights) and the expert weights.

On a GPU the whole forward and backward is capturable in a CUDA graph: no step reads a device
value on the host and every shape follows from the config (``capacity_rows``), never from the
routing. The experts run as the config's ``experts`` key says (:func:`resolve_expert_impl`):
:func:`grouped_experts` (``torch._grouped_mm``), :func:`masked_experts` (a per-expert loop with
static shapes, on CUDA) or :func:`sliced_experts` (a per-expert loop on exact slices, on CPU,
where reading the offsets costs no sync).

Weights are initialised deterministically from ``seed``: the router identically on every
rank, each expert from its *global* id, so :func:`build_dense_weights` rebuilds every rank's
experts in one process and :func:`dense_forward` computes the whole layer densely as a reference.
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

from . import reference
from .config import Config
from .dispatcher import Dispatcher
from .errors import ConfigError, InputError

__all__ = [
    "MoELayer",
    "DenseWeights",
    "build_dense_weights",
    "dense_forward",
    "route",
    "swiglu",
    "grouped_mm_unsupported",
    "resolve_expert_impl",
    "grouped_experts",
    "masked_experts",
    "sliced_experts",
]

_MAX_SEED = 2**31


def _generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one weight: stream 0 is the router, stream ``e + 1`` global expert ``e``.

    The CPU generator (mt19937) keeps only the low 32 bits of its seed, so ``(seed, stream)`` is
    hashed into 32 bits rather than packed side by side (which would drop ``seed``).
    """
    digest = hashlib.sha256(f"moe_comm.layer:{seed}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:4], "little"))


def _router_weight(config: Config, seed: int) -> torch.Tensor:
    """``[E, H]`` float32 on CPU, the same on every rank."""
    gen = _generator(seed, 0)
    return torch.randn(config.num_experts, config.hidden, generator=gen) / math.sqrt(config.hidden)


def _expert_weights(config: Config, ffn_hidden: int, expert: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global expert ``expert``'s ``w_gate_up [H, 2F]`` and ``w_down [F, H]``, rounded to the config dtype, on CPU."""
    gen = _generator(seed, expert + 1)
    hidden = config.hidden
    w_gate_up = torch.randn(hidden, 2 * ffn_hidden, generator=gen) / math.sqrt(hidden)
    w_down = torch.randn(ffn_hidden, hidden, generator=gen) / math.sqrt(ffn_hidden)
    return w_gate_up.to(config.torch_dtype), w_down.to(config.torch_dtype)


def _check_layer_args(config: Config, ffn_hidden: int, seed: int) -> None:
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


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``(silu(x @ W_gate) * (x @ W_up)) @ W_down``.

    Args:
        x: ``[N, H]``. w_gate_up: ``[H, 2F]``, gate columns first, then up. w_down: ``[F, H]``.

    Returns:
        ``[N, H]`` in the dtype of the operands.
    """
    gate, up = (x @ w_gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down


def grouped_mm_unsupported(device: torch.device, dtype: torch.dtype, ffn_hidden: int) -> Optional[str]:
    """Why :func:`grouped_experts` cannot run here without a host sync, or None if it can.

    torch's ``_grouped_mm`` has fast CUDA kernels (offsets read on the device) for bfloat16 on
    compute capability 9.x and 10.x only; anywhere else on CUDA it falls back to a loop that
    copies the offsets to the host (a sync that breaks graph capture). Its operands' row strides
    must be multiples of 16 bytes: ``hidden`` is (the config checks it), ``ffn_hidden`` is checked here.
    """
    if not hasattr(torch, "_grouped_mm"):
        return f"this torch ({torch.__version__}) has no torch._grouped_mm"
    if device.type != "cuda":
        return f"the layer's device is {device}, not a CUDA GPU"
    if dtype != torch.bfloat16:
        return f"the dtype is {str(dtype).removeprefix('torch.')}, not bfloat16"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"{device} has compute capability {major}.{minor}, not 9.x or 10.x"
    if (ffn_hidden * dtype.itemsize) % 16:
        return f"ffn_hidden={ffn_hidden} rows are not a multiple of 16 bytes (use a multiple of 8)"
    return None


def resolve_expert_impl(config: Config, device: torch.device, ffn_hidden: int) -> str:
    """The expert implementation the config's ``experts`` key picks on ``device``: ``grouped_mm`` or ``loop``.

    Raises:
        ConfigError: ``experts: grouped_mm`` where :func:`grouped_mm_unsupported` gives a reason.
    """
    reason = grouped_mm_unsupported(device, config.torch_dtype, ffn_hidden)
    if config.experts == "auto":
        return "loop" if reason else "grouped_mm"
    if config.experts == "grouped_mm" and reason:
        raise ConfigError(
            f"config key 'experts': got 'grouped_mm', but {reason}; torch._grouped_mm runs without a host sync "
            "(graph-capturable) only with bfloat16 on CUDA GPUs of compute capability 9.x or 10.x. "
            "Use experts: loop (or auto, which picks grouped_mm where it can)"
        )
    return config.experts


def grouped_experts(
    rows: torch.Tensor, expert_offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of every local expert on its segment, as two ``torch._grouped_mm`` calls (offsets stay on the device).

    Args:
        rows: ``[N, H]``, the dispatch output's ``x``. expert_offsets: ``[L]`` int32 cumulative segment ends.
        w_gate_up: ``[L, H, 2F]``. w_down: ``[L, F, H]``. All on one device, one dtype.

    Returns:
        ``[N, H]``; rows at or past ``expert_offsets[-1]`` are unspecified.
    """
    # NOTE: checked on H200 with torch 2.11: outputs and gradients (rows, both weights) equal
    # the per-expert loop's bit for bit, and a captured graph replayed with new offsets too.
    gate, up = torch._grouped_mm(rows, w_gate_up, offs=expert_offsets).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_down, offs=expert_offsets)


def masked_experts(
    rows: torch.Tensor, expert_offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of every local expert on its segment with static shapes: graph-capturable on any GPU and dtype.

    Each expert runs over all ``N`` rows and keeps the rows of its own segment (``E_local`` times
    the FLOPs and saved activations of :func:`grouped_experts`): slicing a segment would need its
    bounds on the host.

    Args and returns: as :func:`grouped_experts`; rows at or past ``expert_offsets[-1]`` get zeros.
    """
    num_rows, num_experts = rows.shape[0], w_gate_up.shape[0]
    row_index = torch.arange(num_rows, dtype=expert_offsets.dtype, device=rows.device)
    # Local expert of every row (num_experts past the last segment).
    expert_of_row = torch.searchsorted(expert_offsets, row_index, right=True)[:, None]
    # Rows past the last segment are unspecified (possibly NaN); zero them so that the zero
    # gradient their outputs get cannot turn into 0 * NaN = NaN in the weights' gradients.
    inputs = torch.where(expert_of_row < num_experts, rows, torch.zeros_like(rows))
    out = torch.zeros_like(rows)
    for j, (w_gu, w_d) in enumerate(zip(w_gate_up.unbind(0), w_down.unbind(0))):
        out = torch.where(expert_of_row == j, swiglu(inputs, w_gu, w_d), out)
    return out


def sliced_experts(
    rows: torch.Tensor, expert_offsets: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of every local expert on exactly its segment's rows, for CPU tensors (reads the offsets).

    Args and returns: as :func:`grouped_experts`; rows at or past ``expert_offsets[-1]`` get zeros.
    """
    # NOTE: on CPU, 16-bit matmuls fall back to slow kernels: [32, 1024] x [1024, 1024] took
    # 70 ms in bf16 and 1.2 ms in float32 on one core of the CI machine (AMD EPYC). This path
    # computes in float32 and rounds each expert's output to the rows' dtype, as a GPU GEMM
    # with float32 accumulation does.
    # unbind once (not w[j] per expert): backward then stacks the experts' gradients once.
    gate_ups, downs = w_gate_up.unbind(0), w_down.unbind(0)
    pieces, start = [], 0
    for j, end in enumerate(expert_offsets.tolist()):
        if end > start:
            out = swiglu(rows[start:end].float(), gate_ups[j].float(), downs[j].float())
            pieces.append(out.to(rows.dtype))
        start = end
    pieces.append(rows.new_zeros(rows.shape[0] - start, rows.shape[1]))
    return torch.cat(pieces)


@dataclass(frozen=True)
class DenseWeights:
    """Every weight of the layer in one process (what all ranks' :class:`MoELayer` hold together).

    router: ``[E, H]`` float32. w_gate_up: ``[E, H, 2F]``. w_down: ``[E, F, H]``.
    """

    router: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


def build_dense_weights(
    config: Config,
    ffn_hidden: int,
    seed: int = 0,
    *,
    dtype: Optional[torch.dtype] = None,
    device: torch.device | str = "cpu",
) -> DenseWeights:
    """The weights of every expert exactly as the ``MoELayer`` of each rank initialises them.

    Args:
        config, ffn_hidden, seed: as given to :class:`MoELayer`.
        dtype: dtype of the expert weights returned. Their values are always the config dtype's
            (what the layer holds); ``torch.float32`` returns those values widened, for a reference
            computed without further rounding. Default: the config dtype.
        device: where the tensors are put.

    Returns:
        :class:`DenseWeights`; tensors that do not require grad (call ``requires_grad_`` for a reference).
    """
    _check_layer_args(config, ffn_hidden, seed)
    dtype = config.torch_dtype if dtype is None else dtype
    experts = [_expert_weights(config, ffn_hidden, e, seed) for e in range(config.num_experts)]
    return DenseWeights(
        router=_router_weight(config, seed).to(device),
        w_gate_up=torch.stack([gu for gu, _ in experts]).to(device=device, dtype=dtype),
        w_down=torch.stack([d for _, d in experts]).to(device=device, dtype=dtype),
    )


def dense_forward(
    x: torch.Tensor,
    weights: DenseWeights,
    *,
    topk: int,
    renormalize: bool = True,
    topk_idx: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The whole layer in one process, no communication: the reference for :class:`MoELayer`.

    Args:
        x: ``[..., H]`` tokens on ``weights``' device; computed in the dtype of ``weights.w_gate_up``.
        weights: from :func:`build_dense_weights` (make them require grad to get reference gradients).
        topk, renormalize: as the layer's.
        topk_idx: ``[T, K]`` expert ids (``T`` = tokens of ``x``) to use instead of the router's
            top-k choice, e.g. the layer's ``last_topk_idx``; every id must be in ``[0, E)``.

    Returns:
        ``[..., H]`` in the compute dtype, differentiable w.r.t. ``x`` and every weight.
    """
    num_experts, hidden = weights.router.shape
    x2d = x.reshape(-1, hidden)
    if topk_idx is not None:
        if topk_idx.shape != (x2d.shape[0], topk):
            raise InputError(f"dense_forward topk_idx: expected shape {(x2d.shape[0], topk)}, got {tuple(topk_idx.shape)}")
        if topk_idx.numel() and not (0 <= int(topk_idx.min()) and int(topk_idx.max()) < num_experts):
            raise InputError(f"dense_forward topk_idx: expected ids in [0, {num_experts}), got some outside")
    idx, topk_weights = route(x2d, weights.router, topk, renormalize, topk_idx)
    compute = x2d.to(weights.w_gate_up.dtype)
    # unbind once: indexing the stacked weights per expert would make backward build a
    # full-size gradient for every expert (E times the weights' memory traffic).
    gate_ups, downs = weights.w_gate_up.unbind(0), weights.w_down.unbind(0)
    z = reference.dense_moe(
        compute, idx, topk_weights, lambda e, rows: swiglu(rows, gate_ups[e], downs[e]), num_experts
    )
    return z.reshape(x.shape)


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
        ffn_hidden: F, each expert's intermediate width.
        group: process group of the expert-parallel ranks (None: the default group); used
            only to build a Dispatcher when ``dispatcher`` is not given.
        renormalize: scale each token's top-k weights to sum to 1.
        dispatcher: a :class:`Dispatcher` to share (several layers may share one; the caller
            closes it). If None the layer builds its own and closes it in :meth:`close`.
        seed: weights are drawn from it (router: same on every rank; expert ``e``: from ``(seed, e)``).

    Parameters:
        router.weight: ``[E, H]`` float32, replicated (its gradient is this rank's tokens' part:
            sum it over the ranks, as data-parallel training does).
        w_gate_up: ``[E_local, H, 2F]`` config dtype, local expert ``j`` = global ``rank * E_local + j``.
        w_down: ``[E_local, F, H]`` config dtype.

    Attributes:
        expert_impl: ``"grouped_mm"`` or ``"loop"``, the config's ``experts`` key resolved on this
            device (see :func:`resolve_expert_impl`; an unsupported ``grouped_mm`` raises ``ConfigError``).
        last_topk_idx, last_topk_weights: the routing of the latest forward (``[T, K]`` int64 and
            float32, detached), for tests and diagnostics.
        timer: None, or an object whose ``phase(name)`` returns a context manager; ``forward``
            wraps ``"dispatch"`` and ``"combine"`` in it (``moe-comm run`` times them this way).
    """

    def __init__(
        self,
        config: Config,
        ffn_hidden: int,
        group=None,
        *,
        renormalize: bool = True,
        dispatcher: Optional[Dispatcher] = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_layer_args(config, ffn_hidden, seed)
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
        try:
            self.expert_impl = resolve_expert_impl(config, device, ffn_hidden)
        except ConfigError:
            self.close()  # the dispatcher built above would otherwise leak
            raise
        self.router = nn.Linear(config.hidden, config.num_experts, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            self.router.weight.copy_(_router_weight(config, seed))
        first = disp.rank * disp.num_local_experts
        experts = [_expert_weights(config, ffn_hidden, first + j, seed) for j in range(disp.num_local_experts)]
        self.w_gate_up = nn.Parameter(torch.stack([gu for gu, _ in experts]).to(device))
        self.w_down = nn.Parameter(torch.stack([d for _, d in experts]).to(device))
        self.last_topk_idx: Optional[torch.Tensor] = None
        self.last_topk_weights: Optional[torch.Tensor] = None
        self.timer = None

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
        if rows.device.type == "cpu":
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
            f"hidden={self.config.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.config.num_experts} "
            f"(local {disp.num_local_experts} on rank {disp.rank}/{disp.world_size}), topk={self.config.topk}, "
            f"renormalize={self.renormalize}, backend={disp.backend_name!r}, experts={self.expert_impl!r}"
        )
