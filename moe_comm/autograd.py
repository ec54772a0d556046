"""Autograd for dispatch and combine, written once over the ``Backend`` primitives.

* dispatch backward: the gradient of every expert-major row goes back to its token and is
  summed there: an unweighted combine.
* combine backward: ``dz[t]`` is sent along the same routing (``redispatch``); on the
  destination ``grad_y[row] = w * dz`` and ``grad_w[t, k] = <dz[t], y[row]>``, and the latter
  is returned to the source (``return_entry_values``).
* FP8 dispatch: the quantization is taken as the identity for gradients (straight through, as
  FP8 training recipes do), so the dequantized rows' backward is dispatch's: an unweighted
  combine in the config dtype; gradients are never quantized.
* Token-major layout (``Config.receive_layout``): dispatch, permute, unpermute and combine are four
  functions, each one's backward the forward of its partner: dispatch's is a combine of the rows'
  gradients (and the return of its received weights' gradients to their assignments), permute's an
  unweighted unpermute, unpermute's a permute of the partials' gradients, and combine's a redispatch.
  The gradients are bitwise those of the expert-major path: the same rows are summed in the same order.

Every rank must run the same backward calls in the same order (they are collective), so
the backward functions always make all their exchanges, whichever inputs need gradients.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .routing import Routing, row_values, scatter_entry_values
from .backends.base import Backend, DispatchResult

__all__ = ["dispatch_with_grad", "received_weights", "combine_with_grad", "combine_backward", "expert_row_grads",
           "weights_grad_to_assignments", "unpermute_backward", "straight_through_rows", "permute_with_grad",
           "unpermute_with_grad"]


def kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the backends' kernels take them: contiguous and starting on a 16-byte boundary
    (what the Dispatcher asks of its users' rows; a gradient torch hands over, or a tensor a
    compiled graph hands a custom op, may be a view of either kind). A copy only when needed."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def _rows_grad_to_tokens(backend: Backend, grad_rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The expert-major rows' gradients back to their tokens, summed there (an unweighted combine; token-major:
    reduced per slab row first, permute's backward, then combined)."""
    if backend.token_major:
        grad_rows = backend.unpermute(kernel_rows(grad_rows), routing, None)
    return backend.combine(kernel_rows(grad_rows), routing, weighted=False)


def weights_grad_to_assignments(grad_weights: Optional[torch.Tensor], recv_pos: torch.Tensor, capacity_rows: int,
                                return_entry_values: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Token-major dispatch's backward for its received weights, for the eager path and the custom ops alike:
    ``grad_weights [W * M, K]`` float32 (the destination's, per entry; None: zeros) back to the sources'
    assignments, ``[T, K]`` float32. ``recv_pos``: ``[W, M, K]`` int32; ``return_entry_values`` returns a
    ``[capacity_rows]`` float32 vector's value of every entry to its source (collective)."""
    if grad_weights is None:
        entries = torch.zeros(recv_pos.shape, dtype=torch.float32, device=recv_pos.device)
    else:
        entries = grad_weights.reshape(recv_pos.shape)
    return return_entry_values(row_values(recv_pos, entries, capacity_rows))


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backend: Backend, topk_idx, topk_weights, results: list):
        result = backend.dispatch(x, topk_idx, topk_weights)
        results.append(result)
        ctx.backend = backend
        ctx.routing = result.routing
        ctx.mark_non_differentiable(result.expert_offsets, result.tokens_per_expert)
        return result.x, result.expert_offsets, result.tokens_per_expert

    @staticmethod
    def backward(ctx, grad_rows, _grad_offsets, _grad_counts):
        # The rows' gradients in the layout dispatch returned (token-major rows need no unpermute).
        return ctx.backend.combine(kernel_rows(grad_rows), ctx.routing, weighted=False), None, None, None, None


class _ReceivedWeights(torch.autograd.Function):
    """A token-major dispatch's received weights ``[W * M, K]`` as a function of the sources' ``topk_weights``."""

    @staticmethod
    def forward(ctx, topk_weights, backend: Backend, routing: Routing):
        ctx.backend = backend
        ctx.routing = routing
        return routing.recv_weight.view(backend.num_slab_rows, -1)

    @staticmethod
    def backward(ctx, grad_weights):
        backend, routing = ctx.backend, ctx.routing
        grad = weights_grad_to_assignments(grad_weights, routing.recv_pos, backend.capacity_rows,
                                           lambda values: backend.return_entry_values(values, routing))
        return grad, None, None


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows, backend: Backend, routing: Routing):
        ctx.backend = backend
        ctx.routing = routing
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        return _rows_grad_to_tokens(ctx.backend, grad_rows, ctx.routing), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, backend: Backend, routing: Routing):
        ctx.backend = backend
        ctx.routing = routing
        ctx.save_for_backward(y)
        return backend.combine(y, routing, weighted=True)

    @staticmethod
    def backward(ctx, grad_z):
        (y,) = ctx.saved_tensors
        backend, routing = ctx.backend, ctx.routing
        grad_y, grad_weights = combine_backward(
            grad_z, y, routing,
            redispatch=lambda rows: backend.redispatch(kernel_rows(rows), routing),
            return_entry_values=lambda values: backend.return_entry_values(values, routing),
        )
        return grad_y, grad_weights, None, None


