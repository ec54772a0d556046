"""NVSHMEM heap sizing of the torch symmetric-memory provider (CPU: only the environment is touched)."""

from __future__ import annotations

import pytest

from moe_comm.errors import BackendError
from moe_comm.symm import torch_symm

MIB = 1 << 20


def test_heap_is_the_config_value_or_twice_the_buffer_and_at_least_the_default():
    assert torch_symm.nvshmem_heap_bytes(10 * MIB, 512) == 512 * MIB
    assert torch_symm.nvshmem_heap_bytes(10 * MIB, None) == 1024 * MIB
    assert torch_symm.nvshmem_heap_bytes(900 * MIB + 1, None) == 1801 * MIB


def test_heap_size_is_set_before_nvshmem_starts_and_left_alone_after(monkeypatch):
    monkeypatch.setattr(torch_symm, "_nvshmem_started", False)
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    torch_symm._size_nvshmem_heap(700 * MIB, None)
    assert torch_symm.os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(1400 * MIB)

    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "123")  # an operator's own choice wins over automatic sizing
    torch_symm._size_nvshmem_heap(10 * MIB, None)
    assert torch_symm.os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "123"
    torch_symm._size_nvshmem_heap(10 * MIB, 64)  # but not over the config's explicit value
    assert torch_symm.os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(64 * MIB)

    monkeypatch.setattr(torch_symm, "_nvshmem_started", True)
    torch_symm._size_nvshmem_heap(10 * MIB, 32)  # too late to change: logged, environment untouched
    assert torch_symm.os.environ["NVSHMEM_SYMMETRIC_SIZE"] == str(64 * MIB)


def test_heap_smaller_than_the_buffer_is_refused():
    with pytest.raises(BackendError, match=r"nvshmem.heap_size_mb=8 is smaller than .* \(10 MiB\)"):
        torch_symm._size_nvshmem_heap(10 * MIB, 8)
