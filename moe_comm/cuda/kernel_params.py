"""``cuLaunchKernel``'s parameter arrays, built once per kernel and refilled per launch.

:class:`KernelParams` holds one 8-byte slot per kernel parameter and the array of pointers to
them that the launch takes by address; :func:`kernel_params` builds one from ``(value, ctypes
type)`` pairs. Host memory only: nothing here touches CUDA, so CPU tests build and inspect them.
"""

from __future__ import annotations

import array
import ctypes
from typing import Any, Sequence

from ..errors import InputError

__all__ = ["KernelParams", "kernel_params"]

# Kernel parameter types a launch packs itself: each value goes into an 8-byte slot, of which the
# kernel reads the first 4 or 8 bytes (little-endian), so two's complement of the value suffices.
_INTEGER_PARAMS = frozenset((ctypes.c_int, ctypes.c_uint, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_void_p))
_SLOT_MASK = (1 << 64) - 1


class KernelParams:
    """``cuLaunchKernel``'s kernelParams, reusable: one 8-byte slot per parameter and the array of
    pointers to the slots, which the launch takes by its address.

    The first ``len(fixed)`` parameters are set once, here; :meth:`fill` sets the others before
    each launch. The driver copies the values during the launch call (also while capturing a
    graph), so refilling after it returned is safe; two threads must not fill and launch one
    object at once. A 4-byte parameter is read from its slot's low bytes.

    NOTE: cuda-bindings' own packing of ``(values, types)`` tuples cost ~50 us of host time per
    launch of a 27-parameter kernel on the GPU machines, and building these arrays afresh per
    launch ~14 us on a CPU host; filling a prepared object with 15 values costs about 0.35 us there.

    Args:
        types: the ctypes type of every parameter, in order (``c_int``, ``c_uint``, ``c_longlong``,
            ``c_ulonglong``, ``c_void_p``), kept as ``self.types``. fixed: the values of the
            leading parameters.

    Raises:
        InputError: a type is not one of those, or more fixed values than parameters.
    """

    __slots__ = ("_slots", "_pointers", "_first_free", "address", "types")

    def __init__(self, types: Sequence[Any], fixed: Sequence[int] = ()) -> None:
        unsupported = set(types) - _INTEGER_PARAMS
        if unsupported:
            raise InputError(
                f"kernel parameter types {sorted(map(repr, unsupported))} are not supported; expected one of "
                f"{', '.join(sorted(t.__name__ for t in _INTEGER_PARAMS))}"
            )
        if len(fixed) > len(types):
            raise InputError(f"fixed: {len(fixed)} values for a kernel of {len(types)} parameters")
        self._slots = array.array("Q", bytes(8 * len(types)))
        base = self._slots.buffer_info()[0]
        self._pointers = array.array("Q", range(base, base + 8 * len(types), 8))
        self.address = self._pointers.buffer_info()[0] if types else 0
        self._first_free = len(fixed)
        self.types = tuple(types)
        for index, value in enumerate(fixed):
            self._slots[index] = int(value) & _SLOT_MASK

    def fill(self, values: Sequence[int]) -> "KernelParams":
        """Set every parameter after the fixed ones (ints; negative ones as two's complement); returns self."""
        if len(values) != len(self._slots) - self._first_free:
            raise InputError(
                f"kernel parameters: expected {len(self._slots) - self._first_free} values after the "
                f"{self._first_free} fixed ones, got {len(values)}"
            )
        try:
            # One conversion in C when every value is non-negative (most launches): a third of the
            # loop's time. The lengths match (checked above), so the slots are not reallocated.
            self._slots[self._first_free:] = array.array("Q", values)
        except OverflowError:
            slots = self._slots
            for index, value in enumerate(values, self._first_free):
                slots[index] = value & _SLOT_MASK
        return self

    def values(self) -> list[int]:
        """The slots as unsigned 64-bit ints (for tests and error messages)."""
        return list(self._slots)


def kernel_params(fixed: Sequence[tuple[Any, Any]], per_call: Sequence[Any] = ()) -> KernelParams:
    """:class:`KernelParams` whose leading parameters are the ``fixed`` (value, ctypes type) pairs,
    followed by parameters of the ``per_call`` types, which :meth:`KernelParams.fill` sets."""
    return KernelParams([ctype for _, ctype in fixed] + list(per_call), [int(value) for value, _ in fixed])
