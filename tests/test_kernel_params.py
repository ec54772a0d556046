"""Contract of moe_comm.cuda.kernel_params: the parameter arrays cuLaunchKernel reads (CPU)."""

from __future__ import annotations

import ctypes

import pytest

from moe_comm.errors import InputError
from moe_comm.cuda.kernel_params import KernelParams, kernel_params


def test_launch_parameters_are_packed_as_cuLaunchKernel_reads_them():
    """Each value sits in its own 8-byte slot; a 4-byte parameter is read from the slot's low bytes."""
    params = kernel_params([(0x7FFF_0000_1234, ctypes.c_void_p), (-3, ctypes.c_int), (2**40, ctypes.c_longlong)])
    pointers = [ctypes.c_uint64.from_address(params.address + 8 * i).value for i in range(3)]
    assert ctypes.c_void_p.from_address(pointers[0]).value == 0x7FFF_0000_1234
    assert ctypes.c_int.from_address(pointers[1]).value == -3
    assert ctypes.c_longlong.from_address(pointers[2]).value == 2**40
    assert kernel_params([]).address == 0
    with pytest.raises(InputError, match="c_float"):
        kernel_params([(1, ctypes.c_int), (1.0, ctypes.c_float)])


def test_kernel_params_keep_fixed_values_and_refill_the_rest():
    params = KernelParams([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p], fixed=(0x1000, 7))
    address = params.address
    assert params.fill((-1, 0x2000)) is params and params.address == address  # the same slots, refilled
    assert params.values() == [0x1000, 7, 2**64 - 1, 0x2000]
    params.fill((5, 0x3000))
    assert params.values() == [0x1000, 7, 5, 0x3000]
    assert ctypes.c_int.from_address(ctypes.c_uint64.from_address(address + 16).value).value == 5
    with pytest.raises(InputError, match="expected 2 values after the 2 fixed ones, got 1"):
        params.fill((1,))
    with pytest.raises(InputError, match="fixed: 3 values for a kernel of 2 parameters"):
        KernelParams([ctypes.c_int, ctypes.c_int], fixed=(1, 2, 3))
