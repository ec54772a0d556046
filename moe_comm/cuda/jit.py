"""Run-time compilation of the CUDA C++ kernels with NVRTC, and the disk cache of their cubins.

Loading and launching what this module compiles is :mod:`moe_comm.cuda.driver`'s; nothing here needs
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
  ``os.replace``, under an exclusive ``fcntl.flock`` on ``<entry>.lock`` (waited for at most
  :data:`LOCK_WAIT_S`); the entry is looked for again after the lock is taken, so ranks racing on
  one kernel compile it once.
* Shared nodes: a cubin runs in the caller's CUDA context, so the cache only gives back what this
  user wrote. The directory is created 0700 and refused (ConfigError naming it and
  ``MOE_COMM_CACHE_DIR``) unless this user owns it and nobody else may write it; entries and locks
  are opened relative to the checked directory's descriptor without following symlinks, checked
  on their own descriptor (:mod:`moe_comm.private`) and read from it (:func:`read_cubin`).

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
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .. import protocol
from ..assets import asset_dir
from ..errors import CommTimeoutError, CompileError, InputError
from ..private import open_private_dir, open_private_file, read_private_file

__all__ = [
    "Build",
    "CACHE_SCHEMA_VERSION",
    "Defines",
    "LOCK_WAIT_S",
    "MAX_CUBIN_BYTES",
    "MIN_ARCH",
    "Toolchain",
    "arch_capability",
    "cache_dir",
    "canonical_defines",
    "compile_all",
    "compile_many",
    "compile_source",
    "nvrtc_version",
    "read_cubin",
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
# The largest cubin the cache gives back: ours are a few MiB; a file far past that is not one of them.
MAX_CUBIN_BYTES = 256 << 20
# The longest wait for another process's compile of the same entry (its lock); a compile takes seconds.
LOCK_WAIT_S = 600.0
_LOCK_POLL_S = 0.05
_CACHE_FIX = "Set MOE_COMM_CACHE_DIR to a directory only you can write (it is created with mode 0700 if missing)."


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
        ConfigError: the cache directory or this entry could be changed by another user (see :func:`read_cubin`).
        CommTimeoutError: another process held this entry's lock for :data:`LOCK_WAIT_S`.
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
    dir_fd = open_private_dir(directory, _CACHE_FIX)
    try:
        if _has_entry(path, dir_fd):
            return path
        lock_path = directory / f"{stem}.lock"
        lock = open_private_file(lock_path.name, dir_fd, os.O_RDWR | os.O_CREAT, f"kernel cache lock {lock_path}")
        try:  # closing the lock's descriptor releases it
            _wait_for_lock(lock, lock_path)
            if _has_entry(path, dir_fd):  # another process compiled it while we waited for the lock
                return path
            _write_entry(dir_fd, path.name, _nvrtc_compile(name, text, headers, options))
        finally:
            os.close(lock)
    finally:
        os.close(dir_fd)
    return path


def _has_entry(path: Path, dir_fd: int) -> bool:
    """True if the cache directory ``dir_fd`` holds ``path``'s entry as a file of ours that nobody else
    may write; ConfigError if it holds something else under that name (a symlink, a FIFO, another's file)."""
    try:
        os.close(open_private_file(path.name, dir_fd, os.O_RDONLY, f"cached kernel {path}"))
    except FileNotFoundError:
        return False
    return True


def _wait_for_lock(lock: int, lock_path: Path) -> None:
    """Take the exclusive ``flock`` on ``lock``, waiting at most :data:`LOCK_WAIT_S` for its holder."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"waited {LOCK_WAIT_S:.0f} s for the kernel cache lock {lock_path}, held by another process "
                    "all that time (a compile takes seconds). Find the process that holds it (`fuser` on the file), "
                    "or point MOE_COMM_CACHE_DIR at another directory."
                ) from None
            time.sleep(_LOCK_POLL_S)


def _write_entry(dir_fd: int, name: str, cubin: bytes) -> None:
    """Write ``cubin`` to a fresh temp file in the cache directory and move it into place as ``name``."""
    temp = f".{name}.{secrets.token_hex(8)}.tmp"
    out = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(out, "wb") as handle:
            handle.write(cubin)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(temp, dir_fd=dir_fd)
        raise


def read_cubin(path: Path) -> bytes:
    """The bytes of a cubin :func:`compile_source` returned, read from a descriptor that was checked
    to be a regular file of this user, in a directory of this user, that nobody else may write.

    Raises:
        ConfigError: the cache directory or the file could be changed by another user, the entry is a
            symlink, a FIFO or larger than :data:`MAX_CUBIN_BYTES`.
    """
    dir_fd = open_private_dir(path.parent, _CACHE_FIX)
    try:
        fd = open_private_file(path.name, dir_fd, os.O_RDONLY, f"cached kernel {path}")
    finally:
        os.close(dir_fd)
    try:
        return read_private_file(fd, MAX_CUBIN_BYTES, f"cached kernel {path}")
    finally:
        os.close(fd)


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