def combine_backward(
    grad_z: torch.Tensor,
    y: torch.Tensor,
    routing: Routing,
    redispatch: Callable[[torch.Tensor], torch.Tensor],
    return_entry_values: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a weighted combine, for the eager path and the custom ops alike.

    Args:
        grad_z: ``[T, H]`` gradient of combine's output. y: ``[capacity_rows, H]`` its input.
        routing: the dispatch's routing. redispatch: sends ``[T, H]`` rows along it and returns
            them expert-major ``[capacity_rows, H]``. return_entry_values: returns a
            ``[capacity_rows]`` float32 vector's value of every entry to its source, ``[T, K]``.

    Returns:
        ``grad_y [capacity_rows, H]`` (y's dtype) and ``grad_topk_weights [T, K]`` float32.
    """
    grad_y, row_dot = expert_row_grads(redispatch(grad_z.contiguous()), y, routing.recv_pos, routing.recv_weight)
    return grad_y, return_entry_values(row_dot)


def expert_row_grads(spread: torch.Tensor, y: torch.Tensor, recv_pos: torch.Tensor,
                     recv_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The destination's half of a weighted sum's backward (combine's, and unpermute's).

    Args:
        spread: ``[capacity_rows, H]`` each kept row holds the gradient of the partial its entry went into
            (other rows unspecified). y: ``[capacity_rows, H]`` the rows summed. recv_pos, recv_weight:
            ``[W, M, K]`` (or ``[W * M, K]``) the entries' rows and weights.

    Returns:
        ``grad_y [capacity_rows, H]`` (y's dtype: ``w * spread`` on kept rows, exact zeros elsewhere) and
        ``row_dot [capacity_rows]`` float32 (``<spread, y>`` of each kept row, the gradient of its weight).
    """
    spread = spread.float()
    rows = y.shape[0]
    row_weight = row_values(recv_pos, recv_weight, rows)
    row_used = row_values(recv_pos, torch.ones_like(recv_weight), rows) > 0
    # Rows no entry maps to (padding, and rows past the last segment) get an exact zero,
    # so whatever they held cannot leak a NaN into the experts' weight gradients.
    grad_y = torch.where(row_used[:, None], spread * row_weight[:, None], torch.zeros_like(spread)).to(y.dtype)
    row_dot = torch.where(row_used, (spread * y.float()).sum(dim=1), torch.zeros_like(row_weight))
    return grad_y, row_dot


def dispatch_with_grad(
    backend: Backend, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> DispatchResult:
    """``backend.dispatch`` recorded on the autograd tape: ``out.x`` is differentiable w.r.t. ``x``."""
    results: list[DispatchResult] = []
    rows, offsets, counts = _Dispatch.apply(x, backend, topk_idx, topk_weights, results)
    return DispatchResult(rows, offsets, counts, results[0].routing)


def received_weights(backend: Backend, topk_weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``routing.recv_weight`` as ``[W * M, K]``; token-major with ``topk_weights`` requiring grad, differentiable
    w.r.t. them (the backward returns each entry's gradient to its assignment: ``return_entry_values``)."""
    if backend.token_major and torch.is_grad_enabled() and topk_weights.requires_grad:
        return _ReceivedWeights.apply(topk_weights, backend, routing)
    return routing.recv_weight.view(backend.num_slab_rows, -1)


def combine_with_grad(
    backend: Backend, y: torch.Tensor, topk_weights: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """``backend.combine`` recorded on the autograd tape: differentiable w.r.t. ``y`` and ``topk_weights``
    (token-major: w.r.t. the reduced rows ``y [W * M, H]`` only; the weights were applied by unpermute)."""
    if backend.token_major:
        return _CombineReduced.apply(y, backend, routing)
    return _Combine.apply(y, topk_weights, backend, routing)


class _CombineReduced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, backend: Backend, routing: Routing):
        ctx.backend = backend
        ctx.routing = routing
        return backend.combine(y, routing, weighted=True)

    @staticmethod
    def backward(ctx, grad_z):
        return ctx.backend.redispatch(kernel_rows(grad_z), ctx.routing), None, None


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, backend: Backend, routing: Routing, expert_offsets, tokens_per_expert):
        ctx.backend = backend
        ctx.routing = routing
        return backend.permute(rows, routing, expert_offsets, tokens_per_expert)

    @staticmethod
    def backward(ctx, grad_rows):
        return ctx.backend.unpermute(kernel_rows(grad_rows), ctx.routing, None), None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, backend: Backend, routing: Routing, expert_offsets, tokens_per_expert):
        ctx.backend = backend
        ctx.routing = routing
        ctx.segments = (expert_offsets, tokens_per_expert)
        ctx.save_for_backward(y, weights)
        return backend.unpermute(y, routing, weights)

    @staticmethod
    def backward(ctx, grad_partials):
        y, weights = ctx.saved_tensors
        backend, routing = ctx.backend, ctx.routing
        grad_y, grad_weights = unpermute_backward(
            grad_partials, y, weights, routing.recv_pos,
            permute=lambda rows: backend.permute(kernel_rows(rows), routing, *ctx.segments),
        )
        return grad_y, grad_weights, None, None, None, None


def unpermute_backward(grad_partials: torch.Tensor, y: torch.Tensor, weights: Optional[torch.Tensor],
                       recv_pos: torch.Tensor,
                       permute: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gradients of an unpermute, for the eager path and the custom ops alike.

    Args:
        grad_partials: ``[W * M, H]`` gradient of the reduced rows. y: ``[capacity_rows, H]`` the expert rows.
        weights: ``[W * M, K]`` float32 the entries' weights, None for an unweighted unpermute.
        recv_pos: ``[W, M, K]`` int32. permute: lays ``[W * M, H]`` rows out expert-major ``[capacity_rows, H]``
            (padding rows need not be zero: they are masked).

    Returns:
        ``grad_y [capacity_rows, H]`` (y's dtype) and ``grad_weights [W * M, K]`` float32 (None unweighted).
    """
    spread = permute(grad_partials)
    entry_weights = torch.ones(recv_pos.shape, device=y.device) if weights is None else weights.view(recv_pos.shape)
    grad_y, row_dot = expert_row_grads(spread, y, recv_pos, entry_weights)
    if weights is None:
        return grad_y, None
    return grad_y, scatter_entry_values(row_dot, recv_pos).view(weights.shape)


def permute_with_grad(backend: Backend, rows: torch.Tensor, routing: Routing, expert_offsets: torch.Tensor,
                      tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``backend.permute`` recorded on the autograd tape (its backward: an unweighted unpermute)."""
    return _Permute.apply(rows, backend, routing, expert_offsets, tokens_per_expert)


def unpermute_with_grad(backend: Backend, y: torch.Tensor, weights: Optional[torch.Tensor], routing: Routing,
                        expert_offsets: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``backend.unpermute`` recorded on the autograd tape: differentiable w.r.t. ``y`` and ``weights [W * M, K]``
    (None: unweighted)."""
    return _Unpermute.apply(y, weights, backend, routing, expert_offsets, tokens_per_expert)


def straight_through_rows(backend: Backend, x: torch.Tensor, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``rows`` recorded on the autograd tape as if they were ``x`` dispatched along ``routing``.

    Args:
        x: ``[T, H]`` the config-dtype tokens an FP8 dispatch quantized. rows: ``[capacity_rows, H]``
            its output dequantized to the config dtype (computed without autograd).

    Returns:
        ``rows``, differentiable with respect to ``x``: the backward is an unweighted combine.
    """
    return _StraightThrough.apply(x, rows, backend, routing)
