"""Files and directories that only this user can change: what a shared node needs of moe_comm's own files.

Another local user must not be able to plant, swap or block what moe_comm reads back (a kernel
cubin runs in the caller's CUDA context; a socket directory decides who may connect). So a
directory is opened once, its descriptor is checked (owned by this user, writable by nobody else)
and files inside it are opened relative to that descriptor, never following a symlink, and checked
again on their own descriptor (a regular file of this user that nobody else may write) before a
byte is read from that same descriptor.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ConfigError

__all__ = ["check_private_dir", "open_private_dir", "open_private_file", "read_private_file"]

# Group or others may write: anyone in them could add, remove or replace entries.
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH
_ANY_ACCESS_BY_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def _owner_problem(info: os.stat_result) -> str:
    """Why a file or directory another user could change is refused; empty when it is this user's alone."""
    if info.st_uid != os.geteuid():
        return f"it is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & _WRITABLE_BY_OTHERS:
        return f"group or others may write it (mode {stat.S_IMODE(info.st_mode):04o})"
    return ""


def check_private_dir(fd: int, path: Path, fix: str) -> None:
    """Raise ConfigError unless the open directory ``fd`` (at ``path``) is this user's and no one else's.

    ``fix`` ends the message (which variable to set, what to do). Read or search bits for group and
    others are taken away (the directory is ours; nobody needs to list it), write bits refuse it.
    """
    info = os.fstat(fd)
    problem = "it is not a directory" if not stat.S_ISDIR(info.st_mode) else _owner_problem(info)
    if problem:
        raise ConfigError(f"{path}: refused, {problem}; another user could plant or swap files in it. {fix}")
    if info.st_mode & _ANY_ACCESS_BY_OTHERS:
        os.fchmod(fd, stat.S_IMODE(info.st_mode) & ~_ANY_ACCESS_BY_OTHERS)


def open_private_dir(path: Path, fix: str) -> int:
    """Create ``path`` (mode 0700, parents as needed) if missing, open it and check it; returns its descriptor.

    The caller closes the descriptor. Raises ConfigError naming ``path`` and ending with ``fix``.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot create or open the directory ({exc}). {fix}") from exc
    try:
        check_private_dir(fd, path, fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(name: str, dir_fd: int, flags: int, what: str) -> int:
    """Open ``name`` in the checked directory ``dir_fd`` without following a symlink; returns the descriptor.

    ``flags``: ``os.O_RDONLY``, or ``os.O_RDWR | os.O_CREAT`` (created 0600). ``O_NONBLOCK`` keeps a
    FIFO from blocking the open; the file must then prove on its descriptor to be a regular file of
    this user that nobody else may write. Raises ConfigError naming ``what`` (FileNotFoundError as is).
    """
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP: a symlink; ENXIO: a FIFO nobody reads (opened for writing)
        raise ConfigError(f"{what}: refused, it cannot be opened as a plain file ({exc})") from exc
    info = os.fstat(fd)
    problem = "it is not a regular file" if not stat.S_ISREG(info.st_mode) else _owner_problem(info)
    if problem:
        os.close(fd)
        raise ConfigError(f"{what}: refused, {problem}")
    return fd


def read_private_file(fd: int, max_bytes: int, what: str) -> bytes:
    """All bytes of the regular file open on ``fd`` (from its start); ConfigError if it exceeds ``max_bytes``."""
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise ConfigError(f"{what}: refused, {size} bytes is more than the {max_bytes} such a file may hold")
    chunks = []
    remaining = size
    while remaining > 0:
        chunk = os.pread(fd, remaining, size - remaining)
        if not chunk:
            raise ConfigError(f"{what}: refused, it shrank from {size} bytes while it was read")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)
