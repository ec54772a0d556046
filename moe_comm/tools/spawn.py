"""Run a function on N local ranks, one process each, and collect what every rank returned.

``run_ranks`` is the one way moe_comm starts several processes: ``moe-comm run`` uses it, and
the test suite's harness (``tests/multirank.py``) is a thin wrapper over it. It cannot hang:

* the rendezvous store is a ``FileStore`` in a directory of this run that only this user can
  enter (``mkdtemp``, mode 0700): no port to pick or collide, and no other local user can read or
  write its keys (a TCP store answers anyone who connects, and the setup collectives unpickle what
  the ranks exchange);
* every child gets the environment that keeps NVLink multicast off (``MULTICAST_OFF_ENV``),
  which the GPU machines require, plus the caller's variables;
* a rank that raises reports its traceback; a rank that crashes is reported with its exit code;
* after ``timeout_s`` (or ``failure_grace_s`` after the first failure, since the other ranks
  are then usually blocked in a collective with the failed one) the survivors' Python stacks are
  dumped (``faulthandler`` on SIGUSR1), they are killed and reaped, and the error names them;
* every child destroys its process group, and every child is joined: no zombies.

Ranks are forked by a fork server (``multiprocessing``'s ``forkserver`` method) that has imported
torch once, so a rank does not pay the seconds of a fresh ``import torch``; the server never
initialises CUDA, so the ranks can. ``fn`` must be a module-level function and its arguments and
return value must be picklable. A rank's environment is the caller's at the time of the call (not
the server's, which started at the first call), plus the variables above.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path
from typing import Any, Callable, Mapping, NoReturn, Optional, Union

from ..errors import RankFailureError

__all__ = ["MULTICAST_OFF_ENV", "RankPool", "exit_now", "run_ranks"]

# NVLink multicast (NVLS) can take a shared host's GPUs out of service: every rank
# process keeps NCCL, torch's symmetric memory and NVSHMEM off it. The launcher owns these
# processes, so it sets the variables there and never in the caller's own environment.
MULTICAST_OFF_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# What the fork server imports before it forks any rank: the seconds every fresh interpreter
# would spend importing them. Never anything that initialises CUDA (a forked child could not).
_FORK_SERVER_PRELOAD = ("torch", "torch.distributed")

# The most intra-op threads a rank gets (see _rank_threads).
_RANK_THREADS_MAX = 8

# The rendezvous store's file in the run directory, and the keys the ranks set once their init returned.
_STORE_FILE = "store"
_JOINED_KEY = "moe_comm/joined/"

# Seconds a killed rank gets to write its stack dump before SIGKILL.
_STACK_DUMP_WAIT_S = 0.5


def _rank_threads(cpu_count: int, world_size: int) -> int:
    """torch's intra-op threads for each of ``world_size`` ranks on a host of ``cpu_count`` cores.

    N ranks share the host's cores: torch's default (all cores per process) oversubscribes them
    and makes CPU runs several times slower. Filling every core is slow too: 2 NVSHMEM ranks on
    32 cores ran the GPU dispatch test's CPU reference 2.4x slower with 16 threads each than
    with 8, where 2 NCCL ranks ran as fast with either (likely NVSHMEM's proxy thread, one per
    rank, left without a core of its own). 4 and 8 ran it equally fast: the ranks' CPU ops
    (reference routing, test checks) are too small to use more.
    """
    return max(1, min(_RANK_THREADS_MAX, cpu_count // world_size))


def _child(
    rank: int,
    world_size: int,
    payload: Optional[bytes],
    options: dict,
    writer: Connection,
    tasks: Optional[Connection] = None,
) -> None:
    """Body of one rank process: join the group, run ``fn``, send ``("ok", bytes)`` or ``("error", text)``.

    A pooled rank (``tasks`` given, ``payload`` None) reports ``("ok", pickled None)`` once it has
    joined the group, then runs every call that arrives on ``tasks`` and reports each, until None.
    """
    # The fork server's environment is that of the first call: replace it with this call's.
    os.environ.clear()
    os.environ.update(options["env"])
    # A forked rank leaves through os._exit once this function returns and its non-daemon threads
    # are joined (a leaked one still hangs the exit, which is reported), before C++'s static
    # destructors: there, a thread torch leaves running (seen after torch.compile and gloo runs on
    # the 2-core CI machine) can abort with "terminate called without an active exception" (exit
    # -6), which would turn a rank that finished and reported into a failed one.
    stack_file = open(Path(options["run_dir"]) / f"rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    dist = None
    try:
        call = None if payload is None else pickle.loads(payload)
        import torch
        import torch.distributed as dist

        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(_rank_threads(os.cpu_count() or 1, world_size))
        timeout = timedelta(seconds=options["timeout_s"])
        store = dist.FileStore(str(Path(options["run_dir"]) / _STORE_FILE), world_size)
        store.set_timeout(timeout)
        kwargs = {}
        if options["gpu"]:
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            if "nccl" in options["dist_backend"]:
                kwargs["device_id"] = device
        dist.init_process_group(
            options["dist_backend"], store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )
        # Every rank's init has returned before any rank goes on: a rank whose function returns at once
        # would otherwise tear its process group down while a peer's gloo still connects to it
        # ("Connection closed by peer" in connectFullMesh, seen once on the 2-core CI machine).
        store.set(f"{_JOINED_KEY}{rank}", "1")
        store.wait([f"{_JOINED_KEY}{r}" for r in range(world_size)], timeout)
        delay = options["delay_rank"]
        if delay is not None and delay[0] == rank:
            time.sleep(delay[1])
        message = ("ok", pickle.dumps(None)) if call is None else _called(call, rank, world_size)
    except BaseException:
        message = ("error", traceback.format_exc())
    # Report before tearing down: a teardown that hangs must not lose the traceback.
    writer.send(message)
    if tasks is not None and message[0] == "ok":
        _serve(rank, world_size, tasks, writer)
    writer.close()
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
    # The stack dump stays registered until exit: a rank that hangs on its way out (a leaked
    # non-daemon thread, a stuck teardown) is dumped and killed like any other.


def _called(call: tuple, rank: int, world_size: int) -> tuple[str, Any]:
    """Run one unpickled ``(fn, args)`` on this rank; its report, ``("ok", bytes)`` or ``("error", text)``."""
    fn, args = call
    try:
        value = fn(rank, world_size, *args)
    except BaseException:
        return "error", traceback.format_exc()
    try:
        return "ok", pickle.dumps(value)
    except Exception:
        return "error", f"rank {rank}'s return value could not be pickled:\n{traceback.format_exc()}"


def _serve(rank: int, world_size: int, tasks: Connection, writer: Connection) -> None:
    """A pooled rank's loop: run each pickled ``(fn, args)`` from ``tasks``, report it, until None or EOF.

    Each call's report waits for its GPU work and for the memory it cached to go back to the
    driver, so the next call (another test) starts from what a fresh process would have free.
    """
    import gc

    import torch

    while True:
        try:
            payload = tasks.recv()
        except EOFError:
            return
        if payload is None:
            return
        try:
            message = _called(pickle.loads(payload), rank, world_size)
        except BaseException:  # fn's module could not be imported here
            message = ("error", traceback.format_exc())
        try:
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except BaseException:
            earlier = f"{message[1]}\n" if message[0] == "error" else ""
            message = ("error", f"{earlier}after the call, finishing its GPU work failed:\n{traceback.format_exc()}")
        writer.send(message)


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` at once, stdout and stderr flushed, before C++'s static destructors.

    For rank processes that another launcher started (torchrun): after the process group is
    destroyed torch can still hold a thread (gloo, intermittently on 2-core hosts), and its
    destructor then aborts the finished process ("terminate called without an active exception",
    exit -6), which the launcher reports as a failed rank. ``run_ranks``' own ranks leave this way
    already (forked, they end in ``os._exit``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stacks(run_dir: str, rank: int) -> str:
    path = Path(run_dir) / f"rank{rank}.txt"
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return text or "(no stack dump: the process did not answer SIGUSR1)"


def _kill_all(processes: dict, run_dir: str) -> dict[int, str]:
    """Dump the stacks of live ranks (rank -> process), kill and reap them; returns rank -> stack dump.

    With no ranks to kill it returns at once: every run calls it, and the wait for the dumps cost
    every successful run half a second.
    """
    if not processes:
        return {}
    for process in processes.values():
        try:
            os.kill(process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(_STACK_DUMP_WAIT_S)
    for process in processes.values():
        process.kill()
        process.join()
    return {rank: _stacks(run_dir, rank) for rank in processes}


@dataclass
class _Outcome:
    """What the parent learnt of every rank of one run.

    results: rank -> ``fn``'s return value. failures: rank -> report text (traceback, exit code or
    stacks). unfinished: the ranks that reported nothing by the deadline. hung: the ranks killed
    while still running. first_failure: ``time.monotonic()`` when the first failure arrived.
    """

    unfinished: set[int]
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    first_failure: Optional[float] = None


def _check_world_size(world_size: int, caller: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{caller} world_size: got {world_size!r}, expected an integer >= 1")


def _pickled_call(
    fn: Callable[..., Any], world_size: int, args: tuple, delay_rank: Optional[tuple[int, float]], caller: str
) -> bytes:
    """``(fn, args)`` pickled for the children, after checking ``caller``'s arguments."""
    _check_world_size(world_size, caller)
    if delay_rank is not None and not (0 <= delay_rank[0] < world_size):
        raise ValueError(f"{caller} delay_rank: got rank {delay_rank[0]}, expected one in [0, {world_size})")
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"{caller} fn and args must be picklable (fn a module-level function), got {fn!r}: {exc}"
        ) from None


