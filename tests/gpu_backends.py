"""The GPU backends every GPU test runs on, and how a world of ranks is spawned for each.

``GPU_BACKENDS`` maps a test id (the registry entry's id, e.g. ``nvshmem-put``) to ``(backend
name, config section overrides)`` for every entry of ``moe_comm.backend_table`` that needs
CUDA. Ranks get ``cuda:(rank % GPUs present)``. ``vmm`` maps memory between processes itself, so
it also runs several ranks per GPU, a single GPU included (the ranks' kernels are time-sliced, on
a gloo default group): a one-GPU machine still checks the cross-rank protocol. torch's NVSHMEM and
NCCL symmetric memory and NCCL collectives need one rank per GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

from moe_comm.backend_table import ENTRIES, Memory

__all__ = ["GPU_BACKENDS", "DEFAULT_WORLD", "gpus_needed", "dist_backend_for"]

GPU_BACKENDS = {entry.id: (entry.backend, entry.config_overrides) for entry in ENTRIES if entry.needs_cuda}

# The world size of a GPU test parametrized by backend but not by ``world`` (the layer and
# reliability tests): what the conftest orders it by and the kernel warm-up counts its GPUs by.
DEFAULT_WORLD = 2

# Backends whose ranks may share a GPU: only memory this library maps itself is free of NCCL's
# one-rank-per-device rule.
_SHARE_A_GPU = {entry.id for entry in ENTRIES if entry.memory is Memory.CUDA_VMM}


def gpus_needed(backend_id: str, world: int) -> int:
    """The fewest GPUs that hold ``world`` ranks of ``backend_id`` (pass it to ``requires_gpus``)."""
    return 1 if backend_id in _SHARE_A_GPU else world


def dist_backend_for(world: int, gpus_present: int) -> str:
    """The torch.distributed backend to spawn ``world`` ranks with on ``gpus_present`` GPUs (at least
    :func:`gpus_needed`): NCCL with a GPU per rank, else gloo (ranks that share a GPU)."""
    return "nccl" if gpus_present >= world else "gloo"

