"""Symmetric memory: one allocation of the same size on every rank, mapped so every rank can reach every copy.

``base`` states what every backend's allocation exposes; ``vmm`` implements it with CUDA VMM
for the processes of one host.
"""

__all__: list[str] = []
