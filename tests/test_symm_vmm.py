"""Contract of moe_comm.symm.vmm: every rank reaches every copy; setup and close leave nothing behind.

GPU tests (marked ``gpu``) run ranks in their own processes (``multirank.run_ranks``) over a gloo
group, one GPU per rank or two ranks per GPU; each rank function runs several scenarios, since
every spawn costs a fresh ``import torch`` per rank. The CPU tests at the end check the parts
that need no GPU: the fd exchange between ranks, the undo stack and argument checks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from moe_comm.errors import BackendError, CommTimeoutError, InputError
from moe_comm.symm import vmm
from moe_comm.symm.base import SymmetricMemory, wrap_device_pointer
from moe_comm.symm.vmm import VmmSymmetricMemory, open_fd_count

NBYTES = 8 << 20  # 8 MiB: four granules, so a leaked allocation shows in the free-memory check
TIMEOUT_S = 60.0


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _pattern(rank: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values exact in every dtype used (ints below 256) and different for every rank."""
    return ((torch.arange(n, device=device) * 7 + 31 * rank + 1) % 256).to(dtype)


def _round(rank: int, device: torch.device, value: int) -> None:
    """Build, touch, close: the unit the leak checks repeat."""
    mem = VmmSymmetricMemory(None, device, NBYTES, timeout_s=TIMEOUT_S)
    mem.tensor(rank, 0, (1024,), torch.int32).fill_(value)
    dist.barrier()  # nobody unmaps while a peer may still use the memory
    mem.close()
    mem.close()  # idempotent


def _warm_up(rank: int, device: torch.device) -> tuple[int, int]:
    """One round first, then the fd count and free memory to come back to.

    The first use of a torch kernel loads its module lazily (92 MiB of GPU memory per process
    for the first fill_ on the GPU machines): that must happen before the baseline.
    """
    _round(rank, device, -1)
    return _settle(device)


def _settle(device: torch.device) -> tuple[int, int]:
    """Open fds and free GPU memory once every rank has finished what it was doing."""
    torch.cuda.synchronize(device)
    dist.barrier()
    torch.cuda.empty_cache()  # peer_ptrs_tensor came from torch's caching allocator
    return open_fd_count(), torch.cuda.mem_get_info(device)[0]


