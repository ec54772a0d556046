"""Backends: how symmetric memory is shared and how bytes move. The routing math is in ``moe_comm.routing``.

| name        | transport                          | memory peers write                   |
|-------------|------------------------------------|--------------------------------------|
| reference   | all_to_all_single, gloo, CPU       | none (collective)                    |
| nccl        | collective: all_to_all_single, NCCL | none (collective)                   |
| nccl        | symmetric: device kernels          | NCCL symmetric memory windows        |
| nvshmem     | p2p: device kernels                | NVSHMEM symmetric heap               |
| nvshmem     | put: device kernels, NVSHMEM puts  | NVSHMEM symmetric heap               |
| vmm         | device kernels                     | own CUDA VMM allocation, fds shared  |
"""

import functools

import torch.distributed as dist

from ..errors import BackendError
from .base import Backend, DispatchResult, host_identity, resolve_backend_name

__all__ = ["Backend", "DispatchResult", "host_identity", "resolve_backend_name", "create_backend"]


def create_backend(name: str, config, group, device) -> Backend:
    """Build the backend ``name`` (already resolved from ``auto``) for ``group`` on ``device``.

    Imports lazily so a CPU-only install never loads the GPU stack.

    Raises:
        BackendError: the backend cannot run here (the message says why and what to use instead).
    """
    if name == "reference" or (name == "nccl" and config.nccl.transport == "collective"):
        from .collective import CollectiveBackend

        return CollectiveBackend(config, group, device, name)
    if device.type != "cuda":
        raise BackendError(f"backend {name!r} needs CUDA GPUs; this process has none (use 'reference' on CPU)")
    from .device import DeviceBackend

    if name == "vmm":
        from ..symm.vmm import VmmSymmetricMemory

        factory = functools.partial(VmmSymmetricMemory, fd_passing=config.vmm.fd_passing)
    elif name == "nvshmem":
        from ..symm.torch_symm import TorchSymmetricMemory

        # One rank has no peer to put to: its buffer is local (TorchSymmetricMemory) and stores reach it.
        put = config.nvshmem.transport == "put" and dist.get_world_size(group) > 1
        factory = functools.partial(
            TorchSymmetricMemory, provider="NVSHMEM", put_transport=put,
            heap_size_mb=config.nvshmem.heap_size_mb,
        )
        return DeviceBackend(config, group, device, factory, name, put_transport=put)
    else:
        from ..symm.torch_symm import TorchSymmetricMemory

        factory = functools.partial(TorchSymmetricMemory, provider="NCCL")
    return DeviceBackend(config, group, device, factory, name)
