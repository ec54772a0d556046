"""FP8 rows with block scales: the format the peers dispatch in, and its reference quantizer.

A row of ``H`` channels (``H`` a multiple of 128) becomes ``H`` float8 e4m3 values and ``H / 128``
float32 scales, one per block of 128 consecutive channels (DeepEP's ``(x_fp8 [T, H], scales
[T, H / 128])``): ``x ~= float(x_fp8) * scale`` channel by channel. For each block:

* ``amax = max |x|`` over its 128 channels, in float32, at least ``MIN_AMAX`` (so an all-zero block
  gets a tiny positive scale and quantizes to zeros);
* ``scale = amax * float32(1 / 448)`` (448: the largest e4m3 value; a multiply, so that every
  device rounds it alike), or with ``round_scale`` the smallest power of two at least that (UE8M0
  scales, as DeepEP's ``round_scale``: exact to apply, a little range lost);
* ``x_fp8 = e4m3(clamp(x * (1 / scale), -448, 448))``, rounded to nearest even: a multiply by the
  block's reciprocal, rounded once to float32, as the peers quantize (DeepEP multiplies by
  ``448 / amax``); the clamp only catches the last-bit rounding above 448 of the block's largest
  value. Reciprocal and product are IEEE operations, which round alike on the CPU and on CUDA
  GPUs, and a kernel needs one division per block instead of one per value.

FP8 dispatch moves each row as one packed row of bytes (:func:`pack`): the ``H`` e4m3 bytes, the
``H / 128`` float32 scales, zeros up to a multiple of 64 bytes; its output rows are unpacked as
views (:func:`unpack`), so ``out.x`` and ``out.x_scales`` share one allocation (row stride
:func:`packed_row_bytes`, not contiguous).

Non-finite inputs are not hidden: a block holding a NaN or an inf gets a non-finite scale, and
:func:`dequantize` gives NaN for the whole block. Nothing reads the device on the host, so both
functions run in CUDA graphs and under torch.compile.
"""

from __future__ import annotations

import torch

from .errors import InputError

__all__ = ["FP8_DTYPE", "FP8_MAX", "BLOCK", "MIN_AMAX", "quantize", "dequantize", "packed_row_bytes", "pack",
           "unpack"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
MIN_AMAX = 1e-4  # as DeepEP's per-token cast: a zero block still gets a positive scale

_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_rows(name: str, tensor, dtypes: tuple) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InputError(f"{name}: expected a 2-d tensor [T, H], got {got}")
    if tensor.dtype not in dtypes:
        raise InputError(f"{name}: expected dtype {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                         f"got {str(tensor.dtype).removeprefix('torch.')}")
    if tensor.shape[1] % BLOCK:
        raise InputError(f"{name}: hidden (dim 1) must be a multiple of {BLOCK} (one scale per {BLOCK} channels), "
                         f"got {tensor.shape[1]}")


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` (bf16, fp16 or fp32; ``H`` a multiple of 128) -> ``(x_fp8 [T, H] e4m3, scales [T, H/128] f32)``.

    The reference quantizer (see the module docstring for the math); on ``x``'s device.

    Raises:
        InputError: ``x`` is not 2-d, not of those dtypes, or ``H`` is not a multiple of 128.
    """
    _check_rows("quantize x", x, _SOURCE_DTYPES)
    tokens, hidden = x.shape
    blocks = x.float().reshape(tokens, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(MIN_AMAX)  # amax and clamp_min keep a block's NaN
    # A multiply by the float32 reciprocal, not a division: CUDA divides a tensor by a scalar that
    # way, and the CPU and GPU must give the same scales (and a kernel can do the same). The
    # scalar is rounded to float32 on both (no tensor is made: the call stays graph-capturable).
    scales = amax * (1.0 / FP8_MAX)
    if round_scale:
        scales = torch.exp2(torch.ceil(torch.log2(scales)))
    values = (blocks * torch.reciprocal(scales)[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return values.to(FP8_DTYPE).reshape(tokens, hidden), scales


def dequantize(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x_fp8 [T, H]`` e4m3 and ``scales [T, H/128]`` float32 -> ``[T, H]`` in ``dtype`` (``float(x_fp8) * scale``).

    Raises:
        InputError: the shapes or dtypes do not match the format.
    """
    _check_rows("dequantize x_fp8", x_fp8, (FP8_DTYPE,))
    tokens, hidden = x_fp8.shape
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or \
            tuple(scales.shape) != (tokens, hidden // BLOCK):
        got = f"{tuple(scales.shape)} {scales.dtype}" if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise InputError(f"dequantize scales: expected float32 [{tokens}, {hidden // BLOCK}] (one per {BLOCK} "
                         f"channels of x_fp8 [{tokens}, {hidden}]), got {got}")
    blocks = x_fp8.float().reshape(tokens, hidden // BLOCK, BLOCK) * scales[:, :, None]
    return blocks.reshape(tokens, hidden).to(dtype)


def _scale_bytes(hidden: int) -> int:
    """Bytes of a row's float32 scales, one per block."""
    return 4 * (hidden // BLOCK)


def packed_row_bytes(hidden: int) -> int:
    """Bytes of one packed row: ``hidden`` e4m3 values, ``hidden / 128`` float32 scales, zeros to a multiple of 64.

    NOTE: rows that start on 64-byte boundaries: at H=7168 (7424 bytes against 7392 when padded
    to 16) FP8 dispatch at T=4096 took 142.8 / 141.9 us against 144.8 / 144.6 on one H100 (two
    runs each, world 1); at H=2048 (2112 bytes either way) padding to 128 instead cost 4%.
    """
    return -(-(hidden + _scale_bytes(hidden)) // 64) * 64


def pack(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x_fp8 [T, H]`` e4m3 and ``scales [T, H/128]`` float32 -> ``[T, packed_row_bytes(H)]`` uint8 rows."""
    tokens, hidden = x_fp8.shape
    packed = torch.empty((tokens, packed_row_bytes(hidden)), dtype=torch.uint8, device=x_fp8.device)
    scale_end = hidden + _scale_bytes(hidden)
    packed[:, :hidden] = x_fp8.view(torch.uint8)
    # Flattened first: a [T, 1] tensor may carry a stride of 0 in its unit dimension, which .contiguous() keeps
    # and a byte view refuses (H = 128).
    packed[:, hidden:scale_end] = scales.reshape(-1).view(torch.uint8).view(tokens, scale_end - hidden)
    packed[:, scale_end:] = 0
    return packed


def unpack(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of packed rows ``[N, packed_row_bytes(hidden)]`` uint8: ``(x_fp8 [N, H] e4m3, scales [N, H/128] f32)``.

    NOTE: dtype views, then ``as_strided`` and ``narrow``, not indexing: every FP8 dispatch makes
    these views, eager calls at decode sizes are host-bound, and on an H100 machine this took
    ~11.8 us against 12.8-19.7 with ``packed[:, a:b]`` (``as_strided`` for the scales too, ~10.6,
    needs ``storage_offset()``, which torch.compile cannot trace).
    """
    x_fp8 = packed.view(FP8_DTYPE).as_strided((packed.shape[0], hidden), (packed.stride(0), 1))
    return x_fp8, packed.view(torch.float32).narrow(1, hidden // 4, hidden // BLOCK)
