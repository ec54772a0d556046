"""Tiny CUDA sources that the compile and driver tests build (their defines are the tests' own)."""

from __future__ import annotations

__all__ = ["TOY_SOURCE", "SHARED_SOURCE"]

# Writes `value` into x[i] for i < n; VALUE comes from the defines.
TOY_SOURCE = r"""
extern "C" __global__ void fill_value(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = VALUE;
}
"""

# Copies n floats through dynamic shared memory of `extern` size (used past the 48 KiB default).
SHARED_SOURCE = r"""
extern "C" __global__ void through_shared(const float* src, float* dst, int n) {
    extern __shared__ float stage[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) stage[i] = src[i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = stage[n - 1 - i];
}
"""
