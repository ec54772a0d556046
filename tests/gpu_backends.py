"""The GPU backends every GPU test runs on, and how a world of ranks is spawned for each.

``GPU_BACKENDS`` maps a test id to ``(backend name, config section overrides)``. Ranks get
``cuda:(rank % GPUs present)``. ``vmm`` maps memory between processes itself, so it also runs
several ranks per GPU, a single GPU included (the ranks' kernels are time-sliced, on a gloo
default group): a one-GPU machine still checks the cross-rank protocol. torch's NVSHMEM and NCCL
symmetric memory and NCCL collectives need one rank per GPU (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

from typing import Optional

GPU_BACKENDS = {
    "vmm": ("vmm", {}),
    "nvshmem-p2p": ("nvshmem", {"nvshmem": {"transport": "p2p"}}),
    "nvshmem-put": ("nvshmem", {"nvshmem": {"transport": "put"}}),
    "nccl-symmetric": ("nccl", {"nccl": {"transport": "symmetric"}}),
    "nccl-collective": ("nccl", {"nccl": {"transport": "collective"}}),
}


def dist_backend_for(backend_id: str, world: int, gpus_present: int) -> Optional[str]:
    """The torch.distributed backend to spawn ``world`` ranks of ``backend_id`` with, or None if the
    GPUs present cannot hold them (the test then skips, naming what it needs)."""
    if gpus_present >= world:
        return "nccl"
    if backend_id == "vmm" and gpus_present >= 1:
        return "gloo"
    return None
