"""Backends: how symmetric memory is shared and how bytes move. The routing math is in ``moe_comm.layout``."""

from .base import Backend, DispatchResult, resolve_backend_name

__all__ = ["Backend", "DispatchResult", "resolve_backend_name", "create_backend"]


def create_backend(name: str, config, group, device):
    """Build the backend ``name`` (already resolved from ``auto``) for ``group`` on ``device``.

    Imports lazily so a CPU-only install never loads the GPU stack.
    """
    if name == "reference":
        from .reference import ReferenceBackend

        return ReferenceBackend(config, group, device)
    if name == "vmm":
        from .device import DeviceBackend
        from ..symm.vmm import VmmSymmetricMemory

        return DeviceBackend(config, group, device, VmmSymmetricMemory)
    from ..errors import BackendError

    raise BackendError(
        f"backend {name!r} is not available in this version of moe_comm; use 'vmm' on one host "
        "or 'reference' on CPU"
    )
