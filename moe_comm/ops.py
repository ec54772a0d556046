"""Dispatch and combine as torch custom ops (``torch.ops.moe_comm.*``), for ``torch.compile``.

``torch.compile`` traces Python into a graph; the host-side state of a call (symmetric buffers,
kernels, launch parameters, epochs) must stay out of it. Each op is opaque to the compiler: it
takes tensors and the integer id of a ``Dispatcher`` (a constant of the graph) and looks up that
dispatcher's backend in a registry here. Fake implementations give every output's shape and dtype
from the backend's config alone, and autograd is registered on the ops with the same backward math as the eager path
(:mod:`moe_comm.autograd`), so a compiled model differentiates through dispatch and combine, and
through FP8 dispatch's dequantized rows (``dispatch_fp8``, ``dequantize_fp8``: straight through).

The token-major layout (``Config.receive_layout``) adds ``permute`` and ``unpermute``; there dispatch's
received weights (its last output) are differentiable, and combine's backward is a redispatch alone.

Eager calls do not come here: ``Dispatcher`` calls its backend directly unless
``torch.compiler.is_compiling()``, because an op call costs host time (the dispatcher's
boxing) that decode loops would pay on every call. Both paths run the same backend methods.

NOTE: custom ops may not return tensors that alias each other, so the op asks the backend for
separate allocations (``separate_outputs=True``); eager dispatch packs its small outputs into
one allocation to save host time.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .autograd import combine_backward, kernel_rows, unpermute_backward, weights_grad_to_assignments
from .backends.base import Backend, DispatchResult
from .errors import MoeCommError
from .fp8 import packed_row_bytes
from .routing import Routing

__all__ = ["register_backend", "unregister_backend", "dispatch", "combine", "dispatch_fp8", "dequantize_fp8",
           "permute", "unpermute"]

_backends: dict[int, Backend] = {}


def register_backend(dispatcher_id: int, backend: Backend) -> None:
    """Make ``backend`` reachable from the ops as ``dispatcher_id`` (``Dispatcher`` does this when built)."""
    _backends[dispatcher_id] = backend


def unregister_backend(dispatcher_id: int) -> None:
    """Forget ``dispatcher_id`` (``Dispatcher.close``); a graph that still names it then fails clearly."""
    _backends.pop(dispatcher_id, None)


def _backend(dispatcher_id: int) -> Backend:
    backend = _backends.get(dispatcher_id)
    if backend is None:
        raise MoeCommError(
            f"dispatcher {dispatcher_id} is closed or was never built in this process; a compiled graph that "
            "uses it must be recompiled with a live Dispatcher"
        )
    return backend


def _tagged(dispatcher_id: int, call_tag: int) -> Backend:
    """The backend for a compiled dispatch whose call carries ``call_tag``: an argument of the op, so a
    compiled graph holds each call site's tag as a constant (the Dispatcher checked its range)."""
    backend = _backend(dispatcher_id)
    backend.call_tag = call_tag
    return backend


def _routing(send_mask: Tensor, dest_rank: Tensor, recv_pos: Tensor, recv_weight: Tensor) -> Routing:
    return Routing(send_mask.shape[0], send_mask, dest_rank, recv_pos, recv_weight)


# ------------------------------------------------------------------------------------------ dispatch


