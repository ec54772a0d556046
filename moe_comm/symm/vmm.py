"""Symmetric memory from CUDA VMM, shared between the processes of one host.

Every rank creates one allocation (``cuMemCreate``, POSIX file-descriptor handle), exports it
as an fd, hands the fd to every peer (``SCM_RIGHTS`` over a Unix socket in a 0700 directory rank 0
makes for the setup, each end checking the other's process with ``SO_PEERCRED``; or ``pidfd_getfd``),
imports the peers' fds and maps all ``world_size`` allocations back to back into one reserved
virtual-address range, so ``peer_ptrs[r] = base + r * nbytes``.

NOTE: the per-rank pointers and the contiguous ``[world, ...]`` view share one mapping of every
allocation: one reservation, ``world_size`` maps and one ``cuMemSetAccess``, and
:meth:`VmmSymmetricMemory.contiguous_view` needs no driver call (it cannot fail half-way).

Setup is collective over the group and transactional: each completed step registers its undo
(unmap, free the address range, release a handle, close an fd, close a socket) and a failure on
any rank unwinds everything on every rank. The ranks agree after each phase (inspect, allocate,
map) with one ``all_gather_object`` that carries each rank's error (:func:`moe_comm.agreement.agree`),
so a rank that fails locally makes every rank raise at once, naming it, instead of leaving them to
time out. Waits on sockets
are bounded by ``timeout_s``; the gathers are bounded by the group's own timeout (pass a gloo
group created with the timeout you want).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import os
import shutil
import socket
import struct
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..agreement import agree
from ..errors import BackendError, CommTimeoutError, ConfigError, InputError, MoeCommError
from ..cuda.driver import cu_check, cuda_driver, device_context
from ..private import check_private_dir
from .base import SymmetricMemory, wrap_device_pointer

__all__ = ["FD_PASSING", "VmmSymmetricMemory", "open_fd_count"]

FD_PASSING = ("scm_rights", "pidfd")

_SYS_PIDFD_GETFD = 438  # same number on x86_64 and aarch64
# What a sender puts beside its fd: its rank and its allocation's size (the receiver checks both).
_HEADER = struct.Struct("<iQ")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def open_fd_count() -> int:
    """Number of open file descriptors of this process (``/proc/self/fd``, the listing's own included)."""
    return len(os.listdir("/proc/self/fd"))


class _UndoStack:
    """Undo actions of completed setup steps, run last-in first-out."""

    def __init__(self) -> None:
        self._entries: list[tuple[str, Callable[[], None]]] = []

    def push(self, step: str, undo: Callable[[], None]) -> tuple[str, Callable[[], None]]:
        entry = (step, undo)
        self._entries.append(entry)
        return entry

    def run(self, entry: tuple[str, Callable[[], None]]) -> None:
        """Undo one step now (e.g. close an fd once it is imported) and forget it."""
        for position in range(len(self._entries) - 1, -1, -1):
            if self._entries[position] is entry:
                del self._entries[position]
                break
        entry[1]()

    def unwind(self) -> list[str]:
        """Run every undo, newest first, even past failures; returns the failures as text."""
        errors = []
        while self._entries:
            step, undo = self._entries.pop()
            try:
                undo()
            except Exception as exc:  # keep unwinding: every later undo still has to run
                errors.append(f"undo of {step}: {exc}")
        return errors


# Undo actions (module-level so a test can remove one and show the leak test catches it).
def _release(handle: Any) -> None:
    cu_check(cuda_driver().cuMemRelease(handle), "cuMemRelease")


def _free_address(ptr: int, size: int) -> None:
    cu_check(cuda_driver().cuMemAddressFree(ptr, size), "cuMemAddressFree")


def _unmap(ptr: int, size: int) -> None:
    cu_check(cuda_driver().cuMemUnmap(ptr, size), "cuMemUnmap")


def _peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError as exc:
        raise BackendError(f"vmm needs Linux: cannot read /proc/sys/kernel/random/boot_id ({exc})") from exc


def _socket_path(directory: str, rank: int) -> str:
    return os.path.join(directory, str(rank))


# What the socket directory's check tells a user to do (it is rank 0's temp dir: nothing to set).
_SOCKET_DIR_FIX = "Every rank of the group must run as the same user; the directory is rank 0's and made 0700."


def _make_socket_dir() -> str:
    """A fresh directory for the fd sockets of one setup, mode 0700: no other user can connect in it."""
    return tempfile.mkdtemp(prefix="moe_comm-vmm-")


class _FdExchange:
    """Hands this rank's exported fd to every peer and collects theirs (one setup's worth).

    The sockets live in rank 0's 0700 directory, so only this user reaches them; besides, a sender
    checks that the socket it reached is held by the peer's process (``SO_PEERCRED``) before the fd
    goes out, and a receiver drops any connection from a process that is not a peer still awaited
    and keeps accepting. Every fd received is registered on ``undo`` at once (closing it), so a
    failure anywhere leaves none open. Waits are bounded by ``deadline`` (``time.monotonic()`` seconds).

    pids: every rank's process id, as the ranks announced it through the group.
    """

    def __init__(self, rank: int, world_size: int, size: int, timeout_s: float, undo: _UndoStack, pids: list[int]):
        self.rank = rank
        self.world_size = world_size
        self.size = size
        self.timeout_s = timeout_s
        self.undo = undo
        self.pids = pids

    def _keep(self, fd: int) -> tuple:
        return self.undo.push(f"received fd {fd}", functools.partial(os.close, fd))

    def listen(self, directory: str) -> tuple[socket.socket, tuple]:
        """Open this rank's fd socket in ``directory``; returns it and its undo entry (close it once the
        exchange is over). The directory must be this user's and no one else's."""
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise BackendError(f"rank {self.rank} cannot open the fd socket directory {directory}: {exc}") from exc
        try:
            check_private_dir(dir_fd, Path(directory), _SOCKET_DIR_FIX)
        except ConfigError as exc:
            raise BackendError(f"rank {self.rank}: {exc}") from None
        finally:
            os.close(dir_fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        entry = self.undo.push("fd socket", sock.close)
        try:
            sock.bind(_socket_path(directory, self.rank))
            sock.listen(self.world_size)
        except OSError as exc:
            raise BackendError(f"rank {self.rank} could not listen on its fd socket: {exc}") from exc
        return sock, entry

    def send(self, fd: int, directory: str, deadline: float) -> None:
        """Connect to every peer's socket and send ``fd`` (a queued connection needs no accept to complete),
        once ``SO_PEERCRED`` shows the peer's own process listening there."""
        header = _HEADER.pack(self.rank, self.size)
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            step = f"(step: vmm fd exchange, send to rank {peer})"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    sock.connect(_socket_path(directory, peer))
                    pid, uid = _peer_credentials(sock)
                    if (pid, uid) != (self.pids[peer], os.geteuid()):
                        raise BackendError(
                            f"rank {self.rank}: the fd socket of rank {peer} is held by pid {pid} (uid {uid}), not by "
                            f"rank {peer}'s process (pid {self.pids[peer]}, uid {os.geteuid()}); no fd was sent "
                            f"{step}"
                        )
                    socket.send_fds(sock, [header], [fd])
                except TimeoutError:
                    raise CommTimeoutError(
                        f"rank {self.rank} timed out after {self.timeout_s:.1f} s sending its memory fd to "
                        f"rank {peer} {step}"
                    ) from None
                except OSError as exc:
                    raise BackendError(f"rank {self.rank} could not send its memory fd to rank {peer} {step}: "
                                       f"{exc}") from exc

    def receive(self, listener: socket.socket, deadline: float) -> dict[int, tuple[int, tuple]]:
        """Accept one connection per peer; returns peer rank -> (fd, its undo entry).

        A connection from a process that is not an awaited peer (``SO_PEERCRED`` pid and uid) is
        closed unread and the accepting goes on. An awaited peer's message must name that peer
        and our size.
        """
        received: dict[int, tuple[int, tuple]] = {}
        dropped: list[str] = []
        while len(received) < self.world_size - 1:
            missing = [r for r in range(self.world_size) if r != self.rank and r not in received]
            timeout_error = CommTimeoutError(
                f"rank {self.rank} timed out after {self.timeout_s:.1f} s waiting for the memory fd of rank(s) "
                f"{missing} (step: vmm fd exchange, receive)"
                + (f"; dropped connections from {', '.join(dropped)}" if dropped else "")
            )
            listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                raise timeout_error from None
            with conn:
                pid, uid = _peer_credentials(conn)
                if uid != os.geteuid() or pid not in [self.pids[r] for r in missing]:
                    dropped.append(f"pid {pid} (uid {uid})")
                    continue
                conn.settimeout(max(deadline - time.monotonic(), 1e-3))
                try:
                    data, fds, flags, _ = socket.recv_fds(conn, _HEADER.size, 1)
                except TimeoutError:
                    raise timeout_error from None
                entries = [self._keep(fd) for fd in fds]
                if len(data) != _HEADER.size or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                    raise BackendError(
                        f"rank {self.rank} got a malformed fd message from pid {pid} ({len(data)} bytes, "
                        f"{len(fds)} fds) on its fd socket (step: vmm fd exchange, receive)"
                    )
                sender, their_size = _HEADER.unpack(data)
                if sender not in missing or self.pids[sender] != pid or their_size != self.size:
                    raise BackendError(
                        f"rank {self.rank} got an unexpected fd message: it claims rank {sender} with {their_size} "
                        f"bytes from pid {pid}; expected one of ranks {missing} (pids "
                        f"{[self.pids[r] for r in missing]}) with {self.size} bytes (step: vmm fd exchange, receive)"
                    )
                received[sender] = (fds[0], entries[0])
        return received

    def fetch_pidfd(self, remote_fds: list[int]) -> dict[int, tuple[int, tuple]]:
        """Copy every peer's exported fd out of its process (``pidfd_getfd``); returns peer -> (fd, undo entry)."""
        libc = ctypes.CDLL(None, use_errno=True)
        received = {}
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                pidfd = os.pidfd_open(self.pids[peer])
            except OSError as exc:
                raise BackendError(
                    f"rank {self.rank}: pidfd_open of rank {peer} (pid {self.pids[peer]}) failed: {exc}; use "
                    "vmm.fd_passing: scm_rights"
                ) from exc
            try:
                fd = libc.syscall(_SYS_PIDFD_GETFD, pidfd, remote_fds[peer], 0)
                code = ctypes.get_errno()
            finally:
                os.close(pidfd)
            if fd < 0:
                hint = (
                    "the kernel's ptrace rules forbid it (Yama ptrace_scope, or not root in a container)"
                    if code == errno.EPERM else os.strerror(code)
                )
                raise BackendError(
                    f"rank {self.rank}: pidfd_getfd of rank {peer}'s memory fd (pid {self.pids[peer]}) failed: {hint}. "
                    "Set vmm.fd_passing: scm_rights, which works for any user."
                )
            received[peer] = (fd, self._keep(fd))
        return received


class VmmSymmetricMemory(SymmetricMemory):
    """``nbytes`` of CUDA VMM memory on every rank of a one-host group, every copy mapped in every rank.

    Collective: every rank of ``group`` constructs it with the same ``nbytes`` and ``fd_passing``.
    Several ranks may share a GPU. The memory is zeroed and every rank has finished zeroing its
    copy when the constructor returns.

    Args:
        group: ``torch.distributed`` process group of processes on this host (None: the default
            group). It carries the host-side exchanges; a gloo group is recommended.
        device: this rank's CUDA device, with an index.
        nbytes: bytes per rank; rounded up to the allocation granularity (2 MiB on H100/H200),
            see :attr:`nbytes`.
        timeout_s: bound of every wait on a peer's socket.
        fd_passing: ``"scm_rights"`` (a Unix socket; any user) or ``"pidfd"`` (``pidfd_getfd``;
            root, or no Yama ptrace restriction).

    Raises:
        InputError: an argument is malformed.
        BackendError: the ranks are not on one host, their GPUs cannot reach each other, or a
            driver step failed (on this rank or, named, on another).
        CommTimeoutError: a peer did not connect or send its fd within ``timeout_s``.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        device: torch.device,
        nbytes: int,
        *,
        timeout_s: float,
        fd_passing: str = "scm_rights",
    ):
        if not isinstance(device, torch.device) or device.type != "cuda" or device.index is None:
            raise InputError(
                f"device: got {device!r}, expected a CUDA device with an index, e.g. torch.device('cuda', 0)"
            )
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InputError(f"nbytes: got {nbytes!r}, expected an int > 0")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise InputError(f"timeout_s: got {timeout_s!r}, expected a positive number of seconds")
        if fd_passing not in FD_PASSING:
            raise InputError(f"fd_passing: got {fd_passing!r}, expected one of {', '.join(map(repr, FD_PASSING))}")
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self.nbytes = nbytes
        self._timeout_s = float(timeout_s)
        self._fd_passing = fd_passing
        self._undo = _UndoStack()
        self._closed = False
        self._base = 0
        self._peer_ptrs: list[int] = []
        self._peer_ptrs_tensor: Optional[torch.Tensor] = None
        # Setup state shared between the phases (see _setup).
        self._own_handle: Any = None
        self._own_fd = -1
        self._own_fd_entry: Optional[tuple] = None
        self._exchange: Optional[_FdExchange] = None
        self._listener: Optional[tuple[socket.socket, tuple]] = None
        self._socket_dir_entry: Optional[tuple] = None
        try:
            with device_context(device):
                self._setup(nbytes)
        except BaseException:
            self._closed = True
            errors = self._unwind()
            if errors:  # the setup error is the one to raise; cleanup trouble is reported beside it
                warnings.warn(f"VmmSymmetricMemory cleanup after a failed setup: {'; '.join(errors)}", RuntimeWarning)
            raise

    # ------------------------------------------------------------------ the SymmetricMemory contract

    def close(self) -> None:
        """Synchronise the device, then unmap and release everything this rank holds; idempotent.

        Local: a peer's memory stays alive until that peer and every importer have closed.

        Raises:
            BackendError: an undo step failed (every other step still ran).
        """
        if self._closed:
            return
        self._closed = True
        self._peer_ptrs_tensor = None
        try:
            # Work still queued on any stream may use the mappings: it must end before they go.
            torch.cuda.synchronize(self.device)
        finally:
            errors = self._unwind()
        if errors:
            raise BackendError(f"VmmSymmetricMemory.close on rank {self.rank}: {'; '.join(errors)}")

    def contiguous_view(self, offset_bytes: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """One tensor ``[world_size, *shape]`` of ``dtype`` whose ``[r]`` is rank r's copy at ``offset_bytes``.

        Zero-copy over the back-to-back mapping of all copies (the rank stride is :attr:`nbytes`);
        on :attr:`device`. Raises as :meth:`tensor`.
        """
        self._check_open()
        self._check_view(offset_bytes, shape, dtype)
        itemsize = dtype.itemsize
        strides = []
        step = 1
        for size in reversed(tuple(shape)):
            strides.append(step)
            step *= max(size, 1)
        flat = wrap_device_pointer(self._base, self.world_size * self.nbytes, self.device).view(dtype)
        return flat.as_strided(
            (self.world_size, *shape), (self.nbytes // itemsize, *reversed(strides)), offset_bytes // itemsize
        )

    # ------------------------------------------------------------------ setup

    def _setup(self, requested: int) -> None:
        driver = cuda_driver()
        prop = self._allocation_prop(driver)
        infos = self._agree("inspect", lambda: self._inspect(driver, prop, requested))
        self._check_one_host(infos)
        mine = (requested, self._fd_passing)
        mismatched = [r for r, info in enumerate(infos) if (info["nbytes"], info["fd_passing"]) != mine]
        if mismatched:
            raise BackendError(
                f"VmmSymmetricMemory is collective with equal arguments; rank {self.rank} asked for {requested} bytes "
                f"with fd_passing={self._fd_passing!r}, ranks {mismatched} asked for something else"
            )
        granularity = math.lcm(*(info["granularity"] for info in infos))
        size = requested + (-requested) % granularity
        socket_dir = infos[0]["socket_dir"]
        pids = [info["pid"] for info in infos]

        uuids = [info["uuid"] for info in infos]
        self._exchange = _FdExchange(self.rank, self.world_size, size, self._timeout_s, self._undo, pids)
        remote_fds = self._agree("allocate", lambda: self._allocate(driver, prop, size, uuids, socket_dir))
        self._agree("map", lambda: self._map_all(driver, size, granularity, socket_dir, remote_fds))

        # Every peer holds its own import of our allocation now (the gather above orders it), and
        # every rank is done with the sockets.
        self._undo.run(self._own_fd_entry)
        if self._socket_dir_entry is not None:
            self._undo.run(self._socket_dir_entry)
        self.nbytes = size
        self._peer_ptrs = [self._base + r * size for r in range(self.world_size)]
        self._peer_ptrs_tensor = torch.tensor(self._peer_ptrs, dtype=torch.int64, device=self.device)

    def _agree(self, step: str, local: Callable[[], Any]) -> list:
        """:func:`moe_comm.agreement.agree` on one setup step; returns every rank's result of ``local()``.

        Raises this rank's own error, or a BackendError naming each rank that failed. Only moe_comm's
        own errors are exchanged; any other exception propagates here at once.
        """
        return agree(self._group, local, error=BackendError, what=f"VmmSymmetricMemory setup at step '{step}'",
                     catch=(MoeCommError,))

    def _allocation_prop(self, driver: Any) -> Any:
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device.index
        prop.requestedHandleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _inspect(self, driver: Any, prop: Any, requested: int) -> dict:
        """What the others must know of this rank: host, process, GPU, granularity and its arguments."""
        granularity = cu_check(
            driver.cuMemGetAllocationGranularity(
                prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
        handle = cu_check(driver.cuDeviceGet(self.device.index), "cuDeviceGet")
        return {
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "pid": os.getpid(),
            "uuid": cu_check(driver.cuDeviceGetUuid(handle), "cuDeviceGetUuid").bytes,
            "granularity": int(granularity),
            "nbytes": requested,
            "fd_passing": self._fd_passing,
            "socket_dir": self._socket_dir(),  # only rank 0's is used: the sockets of this setup live there
        }

    def _socket_dir(self) -> Optional[str]:
        """On rank 0 with ``scm_rights`` passing: a fresh 0700 directory for the setup's sockets (removed with
        its undo, on rank 0, once every rank is done with it); else None."""
        if self.rank != 0 or self._fd_passing != "scm_rights":
            return None
        directory = _make_socket_dir()
        self._socket_dir_entry = self._undo.push("fd socket directory", functools.partial(shutil.rmtree, directory))
        return directory

    def _check_one_host(self, infos: list[dict]) -> None:
        hosts: dict[tuple[str, str], list[int]] = {}
        for r, info in enumerate(infos):
            hosts.setdefault((info["host"], info["boot_id"]), []).append(r)
        if len(hosts) > 1:
            where = "; ".join(f"ranks {ranks} on {host} (boot {boot[:8]})" for (host, boot), ranks in hosts.items())
            raise BackendError(
                f"the vmm backend shares memory between the processes of one host only, but the group spans "
                f"{len(hosts)} hosts: {where}. Use the nvshmem or nccl backend across hosts."
            )

    def _check_peer_access(self, driver: Any, uuids: list[bytes]) -> None:
        """Every GPU of the group that this process can see must be able to reach this rank's GPU."""
        count = cu_check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        visible = {}
        for ordinal in range(count):
            handle = cu_check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
            visible[cu_check(driver.cuDeviceGetUuid(handle), "cuDeviceGetUuid").bytes] = handle
        mine = cu_check(driver.cuDeviceGet(self.device.index), "cuDeviceGet")
        for peer, uuid in enumerate(uuids):
            # Same GPU (several ranks per device) needs no peer access; a GPU hidden from this
            # process (CUDA_VISIBLE_DEVICES) cannot be asked, and the import/map reports it.
            if uuid == uuids[self.rank] or uuid not in visible:
                continue
            for source, target in ((mine, visible[uuid]), (visible[uuid], mine)):
                if not cu_check(driver.cuDeviceCanAccessPeer(source, target), "cuDeviceCanAccessPeer"):
                    raise BackendError(
                        f"rank {self.rank}'s GPU (cuda:{self.device.index}) and rank {peer}'s GPU cannot access "
                        "each other's memory (cuDeviceCanAccessPeer is 0); the vmm backend needs peer access "
                        "(NVLink or PCIe P2P). Use the nccl backend on this machine."
                    )

    def _allocate(self, driver: Any, prop: Any, size: int, uuids: list[bytes], socket_dir: Optional[str]) -> int:
        """Create and export this rank's allocation (and open its fd socket); returns the fd's number.

        The number matters to peers only with ``pidfd`` passing, where they copy the fd by number.
        """
        self._check_peer_access(driver, uuids)
        handle = cu_check(driver.cuMemCreate(size, prop, 0), f"cuMemCreate({size} bytes on cuda:{self.device.index})")
        self._undo.push("cuMemCreate", functools.partial(_release, handle))
        self._own_handle = handle
        fd = cu_check(
            driver.cuMemExportToShareableHandle(
                handle, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
            "cuMemExportToShareableHandle(POSIX file descriptor)",
        )
        self._own_fd = fd
        self._own_fd_entry = self._undo.push("export fd", functools.partial(os.close, fd))
        if self._fd_passing == "scm_rights":
            # Listening before the gather that ends this phase: every peer can connect right away.
            self._listener = self._exchange.listen(socket_dir)
        return fd

    def _map_all(
        self, driver: Any, size: int, granularity: int, socket_dir: Optional[str], remote_fds: list[int]
    ) -> None:
        """Receive and import the peers' fds, map all copies back to back, give this GPU access, zero our copy."""
        if self._fd_passing == "scm_rights":
            deadline = time.monotonic() + self._timeout_s
            listener, listener_entry = self._listener
            self._exchange.send(self._own_fd, socket_dir, deadline)
            received = self._exchange.receive(listener, deadline)
            self._undo.run(listener_entry)
        else:
            received = self._exchange.fetch_pidfd(remote_fds)
        handles = {self.rank: self._own_handle}
        for peer, (fd, entry) in sorted(received.items()):
            handle = cu_check(
                driver.cuMemImportFromShareableHandle(
                    fd, driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
                f"cuMemImportFromShareableHandle of rank {peer}'s allocation",
            )
            self._undo.push(f"import of rank {peer}", functools.partial(_release, handle))
            handles[peer] = handle
            self._undo.run(entry)  # the imported handle keeps the memory; the fd is no longer needed
        total = self.world_size * size
        base = int(cu_check(driver.cuMemAddressReserve(total, granularity, 0, 0), f"cuMemAddressReserve({total})"))
        self._undo.push("cuMemAddressReserve", functools.partial(_free_address, base, total))
        for r in range(self.world_size):
            cu_check(driver.cuMemMap(base + r * size, size, 0, handles[r], 0), f"cuMemMap of rank {r}'s allocation")
            self._undo.push(f"cuMemMap of rank {r}", functools.partial(_unmap, base + r * size, size))
        self._set_access(driver, base, total)
        self._base = base
        cu_check(driver.cuMemsetD8(base + self.rank * size, 0, size), "cuMemsetD8 (zero the local copy)")
        # The gather that ends this phase is the barrier: peers may read our copy after it.
        torch.cuda.synchronize(self.device)

    def _set_access(self, driver: Any, base: int, total: int) -> None:
        # The descriptor names the ACCESSING device: this rank's GPU reads and writes every copy.
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        cu_check(driver.cuMemSetAccess(base, total, [access], 1), f"cuMemSetAccess for cuda:{self.device.index}")

    # ------------------------------------------------------------------ teardown

    def _unwind(self) -> list[str]:
        with device_context(self.device):
            return self._undo.unwind()
