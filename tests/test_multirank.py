"""The multi-rank harness itself (CPU, gloo): results, failures and hangs are reported, nothing is left behind."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moe_comm.tools.spawn
from moe_comm.errors import RankFailureError
from moe_comm.tools.spawn import MULTICAST_OFF_ENV, RankPool
from multirank import run_ranks


def _gone(pid: int) -> bool:
    """True when no process (not even a zombie waiting to be reaped) has this id."""
    return not Path(f"/proc/{pid}").exists()


def _report(rank, world_size, token):
    started = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes on one host
    gathered = [None] * world_size
    dist.all_gather_object(gathered, rank * 10)
    env = {name: os.environ.get(name) for name in [*MULTICAST_OFF_ENV, "MOE_COMM_TEST_VAR"]}
    return {"rank": rank, "world": world_size, "token": token, "gathered": gathered, "env": env,
            "pid": os.getpid(), "started": started, "threads": torch.get_num_threads()}


def test_results_in_rank_order_with_env_and_delay():
    # Rank 0 is delayed so it starts fn last: the results must still come back in rank order.
    results = run_ranks(_report, 3, "tok", delay_rank=(0, 1.0), env={"MOE_COMM_TEST_VAR": "yes"}, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert results[0]["started"] > max(results[1]["started"], results[2]["started"]) + 0.5
    for r in results:
        assert r["world"] == 3 and r["token"] == "tok"
        assert r["gathered"] == [0, 10, 20]  # the process group works across all ranks
        assert r["env"]["MOE_COMM_TEST_VAR"] == "yes"
        assert all(r["env"][name] == value for name, value in MULTICAST_OFF_ENV.items())
        assert _gone(r["pid"])
        if "OMP_NUM_THREADS" not in os.environ:
            # The ranks split the cores, a few at most each: none fills the host (NVSHMEM ranks
            # then ran their parallel ops 2.4x slower, likely for want of a core for its proxy).
            assert 1 <= r["threads"] <= min(8, max(1, (os.cpu_count() or 1) // 3)), r["threads"]
    # The parent's own environment is left alone.
    assert "MOE_COMM_TEST_VAR" not in os.environ


def _rank_number(rank, world_size):
    return rank


def test_a_successful_run_waits_for_no_stack_dumps(monkeypatch):
    # The pause that lets killed ranks write their stacks is for runs with ranks to kill: every
    # successful run paid it (half a second each, in every test and every `moe-comm run`).
    pauses = []
    monkeypatch.setattr(moe_comm.tools.spawn.time, "sleep", pauses.append)
    assert run_ranks(_rank_number, 2, timeout_s=60) == [0, 1]
    assert moe_comm.tools.spawn._STACK_DUMP_WAIT_S not in pauses, pauses


def _caller_env(rank, world_size):
    return {name: os.environ.get(name) for name in ("MOE_COMM_TEST_CALLER", "MOE_COMM_TEST_GONE")}


def test_ranks_get_the_callers_environment_of_each_call(monkeypatch):
    # The ranks are forked by a server that outlives one call: each call's environment must still
    # be the caller's at that call, variables set and removed since the server started included.
    monkeypatch.setenv("MOE_COMM_TEST_GONE", "set at the first call")
    assert run_ranks(_caller_env, 1, timeout_s=60) == [
        {"MOE_COMM_TEST_CALLER": None, "MOE_COMM_TEST_GONE": "set at the first call"}]
    monkeypatch.delenv("MOE_COMM_TEST_GONE")
    monkeypatch.setenv("MOE_COMM_TEST_CALLER", "second call")
    assert run_ranks(_caller_env, 2, timeout_s=60) == [
        {"MOE_COMM_TEST_CALLER": "second call", "MOE_COMM_TEST_GONE": None}] * 2


def _fail_some(rank, world_size):
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    if rank == 2:
        raise KeyError("rank two broke on purpose")
    # Rank 0 waits for the others in a collective that never completes: the harness must not
    # wait for the full timeout once a rank has failed.
    dist.barrier()
    return "unreachable"


def test_every_failing_rank_is_reported():
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_ranks(_fail_some, 3, timeout_s=90, failure_grace_s=3.0)
    message = str(info.value)
    assert "--- rank 1 ---" in message and "ValueError: rank one broke on purpose" in message
    assert "--- rank 2 ---" in message and "KeyError: 'rank two broke on purpose'" in message
    assert "in _fail_some" in message  # a real traceback, not just the exception text
    assert "--- rank 0 ---" in message  # blocked in the barrier: an error from gloo, or killed after the grace
    assert time.monotonic() - start < 60


def _sleep_forever():
    while True:
        time.sleep(0.05)


def _hang(rank, world_size, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        _sleep_forever()
    # Rank 0 returns but leaves a non-daemon thread behind, so its process cannot exit.
    threading.Thread(target=_sleep_forever, name="leaked").start()
    return rank


def test_hanging_ranks_are_killed_and_named(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        # 15 s leaves the healthy rank room for its `import torch` on a busy 2-core machine.
        run_ranks(_hang, 2, str(tmp_path), timeout_s=15)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "2 of 2 ranks failed" in message
    rank0, rank1 = message.split("--- rank 1 ---")
    assert "hung" in rank1 and "in _hang" in rank1  # the stack dump shows where it hung
    assert "returned but did not exit" in rank0 and "_sleep_forever" in rank0
    assert elapsed < 35
    for rank in (0, 1):
        assert _gone(int((tmp_path / f"{rank}.pid").read_text()))


def _unpicklable(rank, world_size):
    return lambda: rank


def test_unpicklable_result_and_function_are_errors():
    with pytest.raises(AssertionError, match="could not be pickled"):
        run_ranks(_unpicklable, 1, timeout_s=60)
    with pytest.raises(TypeError, match="picklable"):
        run_ranks(lambda rank, world: rank, 1)


# ----------------------------------------------------------------------------- kept ranks (RankPool)


def _pid_and_sum(rank, world_size, value):
    total = torch.tensor([rank + value])
    dist.all_reduce(total)  # the pool's process group still works on every call
    return os.getpid(), int(total)


def _raise_or_hang(rank, world_size, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("rank one broke on purpose")
    _sleep_forever()  # rank 0 never reports: killed after the grace, with its stacks


def test_pool_keeps_its_ranks_across_calls_and_ends_at_a_failure(tmp_path):
    pool = RankPool(2, timeout_s=60)
    try:
        first = pool.run(_pid_and_sum, 10, timeout_s=60)
        second = pool.run(_pid_and_sum, 20, timeout_s=60)
        assert [total for _, total in first] == [21, 21] and [total for _, total in second] == [41, 41]
        assert [pid for pid, _ in first] == [pid for pid, _ in second]  # the same processes
        start = time.monotonic()
        with pytest.raises(RankFailureError) as info:
            pool.run(_raise_or_hang, str(tmp_path), timeout_s=60, failure_grace_s=2.0)
        assert time.monotonic() - start < 30
        message = str(info.value)
        assert "ValueError: rank one broke on purpose" in message and "in _raise_or_hang" in message
        assert info.value.hung == [0] and "_sleep_forever" in message
        # A failed call ends the pool: its ranks are gone and it refuses further calls.
        assert pool.closed
        assert all(_gone(int((tmp_path / f"{rank}.pid").read_text())) for rank in (0, 1))
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(_pid_and_sum, 1)
    finally:
        pool.close()


def _exit_on_rank0(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_pool_reports_a_rank_that_died_in_a_call():
    with RankPool(2, timeout_s=60) as pool:
        with pytest.raises(RankFailureError, match="exited with code 3") as info:
            pool.run(_exit_on_rank0, timeout_s=60)
        assert list(info.value.failures) == [0] and pool.closed


def test_pool_close_reaps_its_ranks_and_bad_arguments_are_named():
    with RankPool(1, timeout_s=60) as pool:
        [(pid, _)] = pool.run(_pid_and_sum, 0, timeout_s=60)
    assert pool.closed and _gone(pid)
    pool.close()  # idempotent
    with pytest.raises(ValueError, match="RankPool world_size: got 0"):
        RankPool(0)


def test_harness_keeps_one_set_of_ranks_at_a_time():
    import multirank

    try:
        [(a, _)] = run_ranks(_pid_and_sum, 1, 0, reuse="first", timeout_s=60)
        [(b, _)] = run_ranks(_pid_and_sum, 1, 0, reuse="first", timeout_s=60)
        assert a == b
        [(c, _), (d, _)] = run_ranks(_pid_and_sum, 2, 0, reuse="first", timeout_s=60)
        assert a not in (c, d) and _gone(a)  # another world size: the first pool is closed
        [(e, _), _] = run_ranks(_pid_and_sum, 2, 0, reuse="second", timeout_s=60)
        assert e != c and _gone(c) and _gone(d)  # another key too
        with pytest.raises(TypeError, match="delay_rank"):
            run_ranks(_pid_and_sum, 2, 0, reuse="second", delay_rank=(0, 1.0))
        [(f, _)] = run_ranks(_pid_and_sum, 1, 0, timeout_s=60)  # fresh ranks: the kept ones go first
        assert _gone(e) and _gone(f)
    finally:
        multirank.close_pool()
