"""The one list of backends, as data: an entry per (backend, transport) and what it is made of.

Everything that names or describes backends reads it: the config's allowed values
(``moe_comm.config``), the ``auto`` choice (:func:`resolve_backend`), ``moe-comm info`` and the GPU
tests' list of backend ids. How each entry is built lives a floor up, in
``moe_comm.backends.registry``: this module is core, so the config reads it without importing a backend.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from .errors import BackendError

if TYPE_CHECKING:
    import torch

    from .config import Config

__all__ = [
    "Memory",
    "Mover",
    "Reach",
    "BackendEntry",
    "ENTRIES",
    "BACKEND_NAMES",
    "transports",
    "lookup",
    "configured",
    "resolve_backend",
    "resolve_backend_name",
]

_log = logging.getLogger("moe_comm")


class Memory(enum.Enum):
    """The memory a backend's peers write into."""

    NONE = "none (collective exchanges)"
    CUDA_VMM = "own CUDA VMM allocation, fds shared between the processes"
    NVSHMEM_HEAP = "NVSHMEM symmetric heap"
    NCCL_WINDOWS = "NCCL symmetric-memory windows"


class Mover(enum.Enum):
    """What moves the bytes."""

    DEVICE_KERNELS = "device kernels, peer loads/stores"
    NVSHMEM_PUTS = "device kernels, NVSHMEM puts"
    COLLECTIVE = "all_to_all_single of padded slabs"


class Reach(enum.Enum):
    """The widest set of ranks a backend connects."""

    CPU_RANKS = "CPU ranks"
    ONE_HOST = "one host"
    NVLINK_DOMAIN = "one NVLink domain"
    ACROSS_NODES = "across nodes"


@dataclass(frozen=True)
class BackendEntry:
    """One (backend, transport) pair.

    backend: the config's ``backend`` value. transport: the value of its section's ``transport``
        key, None for a backend with one way of moving bytes.
    memory, mover, reach: what it is made of and how far it reaches.
    modules: the moe_comm modules it is built from (a build without them lacks the backend).
    auto: ``backend: auto`` picks this entry when the ranks need exactly its reach.
    """

    backend: str
    transport: Optional[str]
    memory: Memory
    mover: Mover
    reach: Reach
    modules: tuple[str, ...]
    auto: bool = False

    @property
    def id(self) -> str:
        """``backend`` or ``backend-transport``: the entry's name in tests and logs."""
        return self.backend if self.transport is None else f"{self.backend}-{self.transport}"

    @property
    def needs_cuda(self) -> bool:
        """Whether it moves CUDA tensors (every backend but the CPU one)."""
        return self.reach is not Reach.CPU_RANKS

    @property
    def config_overrides(self) -> dict:
        """The ``load_config`` keyword arguments, besides ``backend``, that select this entry."""
        return {} if self.transport is None else {self.backend: {"transport": self.transport}}


_DEVICE = "moe_comm.backends.device"
_TORCH_SYMM = "moe_comm.symm.torch_symm"
_COLLECTIVE = "moe_comm.backends.collective"

# The order is the order of `moe-comm info`, of the config's allowed values and of the GPU tests.
ENTRIES: tuple[BackendEntry, ...] = (
    BackendEntry("vmm", None, Memory.CUDA_VMM, Mover.DEVICE_KERNELS, Reach.ONE_HOST,
                 (_DEVICE, "moe_comm.symm.vmm"), auto=True),
    BackendEntry("nvshmem", "p2p", Memory.NVSHMEM_HEAP, Mover.DEVICE_KERNELS, Reach.NVLINK_DOMAIN,
                 (_DEVICE, _TORCH_SYMM)),
    BackendEntry("nvshmem", "put", Memory.NVSHMEM_HEAP, Mover.NVSHMEM_PUTS, Reach.ACROSS_NODES,
                 (_DEVICE, _TORCH_SYMM, "moe_comm.cuda.nvshmem_build")),
    BackendEntry("nccl", "symmetric", Memory.NCCL_WINDOWS, Mover.DEVICE_KERNELS, Reach.NVLINK_DOMAIN,
                 (_DEVICE, _TORCH_SYMM)),
    BackendEntry("nccl", "collective", Memory.NONE, Mover.COLLECTIVE, Reach.ACROSS_NODES,
                 (_COLLECTIVE,), auto=True),
    BackendEntry("reference", None, Memory.NONE, Mover.COLLECTIVE, Reach.CPU_RANKS,
                 (_COLLECTIVE,), auto=True),
)

BACKEND_NAMES: tuple[str, ...] = tuple(dict.fromkeys(entry.backend for entry in ENTRIES))


def transports(backend: str) -> tuple[str, ...]:
    """The values of ``backend``'s ``transport`` key, in table order (empty if it has no such key)."""
    return tuple(entry.transport for entry in ENTRIES if entry.backend == backend and entry.transport is not None)


def lookup(backend: str, transport: Optional[str] = None) -> BackendEntry:
    """The entry of ``backend`` with ``transport``.

    Raises:
        BackendError: no such entry (the message lists the entries there are).
    """
    for entry in ENTRIES:
        if (entry.backend, entry.transport) == (backend, transport):
            return entry
    known = ", ".join(entry.id for entry in ENTRIES)
    raise BackendError(f"backend {backend!r} with transport {transport!r}: no such backend; expected one of {known}")


def configured(backend: str, config: "Config") -> BackendEntry:
    """The entry of ``backend`` with the transport its section of ``config`` selects."""
    transport = getattr(config, backend).transport if transports(backend) else None
    return lookup(backend, transport)


def resolve_backend(config: "Config", device: "torch.device", hosts: Sequence[tuple[str, str]]) -> BackendEntry:
    """The entry a config selects, with ``auto`` resolved; logs the choice and why.

    ``auto`` picks the ``auto`` entry whose reach is what the ranks need: CPU ranks when the
    device is not a GPU, one host when every rank shares this one, else across nodes.

    Args:
        config: the config. device: the dispatcher's device.
        hosts: every rank's :func:`moe_comm.backends.host_identity`, in rank order.
    """
    if config.backend != "auto":
        return configured(config.backend, config)
    num_hosts = len(set(hosts))
    if device.type != "cuda":
        reach, why = Reach.CPU_RANKS, f"the dispatcher's device is {device}, not a GPU"
    elif num_hosts == 1:
        reach, why = Reach.ONE_HOST, "every rank is on this host, so CUDA VMM memory can be shared between them"
    else:
        reach, why = Reach.ACROSS_NODES, (f"the ranks span {num_hosts} hosts, where vmm cannot reach and nvshmem's "
                                          "peer mappings do not hold")
    entry = next(entry for entry in ENTRIES if entry.auto and entry.reach is reach)
    _log.info("backend auto -> %s: %s", entry.id, why)
    return entry


def resolve_backend_name(config: "Config", device: "torch.device", hosts: Sequence[tuple[str, str]]) -> str:
    """The backend name (the config's ``backend`` value) :func:`resolve_backend` picks."""
    return resolve_backend(config, device, hosts).backend
