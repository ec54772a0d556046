"""The expert math of :class:`moe_comm.MoELayer`: SwiGLU experts applied to dispatch's expert-major rows.

Every local expert ``j`` runs on its segment ``[expert_offsets[j - 1], expert_offsets[j])`` of
the rows, in one of three ways (the config's ``experts`` key, :func:`resolve_expert_impl`):
:func:`grouped_experts` (``torch._grouped_mm``, offsets read on the device),
:func:`masked_experts` (a per-expert loop with static shapes, graph-capturable on any GPU) or
:func:`sliced_experts` (a per-expert loop on exact slices, on CPU, where reading the offsets
costs no sync).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F

from ..config import Config
from ..errors import ConfigError

__all__ = [
    "swiglu",
    "expert_of_rows",
    "grouped_mm_unsupported",
    "resolve_expert_impl",
    "grouped_experts",
    "masked_experts",
    "sliced_experts",
    "shared_expert",
    "check_padding_for_gradients",
]


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``(silu(x @ W_gate) * (x @ W_up)) @ W_down``.

    Args:
        x: ``[N, H]``. w_gate_up: ``[H, 2F]``, gate columns first, then up. w_down: ``[F, H]``.

    Returns:
        ``[N, H]`` in the dtype of the operands.
    """
    gate, up = (x @ w_gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w_down


def expert_of_rows(expert_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The local expert whose segment holds each row: ``[num_rows, 1]`` in the offsets' dtype.

    Args:
        expert_offsets: ``[E_local]`` int32 cumulative segment ends, on the rows' device.
        num_rows: rows of the dispatch output (``capacity_rows``).

    Returns:
        ``E_local`` for rows past the last segment; computed on the device (graph-capturable).
    """
    row_index = torch.arange(num_rows, dtype=expert_offsets.dtype, device=expert_offsets.device)
    return torch.searchsorted(expert_offsets, row_index, right=True)[:, None]


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
    """The expert implementation the config's ``expert_impl`` key picks on ``device``: ``grouped_mm`` or ``loop``.

    Raises:
        ConfigError: ``expert_impl: grouped_mm`` where :func:`grouped_mm_unsupported` gives a reason.
    """
    reason = grouped_mm_unsupported(device, config.torch_dtype, ffn_hidden)
    if config.expert_impl == "auto":
        return "loop" if reason else "grouped_mm"
    if config.expert_impl == "grouped_mm" and reason:
        raise ConfigError(
            f"config key 'expert_impl': got 'grouped_mm', but {reason}; torch._grouped_mm runs without a host sync "
            "(graph-capturable) only with bfloat16 on CUDA GPUs of compute capability 9.x or 10.x. "
            "Use expert_impl: loop (or auto, which picks grouped_mm where it can)"
        )
    return config.expert_impl


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
    num_experts = w_gate_up.shape[0]
    expert_of_row = expert_of_rows(expert_offsets, rows.shape[0])
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


def shared_expert(tokens: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The shared experts (one always-on SwiGLU MLP) on every local token.

    Args:
        tokens: ``[T, H]``. w_gate_up: ``[H, 2S]``. w_down: ``[S, H]``. One device, one dtype.

    Returns:
        ``[T, H]`` in the tokens' dtype. On CPU computed in float32 and rounded once, as
        :func:`sliced_experts` does (16-bit CPU GEMMs are slow); on a GPU in the tokens' dtype.
    """
    if tokens.device.type == "cpu":
        return swiglu(tokens.float(), w_gate_up.float(), w_down.float()).to(tokens.dtype)
    return swiglu(tokens, w_gate_up, w_down)


def check_padding_for_gradients(config: Config, weights: Iterable[torch.Tensor], where: str) -> None:
    """Refuse to build the experts' weight gradients over padding rows that dispatch leaves unwritten.

    With ``zero_padding: false`` a segment's padding rows keep stale bytes, possibly NaN; an
    expert's weight gradient sums ``rows^T @ grad`` over its whole segment, and a NaN row times its
    zero gradient row is NaN. Forward passes and input gradients never mix rows, so only the
    weights' gradients are at risk.

    Args:
        config: the dispatcher's. weights: the experts' weights. where: the caller, for the message.

    Raises:
        ConfigError: ``zero_padding`` is off while autograd records and a weight requires grad.
    """
    if config.zero_padding or not torch.is_grad_enabled() or not any(w.requires_grad for w in weights):
        return
    raise ConfigError(
        f"{where}: config key 'zero_padding' is false, so dispatch leaves the experts' padding rows unwritten "
        "(stale bytes, possibly NaN) and the experts' weight gradients would multiply them; set zero_padding: "
        "true to train, or run inference under torch.no_grad() or torch.inference_mode()"
    )
