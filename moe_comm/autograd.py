"""Autograd for dispatch and combine, written once over the ``Backend`` primitives.

* dispatch backward: the gradient of every expert-major row goes back to its token and is
  summed there: an unweighted combine.
* combine backward: ``dz[t]`` is sent along the same routing (``redispatch``); on the
  destination ``grad_y[row] = w * dz`` and ``grad_w[t, k] = <dz[t], y[row]>``, and the latter
  is returned to the source (``return_entry_values``).
* FP8 dispatch: the quantization is taken as the identity for gradients (straight through, as
  FP8 training recipes do), so the dequantized rows' backward is dispatch's: an unweighted
  combine in the config dtype; gradients are never quantized.

Every rank must run the same backward calls in the same order (they are collective), so
the backward functions always make all their exchanges, whichever inputs need gradients.
"""

from __future__ import annotations

from typing import Callable

import torch

from .routing import Routing, row_values
from .backends.base import Backend, DispatchResult

__all__ = ["dispatch_with_grad", "combine_with_grad", "combine_backward", "straight_through_rows"]


def kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as the backends' kernels take them: contiguous and starting on a 16-byte boundary
    (what the Dispatcher asks of its users' rows; a gradient torch hands over, or a tensor a
    compiled graph hands a custom op, may be a view of either kind). A copy only when needed."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


def _rows_grad_to_tokens(backend: Backend, grad_rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Dispatch's backward: the rows' gradients back to their tokens, summed there (an unweighted combine)."""
    return backend.combine(kernel_rows(grad_rows), routing, weighted=False)


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
        return _rows_grad_to_tokens(ctx.backend, grad_rows, ctx.routing), None, None, None, None


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
    spread = redispatch(grad_z.contiguous()).float()
    rows = y.shape[0]
    row_weight = row_values(routing.recv_pos, routing.recv_weight, rows)
    row_used = row_values(routing.recv_pos, torch.ones_like(routing.recv_weight), rows) > 0
    # Rows no entry maps to (padding, and rows past the last segment) get an exact zero,
    # so whatever they held cannot leak a NaN into the experts' weight gradients.
    grad_y = torch.where(row_used[:, None], spread * row_weight[:, None], torch.zeros_like(spread)).to(y.dtype)
    row_dot = torch.where(row_used, (spread * y.float()).sum(dim=1), torch.zeros_like(row_weight))
    return grad_y, return_entry_values(row_dot)


def dispatch_with_grad(
    backend: Backend, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> DispatchResult:
    """``backend.dispatch`` recorded on the autograd tape: ``out.x`` is differentiable w.r.t. ``x``."""
    results: list[DispatchResult] = []
    rows, offsets, counts = _Dispatch.apply(x, backend, topk_idx, topk_weights, results)
    return DispatchResult(rows, offsets, counts, results[0].routing)


def combine_with_grad(
    backend: Backend, y: torch.Tensor, topk_weights: torch.Tensor, routing: Routing
) -> torch.Tensor:
    """``backend.combine`` recorded on the autograd tape: differentiable w.r.t. ``y`` and ``topk_weights``."""
    return _Combine.apply(y, topk_weights, backend, routing)


def straight_through_rows(backend: Backend, x: torch.Tensor, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``rows`` recorded on the autograd tape as if they were ``x`` dispatched along ``routing``.

    Args:
        x: ``[T, H]`` the config-dtype tokens an FP8 dispatch quantized. rows: ``[capacity_rows, H]``
            its output dequantized to the config dtype (computed without autograd).

    Returns:
        ``rows``, differentiable with respect to ``x``: the backward is an unweighted combine.
    """
    return _StraightThrough.apply(x, rows, backend, routing)
