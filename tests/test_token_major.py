"""The token-major layout (``Config.receive_layout: token_major``) on the ``reference`` backend (gloo, CPU ranks).

dispatch -> permute -> experts -> unpermute -> combine must give the bits of dispatch -> experts -> combine,
forward and backward (x, router weights, expert weights), with uneven batches, holes (-1), drops over
``expert_capacity``, float32, bfloat16 and FP8 dispatch. Worlds 1, 2 and 4: no peer, one, and several sources
whose rows interleave in every segment.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.nn.reference import drop_over_capacity
from multirank import run_ranks
from token_major_checks import (assert_same_rows, assert_token_rows, both_paths, expected_local_ids,
                                experts_by_segment)

NUM_EXPERTS = 8
TOPK = 3
HIDDEN = 128  # FP8 dispatch needs a multiple of 128
MAX_TOKENS = 12


def _config(**overrides):
    base = dict(backend="reference", num_experts=NUM_EXPERTS, topk=TOPK, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS,
                dtype="float32", expert_alignment=4)
    base.update(overrides)
    return moe_comm.load_config(None, **base)


def _inputs(world: int, generator: torch.Generator, dtype: torch.dtype):
    """Every rank's tokens (uneven counts, one rank empty at world > 1), ids with holes, and weights."""
    tokens = [MAX_TOKENS - 3 * r for r in range(world)]
    if world > 1:
        tokens[-1] = 0
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, HIDDEN, generator=generator).to(dtype))
        idx = torch.topk(torch.rand(t, NUM_EXPERTS, generator=generator), TOPK).indices
        idx[torch.rand(t, TOPK, generator=generator) < 0.25] = -1
        idxs.append(idx)
        ws.append(torch.rand(t, TOPK, generator=generator))
    return xs, idxs, ws


def _step(rank: int, world: int, dtype: torch.dtype, capacity, generator: torch.Generator) -> None:
    em = moe_comm.Dispatcher(_config(dtype=str(dtype).split(".")[1], expert_capacity=capacity))
    tm = moe_comm.Dispatcher(_config(dtype=str(dtype).split(".")[1], expert_capacity=capacity,
                                     receive_layout="token_major"))
    local = NUM_EXPERTS // world
    expert_weights = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=generator) / HIDDEN**0.5
    xs, idxs, ws = _inputs(world, generator, dtype)
    leaves = []
    for _ in range(2):
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        weights_local = expert_weights[rank * local:(rank + 1) * local].clone().to(dtype).requires_grad_()
        leaves.append((x, w, weights_local))
    (x_em, w_em, e_em), (x_tm, w_tm, e_tm) = leaves
    out_em = em.dispatch(x_em, idxs[rank], w_em)
    z_em = em.combine(experts_by_segment(e_em)(out_em), out_em.handle)
    out_tm = tm.dispatch(x_tm, idxs[rank], w_tm)
    permuted = tm.permute(out_tm)
    z_tm = tm.combine(tm.unpermute(experts_by_segment(e_tm)(permuted), out_tm), out_tm.handle)

    assert isinstance(out_tm, moe_comm.TokenMajorOutput) and out_tm.x.shape == (world * MAX_TOKENS, HIDDEN)
    assert_same_rows(out_em, permuted)
    assert torch.equal(z_tm, z_em)
    kept = drop_over_capacity(idxs, NUM_EXPERTS, capacity)
    assert torch.equal(out_tm.topk_idx, expected_local_ids(rank, world, MAX_TOKENS, NUM_EXPERTS, idxs, kept))
    assert_token_rows(out_tm, rank, world, MAX_TOKENS, xs)

    grad = torch.randn(z_em.shape, generator=torch.Generator().manual_seed(rank)).to(dtype)
    z_em.backward(grad)
    z_tm.backward(grad)  # collective: every rank runs both, also a rank with no tokens
    for a, b, name in ((x_em, x_tm, "x"), (w_em, w_tm, "topk_weights"), (e_em, e_tm, "expert weights")):
        assert a.grad is not None and b.grad is not None, name
        assert torch.equal(a.grad, b.grad), f"gradient of {name} differs between the layouts"
    for disp in (em, tm):
        if capacity is None:
            disp.check()
        else:  # both layouts drop and report the same entries
            with pytest.raises(moe_comm.DeviceStatusError, match="dropped over expert_capacity=3"):
                disp.check()
        disp.close()