def _start_rank(
    context: ForkServerContext, rank: int, world_size: int, payload: Optional[bytes], options: dict,
    pooled: bool = False,
) -> tuple[ForkServerProcess, Connection, Optional[Connection]]:
    """Start one rank process; returns it, the read end of the pipe it reports on and, for a pooled
    rank, the write end of the pipe it takes calls from."""
    reader, writer = context.Pipe(duplex=False)
    task_reader, task_writer = context.Pipe(duplex=False) if pooled else (None, None)
    process = context.Process(
        target=_child,
        args=(rank, world_size, payload, options, writer, task_reader),
        name=f"moe_comm-rank{rank}",
    )
    process.start()
    writer.close()  # the child holds the write end; EOF here means it is gone
    if task_reader is not None:
        task_reader.close()
    return process, reader, task_writer


def _wait_for_reports(
    processes: list[ForkServerProcess], readers: list[Connection], deadline: float, failure_grace_s: float
) -> _Outcome:
    """Receive every rank's report until ``deadline``, or ``failure_grace_s`` after the first failure."""
    outcome = _Outcome(unfinished=set(range(len(processes))))
    while outcome.unfinished:
        limit = deadline if outcome.first_failure is None else min(deadline, outcome.first_failure + failure_grace_s)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        for reader in wait([readers[r] for r in outcome.unfinished], timeout=remaining):
            rank = readers.index(reader)
            outcome.unfinished.discard(rank)
            kind, data = _receive(reader, processes[rank])
            if kind == "ok":
                outcome.results[rank] = pickle.loads(data)
            else:
                outcome.failures[rank] = data
                if outcome.first_failure is None:
                    outcome.first_failure = time.monotonic()
    return outcome


