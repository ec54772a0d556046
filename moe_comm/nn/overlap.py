"""Leave SMs to the communication: torch's matmuls on all but ``num_sms`` SMs while compute overlaps it.

With ``sm_budget`` set, dispatch and combine run on that many SMs; a GEMM issued beside them on
another stream must leave those SMs free, or its blocks (which fill whole SMs, as ours do) keep
the communication waiting until the GEMM ends. torch's default cuBLAS path for plain matmuls does
not honour torch's SM carveout; its cuBLASLt path does. Measured on one H200 (world 1, T=4096,
H=7168, top-8 of 256, bf16 GEMM 8192^3 beside dispatch+combine at ``sm_budget: 24``,
``benchmarks/results/1xH200-sm-budget-1efce04.md``): without a carveout 25-29% of the
communication was hidden; with cuBLASLt and a carveout of 24 SMs both took 1802 us against
1012 + 1425 us one after the other on the whole device (the GEMM alone on the 108 SMs it is
left: 1739 us), 63% of the communication hidden (94% against that same GEMM run after it).

The budget bounds only dispatch's and combine's kernels. The token-major layout's
``Dispatcher.permute`` and ``Dispatcher.unpermute`` are local kernels with every SM: compute-stream
work like the experts' GEMMs. The guide's recipe (``docs/guide.md``, "Sharing the GPU") runs dispatch
and combine on a communication stream and the permute, the experts and the unpermute on the compute
stream between a wait for dispatch and one before combine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..errors import InputError

__all__ = ["gemm_sm_carveout"]


@contextlib.contextmanager
def gemm_sm_carveout(num_sms: int) -> Iterator[None]:
    """Within the block, torch's matmuls leave ``num_sms`` SMs free (cuBLASLt with an SM carveout).

    Process-wide while it lasts (every matmul of every stream, eager or captured: a CUDA graph
    captured inside keeps the carveout), restored on exit. Pass the config's ``sm_budget``. It changes
    only cuBLAS's matmuls: moe_comm's own kernels (the token-major permute and unpermute too) keep their
    grids. Both torch settings it uses are experimental in torch (``preferred_blas_library``,
    ``_set_sm_carveout_experimental``).

    Raises:
        InputError: ``num_sms`` is not a positive int, or this torch has no SM carveout.
    """
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise InputError(f"gemm_sm_carveout num_sms: expected a positive int (the config's sm_budget), got {num_sms!r}")
    set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if set_carveout is None:
        raise InputError(f"gemm_sm_carveout: torch {torch.__version__} has no SM carveout for matmuls "
                         "(torch._C._set_sm_carveout_experimental); a GEMM will take every SM")
    previous_carveout = torch._C._get_sm_carveout_experimental()
    previous_library = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except RuntimeError as exc:  # a CPU build of torch has no cuBLASLt
        raise InputError(f"gemm_sm_carveout: torch {torch.__version__} cannot use cuBLASLt ({exc})") from None
    set_carveout(num_sms)
    try:
        yield
    finally:
        set_carveout(previous_carveout)
        torch.backends.cuda.preferred_blas_library(previous_library)
