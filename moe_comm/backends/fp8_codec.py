"""FP8 rows on one backend's device: packing them and dequantizing them, by kernels or the torch reference.

The backend owns FP8 dispatch (:meth:`moe_comm.backends.base.Backend.dispatch_fp8`): its dispatch
kernels quantize config-dtype rows as they send them where they can; otherwise it packs them first
with this codec: the one-pass kernels of ``csrc/fp8.cu`` (:class:`moe_comm.cuda.kernels.Fp8PackKernels`)
on GPUs of compute capability 8.9 or newer, the torch reference (:mod:`moe_comm.fp8`) elsewhere
and for power-of-two scales. Every way gives the same bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import fp8
from ..config import Config

__all__ = ["Fp8Codec"]


class Fp8Codec:
    """FP8 rows on ``device``: packs and dequantizes them.

    Args:
        config: a config with ``dispatch_dtype`` set (its dtype, hidden size and ``dispatch_round_scale``).
        device: the backend's device.
    """

    def __init__(self, config: Config, device: torch.device) -> None:
        self._dtype = config.torch_dtype
        self._hidden = config.hidden
        self._round_scale = config.dispatch_round_scale
        self._kernels = None
        if device.type == "cuda":
            from ..cuda.kernels import FP8_KERNELS_MIN_ARCH, Fp8PackKernels

            if torch.cuda.get_device_capability(device) >= FP8_KERNELS_MIN_ARCH:
                self._kernels = Fp8PackKernels(device, self._dtype, self._hidden)

    @property
    def has_kernels(self) -> bool:
        """Whether this device runs the FP8 kernels (compute capability 8.9 or newer): the packing
        kernels here, and the dispatch kernels' quantizing path."""
        return self._kernels is not None

    @torch.no_grad()
    def pack(self, x: torch.Tensor, x_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Packed rows ``[T, packed_row_bytes(H)]`` uint8 of config-dtype ``x [T, H]`` (quantized), or of
        the pair ``x [T, H]`` e4m3 and ``x_scales [T, H/128]`` float32; one pass on a GPU. Records no
        autograd graph (bytes carry no gradient; ``Dispatcher.dequantize`` gives the rows theirs)."""
        kernels = self._kernels
        if x_scales is not None:
            return kernels.pack_pairs(x, x_scales) if kernels is not None else fp8.pack(x, x_scales)
        if kernels is not None and not self._round_scale:
            return kernels.quantize_pack(x)
        return fp8.pack(*fp8.quantize(x, round_scale=self._round_scale))

    def dequantize(self, x_fp8: torch.Tensor, x_scales: torch.Tensor,
                   end: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, H]`` in the config dtype: ``float(x_fp8) * x_scales`` per 128 channels (:func:`fp8.dequantize`).

        One pass on a GPU when the two are the views :func:`fp8.unpack` makes of one allocation
        of packed rows (a dispatch output's); the torch reference otherwise. ``end``: a dispatch
        output's ``expert_offsets[-1:]`` (int32, on the device): the rows at or past it, which
        such an output leaves unspecified, may be left so (the kernel neither reads nor writes them).
        """
        if self._kernels is not None and self._is_packed(x_fp8, x_scales):
            return self._kernels.dequantize_rows(x_fp8, end)
        return fp8.dequantize(x_fp8, x_scales, self._dtype)

    def _is_packed(self, x_fp8: torch.Tensor, x_scales: torch.Tensor) -> bool:
        row_bytes = fp8.packed_row_bytes(self._hidden)
        return (x_fp8.stride() == (row_bytes, 1) and x_scales.stride() == (row_bytes // 4, 1)
                and x_scales.data_ptr() == x_fp8.data_ptr() + self._hidden)