def _receive(reader: Connection, process: ForkServerProcess) -> tuple[str, Any]:
    """One rank's report, ``("ok", pickled value)`` or ``("error", text)``, also for a rank that died silently."""
    try:
        return reader.recv()
    except EOFError:
        process.join(5.0)
        return "error", (
            f"the process exited with code {process.exitcode} without reporting a result "
            "(killed by a signal if negative)"
        )


def _unfinished_reason(outcome: _Outcome, elapsed_s: float, timeout_s: float, failure_grace_s: float) -> str:
    """Why the ranks that did not report are killed: the grace after a failure ran out, or the timeout."""
    if outcome.first_failure is not None and elapsed_s < timeout_s:
        failed = ", ".join(str(r) for r in sorted(outcome.failures))
        return (
            f"still running {failure_grace_s:.1f} s after rank(s) {failed} failed "
            "(probably blocked in a collective with them); killed"
        )
    return f"did not finish within the timeout of {timeout_s:.1f} s (hung); killed"


def _kill_unfinished(outcome: _Outcome, processes: list[ForkServerProcess], run_dir: str, reason: str) -> None:
    """Dump the stacks of the ranks that did not report, kill them, and record them as hung."""
    for rank, stacks in _kill_all({r: processes[r] for r in sorted(outcome.unfinished)}, run_dir).items():
        outcome.hung.append(rank)
        outcome.failures[rank] = f"{reason}. Its Python stacks before the kill:\n{stacks}"


def _wait_for_exits(outcome: _Outcome, processes: list[ForkServerProcess], run_dir: str, deadline: float) -> None:
    """Join the ranks that reported, by ``deadline`` but at least 5 s from now.

    A rank that reported still tears down its group; one that cannot (killed, with its stacks)
    or that exits non-zero is a bug worth reporting, so it is a failure too.
    """
    teardown_deadline = max(deadline, time.monotonic() + 5.0)
    for rank, process in enumerate(processes):
        if rank in outcome.hung:
            continue
        process.join(max(0.0, teardown_deadline - time.monotonic()))
        if process.is_alive():
            outcome.hung.append(rank)
            stacks = _kill_all({rank: process}, run_dir)[rank]
            report = f"returned but did not exit (hung in teardown); killed. Its stacks:\n{stacks}"
            earlier = outcome.failures.get(rank)
            outcome.failures[rank] = report if earlier is None else f"{earlier}\n{report}"
        elif process.exitcode != 0 and rank not in outcome.failures:
            outcome.failures[rank] = f"returned but exited with code {process.exitcode}"


