"""What every backend's symmetric allocation exposes, and wrapping raw device pointers as tensors."""

from __future__ import annotations

import abc
import math
from typing import Sequence

import torch

from ..errors import BackendError, InputError

__all__ = ["SymmetricMemory", "wrap_device_pointer"]


class _CudaArrayInterface:
    """A bare ``__cuda_array_interface__`` (v3) over ``nbytes`` bytes at ``ptr``, for ``torch.as_tensor``."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        # No "stream" key: torch must not synchronise anything when it wraps the pointer.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def wrap_device_pointer(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A zero-copy ``uint8 [nbytes]`` tensor over device memory at ``ptr`` (local or a peer's mapping).

    ``device`` must carry an index: ``torch.as_tensor(..., device="cuda")`` silently copied peer
    memory on the GPU machines. ``__cuda_array_interface__`` has no bfloat16, so
    callers ``.view(dtype)`` the bytes. The tensor does not own the memory: it is invalid once
    the allocation is closed.

    Raises:
        InputError: ``device`` is not a CUDA device with an index, or ``nbytes`` is negative.
        BackendError: torch copied the memory instead of wrapping it.
    """
    if not isinstance(device, torch.device) or device.type != "cuda" or device.index is None:
        raise InputError(f"device: got {device!r}, expected a CUDA device with an index, e.g. torch.device('cuda', 0)")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InputError(f"nbytes: got {nbytes!r}, expected an int >= 0")
    tensor = torch.as_tensor(_CudaArrayInterface(ptr, nbytes), device=device)
    if nbytes and tensor.data_ptr() != ptr:
        raise BackendError(
            f"torch copied the memory at {ptr:#x} instead of wrapping it (got a tensor at {tensor.data_ptr():#x} "
            f"on {tensor.device}); symmetric views must be zero-copy"
        )
    return tensor


class SymmetricMemory(abc.ABC):
    """One allocation of ``nbytes`` on every rank of a group, every copy reachable from every rank.

    Attributes (set by each backend's constructor):
        rank: this process's rank in the group.
        world_size: number of ranks in the group.
        device: this rank's CUDA device (with an index).
        nbytes: size of each rank's copy in bytes (the requested size, rounded up to the
            backend's allocation granularity).

    Implementations set ``_peer_ptrs``, ``_peer_ptrs_tensor`` and ``_closed`` and implement
    :meth:`close`. A closed allocation refuses every access; tensors made from it before the
    close must no longer be used.
    """

    rank: int
    world_size: int
    device: torch.device
    nbytes: int

    # Set by each implementation's constructor: every rank's address, packed for kernels, and
    # whether close() ran.
    _peer_ptrs: list[int]
    _peer_ptrs_tensor: torch.Tensor
    _closed: bool

    @property
    def peer_ptrs(self) -> list[int]:
        """Device addresses, valid in this process, of every rank's copy; index = rank (own copy included)."""
        self._check_open()
        return list(self._peer_ptrs)

    @property
    def peer_ptrs_tensor(self) -> torch.Tensor:
        """``int64 [world_size]`` on :attr:`device`: :attr:`peer_ptrs` packed for kernels."""
        self._check_open()
        return self._peer_ptrs_tensor

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or construction failed)."""
        return self._closed

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything this rank holds; idempotent, local (not collective)."""

    @property
    def local_ptr(self) -> int:
        """Device address of this rank's own copy."""
        return self.peer_ptrs[self.rank]

    def tensor(self, rank: int, offset_bytes: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy view of ``rank``'s copy: ``dtype`` of ``shape``, contiguous, starting ``offset_bytes`` in.

        Writes through a peer's view land in that peer's memory (over NVLink, or locally when
        the peer shares this GPU). The view lives on :attr:`device`, whichever GPU holds the copy.

        Raises:
            BackendError: the allocation is closed.
            InputError: ``rank`` out of range, ``offset_bytes`` not a multiple of the dtype's
                size, or the view does not fit in ``nbytes``.
        """
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise InputError(f"rank: got {rank!r}, expected an int in [0, {self.world_size})")
        size = self._check_view(offset_bytes, shape, dtype)
        ptr = self.peer_ptrs[rank] + offset_bytes
        return wrap_device_pointer(ptr, size, self.device).view(dtype).view(tuple(shape))

    def _check_view(self, offset_bytes: int, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Validate a view of one copy; returns its size in bytes."""
        if not isinstance(dtype, torch.dtype):
            raise InputError(f"dtype: got {dtype!r}, expected a torch.dtype")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InputError(f"shape: got {tuple(shape)!r}, expected non-negative ints")
        itemsize = dtype.itemsize
        if isinstance(offset_bytes, bool) or not isinstance(offset_bytes, int) or offset_bytes < 0 \
                or offset_bytes % itemsize:
            raise InputError(f"offset_bytes: got {offset_bytes!r}, expected an int >= 0 that is a multiple of "
                             f"{itemsize} ({dtype} elements)")
        size = math.prod(shape) * itemsize
        if offset_bytes + size > self.nbytes:
            raise InputError(f"a {dtype} view of shape {tuple(shape)} at offset {offset_bytes} needs "
                             f"{offset_bytes + size} bytes; each copy has {self.nbytes}")
        return size

    def _check_open(self) -> None:
        if self.closed:
            raise BackendError(f"{type(self).__name__} of rank {self.rank} is closed")

    def __enter__(self) -> "SymmetricMemory":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
