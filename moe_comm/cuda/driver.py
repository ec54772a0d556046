"""The CUDA driver API as moe_comm uses it: contexts, modules, kernel functions and their launches.

Driver calls act on the calling thread's current context; moe_comm uses each device's
*primary* context (the one torch uses) and pushes it around every setup call
(:func:`device_context`). :func:`load_function` compiles a kernel through :mod:`moe_comm.cuda.jit`
(or finds it in the disk cache), loads its module once per (device, cubin) and caches the
function, so under CUDA-graph capture it returns a cached function and refuses to compile or
load anything new. ``cuda.bindings`` is imported lazily: a CPU-only install imports moe_comm
without it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ..errors import BackendError, InputError
from .jit import Defines, Toolchain, canonical_defines, compile_source, read_cubin
from .kernel_params import KernelParams, kernel_params

__all__ = [
    "KernelFunction",
    "arch_of",
    "cu_check",
    "cuda_driver",
    "device_context",
    "load_function",
]

# Above this much dynamic shared memory a kernel must opt in with cuFuncSetAttribute.
_DEFAULT_SHARED_LIMIT = 48 * 1024


@functools.lru_cache(maxsize=None)
def cuda_driver() -> Any:
    """``cuda.bindings.driver``, initialised (``cuInit``); raises BackendError if it cannot be used here."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise BackendError(
            f"the CUDA driver bindings cannot be imported ({exc}); install them with `pip install cuda-bindings`"
        ) from exc
    try:
        result = driver.cuInit(0)
    except RuntimeError as exc:  # cuda-pathfinder found no libcuda.so
        raise BackendError(f"the CUDA driver library cannot be loaded: {exc}") from exc
    cu_check(result, "cuInit")
    return driver