def _clean_up(processes: list[ForkServerProcess], readers: list[Connection], run_dir: str) -> None:
    """Kill and reap whatever still runs, close the pipes and remove the run directory (always runs)."""
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()
        process.close()
    for reader in readers:
        reader.close()
    for path in Path(run_dir).glob("*"):
        path.unlink()
    os.rmdir(run_dir)


def _rank_failure_error(fn: Union[Callable[..., Any], str], world_size: int, outcome: _Outcome) -> RankFailureError:
    """The error naming every failed rank with its report, in rank order; ``fn`` is the function the
    ranks ran, or what they were doing (a pool's start-up or close)."""
    failures = outcome.failures
    lines = [f"{len(failures)} of {world_size} ranks failed (fn={getattr(fn, '__qualname__', fn)}):"]
    for rank in sorted(failures):
        lines.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
    return RankFailureError("\n".join(lines), failures, sorted(outcome.hung))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    dist_backend: str = "gloo",
    timeout_s: float = 120.0,
    gpu: bool = False,
    delay_rank: Optional[tuple[int, float]] = None,
    env: Optional[Mapping[str, str]] = None,
    failure_grace_s: float = 10.0,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes joined in a process group.

    Args:
        fn: a module-level function (it is pickled by name); its return value must be picklable.
        world_size: number of ranks, >= 1.
        *args: picklable arguments passed to every rank after ``rank, world_size``.
        dist_backend: ``torch.distributed`` backend string, e.g. ``"gloo"``, ``"nccl"`` or
            ``"cpu:gloo,cuda:nccl"``; with ``nccl`` in it each rank passes its device as ``device_id``.
        timeout_s: deadline for the whole run (start-up included) and the process group's timeout.
        gpu: give rank ``r`` the device ``cuda:(r % device_count)`` before the group starts.
        delay_rank: ``(rank, seconds)``: that rank sleeps after joining the group and before ``fn``,
            to shake out races that depend on who arrives first.
        env: extra environment variables for every rank (on top of ``MULTICAST_OFF_ENV``).
        failure_grace_s: once a rank has failed, how long the others get to finish before they
            are killed (they usually wait in a collective with the failed one).

    Returns:
        The ranks' return values, in rank order.

    Raises:
        RankFailureError: a rank raised, crashed, or was still running at the deadline; the message
            lists every failed rank's traceback (or exit code, or stacks at the kill).
    """
    payload = _pickled_call(fn, world_size, args, delay_rank, "run_ranks")
    ranks = _Ranks(world_size, payload, dist_backend, timeout_s, gpu, delay_rank, env, pooled=False)
    try:
        outcome = ranks.reports(ranks.start, timeout_s, failure_grace_s)
        _wait_for_exits(outcome, ranks.processes, ranks.run_dir, ranks.start + timeout_s)
    finally:
        ranks.clean_up()
    if outcome.failures:
        raise _rank_failure_error(fn, world_size, outcome)
    return [outcome.results[rank] for rank in range(world_size)]


class _Ranks:
    """``world_size`` rank processes started at once around a rendezvous store in a private directory.

    Attributes: processes, readers (the pipes each reports on), tasks (the pipes a pooled rank takes
    calls from, else None each), run_dir (mode 0700: their store file and stack dumps), start
    (``time.monotonic()`` at start).
    """

    def __init__(self, world_size: int, payload: Optional[bytes], dist_backend: str, timeout_s: float, gpu: bool,
                 delay_rank: Optional[tuple[int, float]], env: Optional[Mapping[str, str]], *, pooled: bool) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="moe_comm_ranks_")  # mode 0700
        child_env = {**os.environ, **MULTICAST_OFF_ENV, **(env or {})}
        options = {
            "env": child_env,
            "run_dir": self.run_dir,
            "timeout_s": timeout_s,
            "gpu": gpu,
            "dist_backend": dist_backend,
            "delay_rank": delay_rank,
        }
        context = multiprocessing.get_context("forkserver")
        # Preloaded by the server once; a no-op once the server runs (the first call started it).
        context.set_forkserver_preload(list(_FORK_SERVER_PRELOAD))
        self.processes: list[ForkServerProcess] = []
        self.readers: list[Connection] = []
        self.tasks: list[Optional[Connection]] = []
        self.start = time.monotonic()
        try:
            for rank in range(world_size):
                process, reader, tasks = _start_rank(context, rank, world_size, payload, options, pooled)
                self.processes.append(process)
                self.readers.append(reader)
                self.tasks.append(tasks)
        except BaseException:
            self.clean_up()
            raise

    def reports(self, start: float, timeout_s: float, failure_grace_s: float) -> _Outcome:
        """Every rank's report of the call begun at ``start``; the ranks that gave none by the deadline
        (or ``failure_grace_s`` after the first failure) are dumped, killed and recorded as hung."""
        outcome = _wait_for_reports(self.processes, self.readers, start + timeout_s, failure_grace_s)
        reason = _unfinished_reason(outcome, time.monotonic() - start, timeout_s, failure_grace_s)
        _kill_unfinished(outcome, self.processes, self.run_dir, reason)
        return outcome

    def clean_up(self) -> None:
        """Kill and reap whatever still runs, close every pipe, remove the run directory (idempotent)."""
        for tasks in self.tasks:
            if tasks is not None:
                tasks.close()
        self.tasks = []
        if self.run_dir is not None:
            _clean_up(self.processes, self.readers, self.run_dir)
            self.run_dir = None


class RankPool:
    """``world_size`` rank processes joined in one process group, kept to run one call after another.

    :meth:`run` runs ``fn(rank, world_size, *args)`` on every rank as :func:`run_ranks` does, but
    in the same processes each time: a call does not pay a fork, a process group and, on GPUs, a
    CUDA context and the start of NCCL or NVSHMEM (several seconds a spawn on the GPU machines).
    What a call leaves in its processes (imported modules, a symmetric-memory provider, module
    globals it changed) is there for the next one: pool only calls that expect that; each call's
    GPU work is finished and the memory it cached returned before it reports.

    A call that fails in any way (a rank raises, crashes or hangs) ends the pool: every rank is
    killed (the hung ones with their stacks in the error), the error is raised and later calls are
    refused. Use as a context manager or call :meth:`close`.

    Args:
        world_size, dist_backend, gpu, env: as in :func:`run_ranks`, for every call.
        timeout_s: deadline for the ranks to start and join their group, and the group's timeout.
    """

    def __init__(self, world_size: int, *, dist_backend: str = "gloo", gpu: bool = False,
                 env: Optional[Mapping[str, str]] = None, timeout_s: float = 300.0) -> None:
        _check_world_size(world_size, "RankPool")
        self.world_size = world_size
        self._ranks: Optional[_Ranks] = _Ranks(world_size, None, dist_backend, timeout_s, gpu, None, env, pooled=True)
        outcome = self._ranks.reports(self._ranks.start, timeout_s, failure_grace_s=10.0)
        if outcome.failures:
            self._end()
            raise _rank_failure_error("RankPool start-up", world_size, outcome)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran or a call failed: the ranks are gone."""
        return self._ranks is None

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0, failure_grace_s: float = 10.0) -> list:
        """Run ``fn(rank, world_size, *args)`` on every rank of the pool; the values in rank order.

        Args and raises as :func:`run_ranks` (``timeout_s`` is this call's deadline); a failure also
        closes the pool. Raises RuntimeError on a closed pool.
        """
        if self._ranks is None:
            raise RuntimeError("RankPool.run: the pool is closed (closed by the caller or by a failed call)")
        payload = _pickled_call(fn, self.world_size, args, None, "RankPool.run")
        start = time.monotonic()
        failures = {}
        for rank, tasks in enumerate(self._ranks.tasks):
            try:
                tasks.send(payload)
            except OSError as exc:  # the rank died since its last call
                failures[rank] = f"could not be handed the call ({exc})"
        outcome = self._ranks.reports(start, timeout_s, failure_grace_s)
        for rank, report in failures.items():
            outcome.failures.setdefault(rank, report)  # its own report (exit code) says more
        if outcome.failures:
            self._end()
            raise _rank_failure_error(fn, self.world_size, outcome)
        return [outcome.results[rank] for rank in range(self.world_size)]

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop every rank (each tears its group down and exits) and reap them; idempotent.

        Raises:
            RankFailureError: a rank did not exit by ``timeout_s`` (killed, with its stacks) or exited non-zero.
        """
        if self._ranks is None:
            return
        for tasks in self._ranks.tasks:
            try:
                tasks.send(None)
            except OSError:
                pass  # already gone: _wait_for_exits reports its exit code
        outcome = _Outcome(unfinished=set())
        try:
            _wait_for_exits(outcome, self._ranks.processes, self._ranks.run_dir, time.monotonic() + timeout_s)
        finally:
            self._end()
        if outcome.failures:
            raise _rank_failure_error("RankPool.close", self.world_size, outcome)

    def _end(self) -> None:
        self._ranks.clean_up()
        self._ranks = None

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
