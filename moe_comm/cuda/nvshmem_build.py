"""What kernels that call NVSHMEM's device API need: headers for NVRTC, and module set-up.

The put transport (``nvshmem.transport: put``) compiles ``csrc/*.cu`` with ``PUT_TRANSPORT=1``:
``csrc/transport.cuh`` then includes NVSHMEM's device headers, header-only (every device
function inlined), so no NVSHMEM device library is linked. NVRTC needs three include directories: NVSHMEM's
(the ``nvidia-nvshmem-cu13`` wheel torch uses), CCCL's (``cuda/std`` type traits; the
``nvidia-cuda-cccl`` wheel or a CUDA toolkit) and the CUDA runtime headers NVSHMEM's headers
include (the ``nvidia-cuda-runtime`` wheel or a CUDA toolkit); ``cuda.pathfinder`` finds each.

A module built that way holds NVSHMEM's device state as a module global: it must be initialised
from the host after every load, which torch exposes as ``_nvshmemx_cumodule_init`` once torch's
NVSHMEM is up (the first NVSHMEM symmetric allocation has been made).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BackendError
from .jit import Toolchain

__all__ = ["HEADER_PACKAGES", "toolchain"]

# cuda.pathfinder name -> what to install when it is missing.
HEADER_PACKAGES = {
    "nvshmem": "nvidia-nvshmem-cu13",
    "cccl": "nvidia-cuda-cccl",
    "cudart": "nvidia-cuda-runtime",
}

_VERSION_HEADER = Path("non_abi") / "nvshmem_version.h"


def _header_dirs() -> dict[str, str]:
    try:
        import cuda.pathfinder as pathfinder
    except ImportError as exc:
        raise BackendError(f"the NVSHMEM put transport needs cuda-pathfinder to find its headers: {exc}") from None
    found, missing = {}, []
    for name, package in HEADER_PACKAGES.items():
        directory = pathfinder.find_nvidia_header_directory(name)
        if directory is None:
            missing.append(f"{name} (pip install {package})")
        else:
            found[name] = directory
    if missing:
        raise BackendError(
            "the NVSHMEM put transport compiles its kernels against NVSHMEM's device headers, and these header "
            f"directories were not found: {', '.join(missing)}; install them or use nvshmem.transport 'p2p'"
        )
    return found


def _init_module(module: Any) -> None:
    import torch

    init = getattr(torch._C._distributed_c10d, "_nvshmemx_cumodule_init", None)
    if init is None:
        raise BackendError(
            "this torch build cannot initialise NVSHMEM in a run-time compiled module "
            "(torch._C._distributed_c10d._nvshmemx_cumodule_init is missing); use nvshmem.transport 'p2p'"
        )
    init(int(module))


def toolchain() -> Toolchain:
    """The :class:`moe_comm.cuda.jit.Toolchain` of put-transport kernels.

    Raises:
        BackendError: a header directory is missing (the message names the wheel to install).
    """
    dirs = _header_dirs()
    version_file = Path(dirs["nvshmem"]) / _VERSION_HEADER
    identity = version_file.read_text(encoding="utf-8") if version_file.exists() else dirs["nvshmem"]
    # -default-device: NVSHMEM's headers leave some device-only helpers unannotated.
    options = (*(f"-I{dirs[name]}" for name in HEADER_PACKAGES), "-default-device")
    return Toolchain(options=options, identity=identity, module_init=_init_module)
