"""Symmetric memory from PyTorch's symmetric-memory allocators (NVSHMEM or NCCL windows).

``torch.distributed._symmetric_memory`` allocates one buffer per rank on the chosen provider's
heap and ``rendezvous`` returns every peer's address (``buffer_ptrs``, from ``nvshmem_ptr`` or
NCCL's window mapping); the device kernels then read and write peers exactly as with ``vmm``.
This reaches the peers that the provider can map into this process: the GPUs of one NVLink
domain.

A group of one rank has no peers to share with (and torch's NVSHMEM rendezvous refuses a group of
one): its buffer is then an ordinary device allocation, and the kernels' "remote" writes are local.

With ``put_transport=True`` (NVSHMEM puts) every entry of the peer table is
this rank's own address of the buffer instead: kernels then name a peer's copy by that address
and the peer's rank (NVSHMEM puts), which also reaches peers on other nodes.

Facts of torch's symmetric memory this relies on: the provider is chosen once per process with
``set_backend`` before the first allocation; ``empty`` is collective and needs a device with an
explicit index; NCCL needs one ordinary collective on the group before the first rendezvous.
NVSHMEM starts at the process's first NVSHMEM allocation and reads its heap size
(``NVSHMEM_SYMMETRIC_SIZE``) then, so the variable is set around that allocation only and the
caller's environment is given back afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from ..agreement import agree
from ..errors import BackendError
from .base import SymmetricMemory

__all__ = ["PROVIDERS", "TorchSymmetricMemory", "nvshmem_heap_bytes"]

PROVIDERS = ("NVSHMEM", "NCCL")

_log = logging.getLogger("moe_comm")
_MIB = 1 << 20
_DEFAULT_HEAP_BYTES = 1024 * _MIB  # NVSHMEM's own default
_HEAP_VARIABLE = "NVSHMEM_SYMMETRIC_SIZE"
# Set once this process made its first NVSHMEM allocation: the heap size is fixed from then on.
_nvshmem_started = False


def nvshmem_heap_bytes(nbytes: int, heap_size_mb: Optional[int]) -> int:
    """The NVSHMEM heap to ask for: ``heap_size_mb`` MiB if given, else room for twice this buffer
    (several dispatchers per process) and never less than NVSHMEM's default of 1 GiB."""
    if heap_size_mb is not None:
        return heap_size_mb * _MIB
    return max(_DEFAULT_HEAP_BYTES, -(-2 * nbytes // _MIB) * _MIB)


# Buffers of closed TorchSymmetricMemory objects, with their rendezvous handles, by
# (provider, group name, device index, nbytes). torch does not give freed symmetric memory back
# to the device (NCCL windows stay registered: 50 build/close rounds of an nccl-symmetric
# dispatcher took 200 MiB on 2x H200), so a process that rebuilds dispatchers reuses them.
_pool: dict[tuple, list[tuple[torch.Tensor, object]]] = {}


def _take_pooled(key: tuple, group: dist.ProcessGroup, device: torch.device):
    """A pooled ``(buffer, handle)`` for ``key`` zeroed on every rank, or ``(None, None)`` (collective).

    Every rank must have one for any to reuse it (a rank whose earlier construction failed may
    not): the ranks agree with one gather, and after zeroing they meet at a barrier so no
    peer writes into a buffer before its owner has cleared it.
    """
    have = agree(group, lambda: bool(_pool.get(key)), error=BackendError, what="the symmetric-memory pool lookup")
    if not all(have):
        return None, None
    buffer, handle = _pool[key].pop()
    buffer.zero_()
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    return buffer, handle


@contextlib.contextmanager
def _nvshmem_heap_size(nbytes: int, heap_size_mb: Optional[int]) -> Iterator[None]:
    """Around the call that starts NVSHMEM: ``NVSHMEM_SYMMETRIC_SIZE`` set to the heap this process needs,
    and the caller's value (or its absence) back afterwards, so the processes it starts later do not
    inherit a size chosen for this one. Raises BackendError if the heap cannot hold ``nbytes``."""
    wanted = nvshmem_heap_bytes(nbytes, heap_size_mb)
    if wanted < nbytes:
        raise BackendError(
            f"nvshmem.heap_size_mb={heap_size_mb} is smaller than this dispatcher's symmetric buffer "
            f"({-(-nbytes // _MIB)} MiB); raise it or leave it null to size it automatically"
        )
    if _nvshmem_started:
        if heap_size_mb is not None:
            _log.warning("nvshmem.heap_size_mb=%d ignored: NVSHMEM already started in this process with its heap",
                         heap_size_mb)
        yield
        return
    previous = os.environ.get(_HEAP_VARIABLE)
    if heap_size_mb is None and previous is not None:
        yield  # the operator sized it
        return
    os.environ[_HEAP_VARIABLE] = str(wanted)
    try:
        yield
    finally:
        if previous is None:
            del os.environ[_HEAP_VARIABLE]
        else:
            os.environ[_HEAP_VARIABLE] = previous


def _symm_mem():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        raise BackendError(f"this torch build has no symmetric memory (torch.distributed._symmetric_memory): {exc}")
    return symm_mem


def _select_provider(symm_mem, provider: str) -> None:
    """Pick the process-wide allocator, or explain why another one is already in use."""
    get_backend = getattr(symm_mem, "get_backend", None)  # absent from some torch releases
    current = get_backend(torch.device("cuda", torch.cuda.current_device())) if get_backend else None
    if current == provider:
        return
    try:
        symm_mem.set_backend(provider)
    except Exception as exc:  # torch refuses a switch after the first allocation
        raise BackendError(
            f"cannot use {provider} symmetric memory in this process: torch's symmetric memory already uses "
            f"{current!r} ({exc}); one process can use one provider: build every Dispatcher of a process with the "
            "same backend"
        ) from exc


class TorchSymmetricMemory(SymmetricMemory):
    """``nbytes`` on every rank of ``group`` from torch's ``provider`` (``NVSHMEM`` or ``NCCL``) allocator.

    Collective: every rank calls it with the same arguments in the same order.

    Args:
        group: the process group (None: the default group); its ranks must share an NVLink domain.
        device: this rank's CUDA device (an index is filled in if missing).
        nbytes: bytes per rank.
        timeout_s: kept for the common constructor signature; torch's rendezvous is bounded by the
            group's own timeout.
        provider: ``NVSHMEM`` or ``NCCL``.
        put_transport: False: the peer table holds peer pointers (one NVLink domain); True: every
            entry is this rank's own address of the buffer, which NVSHMEM puts name (NVSHMEM only).
        heap_size_mb: NVSHMEM's heap (``nvshmem.heap_size_mb``); None sizes it from ``nbytes``.

    Raises:
        BackendError: the provider is not available in this torch build, another provider is
            already in use in this process, or a peer's memory cannot be mapped here.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, nbytes: int, *,
                 timeout_s: float, provider: str, put_transport: bool = False,
                 heap_size_mb: Optional[int] = None) -> None:
        global _nvshmem_started
        if provider not in PROVIDERS:
            raise BackendError(f"provider: got {provider!r}, expected one of {PROVIDERS}")
        if put_transport and provider != "NVSHMEM":
            raise BackendError(f"put_transport: the put transport needs the NVSHMEM provider, got {provider!r}")
        del timeout_s  # see the docstring
        self._closed = False
        self.provider = provider
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = nbytes
        group = group if group is not None else dist.group.WORLD
        symm_mem = _symm_mem()
        if provider == "NVSHMEM" and not symm_mem.is_nvshmem_available():
            raise BackendError(
                "NVSHMEM is not available to torch here (symm_mem.is_nvshmem_available() is False); install the "
                "nvidia-nvshmem wheel matching torch's CUDA (the nvshmem or nvshmem-cu13 extra) or pick vmm or nccl"
            )
        if self.world_size == 1:
            self._handle = None
            self._buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._peer_ptrs = [self._buffer.data_ptr()]
            self._peer_ptrs_tensor = torch.tensor(self._peer_ptrs, dtype=torch.int64, device=self.device)
            return
        with torch.cuda.device(self.device):
            _select_provider(symm_mem, provider)
            if provider == "NCCL":
                # NCCL refuses a rendezvous as the communicator's first operation.
                dist.barrier(group=group, device_ids=[self.device.index])
            self._pool_key = (provider, group.group_name, self.device.index, nbytes)
            heap_size = (_nvshmem_heap_size(nbytes, heap_size_mb) if provider == "NVSHMEM"
                         else contextlib.nullcontext())
            with heap_size:
                try:
                    self._buffer, self._handle = _take_pooled(self._pool_key, group, self.device)
                    if self._buffer is None:
                        self._buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=self.device)
                        self._buffer.zero_()
                        self._handle = symm_mem.rendezvous(self._buffer, group.group_name)
                except Exception as exc:
                    raise BackendError(f"{provider} symmetric memory setup failed on rank {self.rank}: {exc}") from exc
                finally:
                    _nvshmem_started = _nvshmem_started or provider == "NVSHMEM"
            if put_transport:
                self._peer_ptrs = [self._buffer.data_ptr()] * self.world_size
            else:
                self._peer_ptrs = [int(p) for p in self._handle.buffer_ptrs]
            if any(p == 0 for p in self._peer_ptrs):
                missing = [r for r, p in enumerate(self._peer_ptrs) if p == 0]
                raise BackendError(
                    f"rank {self.rank} cannot map the {provider} memory of rank(s) {missing} (no NVLink path); "
                    "across nodes use nvshmem.transport 'put' or the nccl backend's collective transport"
                )
            self._peer_ptrs_tensor = torch.tensor(self._peer_ptrs, dtype=torch.int64, device=self.device)
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Return the buffer to this process's pool (see :func:`_take_pooled`); idempotent, local."""
        if self._closed:
            return
        self._closed = True
        torch.cuda.synchronize(self.device)
        if self._handle is not None:
            _pool.setdefault(self._pool_key, []).append((self._buffer, self._handle))
        self._handle = None
        self._buffer = None
        self._peer_ptrs_tensor = None