def _fp8_step(rank: int, world: int, generator: torch.Generator) -> None:
    """FP8 dispatch: the permuted e4m3 rows and scales are the expert-major dispatch's; z bitwise."""
    em = moe_comm.Dispatcher(_config(dtype="bfloat16", dispatch_dtype="float8_e4m3fn"))
    tm = moe_comm.Dispatcher(_config(dtype="bfloat16", dispatch_dtype="float8_e4m3fn", receive_layout="token_major"))
    xs, idxs, ws = _inputs(world, generator, torch.bfloat16)
    scale = torch.rand(HIDDEN, generator=generator) + 0.5
    out_em, z_em, out_tm, permuted, z_tm = both_paths(em, tm, xs[rank], idxs[rank], ws[rank],
                                                      lambda out: (out.x.float() * scale).to(torch.bfloat16))
    assert out_tm.x.dtype == torch.float8_e4m3fn and out_tm.x_scales.shape == (world * MAX_TOKENS, HIDDEN // 128)
    assert_same_rows(out_em, permuted)
    assert torch.equal(z_tm, z_em)
    em.close()
    tm.close()


def _all_steps(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(5)
    for dtype, capacity in ((torch.float32, None), (torch.float32, 3), (torch.bfloat16, None)):
        _step(rank, world, dtype, capacity, generator)
    _fp8_step(rank, world, generator)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_token_major_is_bitwise_the_expert_major_path(world):
    run_ranks(_all_steps, world, timeout_s=240)


def _wrong_calls(rank: int, world: int) -> None:
    em = moe_comm.Dispatcher(_config())
    tm = moe_comm.Dispatcher(_config(receive_layout="token_major"))
    x = torch.randn(4, HIDDEN)
    idx = torch.zeros(4, TOPK, dtype=torch.int64)
    w = torch.ones(4, TOPK)
    out_em = em.dispatch(x, idx, w)
    with pytest.raises(moe_comm.ConfigError, match="receive_layout 'expert_major'"):
        em.permute(out_em)
    out_tm = tm.dispatch(x, idx, w)
    with pytest.raises(moe_comm.InputError, match="out: expected the TokenMajorOutput"):
        tm.permute(out_em)
    with pytest.raises(moe_comm.InputError, match="expert_offsets: a token-major dispatch output"):
        out_tm.expert_offsets  # code written for expert-major rows fails instead of reading token rows as segments
    permuted = tm.permute(out_tm)
    with pytest.raises(moe_comm.InputError, match=rf"y: expected shape \[{world * MAX_TOKENS}, {HIDDEN}\]"):
        tm.combine(permuted.x, out_tm.handle)  # expert-major rows where the reduced rows go
    with pytest.raises(moe_comm.InputError, match=rf"y: expected shape \[{tm.capacity_rows}, {HIDDEN}\]"):
        tm.unpermute(out_tm.x[:-1], out_tm)
    tm.combine(tm.unpermute(permuted.x, out_tm), out_tm.handle)  # the calls stay paired on every rank
    em.close()
    tm.close()


def _unkept_rows(rank: int, world: int) -> None:
    """Combine reads nothing of a reduced row without a kept entry (unpermute leaves it unspecified): NaN there
    changes no bit of z, also for tokens whose every entry was dropped over the capacity."""
    tm = moe_comm.Dispatcher(_config(receive_layout="token_major", expert_capacity=1))
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(MAX_TOKENS, HIDDEN, generator=generator)
    idx = torch.topk(torch.rand(MAX_TOKENS, NUM_EXPERTS, generator=generator), TOPK).indices
    w = torch.rand(MAX_TOKENS, TOPK, generator=generator)
    out = tm.dispatch(x, idx, w)
    reduced = tm.unpermute(tm.permute(out).x, out)
    unkept = (out.topk_idx < 0).all(dim=1)
    assert bool(unkept.any()), "every slab row kept an entry: the scenario tests nothing"
    z = tm.combine(reduced, out.handle)
    z_nan = tm.combine(torch.where(unkept[:, None], float("nan"), reduced), out.handle)
    assert torch.equal(z, z_nan)
    with pytest.raises(moe_comm.DeviceStatusError, match="dropped over expert_capacity=1"):
        tm.check()
    tm.close()


def test_reduced_rows_without_a_kept_entry_are_never_read():
    run_ranks(_unkept_rows, 2, timeout_s=120)


def test_wrong_calls_name_the_layout():
    run_ranks(_wrong_calls, 2, timeout_s=120)
