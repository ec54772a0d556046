"""How each backend of :data:`moe_comm.backend_table.ENTRIES` is built: one builder per entry id.

The table (names, transports, memory, reach) is core data the config reads; the builders are here,
a floor up, beside the backends they build. A builder imports what it builds when it runs, so a
CPU-only install never loads the GPU stack.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from ..backend_table import BackendEntry
from ..errors import BackendError

if TYPE_CHECKING:
    import torch

    from ..config import Config
    from .base import Backend

__all__ = ["BUILDERS", "build"]


def _build_collective(name: str, config: "Config", group, device: "torch.device") -> "Backend":
    from .collective import CollectiveBackend

    return CollectiveBackend(config, group, device, name)


def _build_vmm(config: "Config", group, device: "torch.device") -> "Backend":
    from ..symm.vmm import VmmSymmetricMemory
    from .device import DeviceBackend

    factory = functools.partial(VmmSymmetricMemory, fd_passing=config.vmm.fd_passing)
    return DeviceBackend(config, group, device, factory, "vmm")


def _build_nvshmem(config: "Config", group, device: "torch.device") -> "Backend":
    import torch.distributed as dist

    from ..symm.torch_symm import TorchSymmetricMemory
    from .device import DeviceBackend

    # One rank has no peer to put to: its buffer is local (TorchSymmetricMemory) and stores reach it.
    put = config.nvshmem.transport == "put" and dist.get_world_size(group) > 1
    factory = functools.partial(
        TorchSymmetricMemory, provider="NVSHMEM", put_transport=put, heap_size_mb=config.nvshmem.heap_size_mb,
    )
    return DeviceBackend(config, group, device, factory, "nvshmem", put_transport=put)


def _build_nccl_symmetric(config: "Config", group, device: "torch.device") -> "Backend":
    from ..symm.torch_symm import TorchSymmetricMemory
    from .device import DeviceBackend

    factory = functools.partial(TorchSymmetricMemory, provider="NCCL")
    return DeviceBackend(config, group, device, factory, "nccl")


# Keyed by BackendEntry.id; tests/test_backend_choice.py checks that every entry has one.
BUILDERS: dict[str, Callable[["Config", object, "torch.device"], "Backend"]] = {
    "vmm": _build_vmm,
    "nvshmem-p2p": _build_nvshmem,
    "nvshmem-put": _build_nvshmem,
    "nccl-symmetric": _build_nccl_symmetric,
    "nccl-collective": functools.partial(_build_collective, "nccl"),
    "reference": functools.partial(_build_collective, "reference"),
}


def build(entry: BackendEntry, config: "Config", group, device: "torch.device") -> "Backend":
    """Build ``entry``'s backend for ``group`` on ``device``.

    Raises:
        BackendError: it needs CUDA and ``device`` is not a GPU.
    """
    if entry.needs_cuda and device.type != "cuda":
        raise BackendError(
            f"backend {entry.backend!r} needs CUDA GPUs; this process has none (use 'reference' on CPU)"
        )
    return BUILDERS[entry.id](config, group, device)
