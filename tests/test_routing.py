"""The routing math of ``moe_comm.routing`` on small hand-worked examples (single process)."""

from __future__ import annotations

import pytest
import torch

from moe_comm import protocol, routing


def test_plan_source_dedups_and_reports_invalid_ids():
    status = protocol.new_status(torch.device("cpu"))
    # 2 ranks x 2 local experts. Token 0 has two experts on rank 1: it is sent there once.
    topk_idx = torch.tensor([[2, 3, -1], [0, 9, 1], [-1, -1, -1], [-5, 2, 0]])
    call = torch.tensor([3])
    send_mask, dest_rank, slab_expert = routing.plan_source(topk_idx, 4, 2, rank=1, status=status, call=call)
    assert send_mask.tolist() == [[False, True], [True, False], [False, False], [True, True]]
    assert dest_rank.tolist() == [[1, 1, -1], [0, -1, 0], [-1, -1, -1], [-1, 1, 0]]
    assert slab_expert[1].tolist() == [[0, 1, -1], [-1, -1, -1], [-1, -1, -1], [-1, 0, -1]]
    assert slab_expert[0].tolist() == [[-1, -1, -1], [0, -1, 1], [-1, -1, -1], [-1, -1, 0]]
    assert status[protocol.STATUS_NUM_INVALID] == 2
    assert status[protocol.STATUS_FIRST_INVALID] == (1 << 32) + 1  # rank 1, token 1
    assert status[protocol.STATUS_FIRST_INVALID_CALL] == 3
    # A later call's offenders add to the count; the first offender stays the earliest call's,
    # even where the later call's (rank, token) is smaller.
    routing.plan_source(torch.tensor([[7, -1]] * 2), 4, 2, rank=0, status=status, call=torch.tensor([4]))
    assert status[protocol.STATUS_NUM_INVALID] == 4
    assert status[protocol.STATUS_FIRST_INVALID] == (1 << 32) + 1
    assert status[protocol.STATUS_FIRST_INVALID_CALL] == 3
    # A call without offenders leaves everything as it was.
    routing.plan_source(torch.tensor([[0, 1]]), 4, 2, rank=0, status=status, call=torch.tensor([5]))
    assert status[protocol.STATUS_NUM_INVALID] == 4 and status[protocol.STATUS_FIRST_INVALID_CALL] == 3
    report = protocol.decode_status(status.tolist())
    assert (report.first_invalid, report.first_invalid_call, report.first_dropped_call) == ((1, 1), 3, None)


def test_plan_destination_orders_aligns_and_drops():
    status = protocol.new_status(torch.device("cpu"))
    # 2 sources, 3 slab rows, top-2, 2 local experts. Entries of expert 0 in (s, t, k) order:
    # (0,0,1) (0,2,0) (1,0,0) (1,1,1); expert 1: (0,0,0) (1,1,0).
    recv_expert = torch.tensor(
        [
            [[1, 0], [-1, -1], [0, -1]],
            [[0, -1], [1, 0], [-1, -1]],
        ],
        dtype=torch.int32,
    )
    plan = routing.plan_destination(recv_expert, 2, expert_alignment=4, expert_capacity=None, status=status,
                                    call=torch.tensor([1]))
    assert plan.tokens_per_expert.tolist() == [4, 2]
    assert plan.expert_offsets.tolist() == [4, 8]
    assert plan.recv_pos.tolist() == [[[4, 0], [-1, -1], [1, -1]], [[2, -1], [5, 3], [-1, -1]]]
    assert status[protocol.STATUS_NUM_DROPPED] == 0

    capped = routing.plan_destination(recv_expert, 2, expert_alignment=4, expert_capacity=3, status=status,
                                      call=torch.tensor([2]))
    # Expert 0 keeps its first three entries; (1,1,1) is dropped and marked -2.
    assert capped.tokens_per_expert.tolist() == [3, 2]
    assert capped.recv_pos.tolist() == [[[4, 0], [-1, -1], [1, -1]], [[2, -1], [5, -2], [-1, -1]]]
    assert status[protocol.STATUS_NUM_DROPPED] == 1
    assert status[protocol.STATUS_FIRST_DROPPED] == (1 << 32) + 1  # from source 1, token 1
    assert status[protocol.STATUS_FIRST_DROPPED_CALL] == 2


