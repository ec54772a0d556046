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


def _heap_variable_inside(nbytes: int, heap_size_mb):
    with torch_symm._nvshmem_heap_size(nbytes, heap_size_mb):
        return torch_symm.os.environ.get("NVSHMEM_SYMMETRIC_SIZE")


def test_heap_size_is_set_while_nvshmem_starts_and_the_environment_given_back(monkeypatch):
    monkeypatch.setattr(torch_symm, "_nvshmem_started", False)
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE", raising=False)
    assert _heap_variable_inside(700 * MIB, None) == str(1400 * MIB)
    # Not left behind: processes this one starts later would inherit a size chosen for it.
    assert "NVSHMEM_SYMMETRIC_SIZE" not in torch_symm.os.environ
    with pytest.raises(RuntimeError, match="allocation failed"):
        with torch_symm._nvshmem_heap_size(10 * MIB, None):
            raise RuntimeError("allocation failed")
    assert "NVSHMEM_SYMMETRIC_SIZE" not in torch_symm.os.environ

    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "123")  # an operator's own choice wins over automatic sizing
    assert _heap_variable_inside(10 * MIB, None) == "123"
    assert _heap_variable_inside(10 * MIB, 64) == str(64 * MIB)  # but not over the config's explicit value
    assert torch_symm.os.environ["NVSHMEM_SYMMETRIC_SIZE"] == "123"

    monkeypatch.setattr(torch_symm, "_nvshmem_started", True)
    assert _heap_variable_inside(10 * MIB, 32) == "123"  # too late to change: logged, environment untouched


def test_heap_smaller_than_the_buffer_is_refused():
    with pytest.raises(BackendError, match=r"nvshmem.heap_size_mb=8 is smaller than .* \(10 MiB\)"):
        with torch_symm._nvshmem_heap_size(10 * MIB, 8):
            pass
