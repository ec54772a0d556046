"""Run-time compilation of the CUDA C++ kernels with NVRTC, and the disk cache of their cubins.

Loading and launching what this module compiles is :mod:`moe_comm.driver`'s; nothing here needs
a GPU (``moe-comm compile`` builds every kernel on a CPU host).

Compile path and cache contract
-------------------------------
* Sources are ``csrc/<name>.cu`` (read with ``importlib.resources``); they may include
  the package's headers as ``#include "<header>.cuh"`` (NVRTC has no standard headers). Every
  ``csrc/*.cuh`` is handed to NVRTC in memory, and so is ``protocol.cuh``, generated from
  :mod:`moe_comm.protocol` (:func:`moe_comm.protocol.cuda_header`), so what the compiler sees is
  exactly what the cache key hashes, also when the package is installed as a zip. A build may add
  a :class:`Toolchain`: include directories of external headers (NVSHMEM's device API for the put
  transport), extra options and a text that identifies those headers' version for the cache key.
* Options: ``--gpu-architecture=sm_XX`` (a real architecture gives SASS), ``--std=c++17``,
  ``-lineinfo``, one ``-DNAME=VALUE`` per define, then the toolchain's options. (NVRTC rejects ``-O3``.)
* Cache key: sha256 of :data:`CACHE_SCHEMA_VERSION`, the NVRTC version, the kernel name, the
  source, every header (name and text, the generated one included), the option list (which holds
  the architecture, the defines and the include directories) and the toolchain's identity text.
  Entry names are readable, e.g. ``dispatch-bf16_hidden7168-sm90-<hash16>.cubin``.
* Cache directory: ``$MOE_COMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/moe_comm``, else
  ``~/.cache/moe_comm`` (:func:`cache_dir` is the one place that reads these variables).
* :func:`compile_many` compiles independent builds (the kernel files of one config) at once,
  one thread each: NVRTC runs without the GIL.
* A cubin is written to a temp file in the cache directory and moved into place with
  ``os.replace``, under an exclusive ``fcntl.flock`` on ``<entry>.lock``; the entry is looked
  for again after the lock is taken, so ranks racing on one kernel compile it once.

Default defines for :func:`compile_all`
---------------------------------------
A ``.cu`` file declares the define sets that ``moe-comm compile`` should build with lines of
the form ``// moe_comm-defines: {"HIDDEN": 7168, "DTYPE": "bf16"}`` (a JSON object of int or
string values; one line per set). A file with no such line is compiled once without defines.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from . import protocol
from .assets import asset_dir
from .errors import CompileError, InputError

__all__ = [
    "Build",
    "CACHE_SCHEMA_VERSION",
    "Defines",
    "MIN_ARCH",
    "Toolchain",
    "arch_capability",
    "cache_dir",
    "canonical_defines",
    "compile_all",
    "compile_many",
    "compile_source",
    "nvrtc_version",
]

# Bump when the compile path changes in a way the key does not see (options layout, entry format).
CACHE_SCHEMA_VERSION = 1

Defines = Mapping[str, Union[int, str]]

_ARCH_RE = re.compile(r"sm_[0-9]{2,3}[af]?")
# The oldest architecture the kernels compile for: their bf16 packing (cvt.rn.bf16x2.f32) needs sm_80.
MIN_ARCH = 80
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DEFINES_LINE = "// moe_comm-defines:"
# The header generated from moe_comm.protocol, included by csrc/common.cuh.
_PROTOCOL_HEADER = "protocol.cuh"


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
    """Every ``csrc/*.cuh``, name -> text, sorted by name, then the generated ``protocol.cuh``
    (the order is part of the cache key)."""
    headers = {name: entry.read_text(encoding="utf-8") for name, entry in _csrc_files(".cuh").items()}
    if _PROTOCOL_HEADER in headers:
        raise CompileError(f"csrc/{_PROTOCOL_HEADER} must not exist: it is generated from moe_comm/protocol.py")
    headers[_PROTOCOL_HEADER] = protocol.cuda_header()
    return headers


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
    arch_capability(arch)


def arch_capability(arch: str) -> tuple[int, int]:
    """``(major, minor)`` of a real architecture such as ``sm_90`` or ``sm_100a``.

    Raises:
        InputError: ``arch`` is malformed, or older than ``sm_80`` (:data:`MIN_ARCH`).
    """
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise InputError(f"arch: got {arch!r}, expected a real GPU architecture such as 'sm_90' or 'sm_90a'")
    number = int(arch[3:].rstrip("af"))
    if number < MIN_ARCH:
        raise InputError(f"arch: got {arch!r}; moe_comm's kernels need sm_{MIN_ARCH} or newer "
                         f"(compute capability {MIN_ARCH // 10}.{MIN_ARCH % 10}: Ampere, Hopper, Blackwell)")
    return number // 10, number % 10


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InputError(f"kernel name: got {name!r}, expected an identifier (letters, digits, '_')")


def canonical_defines(defines: Defines) -> tuple[tuple[str, Union[int, str]], ...]:
    """Validated defines in a canonical order (so the same set always gives the same key and name).

    Raises InputError naming the first malformed name or value.
    """
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
    canonical = canonical_defines(defines)
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


Build = tuple[str, Defines, Toolchain]


def compile_many(builds: Sequence[Build], *, arch: str) -> list[Path]:
    """:func:`compile_source` of every ``(name, defines, toolchain)`` build for ``arch``, at once; the
    cubin paths in the builds' order.

    NOTE: NVRTC releases the GIL while it compiles, and a cold cache is on the path of a first
    Dispatcher (and of every rank waiting on its file lock): on a 2-core CPU host a put-transport
    dispatch and combine took 5.6 s in two threads against 7.4 s one after the other, and a
    machine with more cores runs every kernel file of a config at once.

    Raises:
        CompileError, InputError: as :func:`compile_source`, for the first failing build in order
            (the others still finish, so no thread outlives the call).
    """
    _check_arch(arch)
    if len(builds) <= 1:
        return [compile_source(name, arch=arch, defines=defines, toolchain=toolchain)
                for name, defines, toolchain in builds]
    # At least two threads even on one core: a build waiting on another rank's file lock holds none.
    with ThreadPoolExecutor(max_workers=min(len(builds), max(2, os.cpu_count() or 1))) as pool:
        futures = [pool.submit(compile_source, name, arch=arch, defines=defines, toolchain=toolchain)
                   for name, defines, toolchain in builds]
        return [future.result() for future in futures]


def compile_all(arch: str) -> list[Path]:
    """Compile every ``csrc/*.cu`` for ``arch`` with each define set it declares; returns the cubin paths.

    Prints nothing (``moe-comm compile`` reports the paths). Raises CompileError on the first failure.
    """
    builds = [(name, defines, _NO_TOOLCHAIN) for name, entry in sorted(_kernel_sources().items())
              for defines in _declared_defines(name, entry.read_text(encoding="utf-8"))]
    return compile_many(builds, arch=arch)
