"""The experts' side of a dispatch in either receive layout (the config's ``receive_layout``).

Experts always read expert-major rows and write their outputs in the same rows; what differs is how
those rows come from a dispatch output and how combine takes the outputs back:

* ``expert_major``: dispatch's rows are already expert-major, and combine takes the experts' rows.
* ``token_major``: :meth:`Dispatcher.permute` lays dispatch's rows out expert-major, and
  :meth:`Dispatcher.unpermute` reduces the experts' rows to the **reduced rows** combine takes (one
  per arrived token, the router weights applied). Both are local work on the caller's stream with
  every SM (``sm_budget`` bounds only dispatch's and combine's kernels).

``MoELayer``, the transformers integration, the torchtitan dispatcher and ``moe-comm bench`` all go
through these two functions, so a step reads the same in both layouts::

    out = disp.dispatch(x, topk_idx, topk_weights)
    rows = expert_rows(disp, out)
    y = experts(disp.dequantize(rows), rows.expert_offsets)
    z = disp.combine(combine_rows(disp, y, out), out.handle)

and gives the same bits in both.
"""

from __future__ import annotations

from typing import Union

import torch

from ..dispatcher import Dispatcher
from ..outputs import DispatchOutput, TokenMajorOutput

__all__ = ["expert_rows", "combine_rows"]


def expert_rows(dispatcher: Dispatcher, out: Union[DispatchOutput, TokenMajorOutput]) -> DispatchOutput:
    """The expert-major rows the experts read: ``out`` itself, or with a token-major config ``dispatcher.permute(out)``.

    Args:
        dispatcher: the Dispatcher that dispatched ``out`` (its config's ``receive_layout`` decides).
        out: its dispatch output.

    Returns:
        A :class:`DispatchOutput` (``x [capacity_rows, H]`` on the dispatcher's device; FP8 dispatch: e4m3
        with ``x_scales``, for :meth:`Dispatcher.dequantize`), differentiable as dispatch's ``x`` is.
    """
    return dispatcher.permute(out) if dispatcher.config.token_major else out


def combine_rows(dispatcher: Dispatcher, y: torch.Tensor, out: Union[DispatchOutput, TokenMajorOutput]) -> torch.Tensor:
    """The rows :meth:`Dispatcher.combine` takes for the experts' outputs ``y``: ``y`` itself, or with a
    token-major config ``dispatcher.unpermute(y, out)`` (the reduced rows, router weights applied).

    Args:
        dispatcher: the Dispatcher that dispatched ``out``.
        y: ``[capacity_rows, H]`` the experts' outputs in :func:`expert_rows`' layout, config dtype, contiguous.
        out: the dispatch output ``y`` was computed from.

    Returns:
        ``[capacity_rows, H]`` (expert-major) or ``[W * M, H]`` (token-major), config dtype, on the
        dispatcher's device; differentiable with respect to ``y`` (token-major also to ``out.topk_weights``).
    """
    return dispatcher.unpermute(y, out) if dispatcher.config.token_major else y
