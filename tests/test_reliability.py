"""Failures are loud, bounded and clear on the ``reference`` backend (gloo, CPU ranks).

The CPU half of issue #6; ``tests/test_gpu_reliability.py`` runs the same contracts on every GPU
backend. World 2 throughout: the smallest world with a peer that can skip, differ or leave.
Each test is one spawn running several scenarios (a spawn costs every rank an ``import torch``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from multirank import run_ranks
from tensor_views import off_boundary

NUM_EXPERTS = 8
TOPK = 2
HIDDEN = 8
MAX_TOKENS = 6
TIMEOUT_S = 2.0


def _config(**overrides):
    values = dict(backend="reference", num_experts=NUM_EXPERTS, topk=TOPK, hidden=HIDDEN,
                  max_tokens_per_rank=MAX_TOKENS, dtype="float32", expert_alignment=2)
    values.update(overrides)
    return moe_comm.load_config(None, **values)


def _inputs(num_tokens: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    idx = torch.randint(0, NUM_EXPERTS, (num_tokens, TOPK), generator=generator)
    return x, idx, torch.rand(num_tokens, TOPK, generator=generator)


def _validation(rank: int, world: int) -> None:
    """Every argument error names the argument, what was expected and what came; none reaches a peer."""
    with moe_comm.Dispatcher(_config()) as disp:
        x, idx, w = _inputs(4, seed=rank)
        cases = [
            ((x, idx.to(torch.int16), w), "topk_idx: expected dtype int32 or int64, got torch.int16"),
            ((x, idx.to("meta"), w), "topk_idx: expected a tensor on cpu, got one on meta"),
            ((x, idx, w.to("meta")), "topk_weights: expected a tensor on cpu, got one on meta"),
            ((x, idx, torch.rand(TOPK, 4).t()), "topk_weights: expected a contiguous tensor"),
            ((x, torch.randint(0, 8, (TOPK, 4)).t(), w), "topk_idx: expected a contiguous tensor"),
            ((x, idx, w[:3]), r"topk_weights: expected shape \[4, 2\], got \(3, 2\)"),  # T of weights != T of x
            ((x, idx, w[:, None]), r"topk_weights: expected shape \[4, 2\], got \(4, 1, 2\)"),
            ((x[None], idx, w), r"x: expected shape \[\*, 8\], got \(1, 4, 8\) \(a 2-D tensor, one row per token: "
                                r"flatten the batch dimensions with .reshape\(-1, 8\)\)"),
            ((x, idx.tolist(), w), "topk_idx: expected a torch.Tensor, got list"),
            ((off_boundary(x), idx, w), "x: expected a tensor whose data starts on a 16-byte boundary .* got one "
                                         "starting 4 bytes past one .*call .clone"),
        ]
        for args, message in cases:
            with pytest.raises(moe_comm.InputError, match=message):
                disp.dispatch(*args)
        out = disp.dispatch(x, idx, w)
        y = out.x.clone()
        combine_cases = [
            ((y.double(), out.handle), "y: expected dtype float32, got torch.float64"),
            ((y.to("meta"), out.handle), "y: expected a tensor on cpu, got one on meta"),
            ((torch.randn(HIDDEN, disp.capacity_rows).t(), out.handle), "y: expected a contiguous tensor"),
            ((off_boundary(y), out.handle), "y: expected a tensor whose data starts on a 16-byte boundary"),
            ((y, out.handle.routing), "handle: expected the DispatchHandle of a dispatch call, got Routing"),
        ]
        for args, message in combine_cases:
            with pytest.raises(moe_comm.InputError, match=message):
                disp.combine(*args)

        # A handle from an older step is valid (it owns its routing): two micro-batches dispatched
        # before either is combined give the bits each gives when combined right away.
        first = disp.combine(y, out.handle)
        x2, idx2, w2 = _inputs(MAX_TOKENS, seed=10 + rank)
        out2 = disp.dispatch(x2, idx2, w2)
        second = disp.combine(out2.x.clone(), out2.handle)
        out_a = disp.dispatch(x, idx, w)
        out_b = disp.dispatch(x2, idx2, w2)
        assert torch.equal(disp.combine(out_b.x.clone(), out_b.handle), second)
        assert torch.equal(disp.combine(out_a.x.clone(), out_a.handle), first)
        disp.check()


def _check_every_step(rank: int, world: int) -> None:
    """check_every_step raises on the call that recorded a fault, and stays quiet on clean calls."""
    with moe_comm.Dispatcher(_config(check_every_step=True, expert_capacity=1)) as disp:
        x, idx, w = _inputs(4, seed=rank)
        idx[:] = -1  # nothing routed: no fault, no raise
        out = disp.dispatch(x, idx, w)
        disp.combine(out.x, out.handle)
        idx[:, 0] = 0  # every token of both ranks to expert 0, capacity 1: rank 0 drops 7 of 8
        if rank == 0:
            first = "first: from rank 0, token 1, in call 2 "  # after the clean call above
            with pytest.raises(moe_comm.DeviceStatusError, match=rf"7 assignment\(s\) dropped.*{first}"):
                disp.dispatch(x, idx, w)
        else:
            disp.dispatch(x, idx, w)  # the drops are recorded on the destination, rank 0
        assert disp.read_status().ok, "the raising check cleared the status"


def test_argument_errors_and_check_every_step():
    run_ranks(_validation_and_checks, 2, timeout_s=120)


def _validation_and_checks(rank: int, world: int) -> None:
    _validation(rank, world)
    _check_every_step(rank, world)


def _mismatched_setups(rank: int, world: int) -> list:
    """Different configs, or the same configs built in a different order, raise at construction on every rank."""
    outcomes = []
    a, b = _config(), _config(hidden=2 * HIDDEN)
    # Rank 0 builds a then b, rank 1 b then a: each construction pairs a with b across the ranks.
    for config in (a, b) if rank == 0 else (b, a):
        with pytest.raises(moe_comm.ConfigError, match="differs between ranks.*same order"):
            moe_comm.Dispatcher(config)
        outcomes.append("raised")
    # The error names the key that differs and every rank's value of it.
    with pytest.raises(moe_comm.ConfigError, match=r"differs between ranks: 'timeout_s': rank 0 has .*, rank 1 has "):
        moe_comm.Dispatcher(_config(timeout_s=TIMEOUT_S + rank))
    with pytest.raises(moe_comm.ConfigError, match=r"'vmm.fd_passing': rank 0 has 'scm_rights', rank 1 has 'pidfd'"):
        moe_comm.Dispatcher(_config(vmm={"fd_passing": ("scm_rights", "pidfd")[rank]}))
    # After the errors the group is still in step: a matching construction works.
    with moe_comm.Dispatcher(_config()) as disp:
        x, idx, w = _inputs(3, seed=rank)
        out = disp.dispatch(x, idx, w)
        disp.combine(out.x, out.handle)
    return outcomes


def test_mismatched_setups_raise_at_construction():
    assert run_ranks(_mismatched_setups, 2, timeout_s=120) == [["raised", "raised"]] * 2


def _skipped_step(rank: int, world: int) -> str:
    """Rank 1 skips a step: rank 0's dispatch raises within timeout_s naming the exchange and the peer."""
    # The dispatcher gets a group of its own: after the timeout that group's ranks are out of step,
    # and the default group stays usable for the test's own synchronisation.
    group = dist.new_group(backend="gloo")
    with moe_comm.Dispatcher(_config(timeout_s=TIMEOUT_S), group=group) as disp:
        x, idx, w = _inputs(MAX_TOKENS, seed=rank)
        out = disp.dispatch(x, idx, w)  # a step both ranks make
        disp.combine(out.x, out.handle)
        if rank == 0:
            start = time.monotonic()
            with pytest.raises(moe_comm.CommTimeoutError,
                               match=r"rank 0 timed out after 2.0 s in dispatch: all_to_all_single of expert ids "
                                     r"\(peer rank 1\)"):
                disp.dispatch(x, idx, w)
            elapsed = time.monotonic() - start
            assert elapsed < TIMEOUT_S + 2.0, f"the timeout took {elapsed:.1f} s"
            # The ranks' collectives are out of step now: every later call says so instead of pairing
            # up with the wrong exchange.
            with pytest.raises(moe_comm.BackendError, match="earlier exchange failed.*out of step"):
                disp.combine(out.x, out.handle)
        dist.barrier()  # rank 1 stays until rank 0 has seen the timeout
    return "ok"


def test_skipped_step_times_out_and_exits_cleanly():
    # run_ranks fails if a rank hangs or does not exit (its teardown included).
    start = time.monotonic()
    assert run_ranks(_skipped_step, 2, timeout_s=60) == ["ok", "ok"]
    assert time.monotonic() - start < 45


_EXIT_WITHOUT_CLOSE = textwrap.dedent(
    """
    import torch, torch.distributed as dist, moe_comm
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    disp = moe_comm.Dispatcher(moe_comm.load_config(None, backend="reference", num_experts=4, topk=2, hidden=8,
                                                    max_tokens_per_rank=4, dtype="float32"))
    out = disp.dispatch(torch.randn(3, 8), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    disp.combine(out.x, out.handle)
    print("built", flush=True)
    # Exit with the dispatcher, its output and the process group alive: interpreter teardown
    # destroys them in whatever order it likes.
    """
)


def test_interpreter_exit_without_close_is_clean():
    result = subprocess.run([sys.executable, "-c", _EXIT_WITHOUT_CLOSE], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "built" in result.stdout, result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
