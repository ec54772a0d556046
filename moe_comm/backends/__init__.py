"""Backends: how symmetric memory is shared and how bytes move. The routing math is in ``moe_comm.routing``.

Every backend and transport is one entry of ``moe_comm.backend_table`` (its memory, mover, reach
and modules), built by ``moe_comm.backends.registry``; ``moe-comm info`` prints them.
"""

from ..backend_table import configured, resolve_backend, resolve_backend_name
from .base import Backend, DispatchResult, host_identity
from .registry import build

__all__ = ["Backend", "DispatchResult", "host_identity", "resolve_backend", "resolve_backend_name", "create_backend"]


def create_backend(name: str, config, group, device) -> Backend:
    """Build the backend ``name`` (already resolved from ``auto``), with the transport ``config`` selects,
    for ``group`` on ``device``.

    Imports lazily so a CPU-only install never loads the GPU stack.

    Raises:
        BackendError: the backend cannot run here (the message says why and what to use instead).
    """
    return build(configured(name, config), config, group, device)
