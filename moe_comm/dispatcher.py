"""``Dispatcher``: the public entry point that owns a backend, validates every call and wires autograd."""

from __future__ import annotations

import dataclasses
import itertools
import time
from datetime import timedelta
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import fp8, ops, protocol
from .agreement import agree
from .outputs import DispatchHandle, DispatchOutput, TokenMajorOutput
from .protocol import StatusReport
from .autograd import (combine_with_grad, dispatch_with_grad, permute_with_grad, received_weights,
                       straight_through_rows, unpermute_with_grad)
from .backends import host_identity, registry, resolve_backend
from .config import Config
from .errors import CommTimeoutError, ConfigError, DeviceStatusError, GroupFailedError, InputError, MoeCommError

__all__ = ["Dispatcher"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_dispatcher_ids = itertools.count()


def _misaligned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data starts off a 16-byte boundary. Unknown while torch.compile traces
    (fake tensors have no address): the custom ops take care of it then (``autograd.kernel_rows``)."""
    return not torch.compiler.is_compiling() and tensor.data_ptr() % 16 != 0


def _check_rows(name: str, tensor, num_rows: Optional[int], num_cols: int, dtypes: tuple, device: torch.device,
                dtype_text: str, vector_rows: bool = False) -> None:
    """Raise ``InputError`` unless ``tensor`` is a contiguous ``[num_rows, num_cols]`` tensor (None: any number
    of rows) of a dtype in ``dtypes`` on ``device``; with ``vector_rows`` also 16-byte aligned (the
    device kernels move rows in 16-byte vectors: a misaligned one would fault and take the CUDA
    context with it; every backend asks for it, so inputs valid on one are valid on all)."""
    # NOTE: the accepted case is tested in one expression first: eager calls at decode sizes are
    # host-bound, and the itemised checks below cost twice as much (0.8 against 0.4 us a tensor on a
    # CPU host); they run only to name what is wrong.
    if isinstance(tensor, torch.Tensor):
        shape = tensor.shape
        if (len(shape) == 2 and shape[1] == num_cols and (num_rows is None or shape[0] == num_rows)
                and tensor.dtype in dtypes and tensor.device == device and tensor.is_contiguous()
                and not (vector_rows and _misaligned(tensor))):
            return
    else:
        raise InputError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 2 or tensor.shape[1] != num_cols or (num_rows is not None and tensor.shape[0] != num_rows):
        wanted = f"[{'*' if num_rows is None else num_rows}, {num_cols}]"
        flatten = (f" (a 2-D tensor, one row per token: flatten the batch dimensions with .reshape(-1, {num_cols}))"
                   if tensor.dim() > 2 and tensor.shape[-1] == num_cols else "")
        raise InputError(f"{name}: expected shape {wanted}, got {tuple(tensor.shape)}{flatten}")
    if tensor.dtype not in dtypes:
        raise InputError(f"{name}: expected dtype {dtype_text}, got {tensor.dtype}")
    if tensor.device != device:
        raise InputError(f"{name}: expected a tensor on {device}, got one on {tensor.device}")
    if not tensor.is_contiguous():
        raise InputError(f"{name}: expected a contiguous tensor, got strides {tensor.stride()} (call .contiguous())")
    raise InputError(f"{name}: expected a tensor whose data starts on a 16-byte boundary (rows move in 16-byte "
                     f"vectors), got one starting {tensor.data_ptr() % 16} bytes past one (a view into the middle "
                     "of its storage: call .clone())")


def _differing_keys(configs: list[dict], prefix: str = "") -> dict[str, list]:
    """Dotted key -> every rank's value, for each key whose value is not the same on every rank."""
    differing: dict[str, list] = {}
    for key in configs[0]:
        values = [config[key] for config in configs]
        if all(isinstance(value, dict) for value in values):
            differing.update(_differing_keys(values, f"{prefix}{key}."))
        elif any(value != values[0] for value in values):
            differing[f"{prefix}{key}"] = values
    return differing


class Dispatcher:
    """Dispatch tokens to the ranks of their experts and combine the expert outputs back.

    Collective: every rank of ``group`` builds its ``Dispatcher`` with the same config, in the
    same order; the constructor allocates, rendezvous and compiles kernels, so the per-step
    calls only launch work (and can be captured in a CUDA graph).

    Args:
        config: a :class:`moe_comm.Config` (see :func:`moe_comm.load_config`).
        group: the process group of the expert-parallel ranks; None is the default group.
            The ``reference`` backend needs a gloo group; GPU backends use the group for setup.

    Raises:
        ConfigError: the config does not fit the group, or the ranks' configs differ.
        BackendError: the backend cannot run on this machine (the message says why).
    """

    def __init__(self, config: Config, group: Optional[dist.ProcessGroup] = None) -> None:
        if not isinstance(config, Config):
            raise ConfigError(f"Dispatcher config: expected a moe_comm.Config, got {type(config).__name__}")
        if not dist.is_initialized():
            raise ConfigError("Dispatcher needs torch.distributed: call torch.distributed.init_process_group first")
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        config.check_world(self.world_size)
        hosts = self._check_same_config()
        cuda_wanted = config.backend not in ("reference",) and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda_wanted else torch.device("cpu")
        entry = resolve_backend(config, self.device, hosts)
        self.backend_name = entry.backend
        self.num_local_experts = config.num_local_experts(self.world_size)
        self.capacity_rows = config.capacity_rows(self.world_size)
        self._id = next(_dispatcher_ids)
        self._backend = registry.build(entry, config, group, self.device)
        ops.register_backend(self._id, self._backend)
        self._closed = False
        # What check() found when the group's calls went out of step (a timeout, an abort); every call
        # raises it until reset().
        self._failure: Optional[str] = None
        self._call_sites = itertools.count()

    def _check_same_config(self) -> list[tuple[str, str]]:
        """Compare the configs of all ranks (one gather); returns every rank's host identity.

        Ranks that build their Dispatchers in a different order pair up different configs here,
        so they get this error too (on every rank) instead of a hang or garbage later. The error
        names each key that differs and every rank's value of it.
        """
        mine = self.config.to_dict()
        gathered = agree(self.group, lambda: (mine, host_identity()), error=ConfigError,
                         what="reading the config and host identity")
        differing = _differing_keys([config for config, _ in gathered])
        if differing:
            shown = "; ".join(
                f"'{key}': " + ", ".join(f"rank {r} has {value!r}" for r, value in enumerate(values))
                for key, values in differing.items()
            )
            raise ConfigError(
                f"Dispatcher config differs between ranks: {shown}; every rank must build its Dispatchers from the "
                "same configs, in the same order"
            )
        return [host for _, host in gathered]

    def _live_backend(self):
        if self._closed:
            raise MoeCommError("this Dispatcher is closed; build a new one")
        if self._failure is not None:
            raise GroupFailedError(
                f"rank {self.rank}: this Dispatcher's calls are out of step since an earlier failure ({self._failure}); "
                "call reset() on every rank (collective) or build a new Dispatcher"
            )
        if self.config.check_every_step and torch.compiler.is_compiling():
            raise ConfigError(
                "config key 'check_every_step' is true, but this call is being compiled by torch.compile, whose graphs "
                "cannot read the status on the host; compile with check_every_step false and call check() between steps"
            )
        if self.config.check_every_step and self._capturing():
            # Raised before any launch, so the capture itself stays valid.
            raise ConfigError(
                "config key 'check_every_step' is true, but this call is being captured in a CUDA graph, where the "
                "host cannot read the status; capture with check_every_step false and call check() after replays"
            )
        return self._backend

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def new_call_site(self) -> int:
        """A number for a caller that dispatches on this Dispatcher (a layer), 0, 1, 2, ... in the order asked.

        Collective by convention: every rank builds its layers in the same order, so a layer gets the
        same number on every rank; :meth:`call_tag` turns it and a batch slice into a ``call_tag``.
        """
        return next(self._call_sites)

    @staticmethod
    def call_tag(site: int, batch_slice: int = 0) -> int:
        """The ``call_tag`` of batch slice ``batch_slice`` of call site ``site`` (distinct for 64 sites x 64 slices)."""
        return (site * 64 + batch_slice) % protocol.CALL_TAG_LIMIT

    def dispatch(self, x: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]], topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, *, call_tag: int = 0) -> Union[DispatchOutput, TokenMajorOutput]:
        """Send every token to the ranks holding its experts and lay the rows out (the config's ``receive_layout``).

        Args:
            x: ``[T, H]`` tokens, ``T <= max_tokens_per_rank``, the config dtype, contiguous, on ``self.device``.
                With the config's ``dispatch_dtype`` (FP8) also a pre-quantized pair ``(x_fp8 [T, H]
                float8_e4m3fn, x_scales [T, H / 128] float32)`` (:func:`moe_comm.quantize`'s format);
                a tensor is quantized first (:func:`moe_comm.quantize`, ``dispatch_round_scale``).
            topk_idx: ``[T, K]`` int32/int64 global expert ids in ``[0, num_experts)``, or -1 for none.
                Other values are dropped and recorded in the device status (see :meth:`check`).
            topk_weights: ``[T, K]`` float32 router weights (used by :meth:`combine`).
            call_tag: an int in ``[0, 4096)`` that the paired call of every rank must carry too (calls pair
                up by their order; the library's layers pass :meth:`call_tag` of their layer and batch
                slice): a call that meets a peer's call of another tag fails on every rank, reported by
                :meth:`check`, instead of summing another layer's rows (compiled graphs too: the tag is an
                argument of the custom op).

        Returns:
            A :class:`DispatchOutput`; differentiable with respect to ``x`` (FP8 dispatch: through
            :meth:`dequantize`, whose rows' backward is the config-dtype one of a plain dispatch). With the
            config's ``receive_layout`` ``token_major`` a :class:`TokenMajorOutput` (each arrived token once:
            :meth:`permute` lays it out expert-major), differentiable with respect to ``x`` and, through its
            ``topk_weights``, ``topk_weights``.
        """
        backend = self._live_backend()
        cfg = self.config
        if isinstance(call_tag, bool) or not isinstance(call_tag, int) or not 0 <= call_tag < protocol.CALL_TAG_LIMIT:
            raise InputError(f"call_tag: expected an int in [0, {protocol.CALL_TAG_LIMIT}), got {call_tag!r}")
        if not torch.compiler.is_compiling():
            backend.call_tag = call_tag  # a compiled graph hands it to the op instead
        if cfg.dispatch_dtype is not None:
            return self._dispatch_fp8(backend, x, topk_idx, topk_weights, call_tag)
        if isinstance(x, tuple):
            raise InputError("x: a (x_fp8, x_scales) pair is dispatched only with the config's dispatch_dtype set "
                             f"(float8_e4m3fn); this config dispatches {cfg.dtype} rows")
        _check_rows("x", x, None, cfg.hidden, (cfg.torch_dtype,), self.device, cfg.dtype, vector_rows=True)
        self._check_routing(x.shape[0], topk_idx, topk_weights)
        if torch.compiler.is_compiling():
            result = ops.dispatch(self._id, x, topk_idx, topk_weights, call_tag)
        elif torch.is_grad_enabled() and x.requires_grad:
            result = dispatch_with_grad(backend, x, topk_idx, topk_weights)
        else:
            result = backend.dispatch(x, topk_idx, topk_weights)
        handle = DispatchHandle(self._id, result.routing, topk_weights)
        if cfg.check_every_step:
            self.check()
        if cfg.token_major:
            return self._token_major_output(result, handle, result.x)
        return DispatchOutput(result.x, result.expert_offsets, result.tokens_per_expert, handle)

    def _token_major_output(self, result, handle: DispatchHandle, rows: torch.Tensor,
                            x_scales: Optional[torch.Tensor] = None,
                            quantized_from: Optional[torch.Tensor] = None) -> TokenMajorOutput:
        """A token-major dispatch's output: ``rows`` (``result.x``, or FP8's packed rows), ``result.x`` as ``x``
        (FP8: the e4m3 view, with ``x_scales``), and the received weights (differentiable
        w.r.t. ``handle.topk_weights``: under torch.compile through the dispatch op's own autograd)."""
        routing = result.routing
        if torch.compiler.is_compiling():
            weights = routing.recv_weight.view(self._backend.num_slab_rows, self.config.topk)
        else:
            weights = received_weights(self._backend, handle.topk_weights, routing)
        return TokenMajorOutput(result.x, weights, result.expert_offsets, result.tokens_per_expert, handle, rows,
                                x_scales, quantized_from)

    def _check_routing(self, num_tokens: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
        cfg = self.config
        if num_tokens > cfg.max_tokens_per_rank:
            raise InputError(
                f"x: expected at most max_tokens_per_rank={cfg.max_tokens_per_rank} rows, got {num_tokens}"
            )
        # [T, K]: T from x, K = topk from the config; a mismatch between the two names the one that is off.
        _check_rows("topk_idx", topk_idx, num_tokens, cfg.topk, _INDEX_DTYPES, self.device, "int32 or int64")
        _check_rows("topk_weights", topk_weights, num_tokens, cfg.topk, (torch.float32,), self.device, "float32")

    def _dispatch_fp8(self, backend, x, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      call_tag: int) -> Union[DispatchOutput, TokenMajorOutput]:
        """FP8 dispatch: ``x`` quantized (or given as ``(x_fp8, x_scales)``), moved as packed rows, unpacked as views."""
        cfg = self.config
        if isinstance(x, tuple):
            if len(x) != 2:
                raise InputError(f"x: expected a tensor or an (x_fp8, x_scales) pair, got a tuple of {len(x)}")
            x_fp8, x_scales = x
            _check_rows("x_fp8", x_fp8, None, cfg.hidden, (fp8.FP8_DTYPE,), self.device, "float8_e4m3fn",
                        vector_rows=True)
            _check_rows("x_scales", x_scales, x_fp8.shape[0], cfg.hidden // fp8.BLOCK, (torch.float32,),
                        self.device, "float32")
            num_tokens = x_fp8.shape[0]
            x = x_fp8
        else:
            _check_rows("x", x, None, cfg.hidden, (cfg.torch_dtype,), self.device, cfg.dtype, vector_rows=True)
            num_tokens = x.shape[0]
            x_scales = None
        self._check_routing(num_tokens, topk_idx, topk_weights)
        quantized_from = x if x_scales is None and torch.is_grad_enabled() and x.requires_grad else None
        if torch.compiler.is_compiling():
            # Token-major: the op's received weights carry the router weights' gradient (unpermute applies them).
            weights = topk_weights if cfg.token_major else topk_weights.detach()
            result = ops.dispatch_fp8(self._id, x.detach(), x_scales, topk_idx, weights, call_tag)
        else:
            result = backend.dispatch_fp8(x, x_scales, topk_idx, topk_weights)
        out_x, out_scales = fp8.unpack(result.x, cfg.hidden)
        handle = DispatchHandle(self._id, result.routing, topk_weights)
        if cfg.check_every_step:
            self.check()
        if cfg.token_major:
            unpacked = dataclasses.replace(result, x=out_x)
            return self._token_major_output(unpacked, handle, result.x, out_scales, quantized_from)
        return DispatchOutput(out_x, result.expert_offsets, result.tokens_per_expert, handle, out_scales,
                              quantized_from)

    def split_batch(self, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Row slices of ``tensors`` (each ``[T, ...]``, same ``T``) for one dispatch/combine call each,
        as many on every rank: ``[(tensors[0][a:b], tensors[1][a:b], ...), ...]``.

        Calls pair up across ranks by their order, so a batch of more than ``max_tokens_per_rank``
        tokens must become as many calls on every rank, however many tokens each rank has (batches
        differ in size between ranks all the time). Every rank makes ``max over ranks of
        ceil(T / max_tokens_per_rank)`` calls (at least one): slices of ``max_tokens_per_rank`` rows,
        then empty ones. The count is agreed in one small all-reduce over the group (a host sync on
        an NCCL group). Under CUDA graph capture and torch.compile shapes are static and no host
        collective may run: there the count is this rank's own, and every rank must pass as many
        tokens (a mismatch then times out and is reported on every rank by :meth:`check`).
        """
        num_tokens = tensors[0].shape[0]
        size = self.config.max_tokens_per_rank
        num_calls = max(1, -(-num_tokens // size))
        if self.world_size > 1 and not torch.compiler.is_compiling() and not self._capturing():
            num_calls = self._agree_max(num_calls)
        pieces = list(zip(*(tensor.split(size) for tensor in tensors))) if num_tokens else []
        return pieces + [tuple(tensor[:0] for tensor in tensors)] * (num_calls - len(pieces))

    def _agree_max(self, value: int) -> int:
        """The largest of every rank's ``value``: one all-reduce over the group, on the device it serves,
        waited for at most ``timeout_s`` (a rank that never makes its matching forward).

        Raises:
            CommTimeoutError: a peer did not join within ``timeout_s``.
        """
        on_cpu = "gloo" in str(dist.get_backend(self.group))
        tensor = torch.tensor([value], dtype=torch.int64, device="cpu" if on_cpu else self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        deadline = time.monotonic() + self.config.timeout_s
        try:
            if on_cpu:
                work.wait(timeout=timedelta(seconds=self.config.timeout_s))
            else:
                work.wait()  # orders the current stream after the all-reduce; the event below bounds the host
                done = torch.cuda.Event()
                done.record()
                while not done.query():
                    if time.monotonic() > deadline:
                        raise RuntimeError("timed out")
                    time.sleep(0.0001)
        except RuntimeError as exc:
            raise CommTimeoutError(
                f"rank {self.rank} timed out after {self.config.timeout_s} s agreeing on the number of batch slices "
                "with its peers (split_batch): a peer is slow or dead, or it made fewer forward calls"
            ) from exc
        return int(tensor.item())

    def dequantize(self, out: DispatchOutput) -> torch.Tensor:
        """The rows of a dispatch output in the config dtype: ``[capacity_rows, H]``.

        For FP8 dispatch ``float(out.x) * out.x_scales`` per 128 channels, rounded to the config
        dtype (:func:`moe_comm.dequantize`, in one pass on GPUs of compute capability 8.9 or newer;
        zero padding rows give zeros); otherwise ``out.x`` itself. For experts that do not take FP8.
        Rows at or past ``out.expert_offsets[-1]`` are unspecified, as ``out.x``'s are: on a GPU
        the pass reads that bound on the device and leaves them unwritten (they are most rows
        wherever a rank receives fewer than M * K entries: ~7/8 of them at 8 ranks with T = M).

        Differentiable with respect to the dispatched ``x`` when it required grad (``out.quantized_from``):
        straight through the quantization, so the backward is a plain dispatch's, an unweighted
        combine of the rows' gradients in the config dtype (collective, like every backward here).
        """
        if out.x_scales is None:
            return out.x
        quantized_from = out.quantized_from if torch.is_grad_enabled() else None
        end = out.expert_offsets[-1:]
        if torch.compiler.is_compiling():
            return ops.dequantize_fp8(self._id, out.x, out.x_scales, end, quantized_from, out.handle.routing)
        with torch.no_grad():
            rows = self._backend.dequantize_fp8(out.x, out.x_scales, end)
        if quantized_from is None:
            return rows
        return straight_through_rows(self._live_backend(), quantized_from, rows, out.handle.routing)

    def permute(self, out: TokenMajorOutput) -> DispatchOutput:
        """The expert-major rows of a token-major dispatch (the config's ``receive_layout`` ``token_major``).

        Local (no rank takes part), on the current stream with every SM of the device (``sm_budget`` bounds
        only the communication): each kept entry's row becomes its token's row, laid out exactly as an
        expert-major dispatch lays it out (same ``expert_offsets``, alignment, zero padding, FP8 rows), so
        experts written for :class:`DispatchOutput` run unchanged. Differentiable with respect to
        ``out.x``: the backward is an unweighted :meth:`unpermute`.

        Args:
            out: the :class:`TokenMajorOutput` of a dispatch of this Dispatcher.

        Returns:
            A :class:`DispatchOutput` (``x [capacity_rows, H]``; its handle is ``out.handle``).
        """
        backend = self._live_backend()
        self._check_token_major("out", out)
        routing = out.handle.routing
        segments = (out.permuted_offsets, out.tokens_per_expert)
        if torch.compiler.is_compiling():
            rows = ops.permute(self._id, out.rows, routing, *segments)
        elif torch.is_grad_enabled() and out.rows.requires_grad:
            rows = permute_with_grad(backend, out.rows, routing, *segments)
        else:
            rows = backend.permute(out.rows, routing, *segments)
        x, x_scales = (rows, None) if out.x_scales is None else fp8.unpack(rows, self.config.hidden)
        return DispatchOutput(x, *segments, out.handle, x_scales, out.quantized_from)

    def unpermute(self, y: torch.Tensor, out: TokenMajorOutput, *, weighted: bool = True) -> torch.Tensor:
        """Reduce the experts' rows to one row per arrived token: the rows :meth:`combine` takes (token-major).

        Local, on the current stream with every SM: for each row ``g`` of ``out.x`` with a kept entry,
        ``dtype(sum over its kept entries k, increasing, of out.topk_weights[g, k] * y[row of (g, k)])`` in
        float32, a separately rounded multiply and add (``weighted`` False: weight 1, for experts that
        applied the router weights themselves). These are the partial sums an expert-major combine
        computes, so ``combine(unpermute(y, out), out.handle)`` is bitwise ``combine(y, handle)`` of the
        expert-major path. Differentiable with respect to ``y`` and ``out.topk_weights``.

        Args:
            y: ``[capacity_rows, H]`` expert outputs in :meth:`permute`'s layout, config dtype, contiguous.
            out: the :class:`TokenMajorOutput` that was permuted.

        Returns:
            ``[W * M, H]`` in the config dtype; rows without a kept entry are unspecified (combine reads none).
        """
        backend = self._live_backend()
        cfg = self.config
        self._check_token_major("out", out)
        _check_rows("y", y, self.capacity_rows, cfg.hidden, (cfg.torch_dtype,), self.device, cfg.dtype,
                    vector_rows=True)
        _check_rows("out.topk_weights", out.topk_weights, backend.num_slab_rows, cfg.topk, (torch.float32,),
                    self.device, "float32")
        routing = out.handle.routing
        weights = out.topk_weights if weighted else None
        segments = (out.permuted_offsets, out.tokens_per_expert)
        if torch.compiler.is_compiling():
            return ops.unpermute(self._id, y, weights, routing)
        if torch.is_grad_enabled() and (y.requires_grad or (weights is not None and weights.requires_grad)):
            return unpermute_with_grad(backend, y, weights, routing, *segments)
        return backend.unpermute(y, routing, weights)

    def _check_token_major(self, name: str, out) -> None:
        if not self.config.token_major:
            raise ConfigError(
                f"{name}: permute and unpermute belong to the token-major layout; this Dispatcher's config has "
                f"receive_layout {self.config.receive_layout!r} (set receive_layout: token_major)"
            )
        if not isinstance(out, TokenMajorOutput):
            raise InputError(f"{name}: expected the TokenMajorOutput of a dispatch call, got {type(out).__name__}")
        if out.handle.dispatcher_id != self._id:
            raise InputError(f"{name}: it comes from another Dispatcher; use the dispatcher that dispatched")

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Bring expert outputs back to their tokens and sum them with the router weights.

        Args:
            y: ``[capacity_rows, H]`` expert outputs in ``out.x``'s layout, config dtype, contiguous. With the
                config's ``receive_layout`` ``token_major``: ``[W * M, H]``, the rows :meth:`unpermute`
                reduced (the weights were applied there).
            handle: ``out.handle`` of a dispatch call of this dispatcher.

        Returns:
            ``[T, H]`` with ``z[t] = sum_k topk_weights[t, k] * y[row of (t, k)]`` (zeros for a
            token with no valid expert); differentiable with respect to ``y`` and ``topk_weights``
            (token-major: with respect to ``y``). Weights and rows are used as given: a NaN or infinite
            one of a kept assignment reaches ``z[t]`` as it would the dense sum (checking them would
            cost a host sync per call).
        """
        backend = self._live_backend()
        cfg = self.config
        if not isinstance(handle, DispatchHandle):
            raise InputError(f"handle: expected the DispatchHandle of a dispatch call, got {type(handle).__name__}")
        if handle.dispatcher_id != self._id:
            raise InputError("handle: it comes from another Dispatcher; combine with the dispatcher that dispatched")
        rows = backend.num_slab_rows if cfg.token_major else self.capacity_rows
        _check_rows("y", y, rows, cfg.hidden, (cfg.torch_dtype,), self.device, cfg.dtype, vector_rows=True)
        weights = handle.topk_weights
        if torch.compiler.is_compiling():
            z = ops.combine(self._id, y, weights, handle.routing)
        elif torch.is_grad_enabled() and (y.requires_grad or (weights.requires_grad and not cfg.token_major)):
            z = combine_with_grad(backend, y, weights, handle.routing)
        else:
            z = backend.combine(y, handle.routing, weighted=True)
        if cfg.check_every_step:
            self.check()
        return z

    def read_status(self) -> StatusReport:
        """Read the device status word (a host sync; keep it off the hot path). Does not clear it.

        Waits at most about ``timeout_s`` for the device: a step stuck on a peer that never came
        is reported as a timeout instead of blocking here (see ``Backend.wait_settled``).

        Raises:
            MoeCommError: called during CUDA graph capture (the host cannot read the device then).
        """
        backend = self._live_backend()
        if self._capturing():
            raise MoeCommError(
                "read_status()/check() read the device status on the host, which cannot happen while a CUDA graph "
                "is being captured; call it after the graph's replay"
            )
        stalled = backend.wait_settled()
        if stalled is not None:
            phase, peer = stalled
            return StatusReport(num_invalid=0, first_invalid=None, first_invalid_call=None, num_dropped=0,
                                first_dropped=None, first_dropped_call=None, timeout_phase=phase, timeout_peer=peer)
        return protocol.decode_status(backend.status.tolist(), backend.warm_up_calls)

    def check(self) -> None:
        """Raise :class:`DeviceStatusError` if any call since the last check recorded a fault; then clear the status.

        Faults: expert ids outside ``[0, num_experts)`` other than -1, assignments dropped over
        ``expert_capacity``, and waits on a peer that ran past ``timeout_s``. A host sync.

        A timeout on any rank is the whole group's failure: the rank that timed out raises the group's
        abort word, every call of every rank then gives up its waits at once, and ``check()`` raises
        :class:`GroupFailedError` on every rank that made such a call; from then on every call on
        this Dispatcher raises at once, until :meth:`reset` (collective) or a new Dispatcher.
        """
        report = self.read_status()
        if report.ok:
            return
        self._live_backend().status.copy_(protocol.new_status(self.device))

        def first(source: str, offender: tuple[int, int], call: int) -> str:
            rank, token = offender
            return (f"first: {source} {rank}, token {token}, in call {call} of this Dispatcher (its dispatches "
                    "and backward redispatches, counted from 1)")

        problems = []
        if report.timeout_phase:
            peer = "peer rank unknown" if report.timeout_peer is None else f"peer rank {report.timeout_peer}"
            problems.append(
                f"rank {self.rank} timed out after {self.config.timeout_s} s in {report.timeout_phase} "
                f"({peer}); results of that step are invalid (the peer is slow or dead, or it made fewer calls: every "
                "rank must make the same calls in the same order, e.g. generate the same number of tokens)"
            )
        if report.call_mismatch is not None:
            mismatch = report.call_mismatch
            problems.append(
                f"rank {self.rank}'s dispatch (call tag {mismatch.own_tag}) met a call of another layer or batch slice "
                f"on rank {mismatch.peer} (call tag {mismatch.peer_tag}): the ranks made different calls (every rank "
                "must make the same dispatch/combine calls in the same order, e.g. the same number of forwards); its "
                "results are invalid"
            )
        elif report.abort is not None and not report.timeout_phase:
            problems.append(
                f"rank {self.rank}'s calls were aborted because {report.abort.describe()}; results of this rank's "
                "calls since then are invalid"
            )
        if report.num_invalid:
            problems.append(
                f"{report.num_invalid} expert id(s) outside [0, {self.config.num_experts}) and not -1 "
                f"({first('rank', report.first_invalid, report.first_invalid_call)}); those assignments were dropped"
            )
        if report.num_dropped:
            problems.append(
                f"{report.num_dropped} assignment(s) dropped over expert_capacity={self.config.expert_capacity} "
                f"on rank {self.rank} ({first('from rank', report.first_dropped, report.first_dropped_call)})"
            )
        if report.broken:
            self._failure = "; ".join(problems[:1])
            hint = self._backend.crowding_hint() if report.call_mismatch is None else None  # a cause of timeouts
            if hint is not None:
                problems.append(f"a likely cause: {hint}")
            raise GroupFailedError(
                "; ".join(problems) + "; every later call on this Dispatcher raises until reset() is called on every "
                "rank (collective) or the Dispatcher is rebuilt"
            )
        raise DeviceStatusError("; ".join(problems))

    def reset(self) -> None:
        """Collective: bring this Dispatcher back into step on every rank after a failure (see :meth:`check`).

        Every rank of the group calls it (with the device free of this Dispatcher's work in flight:
        the kernels' waits are bounded, and end at once after a failure); it clears the status, the
        abort word, every flag, epoch and counter of the protocol on every rank, so the next call
        of every rank pairs with its peers' next call again. CUDA graphs captured before stay valid
        (they read the epochs from device memory, which restart on every rank alike). Results of the
        calls before the reset that ``check()`` reported are still invalid.

        Raises:
            BackendError: the backend cannot recover (the collective backends after a failed exchange:
                their process group is out of step), or a rank failed to reset; rebuild then.
        """
        if self._closed:
            raise MoeCommError("this Dispatcher is closed; build a new one")
        if self._capturing():
            raise MoeCommError("reset() synchronizes the device and the ranks; call it outside CUDA graph capture")
        self._backend.reset()
        self._failure = None

    def close(self) -> None:
        """Release every buffer and mapping; idempotent. The dispatcher cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            ops.unregister_backend(self._id)
            self._backend.close()

    def __enter__(self) -> "Dispatcher":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"Dispatcher(backend={self.backend_name!r}, rank={self.rank}/{self.world_size}, device={self.device}, "
            f"experts={cfg.num_experts} (local {self.num_local_experts}), topk={cfg.topk}, hidden={cfg.hidden}, "
            f"max_tokens_per_rank={cfg.max_tokens_per_rank}, dtype={cfg.dtype})"
        )
