"""The FP8 row format (``moe_comm.fp8``'s docstring) written out independently, for the tests to compare with.

Nothing here calls moe_comm or torch's float8 conversion: e4m3 values come from their bit layout,
rounding to nearest even is done by hand, and every float32 operation is computed exactly in
float64 and rounded to float32 once (for ``*`` and ``/`` of float32 operands float64 holds the
exact product, and a quotient rounded to 53 bits then to 24 rounds as the float32 division would:
53 >= 2 * 24 + 2). So a quantizer that divides by 448 instead of multiplying by ``float32(1/448)``,
or that rounds its values another way, gives other bits than these.
"""

from __future__ import annotations

import torch

__all__ = ["E4M3_VALUES", "quantize", "dequantize"]

BLOCK = 128
FP8_MAX = 448.0
MIN_AMAX = 1e-4


def _e4m3_values() -> torch.Tensor:
    """float64 ``[127]``: the value of each non-negative finite e4m3fn code 0..126 (127 is NaN)."""
    values = []
    for code in range(127):
        exponent, mantissa = code >> 3, code & 7
        if exponent == 0:  # subnormal
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return torch.tensor(values, dtype=torch.float64)


E4M3_VALUES = _e4m3_values()


def _to_float32(exact: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, rounded to nearest even once."""
    return exact.to(torch.float32)


def _encode_e4m3(values: torch.Tensor) -> torch.Tensor:
    """float32 values within [-448, 448] -> uint8 e4m3fn codes, rounded to nearest, ties to the even code."""
    magnitude = values.double().abs().reshape(-1)
    above = torch.searchsorted(E4M3_VALUES, magnitude).clamp(max=len(E4M3_VALUES) - 1)
    below = (above - 1).clamp(min=0)
    to_above, to_below = E4M3_VALUES[above] - magnitude, magnitude - E4M3_VALUES[below]
    tie_goes_up = (to_above == to_below) & (above % 2 == 0)
    code = torch.where((to_above < to_below) | tie_goes_up | (to_above == 0), above, below)
    sign = torch.signbit(values.reshape(-1)).to(torch.int64) << 7
    return (code | sign).to(torch.uint8).reshape(values.shape)


def quantize(x: torch.Tensor, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` (finite; bf16, fp16 or fp32) -> ``(codes [T, H] uint8, scales [T, H / 128] float32)``.

    ``codes`` are the e4m3fn bytes (compare with ``x_fp8.view(torch.uint8)``).
    """
    tokens, hidden = x.shape
    blocks = x.float().reshape(tokens, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(MIN_AMAX).double()  # a max is exact in any precision
    inverse_448 = _to_float32(torch.tensor(1 / FP8_MAX, dtype=torch.float64)).double()
    scales = _to_float32(amax * inverse_448)
    if round_scale:
        mantissa, exponent = torch.frexp(scales.double())  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        scales = _to_float32(torch.where(mantissa == 0.5, scales.double(), torch.ldexp(torch.ones_like(mantissa),
                                                                                         exponent)))
    reciprocal = _to_float32(1.0 / scales.double()).double()
    values = _to_float32(blocks.double() * reciprocal[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return _encode_e4m3(values).reshape(tokens, hidden), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes [T, H]`` uint8 e4m3fn bytes (no NaN code) and ``scales [T, H / 128]`` float32 -> ``[T, H]`` in ``dtype``.

    ``float32(value * scale)``, then rounded to ``dtype``.
    """
    tokens, hidden = codes.shape
    magnitude = E4M3_VALUES[(codes & 0x7F).long()]
    signed = torch.where((codes & 0x80) != 0, -magnitude, magnitude)
    exact = signed.reshape(tokens, hidden // BLOCK, BLOCK) * scales.double()[:, :, None]
    return _to_float32(exact).reshape(tokens, hidden).to(dtype)