def rank_reach_every_copy(rank: int, world_size: int, fd_passing: str) -> None:
    device = _device()
    n = 4096
    with VmmSymmetricMemory(None, device, NBYTES - 12345, timeout_s=TIMEOUT_S, fd_passing=fd_passing) as mem:
        assert (mem.rank, mem.world_size, mem.device, mem.nbytes) == (rank, world_size, device, NBYTES)
        assert len(mem.peer_ptrs) == world_size and mem.local_ptr == mem.peer_ptrs[rank]
        ptrs = mem.peer_ptrs_tensor
        assert ptrs.dtype == torch.int64 and ptrs.device == device and ptrs.tolist() == mem.peer_ptrs

        # The whole copy starts zeroed, and the peers see it zeroed.
        whole = mem.tensor(rank, 0, (NBYTES,), torch.uint8)
        assert whole.data_ptr() == mem.local_ptr and int(whole.count_nonzero()) == 0

        # Each rank writes its pattern in two dtypes: bf16 (no __cuda_array_interface__ type) at 0,
        # int32 at an offset past the first granule.
        int_offset = (2 << 20) + 64
        mem.tensor(rank, 0, (n,), torch.bfloat16).copy_(_pattern(rank, n, torch.bfloat16, device))
        mem.tensor(rank, int_offset, (4, n // 4), torch.int32).copy_(
            _pattern(rank, n, torch.int32, device).view(4, n // 4))
        torch.cuda.synchronize(device)
        dist.barrier()

        for peer in range(world_size):
            view = mem.tensor(peer, 0, (n,), torch.bfloat16)
            assert view.device == device and view.data_ptr() == mem.peer_ptrs[peer]
            assert torch.equal(view, _pattern(peer, n, torch.bfloat16, device)), f"rank {peer}'s bf16 copy"
            ints = mem.tensor(peer, int_offset, (4, n // 4), torch.int32)
            assert torch.equal(ints.flatten(), _pattern(peer, n, torch.int32, device)), f"rank {peer}'s int32 copy"

        # The contiguous view: [r] is rank r's copy at the offset.
        both = mem.contiguous_view(int_offset, (4, n // 4), torch.int32)
        assert both.shape == (world_size, 4, n // 4) and both.device == device
        for peer in range(world_size):
            assert both[peer].data_ptr() == mem.peer_ptrs[peer] + int_offset
            assert torch.equal(both[peer].flatten(), _pattern(peer, n, torch.int32, device))
        assert torch.equal(mem.contiguous_view(0, (n,), torch.bfloat16)[:, :8],
                           torch.stack([_pattern(r, n, torch.bfloat16, device)[:8] for r in range(world_size)]))

        # Kernels on this GPU write into a peer's copy: a copy, and a read-modify-write kernel,
        # each into this rank's own slot of its right neighbour's copy.
        right, left = (rank + 1) % world_size, (rank - 1) % world_size
        slot = 4 << 20
        values = _pattern(rank, n, torch.float32, device)
        mem.tensor(right, slot + rank * n * 4, (n,), torch.float32).copy_(values)
        remote = mem.tensor(right, slot + (world_size + rank) * n * 4, (n,), torch.float32)
        remote.fill_(1.0)
        remote.add_(values)
        torch.cuda.synchronize(device)
        dist.barrier()
        expected = _pattern(left, n, torch.float32, device)
        assert torch.equal(mem.tensor(rank, slot + left * n * 4, (n,), torch.float32), expected)
        assert torch.equal(mem.tensor(rank, slot + (world_size + left) * n * 4, (n,), torch.float32), expected + 1)

        # Views are checked against the copy's size and the dtype's alignment.
        with pytest.raises(InputError, match="offset_bytes"):
            mem.tensor(rank, 2, (4,), torch.float32)
        with pytest.raises(InputError, match="needs"):
            mem.tensor(rank, NBYTES - 4, (2,), torch.float32)
        with pytest.raises(InputError, match="rank"):
            mem.tensor(world_size, 0, (1,), torch.uint8)
        dist.barrier()  # nobody unmaps while a peer may still read
    assert mem.closed
    mem.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        mem.tensor(rank, 0, (1,), torch.uint8)


# World 2: one rank per GPU, peers over NVLink. World 4: two ranks share each GPU, so a "peer"
# copy may sit on this rank's own GPU. pidfd passing runs once (the GPU machines allow it).
@pytest.mark.gpu
@pytest.mark.parametrize("world_size,fd_passing", [(2, "scm_rights"), (4, "scm_rights"), (2, "pidfd")])
def test_every_rank_reaches_every_copy(world_size, fd_passing, requires_gpus):
    from multirank import run_ranks

    requires_gpus(2)

    # The last rank arrives late: nobody may connect to a socket before its owner listens.
    run_ranks(rank_reach_every_copy, world_size, fd_passing, gpu=True, timeout_s=180.0,
              delay_rank=(world_size - 1, 1.0))


def rank_build_and_close(rank: int, world_size: int, rounds: int) -> None:
    device = _device()
    fds, free = _warm_up(rank, device)
    for i in range(rounds):
        _round(rank, device, i)
    fds_after, free_after = _settle(device)
    assert fds_after == fds, f"fd leak: {fds} open fds before {rounds} build/close rounds, {fds_after} after"
    assert free - free_after < NBYTES, f"GPU memory leak: {free - free_after} bytes fewer free after {rounds} rounds"


@pytest.mark.gpu
def test_build_and_close_leaves_nothing_behind(requires_gpus):
    from multirank import run_ranks

    requires_gpus(2)

    # World 4 so that two ranks per GPU also import each other's memory.
    run_ranks(rank_build_and_close, 4, 20, gpu=True, timeout_s=240.0)


def _inject_failure(*args, **kwargs):
    raise BackendError("injected failure in cuMemSetAccess")


def rank_failed_setup_is_undone(rank: int, world_size: int, failing_ranks: list[int]) -> None:
    device = _device()
    fds, free = _warm_up(rank, device)
    # The failure comes after every allocation was imported and mapped: the deepest undo stack.
    inject = mock.patch.object(VmmSymmetricMemory, "_set_access", _inject_failure)
    with inject if rank in failing_ranks else contextlib.nullcontext():
        with pytest.raises(BackendError) as info:
            VmmSymmetricMemory(None, device, NBYTES, timeout_s=TIMEOUT_S)
    if rank in failing_ranks:
        assert "injected failure" in str(info.value)
    else:  # the others learn which rank failed instead of timing out
        assert f"rank {failing_ranks[0]}: BackendError: injected failure" in str(info.value)
    fds_after, free_after = _settle(device)
    assert fds_after == fds, f"fd leak after a failed setup: {fds} before, {fds_after} after"
    assert free - free_after < NBYTES, f"GPU memory leak after a failed setup: {free - free_after} bytes"
    _round(rank, device, 1)  # and the next setup works


# Every rank failing unwinds everywhere; one rank failing must also unwind the ranks that succeeded.
@pytest.mark.gpu
@pytest.mark.parametrize("failing_ranks", [[0, 1, 2, 3], [1]])
def test_failed_setup_leaves_nothing_behind(failing_ranks, requires_gpus):
    from multirank import run_ranks

    requires_gpus(2)

    run_ranks(rank_failed_setup_is_undone, 4, failing_ranks, gpu=True, timeout_s=180.0)


def rank_missing_undo_is_caught(rank: int, world_size: int) -> bool:
    """The leak check above is meaningful: with the handle-release undo removed, free memory does not come back."""
    device = _device()
    _, free = _warm_up(rank, device)
    with mock.patch.object(vmm, "_release", lambda handle: None):
        _round(rank, device, 0)
    _, free_after = _settle(device)
    return free - free_after >= NBYTES


@pytest.mark.gpu
def test_leak_check_catches_a_missing_undo(requires_gpus):
    from multirank import run_ranks

    requires_gpus(2)

    assert all(run_ranks(rank_missing_undo_is_caught, 2, gpu=True, timeout_s=120.0))



# ------------------------------------------------------------------ CPU: fd exchange, undo stack, arguments


def _memfd(tag: str) -> int:
    return os.memfd_create(f"moe_comm-test-{tag}")


def _same_file(a: int, b: int) -> bool:
    return os.fstat(a).st_ino == os.fstat(b).st_ino


def test_undo_stack_runs_newest_first_and_past_failures():
    ran = []
    undo = vmm._UndoStack()
    undo.push("first", lambda: ran.append("first"))
    early = undo.push("early", lambda: ran.append("early"))

    def broken():
        ran.append("broken")
        raise OSError("boom")

    undo.push("broken", broken)
    undo.push("last", lambda: ran.append("last"))
    undo.run(early)  # run now and never again
    assert ran == ["early"]
    errors = undo.unwind()
    assert ran == ["early", "last", "broken", "first"]
    assert len(errors) == 1 and "broken" in errors[0] and "boom" in errors[0]
    assert undo.unwind() == [] and ran == ["early", "last", "broken", "first"]


def _exchange_ranks(world_size: int, fds: list[int], senders: list[int], timeout_s: float):
    """Run the scm_rights exchange for ranks on threads of this process; returns per-rank (received, error, undo)."""
    token = os.urandom(8).hex()
    pids = [os.getpid()] * world_size
    undos = [vmm._UndoStack() for _ in range(world_size)]
    exchanges = [vmm._FdExchange(r, world_size, 2 << 20, timeout_s, undos[r]) for r in range(world_size)]
    listeners = [exchange.listen(token) for exchange in exchanges]
    results: list = [None] * world_size
    deadline = time.monotonic() + timeout_s

    def rank_body(rank: int) -> None:
        try:
            if rank in senders:
                exchanges[rank].send(fds[rank], token, deadline)
            results[rank] = (exchanges[rank].receive(listeners[rank][0], pids, deadline), None)
        except Exception as exc:
            results[rank] = (None, exc)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [(received, error, undos[r]) for r, (received, error) in enumerate(results)]


def test_scm_rights_exchange_hands_every_fd_to_every_peer_and_unwinds():
    start = open_fd_count()
    fds = [_memfd(f"rank{r}") for r in range(3)]
    results = _exchange_ranks(3, fds, senders=[0, 1, 2], timeout_s=10.0)
    for rank, (received, error, _) in enumerate(results):
        assert error is None, error
        assert sorted(received) == [r for r in range(3) if r != rank]
        for peer, (fd, _) in received.items():
            assert fd not in fds and _same_file(fd, fds[peer])
    for _, _, undo in results:
        assert undo.unwind() == []  # closes the received fds and the listening sockets
    for fd in fds:
        os.close(fd)
    assert open_fd_count() == start


def test_missing_peer_times_out_naming_it_and_leaks_nothing():
    start = open_fd_count()
    fds = [_memfd(f"rank{r}") for r in range(3)]
    results = _exchange_ranks(3, fds, senders=[1], timeout_s=0.5)  # ranks 0 and 2 never send
    received, error, _ = results[2]
    assert isinstance(error, CommTimeoutError)
    assert "rank 2" in str(error) and "[0]" in str(error) and "receive" in str(error)
    _, error, _ = results[0]
    assert isinstance(error, CommTimeoutError) and "[2]" in str(error)  # rank 1's fd arrived
    for _, _, undo in results:
        assert undo.unwind() == []
    for fd in fds:
        os.close(fd)
    assert open_fd_count() == start


def test_a_sender_with_the_wrong_pid_is_refused():
    """SO_PEERCRED must match the pid the claimed rank announced through the group."""
    start = open_fd_count()
    token = os.urandom(8).hex()
    undo = vmm._UndoStack()
    exchange = vmm._FdExchange(0, 2, 2 << 20, 5.0, undo)
    listener, _ = exchange.listen(token)
    impostor = vmm._FdExchange(1, 2, 2 << 20, 5.0, vmm._UndoStack())
    fd = _memfd("impostor")
    impostor.send(fd, token, time.monotonic() + 5.0)
    with pytest.raises(BackendError, match="unexpected fd message"):
        exchange.receive(listener, pids=[os.getpid(), os.getpid() + 1_000_000], deadline=time.monotonic() + 5.0)
    assert undo.unwind() == []  # the fd that came with the refused message is closed too
    os.close(fd)
    assert open_fd_count() == start


def test_send_to_a_rank_that_is_not_listening_names_it():
    exchange = vmm._FdExchange(0, 2, 2 << 20, 1.0, vmm._UndoStack())
    fd = _memfd("lonely")
    try:
        with pytest.raises(BackendError, match="to rank 1"):
            exchange.send(fd, os.urandom(8).hex(), time.monotonic() + 1.0)
    finally:
        os.close(fd)


def test_pidfd_fetch_copies_the_fd_or_explains_why_not():
    """pidfd_getfd on this very process: works where ptrace rules allow, else says to use scm_rights."""
    undo = vmm._UndoStack()
    exchange = vmm._FdExchange(0, 2, 2 << 20, 1.0, undo)
    fd = _memfd("pidfd")
    try:
        received = exchange.fetch_pidfd([os.getpid(), os.getpid()], [-1, fd])
    except BackendError as exc:
        assert "scm_rights" in str(exc)
    else:
        (copy, _), = received.values()
        assert copy != fd and _same_file(copy, fd)
    finally:
        assert undo.unwind() == []
        os.close(fd)


def test_socket_names_live_in_the_abstract_namespace():
    name = vmm._socket_name("abc", 3)
    assert name.startswith("\0") and name.endswith("abc-3")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(name)  # no file is created, nothing to clean up


def test_arguments_are_checked_before_any_collective():
    cuda0 = torch.device("cuda", 0)
    with pytest.raises(InputError, match="device"):
        VmmSymmetricMemory(None, torch.device("cuda"), 1 << 20, timeout_s=1.0)
    with pytest.raises(InputError, match="nbytes"):
        VmmSymmetricMemory(None, cuda0, 0, timeout_s=1.0)
    with pytest.raises(InputError, match="timeout_s"):
        VmmSymmetricMemory(None, cuda0, 1 << 20, timeout_s=float("inf"))
    with pytest.raises(InputError, match="fd_passing"):
        VmmSymmetricMemory(None, cuda0, 1 << 20, timeout_s=1.0, fd_passing="carrier pigeon")
    with pytest.raises(InputError, match="index"):
        wrap_device_pointer(0x1000, 16, torch.device("cuda"))


class _FakeMemory(SymmetricMemory):
    """Just enough of a backend to check the view arguments without a GPU."""

    rank, world_size, nbytes = 0, 2, 4096
    device = torch.device("cuda", 0)
    peer_ptrs = [0x10000, 0x20000]
    peer_ptrs_tensor = None
    closed = False

    def close(self) -> None:
        self.closed = True


def test_views_are_checked_against_rank_size_and_alignment():
    mem = _FakeMemory()
    with pytest.raises(InputError, match="rank"):
        mem.tensor(2, 0, (4,), torch.float32)
    with pytest.raises(InputError, match="offset_bytes"):
        mem.tensor(0, 2, (4,), torch.float32)
    with pytest.raises(InputError, match="needs 4100 bytes"):
        mem.tensor(1, 4, (1024,), torch.float32)
    with pytest.raises(InputError, match="shape"):
        mem.tensor(0, 0, (-1,), torch.float32)
    with mem:
        pass
    with pytest.raises(BackendError, match="closed"):
        mem.tensor(0, 0, (4,), torch.float32)
