"""Run-time compilation of the CUDA C++ kernels (NVRTC) and loading/launching them (CUDA driver API).

Compile path and cache contract
-------------------------------
* Sources are ``csrc/<name>.cu`` (read with ``importlib.resources``); they may include
  the package's headers as ``#include "<header>.cuh"`` (NVRTC has no standard headers). Every
  ``csrc/*.cuh`` is handed to NVRTC in memory, so what the compiler sees is exactly what the cache
  key hashes, also when the package is installed as a zip. A build may add a :class:`Toolchain`:
  include directories of external headers (NVSHMEM's device API for the put transport), extra
  options and a text that identifies those headers' version for the cache key.
* Options: ``--gpu-architecture=sm_XX`` (a real architecture gives SASS), ``--std=c++17``,
  ``-lineinfo``, one ``-DNAME=VALUE`` per define, then the toolchain's options. (NVRTC rejects ``-O3``.)
* Cache key: sha256 of :data:`CACHE_SCHEMA_VERSION`, the NVRTC version, the kernel name, the
  source, every header (name and text), the option list (which holds the architecture, the
  defines and the include directories) and the toolchain's identity text. Entry names are
  readable, e.g. ``dispatch-bf16_hidden7168-sm90-<hash16>.cubin``.
* Cache directory: ``$MOE_COMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/moe_comm``, else
  ``~/.cache/moe_comm`` (:func:`cache_dir` is the one place that reads these variables).
* A cubin is written to a temp file in the cache directory and moved into place with
  ``os.replace``, under an exclusive ``fcntl.flock`` on ``<entry>.lock``; the entry is looked
  for again after the lock is taken, so ranks racing on one kernel compile it once.

Default defines for :func:`compile_all`
---------------------------------------
A ``.cu`` file declares the define sets that ``moe-comm compile`` should build with lines of
the form ``// moe_comm-defines: {"HIDDEN": 7168, "DTYPE": "bf16"}`` (a JSON object of int or
string values; one line per set). A file with no such line is compiled once without defines.

Loading and launching
---------------------
Driver calls act on the calling thread's current context; moe_comm uses each device's
*primary* context (the one torch uses) and pushes it around every setup call
(:func:`device_context`). Modules are loaded once per (device, cubin) and functions are
cached, so :func:`load_function` under CUDA-graph capture returns a cached function and
refuses to compile or load anything new. ``cuda.bindings`` is imported lazily: a CPU-only
install imports moe_comm without it.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from .assets import asset_dir
from .errors import BackendError, CompileError, InputError

__all__ = [
    "CACHE_SCHEMA_VERSION",
    "KernelFunction",
    "KernelParams",
    "Toolchain",
    "arch_of",
    "cache_dir",
    "compile_all",
    "compile_source",
    "cu_check",
    "cuda_driver",
    "device_context",
    "kernel_params",
    "load_function",
    "nvrtc_version",
]

# Bump when the compile path changes in a way the key does not see (options layout, entry format).
CACHE_SCHEMA_VERSION = 1

Defines = Mapping[str, Union[int, str]]

_ARCH_RE = re.compile(r"sm_[0-9]{2,3}[af]?")
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINES_LINE = "// moe_comm-defines:"
# Above this much dynamic shared memory a kernel must opt in with cuFuncSetAttribute.
_DEFAULT_SHARED_LIMIT = 48 * 1024
# Kernel parameter types a launch packs itself: each value goes into an 8-byte slot, of which the
# kernel reads the first 4 or 8 bytes (little-endian), so two's complement of the value suffices.
_INTEGER_PARAMS = frozenset((ctypes.c_int, ctypes.c_uint, ctypes.c_longlong, ctypes.c_ulonglong, ctypes.c_void_p))
_SLOT_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Toolchain:
    """What a build needs beyond the packaged sources: external headers and module set-up.

    options: extra NVRTC options (``-I<dir>`` for each include directory, flags the headers need).
    identity: text that changes when those headers change (e.g. their version file), hashed into
        the cache key. module_init: called with the ``CUmodule`` right after each load (e.g. to
        initialise a library's device state in the module); not part of the key.
    """

    options: tuple[str, ...] = ()
    identity: str = ""
    module_init: Optional[Callable[[Any], None]] = None


_NO_TOOLCHAIN = Toolchain()


def cache_dir() -> Path:
    """Directory of cached cubins: ``$MOE_COMM_CACHE_DIR``, ``$XDG_CACHE_HOME/moe_comm`` or ``~/.cache/moe_comm``."""
    explicit = os.environ.get("MOE_COMM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "moe_comm"


# --------------------------------------------------------------------------- NVRTC


@functools.lru_cache(maxsize=None)
def _nvrtc() -> tuple[Any, tuple[int, int]]:
    """The ``cuda.bindings.nvrtc`` module and the NVRTC version; raises CompileError if unusable."""
    hint = ("install it with `pip install nvidia-cuda-nvrtc` (the `moe_comm[nvrtc]` extra) or use a CUDA "
            "toolkit whose libnvrtc the loader finds")
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CompileError(f"NVRTC is not available: cuda.bindings.nvrtc cannot be imported ({exc}); {hint}") from exc
    try:
        # The library itself is found lazily (cuda-pathfinder); the first call shows whether it is there.
        result, major, minor = nvrtc.nvrtcVersion()
    except RuntimeError as exc:
        raise CompileError(f"NVRTC is not available: {exc}; {hint}") from exc
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC is not available: nvrtcVersion returned {result!r}; {hint}")
    return nvrtc, (major, minor)


def nvrtc_version() -> tuple[int, int]:
    """``(major, minor)`` of the NVRTC library in use; raises CompileError naming the fix if it is missing."""
    return _nvrtc()[1]


def _nvrtc_compile(name: str, source: str, headers: Mapping[str, str], options: Sequence[str]) -> bytes:
    """Compile one program to a cubin; raises CompileError carrying the full NVRTC log."""
    nvrtc, _ = _nvrtc()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS

    def check(result: tuple, call: str) -> tuple:
        if result[0] != ok:
            raise CompileError(f"kernel '{name}': {call} failed with {result[0].name}")
        return result[1:]

    (program,) = check(
        nvrtc.nvrtcCreateProgram(
            source.encode(), f"{name}.cu".encode(), len(headers),
            [text.encode() for text in headers.values()], [header.encode() for header in headers],
        ),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [option.encode() for option in options]
        (compiled,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        (log_size,) = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer: it must be mutable. An immutable ``b" " * n`` would be
        # overwritten in place, and for n = 1 that is Python's shared one-byte b" " object, which
        # silently corrupted everything that later pickled a space (gloo object collectives).
        log = bytearray(log_size)
        check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
        if compiled != ok:
            text = bytes(log).rstrip(b"\0").decode(errors="replace")
            raise CompileError(
                f"NVRTC could not compile kernel '{name}' ({compiled.name}); options: {' '.join(options)}\n{text}"
            )
        (cubin_size,) = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = bytearray(cubin_size)
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(program)


# --------------------------------------------------------------------------- sources and cache entries


def _csrc_files(suffix: str) -> dict[str, Any]:
    """File name -> resource of every ``csrc/*<suffix>`` (:func:`moe_comm.assets.asset_dir`), sorted by name."""
    csrc = asset_dir("csrc")
    return {entry.name: entry for entry in sorted(csrc.iterdir(), key=lambda e: e.name) if entry.name.endswith(suffix)}


def _headers() -> dict[str, str]:
    """Every ``csrc/*.cuh``, name -> text, sorted by name (the order is part of the cache key)."""
    return {name: entry.read_text(encoding="utf-8") for name, entry in _csrc_files(".cuh").items()}


def _kernel_sources() -> dict[str, Any]:
    """Kernel name -> resource of every ``csrc/<name>.cu``."""
    return {name[: -len(".cu")]: entry for name, entry in _csrc_files(".cu").items()}


def _read_kernel(name: str) -> str:
    sources = _kernel_sources()
    if name not in sources:
        raise CompileError(
            f"kernel name: got {name!r}, expected one of the sources in csrc: "
            f"{', '.join(sorted(sources)) or '(none)'}"
        )
    return sources[name].read_text(encoding="utf-8")


def _check_arch(arch: str) -> None:
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise InputError(f"arch: got {arch!r}, expected a real GPU architecture such as 'sm_90' or 'sm_90a'")


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InputError(f"kernel name: got {name!r}, expected an identifier (letters, digits, '_')")


def _sorted_defines(defines: Defines) -> tuple[tuple[str, Union[int, str]], ...]:
    """Validated defines in a canonical order (so the same set always gives the same key and name)."""
    if not isinstance(defines, Mapping):
        raise InputError(f"defines: got {type(defines).__name__}, expected a mapping of macro name to int or str")
    for key, value in defines.items():
        if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
            raise InputError(f"defines: macro name {key!r} is not a C identifier")
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise InputError(f"defines[{key!r}]: got {value!r}, expected an int or a str")
    return tuple(sorted(defines.items()))


def _short_defines(defines: tuple[tuple[str, Union[int, str]], ...]) -> str:
    """Readable summary for the entry name: ints as ``hidden7168``, strings as their value (``bf16``)."""
    parts = []
    for key, value in defines:
        if isinstance(value, int):
            parts.append(f"{key.lower()}{value}")
        else:
            parts.append(re.sub(r"[^A-Za-z0-9]+", "", value).lower() or key.lower())
    return "_".join(parts)[:48]


def _options(arch: str, defines: tuple[tuple[str, Union[int, str]], ...], toolchain: Toolchain) -> list[str]:
    return [
        f"--gpu-architecture={arch}", "--std=c++17", "-lineinfo",
        *(f"-D{key}={value}" for key, value in defines), *toolchain.options,
    ]


def _cache_key(name: str, source: str, headers: Mapping[str, str], options: Sequence[str], identity: str) -> str:
    major, minor = nvrtc_version()
    digest = hashlib.sha256()
    parts = [f"schema={CACHE_SCHEMA_VERSION}", f"nvrtc={major}.{minor}", name, source]
    parts += [f"{header}\0{text}" for header, text in headers.items()]
    parts += list(options) + [identity]
    for part in parts:
        data = part.encode()
        # Length-prefixed so that moving text between two parts changes the digest.
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def compile_source(
    name: str,
    *,
    arch: str,
    defines: Defines = {},
    source: Optional[str] = None,
    toolchain: Toolchain = _NO_TOOLCHAIN,
) -> Path:
    """Compile a kernel with NVRTC (or find it in the cache) and return the cubin's path.

    Args:
        name: the kernel source ``csrc/<name>.cu``; with ``source`` given, just the
            name used in the entry name and in NVRTC messages.
        arch: real architecture, e.g. ``"sm_90"`` (see :func:`arch_of`).
        defines: macros passed as ``-DNAME=VALUE`` (int or str values).
        source: explicit CUDA C++ text to compile instead of the packaged file (tests, experiments).
            It may include the packaged ``.cuh`` headers.
        toolchain: external headers and options of this build (see :class:`Toolchain`).

    Returns:
        Path of ``<cache_dir>/<name>-<defines>-<arch>-<hash16>.cubin``.

    Raises:
        CompileError: NVRTC is missing, the source does not exist, or it does not compile (the
            message holds the NVRTC log).
        InputError: ``arch``, ``name`` or ``defines`` are malformed.
    """
    _check_name(name)
    _check_arch(arch)
    canonical = _sorted_defines(defines)
    text = _read_kernel(name) if source is None else source
    headers = _headers()
    options = _options(arch, canonical, toolchain)
    digest = _cache_key(name, text, headers, options, toolchain.identity)
    short = _short_defines(canonical)
    stem = "-".join(part for part in (name, short, arch.replace("_", ""), digest[:16]) if part)
    directory = cache_dir()
    path = directory / f"{stem}.cubin"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / f"{stem}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process compiled it while we waited for the lock
            return path
        cubin = _nvrtc_compile(name, text, headers, options)
        handle, temp = tempfile.mkstemp(dir=directory, prefix=f".{stem}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(cubin)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    return path


def _declared_defines(name: str, text: str) -> list[dict]:
    """The ``// moe_comm-defines: {...}`` sets of a source, or ``[{}]`` when it declares none."""
    sets = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.startswith(_DEFINES_LINE):
            continue
        try:
            value = json.loads(line[len(_DEFINES_LINE):])
        except json.JSONDecodeError as exc:
            raise CompileError(f"csrc/{name}.cu line {number}: the defines are not a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise CompileError(f"csrc/{name}.cu line {number}: got {value!r}, expected a JSON object of defines")
        sets.append(value)
    return sets or [{}]


def compile_all(arch: str) -> list[Path]:
    """Compile every ``csrc/*.cu`` for ``arch`` with each define set it declares; returns the cubin paths.

    Prints nothing (``moe-comm compile`` reports the paths). Raises CompileError on the first failure.
    """
    _check_arch(arch)
    paths = []
    for name, entry in sorted(_kernel_sources().items()):
        for defines in _declared_defines(name, entry.read_text(encoding="utf-8")):
            paths.append(compile_source(name, arch=arch, defines=defines))
    return paths


# --------------------------------------------------------------------------- driver API


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


class KernelParams:
    """``cuLaunchKernel``'s kernelParams, reusable: one 8-byte slot per parameter and the array of
    pointers to the slots, which the launch takes by its address.

    The first ``len(fixed)`` parameters are set once, here; :meth:`fill` sets the others before
    each launch. The driver copies the values during the launch call (also while capturing a
    graph), so refilling after it returned is safe; two threads must not fill and launch one
    object at once. A 4-byte parameter is read from its slot's low bytes.

    NOTE: cuda-bindings' own packing of ``(values, types)`` tuples cost ~50 us of host time per
    launch of a 27-parameter kernel on the GPU machines, and building these arrays afresh per
    launch ~14 us on a CPU host; filling a prepared object costs about 0.1 us per value.

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
    toolchain: Toolchain = _NO_TOOLCHAIN,
) -> KernelFunction:
    """Compile (cached), load and look up a kernel entry point on ``device``.

    The module is loaded once per (device, cubin) into the device's primary context, and the
    function is cached per (device, name, entry, defines, source): a second call is a dict lookup.

    Args:
        device: CUDA device (an index-less ``cuda`` means the current device).
        name, defines, source, toolchain: as in :func:`compile_source`; ``toolchain.module_init``
            runs once per loaded module.
        entry: the ``extern "C"`` ``__global__`` function to return.

    Raises:
        BackendError: called while the current stream is capturing a CUDA graph and the function
            is not cached yet (compiling and loading cannot be captured), or a driver call failed.
        CompileError: as in :func:`compile_source`.
    """
    index = _device_index(device)
    key = (index, name, entry, _sorted_defines(defines), source, toolchain)
    function = _functions.get(key)
    if function is not None:
        return function
    if torch.cuda.is_current_stream_capturing():
        raise BackendError(
            f"load_function({name!r}, entry={entry!r}) was called while the current CUDA stream is capturing a "
            "graph; compiling and loading a kernel cannot be captured. Call it once before the capture (for a "
            "Dispatcher: construct it and call warmup() before capturing)."
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
                    module = cu_check(driver.cuModuleLoadData(path.read_bytes()), f"cuModuleLoadData({path.name})")
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