@torch.library.custom_op("moe_comm::dispatch", mutates_args=())
def _dispatch_op(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, dispatcher_id: int, call_tag: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``out.x``, ``expert_offsets``, ``tokens_per_expert`` and the routing's four tensors."""
    result = _tagged(dispatcher_id, call_tag).dispatch(kernel_rows(x), topk_idx, topk_weights, separate_outputs=True)
    routing = result.routing
    return (result.x, result.expert_offsets, result.tokens_per_expert, routing.send_mask, routing.dest_rank,
            routing.recv_pos, routing.recv_weight)


@_dispatch_op.register_fake
def _dispatch_fake(x, topk_idx, topk_weights, dispatcher_id, call_tag):
    backend = _backend(dispatcher_id)
    cfg = backend.config
    tokens = x.shape[0]
    slab = (backend.world_size, cfg.max_tokens_per_rank, cfg.topk)
    local = backend.num_local_experts
    rows = backend.num_slab_rows if backend.token_major else backend.capacity_rows
    return (
        x.new_empty((rows, cfg.hidden)),
        x.new_empty((local,), dtype=torch.int32),
        x.new_empty((local,), dtype=torch.int32),
        x.new_empty((tokens, backend.world_size), dtype=torch.bool),
        x.new_empty((tokens, cfg.topk), dtype=torch.int32),
        x.new_empty(slab, dtype=torch.int32),
        x.new_empty(slab, dtype=torch.float32),
    )


def _mark_outputs(ctx, output, dispatcher_id: int) -> None:
    """Dispatch's outputs: all but its rows non-differentiable, and its received weights (the last) too unless
    the layout is token-major (where unpermute applies them); saves the routing tensors."""
    ctx.dispatcher_id = dispatcher_id
    ctx.token_major = _backend(dispatcher_id).token_major
    ctx.mark_non_differentiable(*output[1:-1] if ctx.token_major else output[1:])
    ctx.save_for_backward(*output[3:])


def _dispatch_setup(ctx, inputs, output) -> None:
    _mark_outputs(ctx, output, inputs[3])


def _unweighted_combine(ctx, rows: Tensor) -> Tensor:
    """The unweighted combine of ``rows`` in the layout combine takes, along the routing tensors ``ctx`` saved."""
    send_mask, dest_rank, recv_pos, recv_weight = ctx.saved_tensors
    return torch.ops.moe_comm.combine(
        rows.contiguous(), None, send_mask, dest_rank, recv_pos, recv_weight, ctx.dispatcher_id, False
    )


def _rows_grad_to_tokens(ctx, grad_rows: Tensor) -> Tensor:
    """The expert-major rows' gradients back to their tokens, summed there (token-major: reduced per slab
    row first, permute's backward)."""
    if ctx.token_major:
        grad_rows = torch.ops.moe_comm.unpermute(grad_rows.contiguous(), ctx.saved_tensors[2], None, ctx.dispatcher_id)
    return _unweighted_combine(ctx, grad_rows)


def _weights_grad_to_sources(ctx, grad_weights: Optional[Tensor]) -> Optional[Tensor]:
    """Token-major: the received weights' gradients ``[W * M, K]`` back to the sources' assignments ``[T, K]``."""
    if not ctx.token_major:
        return None
    routing_tensors = ctx.saved_tensors
    return weights_grad_to_assignments(
        grad_weights, routing_tensors[2], _backend(ctx.dispatcher_id).capacity_rows,
        lambda values: torch.ops.moe_comm.return_entry_values(values, *routing_tensors, ctx.dispatcher_id),
    )


def _dispatch_backward(ctx, grad_rows, *grads):
    # The rows' gradients come in the layout dispatch returned (token-major rows need no unpermute).
    grad_x = _unweighted_combine(ctx, grad_rows)
    return grad_x, None, _weights_grad_to_sources(ctx, grads[-1]), None, None


torch.library.register_autograd("moe_comm::dispatch", _dispatch_backward, setup_context=_dispatch_setup)


def dispatch(dispatcher_id: int, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, call_tag: int) -> DispatchResult:
    """``Backend.dispatch`` of dispatcher ``dispatcher_id`` through the custom op (differentiable in ``x``)."""
    out_x, offsets, counts, *routing = torch.ops.moe_comm.dispatch(x, topk_idx, topk_weights, dispatcher_id,
                                                                   call_tag)
    return DispatchResult(out_x, offsets, counts, _routing(*routing))


# -------------------------------------------------------------------------------------- FP8 dispatch


@torch.library.custom_op("moe_comm::dispatch_fp8", mutates_args=())
def _dispatch_fp8_op(
    x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor, topk_weights: Tensor, dispatcher_id: int, call_tag: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """FP8 dispatch of config-dtype ``x`` (``x_scales`` None) or of the pair ``(x, x_scales)``: the packed
    output rows ``[capacity_rows, packed_row_bytes(H)]`` uint8, then what ``dispatch`` returns after ``out.x``.

    Not differentiable: the gradient reaches ``x`` through :func:`dequantize_fp8` (straight through).
    """
    scales = None if x_scales is None else x_scales.contiguous()
    result = _tagged(dispatcher_id, call_tag).dispatch_fp8(kernel_rows(x), scales, topk_idx, topk_weights,
                                                           separate_outputs=True)
    routing = result.routing
    return (result.x, result.expert_offsets, result.tokens_per_expert, routing.send_mask, routing.dest_rank,
            routing.recv_pos, routing.recv_weight)


@_dispatch_fp8_op.register_fake
def _dispatch_fp8_fake(x, x_scales, topk_idx, topk_weights, dispatcher_id, call_tag):
    rows, *rest = _dispatch_fake(x, topk_idx, topk_weights, dispatcher_id, call_tag)
    packed = x.new_empty((rows.shape[0], packed_row_bytes(rows.shape[1])), dtype=torch.uint8)
    return (packed, *rest)


def _dispatch_fp8_setup(ctx, inputs, output) -> None:
    _mark_outputs(ctx, output, inputs[4])


def _dispatch_fp8_backward(ctx, *grads):
    # The rows reach x through dequantize_fp8 (straight through); only token-major weights have a gradient here.
    return None, None, None, _weights_grad_to_sources(ctx, grads[-1]), None, None


torch.library.register_autograd("moe_comm::dispatch_fp8", _dispatch_fp8_backward, setup_context=_dispatch_fp8_setup)


def dispatch_fp8(dispatcher_id: int, x: Tensor, x_scales: Optional[Tensor], topk_idx: Tensor,
                 topk_weights: Tensor, call_tag: int) -> DispatchResult:
    """FP8 dispatch through the custom op; ``result.x`` holds the packed rows (``moe_comm.fp8.unpack``)."""
    packed, offsets, counts, *routing = torch.ops.moe_comm.dispatch_fp8(x, x_scales, topk_idx, topk_weights,
                                                                         dispatcher_id, call_tag)
    return DispatchResult(packed, offsets, counts, _routing(*routing))


@torch.library.custom_op("moe_comm::dequantize_fp8", mutates_args=())
def _dequantize_fp8_op(
    x_fp8: Tensor, x_scales: Tensor, end: Tensor, quantized_from: Optional[Tensor], send_mask: Tensor,
    dest_rank: Tensor, recv_pos: Tensor, recv_weight: Tensor, dispatcher_id: int,
) -> Tensor:
    """``[N, H]`` config dtype: the FP8 rows dequantized, those below ``end`` (``expert_offsets[-1:]``) at
    least (``Backend.dequantize_fp8``). ``quantized_from``, the ``x`` an FP8 dispatch quantized along the
    routing, is an input only so autograd can reach it (straight through the quantization)."""
    return _backend(dispatcher_id).dequantize_fp8(x_fp8, x_scales, end)


@_dequantize_fp8_op.register_fake
def _dequantize_fp8_fake(x_fp8, x_scales, end, quantized_from, send_mask, dest_rank, recv_pos, recv_weight,
                         dispatcher_id):
    return x_fp8.new_empty(tuple(x_fp8.shape), dtype=_backend(dispatcher_id).config.torch_dtype)


def _dequantize_fp8_setup(ctx, inputs, output) -> None:
    ctx.dispatcher_id = inputs[-1]
    ctx.token_major = _backend(ctx.dispatcher_id).token_major
    ctx.save_for_backward(*inputs[4:8])


def _dequantize_fp8_backward(ctx, grad_rows):
    # Straight through: the rows' gradients go back to their tokens as a config-dtype dispatch's do.
    return None, None, None, _rows_grad_to_tokens(ctx, grad_rows), None, None, None, None, None


torch.library.register_autograd("moe_comm::dequantize_fp8", _dequantize_fp8_backward,
                                setup_context=_dequantize_fp8_setup)


def dequantize_fp8(dispatcher_id: int, x_fp8: Tensor, x_scales: Tensor, end: Tensor, quantized_from: Optional[Tensor],
                   routing: Routing) -> Tensor:
    """The rows of an FP8 dispatch output in the config dtype through the custom op, those below ``end``
    (``expert_offsets[-1:]``) at least; differentiable with respect to ``quantized_from`` (None: not
    differentiable)."""
    return torch.ops.moe_comm.dequantize_fp8(x_fp8, x_scales, end, quantized_from, routing.send_mask,
                                             routing.dest_rank, routing.recv_pos, routing.recv_weight, dispatcher_id)


# ------------------------------------------------------------------------------------------- combine


@torch.library.custom_op("moe_comm::combine", mutates_args=())
def _combine_op(
    y: Tensor, topk_weights: Optional[Tensor], send_mask: Tensor, dest_rank: Tensor, recv_pos: Tensor,
    recv_weight: Tensor, dispatcher_id: int, weighted: bool,
) -> Tensor:
    """``z [T, H]``; ``topk_weights`` is an input only so autograd can reach it (the weights the
    destination applies travelled with dispatch as ``recv_weight``)."""
    routing = _routing(send_mask, dest_rank, recv_pos, recv_weight)
    return _backend(dispatcher_id).combine(kernel_rows(y), routing, weighted=weighted)


@_combine_op.register_fake
def _combine_fake(y, topk_weights, send_mask, dest_rank, recv_pos, recv_weight, dispatcher_id, weighted):
    return y.new_empty((send_mask.shape[0], y.shape[1]))


def _combine_setup(ctx, inputs, output) -> None:
    y, topk_weights, send_mask, dest_rank, recv_pos, recv_weight, dispatcher_id, weighted = inputs
    ctx.dispatcher_id = dispatcher_id
    ctx.weighted = weighted
    ctx.save_for_backward(y, send_mask, dest_rank, recv_pos, recv_weight)


def _combine_backward(ctx, grad_z):
    if not ctx.weighted:
        raise MoeCommError("the unweighted combine is dispatch's backward; it has no backward of its own")
    y, *routing_tensors = ctx.saved_tensors
    dispatcher_id = ctx.dispatcher_id
    if _backend(dispatcher_id).token_major:
        # The reduced rows' gradient: each slab row's token gradient (the weights were unpermute's).
        return (torch.ops.moe_comm.redispatch(grad_z.contiguous(), *routing_tensors, dispatcher_id),
                None, None, None, None, None, None, None)
    routing = _routing(*routing_tensors)
    grad_y, grad_weights = combine_backward(
        grad_z, y, routing,
        redispatch=lambda rows: torch.ops.moe_comm.redispatch(rows, *routing_tensors, dispatcher_id),
        return_entry_values=lambda values: torch.ops.moe_comm.return_entry_values(
            values, *routing_tensors, dispatcher_id),
    )
    return grad_y, grad_weights, None, None, None, None, None, None


torch.library.register_autograd("moe_comm::combine", _combine_backward, setup_context=_combine_setup)


def combine(dispatcher_id: int, y: Tensor, topk_weights: Tensor, routing: Routing) -> Tensor:
    """``Backend.combine`` (weighted) through the custom op; differentiable in ``y`` and ``topk_weights``."""
    return torch.ops.moe_comm.combine(y, topk_weights, routing.send_mask, routing.dest_rank, routing.recv_pos,
                                      routing.recv_weight, dispatcher_id, True)


# ---------------------------------------------------------------------------- combine's backward


@torch.library.custom_op("moe_comm::redispatch", mutates_args=())
def _redispatch_op(
    x: Tensor, send_mask: Tensor, dest_rank: Tensor, recv_pos: Tensor, recv_weight: Tensor, dispatcher_id: int
) -> Tensor:
    """``[capacity_rows, H]``: rows of ``x [T, H]`` sent along an existing routing."""
    return _backend(dispatcher_id).redispatch(kernel_rows(x), _routing(send_mask, dest_rank, recv_pos, recv_weight))


@_redispatch_op.register_fake
def _redispatch_fake(x, send_mask, dest_rank, recv_pos, recv_weight, dispatcher_id):
    backend = _backend(dispatcher_id)
    return x.new_empty((backend.num_slab_rows if backend.token_major else backend.capacity_rows, x.shape[1]))


@torch.library.custom_op("moe_comm::return_entry_values", mutates_args=())
def _return_entry_values_op(
    row_vector: Tensor, send_mask: Tensor, dest_rank: Tensor, recv_pos: Tensor, recv_weight: Tensor,
    dispatcher_id: int,
) -> Tensor:
    """``[T, K]`` float32: each assignment's value of ``row_vector [capacity_rows]``, from its destination."""
    routing = _routing(send_mask, dest_rank, recv_pos, recv_weight)
    return _backend(dispatcher_id).return_entry_values(row_vector, routing)


@_return_entry_values_op.register_fake
def _return_entry_values_fake(row_vector, send_mask, dest_rank, recv_pos, recv_weight, dispatcher_id):
    return row_vector.new_empty(tuple(dest_rank.shape), dtype=torch.float32)


# ------------------------------------------------------------------------------ permute / unpermute


@torch.library.custom_op("moe_comm::permute", mutates_args=())
def _permute_op(rows: Tensor, recv_pos: Tensor, expert_offsets: Tensor, tokens_per_expert: Tensor,
                dispatcher_id: int) -> Tensor:
    """``[capacity_rows, R]``: token-major ``rows [W * M, R]`` laid out expert-major (``Backend.permute``)."""
    routing = Routing(0, None, None, recv_pos, None)
    return _backend(dispatcher_id).permute(kernel_rows(rows), routing, expert_offsets, tokens_per_expert)


@_permute_op.register_fake
def _permute_fake(rows, recv_pos, expert_offsets, tokens_per_expert, dispatcher_id):
    return rows.new_empty((_backend(dispatcher_id).capacity_rows, rows.shape[1]))


def _permute_setup(ctx, inputs, output) -> None:
    ctx.dispatcher_id = inputs[-1]
    ctx.save_for_backward(inputs[1])


def _permute_backward(ctx, grad_rows):
    (recv_pos,) = ctx.saved_tensors
    grad = torch.ops.moe_comm.unpermute(grad_rows.contiguous(), recv_pos, None, ctx.dispatcher_id)
    return grad, None, None, None, None


torch.library.register_autograd("moe_comm::permute", _permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("moe_comm::unpermute", mutates_args=())
def _unpermute_op(y: Tensor, recv_pos: Tensor, weights: Optional[Tensor], dispatcher_id: int) -> Tensor:
    """``[W * M, H]``: the expert rows ``y [capacity_rows, H]`` reduced per slab row (``Backend.unpermute``)."""
    routing = Routing(0, None, None, recv_pos, None)
    return _backend(dispatcher_id).unpermute(kernel_rows(y), routing, weights)


@_unpermute_op.register_fake
def _unpermute_fake(y, recv_pos, weights, dispatcher_id):
    return y.new_empty((_backend(dispatcher_id).num_slab_rows, y.shape[1]))


def _unpermute_setup(ctx, inputs, output) -> None:
    y, recv_pos, weights, dispatcher_id = inputs
    ctx.dispatcher_id = dispatcher_id
    ctx.weighted = weights is not None
    ctx.save_for_backward(y, recv_pos, weights)


def _unpermute_backward(ctx, grad_partials):
    y, recv_pos, weights = ctx.saved_tensors
    # The spread's padding rows are masked, so the segments permute would zero are not needed.
    no_segments = recv_pos.new_zeros(_backend(ctx.dispatcher_id).num_local_experts)
    grad_y, grad_weights = unpermute_backward(
        grad_partials, y, weights if ctx.weighted else None, recv_pos,
        permute=lambda rows: torch.ops.moe_comm.permute(rows.contiguous(), recv_pos, no_segments, no_segments,
                                                        ctx.dispatcher_id),
    )
    return grad_y, None, grad_weights, None


torch.library.register_autograd("moe_comm::unpermute", _unpermute_backward, setup_context=_unpermute_setup)


def permute(dispatcher_id: int, rows: Tensor, routing: Routing, expert_offsets: Tensor,
            tokens_per_expert: Tensor) -> Tensor:
    """``Backend.permute`` through the custom op (differentiable in ``rows``)."""
    return torch.ops.moe_comm.permute(rows, routing.recv_pos, expert_offsets, tokens_per_expert, dispatcher_id)


def unpermute(dispatcher_id: int, y: Tensor, weights: Optional[Tensor], routing: Routing) -> Tensor:
    """``Backend.unpermute`` through the custom op (differentiable in ``y`` and ``weights``)."""
    return torch.ops.moe_comm.unpermute(y, routing.recv_pos, weights, dispatcher_id)