def cu_check(result: tuple, step: str) -> Any:
    """Check the ``CUresult`` that starts a cuda-bindings return tuple.

    Returns:
        None, the single output, or a tuple of the outputs.

    Raises:
        BackendError: naming ``step`` and the CUDA error (name and description).
    """
    error = result[0]
    if error:  # CUresult is an int enum; CUDA_SUCCESS is 0
        raise BackendError(f"{step} failed with {_error_text(error)}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _error_text(error: Any) -> str:
    name = getattr(error, "name", str(error))
    try:
        described, text = cuda_driver().cuGetErrorString(error)
    except BackendError:
        return name
    return f"{name} ({text.decode(errors='replace')})" if not described and text else name


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def _primary_context(index: int) -> Any:
    """Device ``index``'s primary context (the one torch uses), retained once for the process's life."""
    context = _contexts.get(index)
    if context is not None:
        return context
    with _contexts_lock:
        if index not in _contexts:
            torch.cuda.init()
            driver = cuda_driver()
            device = cu_check(driver.cuDeviceGet(index), f"cuDeviceGet({index})")
            _contexts[index] = cu_check(driver.cuDevicePrimaryCtxRetain(device), f"cuDevicePrimaryCtxRetain({index})")
        return _contexts[index]


def _device_index(device: Union[torch.device, int]) -> int:
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise InputError(f"device: got {device!r}, expected a CUDA torch.device such as torch.device('cuda', 0)")
    return torch.cuda.current_device() if device.index is None else device.index


@contextlib.contextmanager
def device_context(device: Union[torch.device, int]) -> Iterator[int]:
    """Make ``device``'s primary context current on this thread for the block; yields the device index.

    Pushes and pops the context so the thread's previous context (and so torch's current
    device) is unchanged afterwards.
    """
    index = _device_index(device)
    driver = cuda_driver()
    cu_check(driver.cuCtxPushCurrent(_primary_context(index)), "cuCtxPushCurrent")
    try:
        yield index
    finally:
        cu_check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def arch_of(device: torch.device) -> str:
    """The NVRTC architecture of a CUDA device, e.g. ``"sm_90"`` for an H100/H200."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class KernelFunction:
    """One loaded ``extern "C"`` entry point of a compiled kernel on one device.

    Attributes:
        name: the kernel source name; entry: the entry point; device: the device it is loaded on.
    """

    __slots__ = ("name", "entry", "device", "_index", "_function", "_context", "_launch", "_get_context",
                 "_raw_stream", "_shared_limit")

    def __init__(self, function: Any, device: torch.device, name: str, entry: str):
        self.name = name
        self.entry = entry
        self.device = device
        self._index = device.index
        self._function = function
        self._context = int(_primary_context(self._index))
        # Bound once: looking these up would otherwise be part of every launch.
        driver = cuda_driver()
        self._launch = driver.cuLaunchKernel
        self._get_context = driver.cuCtxGetCurrent
        self._raw_stream = torch._C._cuda_getCurrentRawStream
        self._shared_limit = _DEFAULT_SHARED_LIMIT

    def __repr__(self) -> str:
        return f"KernelFunction({self.name}.{self.entry} on {self.device})"

    def launch(
        self,
        grid: Union[int, tuple[int, ...]],
        block: Union[int, tuple[int, ...]],
        args: Union["KernelParams", Sequence[tuple[Any, Any]]],
        shared_bytes: int = 0,
        stream: Optional[torch.cuda.Stream] = None,
    ) -> None:
        """Launch the kernel asynchronously (``cuLaunchKernel``); capturable in a CUDA graph.

        Args:
            grid, block: an int or a tuple of 1 to 3 ints (x, y, z).
            args: a filled :class:`KernelParams` (what per-step launches reuse), or ``(value,
                ctypes type)`` per kernel parameter, in order, e.g. ``(tensor.data_ptr(),
                ctypes.c_void_p)`` for a pointer, ``(n, ctypes.c_int)``; the types are ``c_int``,
                ``c_uint``, ``c_longlong``, ``c_ulonglong`` and ``c_void_p``.
            shared_bytes: dynamic shared memory per block; above 48 KiB the function's limit is
                raised first (once per new maximum).
            stream: defaults to torch's current stream on the kernel's device.

        Raises:
            BackendError: the launch failed (error name and kernel in the message).
            InputError: a parameter type is not one of the above.
        """
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        if shared_bytes > self._shared_limit:
            self._raise_shared_limit(shared_bytes)
        # NOTE: torch.cuda.current_stream(i).cuda_stream costs 1.5 us of host time per call on the
        # GPU machines; the raw-stream getter (what torch's own generated code calls) is much cheaper.
        handle = stream.cuda_stream if stream is not None else self._raw_stream(self._index)
        params = args if type(args) is KernelParams else kernel_params(args)
        # The launch acts on the thread's current context: a thread that never touched CUDA has
        # none (CUDA_ERROR_INVALID_CONTEXT) and one whose current device is another GPU has the
        # wrong one (CUDA_ERROR_INVALID_HANDLE). Checking costs 0.15 us; fixing it only when needed.
        address = params.address
        if int(self._get_context()[1]) == self._context:
            (error,) = self._launch(self._function, gx, gy, gz, bx, by, bz, shared_bytes, handle, address, 0)
        else:
            with device_context(self._index):
                (error,) = self._launch(self._function, gx, gy, gz, bx, by, bz, shared_bytes, handle, address, 0)
        if error:
            raise BackendError(
                f"cuLaunchKernel of {self.name}.{self.entry} (grid {grid}, block {block}, "
                f"{shared_bytes} B shared) failed with {_error_text(error)}"
            )

    def _raise_shared_limit(self, shared_bytes: int) -> None:
        driver = cuda_driver()
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        with device_context(self._index):
            cu_check(
                driver.cuFuncSetAttribute(self._function, attribute, shared_bytes),
                f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_bytes}) of {self.name}.{self.entry}",
            )
        self._shared_limit = shared_bytes


def _dim3(dim: Union[int, tuple[int, ...]], what: str) -> tuple[int, int, int]:
    if type(dim) is int:
        if dim > 0:
            return dim, 1, 1
    elif isinstance(dim, tuple) and 1 <= len(dim) <= 3 and all(type(d) is int and d > 0 for d in dim):
        return (dim + (1, 1))[:3]
    raise InputError(f"{what}: got {dim!r}, expected a positive int or a tuple of 1 to 3 positive ints")


_modules: dict[tuple[int, str], Any] = {}
_functions: dict[tuple, KernelFunction] = {}
_load_lock = threading.Lock()


def load_function(
    device: torch.device,
    name: str,
    entry: str,
    defines: Defines = {},
    *,
    source: Optional[str] = None,
    toolchain: Toolchain = Toolchain(),
) -> KernelFunction:
    """Compile (cached), load and look up a kernel entry point on ``device``.

    The module is loaded once per (device, cubin) into the device's primary context, and the
    function is cached per (device, name, entry, defines, source): a second call is a dict lookup.

    Args:
        device: CUDA device (an index-less ``cuda`` means the current device).
        name, defines, source, toolchain: as in :func:`moe_comm.cuda.jit.compile_source`; ``toolchain.module_init``
            runs once per loaded module.
        entry: the ``extern "C"`` ``__global__`` function to return.

    Raises:
        BackendError: called while the current stream is capturing a CUDA graph and the function
            is not cached yet (compiling and loading cannot be captured), or a driver call failed.
        CompileError, ConfigError: as in :func:`moe_comm.cuda.jit.compile_source` and :func:`moe_comm.cuda.jit.read_cubin`.
    """
    index = _device_index(device)
    key = (index, name, entry, canonical_defines(defines), source, toolchain)
    function = _functions.get(key)
    if function is not None:
        return function
    if torch.cuda.is_current_stream_capturing():
        raise BackendError(
            f"load_function({name!r}, entry={entry!r}) was called while the current CUDA stream is capturing a "
            "graph; compiling and loading a kernel cannot be captured. Call it once before the capture (a "
            "Dispatcher's constructor compiles and loads every kernel and runs a warm-up step: construct it before "
            "capturing)."
        )
    with _load_lock:
        function = _functions.get(key)
        if function is None:
            target = torch.device("cuda", index)
            path = compile_source(name, arch=arch_of(target), defines=defines, source=source, toolchain=toolchain)
            driver = cuda_driver()
            with device_context(index):
                module = _modules.get((index, str(path)))
                if module is None:
                    module = cu_check(driver.cuModuleLoadData(read_cubin(path)), f"cuModuleLoadData({path.name})")
                    if toolchain.module_init is not None:
                        toolchain.module_init(module)
                    _modules[(index, str(path))] = module
                handle = cu_check(
                    driver.cuModuleGetFunction(module, entry.encode()),
                    f"cuModuleGetFunction: entry {entry!r} of {path.name} (is it declared extern \"C\" __global__?)",
                )
            function = KernelFunction(handle, target, name, entry)
            _functions[key] = function
    return function