def test_expand_and_combine_follow_the_fixed_order():
    recv_pos = torch.tensor([[[1, -1]], [[0, 2]]], dtype=torch.int32)  # W=2, M=1, K=2
    recv_rows = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    out = routing.expand_rows(recv_rows, recv_pos, capacity_rows=4, zero_padding=True)
    assert out.tolist() == [[3.0, 4.0], [1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]
    # Without zero padding the unmapped row is all 0xFF bytes: NaN in each row format.
    for rows in (recv_rows, recv_rows.to(torch.bfloat16), recv_rows.to(torch.float16)):
        unwritten = routing.expand_rows(rows, recv_pos, capacity_rows=4, zero_padding=False)
        assert torch.equal(unwritten[:3], out[:3].to(rows.dtype)) and unwritten[3].isnan().all()
    packed = torch.zeros(2, 1, 8, dtype=torch.uint8)  # a packed FP8 row: 4 e4m3 bytes and one float32 scale
    unwritten = routing.expand_rows(packed, recv_pos, capacity_rows=4, zero_padding=False)[3]
    assert unwritten[:4].view(torch.float8_e4m3fn).float().isnan().all() and unwritten[4:].view(torch.float32).isnan()

    weights = torch.tensor([[[0.5, 9.0]], [[2.0, 0.25]]])
    y = torch.tensor([[1.0, 1.0], [2.0, 2.0], [4.0, 8.0], [float("nan"), 0.0]])
    partial = routing.reduce_partials(y, recv_pos, weights)
    assert partial.tolist() == [[[1.0, 1.0]], [[3.0, 4.0]]]  # a NaN in an unused row never leaks
    assert routing.reduce_partials(y, recv_pos, None).tolist() == [[[2.0, 2.0]], [[5.0, 9.0]]]

    send_mask = torch.tensor([[True, True], [False, True], [False, False]])
    returned = torch.tensor([[[1.0], [7.0], [7.0]], [[2.0], [3.0], [7.0]]])
    assert routing.sum_returned(returned, send_mask).tolist() == [[3.0], [3.0], [0.0]]


@pytest.mark.parametrize("dtype, weighted", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)])
def test_partials_equal_an_entry_by_entry_sum(dtype, weighted):
    # The contract spelled out one entry at a time: float32 from +0, k in order, the product and the
    # sum each rounded, empty (-1) and dropped (-2) entries skipped whatever row and weight they hold.
    gen = torch.Generator().manual_seed(3)
    num_ranks, slab_rows, topk, hidden, capacity = 2, 5, 4, 6, 12
    y = torch.randn(capacity, hidden, generator=gen).to(dtype)
    y[0] = torch.tensor([float("inf"), float("nan"), -0.0, 0.0, float("-inf"), 1.0])  # what empty entries read
    y[1, :2] = -0.0
    recv_pos = torch.randint(0, capacity, (num_ranks, slab_rows, topk), generator=gen, dtype=torch.int32)
    recv_pos[torch.rand(recv_pos.shape, generator=gen) < 0.4] = -1
    recv_pos[0, 0] = torch.tensor([-2, 1, -1, 1], dtype=torch.int32)
    recv_pos[1, 4] = -1  # a slab row with no entry
    weights = torch.randn(recv_pos.shape, generator=gen)
    weights[recv_pos < 0] = float("nan")
    weights[0, 0, 1] = -1.0  # -1 x -0.0 = +0.0 added to +0.0
    want = torch.zeros(num_ranks, slab_rows, hidden)
    for r in range(num_ranks):
        for m in range(slab_rows):
            acc = torch.zeros(hidden)
            for k in range(topk):
                if recv_pos[r, m, k] >= 0:
                    row = y[recv_pos[r, m, k]].float()
                    acc = acc + (weights[r, m, k] * row if weighted else row)
            want[r, m] = acc
    got = routing.reduce_partials(y, recv_pos, weights if weighted else None)
    bits = torch.int16 if dtype is torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.to(dtype).view(bits))


def test_bf16_partials_round_once_after_float32_accumulation():
    # 1 + 2^-8 + 2^-8 = 1 + 2^-7 is exact in float32 and in bfloat16; adding in bfloat16 would
    # round each 1 + 2^-8 (a tie) back to 1. The contract: float32 sum, one rounding at the end.
    recv_pos = torch.tensor([[[0, 1, 2]]], dtype=torch.int32)
    y = torch.tensor([[1.0], [2.0**-8], [2.0**-8]]).bfloat16()
    partial = routing.reduce_partials(y, recv_pos, torch.ones(1, 1, 3))
    assert partial.dtype is torch.bfloat16
    assert partial.float().item() == 1.0 + 2.0**-7


def test_entry_values_round_trip():
    recv_pos = torch.tensor([[[1, -1]], [[0, -2]]], dtype=torch.int32)
    row_vector = torch.tensor([10.0, 20.0, 30.0])
    entries = routing.scatter_entry_values(row_vector, recv_pos)
    assert entries.tolist() == [[[20.0, 0.0]], [[10.0, 0.0]]]
    dest_rank = torch.tensor([[1, -1]], dtype=torch.int32)
    assert routing.gather_entry_values(entries, dest_rank).tolist() == [[10.0, 0.0]]
    assert routing.row_values(recv_pos, torch.tensor([[[0.5, 7.0]], [[0.25, 7.0]]]), 3).tolist() == [0.25, 0.5, 0.0]
