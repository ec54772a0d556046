"""The token-major layout's local conversions on the GPU (contract: permute / unpermute): ``csrc/permute.cu``
through ``moe_comm.cuda.kernels.PermuteKernels`` against ``moe_comm.routing``, bit for bit.

One process, no ranks: the routings are what a destination rank of ``W`` ranks receives, planned
with ``routing.plan_destination`` on the GPU from random local experts (empty entries, slab rows
past each source's T, and with a capacity dropped entries). Outputs start as 0xFF bytes (NaN in
every row format), so a row the contract needs that the kernel did not write shows, and so does a
row it must not write: permute writes the kept rows and, with zero padding, the padding rows below
``expert_offsets[-1]`` (``routing.expand_rows``), nothing past them; unpermute writes the slab rows
with a kept entry (``routing.reduce_partials``), nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import moe_comm
from capture import warm_up_on_side_stream
from moe_comm import fp8, protocol, routing
from moe_comm.cuda.kernels import PermuteKernels

pytestmark = pytest.mark.gpu

SENTINEL = 0xFF


@dataclass(frozen=True)
class Shape:
    world: int
    max_tokens: int
    hidden: int
    topk: int
    num_local_experts: int
    alignment: int
    capacity: Optional[int]

    def capacity_rows(self) -> int:
        config = moe_comm.load_config(None, num_experts=self.num_local_experts * self.world, topk=self.topk,
                                      hidden=self.hidden, max_tokens_per_rank=self.max_tokens,
                                      expert_alignment=self.alignment, expert_capacity=self.capacity)
        return config.capacity_rows(self.world)


def _plan(shape: Shape, gen: torch.Generator) -> routing.DestinationPlan:
    """A destination's plan: each source s sends its first T_s slab rows (T_s random, M/2 to M), half of those
    rows carry nothing here (their tokens' experts are elsewhere), and each entry of the others is a
    random local expert or, a third of them, empty (-1)."""
    entries = (shape.world, shape.max_tokens, shape.topk)
    recv_expert = torch.randint(0, shape.num_local_experts, entries, generator=gen, device="cuda", dtype=torch.int32)
    recv_expert[torch.rand(entries, generator=gen, device="cuda") < 1 / 3] = -1
    recv_expert[torch.rand(entries[:2], generator=gen, device="cuda") < 1 / 2] = -1
    tokens = torch.randint(shape.max_tokens // 2, shape.max_tokens + 1, (shape.world,), generator=gen, device="cuda")
    recv_expert[torch.arange(shape.max_tokens, device="cuda")[None, :] >= tokens[:, None]] = -1
    status = protocol.new_status(torch.device("cuda"))
    plan = routing.plan_destination(recv_expert, shape.num_local_experts, shape.alignment, shape.capacity, status,
                                    torch.ones(1, dtype=torch.int64, device="cuda"))
    assert shape.capacity is None or bool((plan.recv_pos == -2).any()), "a capacity that drops nothing"
    return plan


def _random_rows(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:  # packed FP8 rows: bytes, whatever they mean
        return torch.randint(0, 256, (rows, cols), generator=gen, device="cuda", dtype=torch.uint8)
    return torch.randn(rows, cols, generator=gen, device="cuda").to(dtype)


def _sentinel(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(rows, cols, dtype=dtype, device="cuda")
    out.view(torch.uint8).fill_(SENTINEL)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _check_permute(shape: Shape, plan: routing.DestinationPlan, rows: torch.Tensor, got: torch.Tensor,
                   zero_padding: bool) -> None:
    """``got`` (0xFF before the kernel) is expand_rows' output on the rows the contract defines, and 0xFF elsewhere."""
    recv_pos = plan.recv_pos
    want = routing.expand_rows(rows.view(shape.world, shape.max_tokens, -1), recv_pos, got.shape[0], zero_padding)
    end = int(plan.expert_offsets[-1])
    if zero_padding:
        # Every row below the segments' end (kept rows and padding), and nothing written past it.
        assert torch.equal(_bytes(got[:end]), _bytes(want[:end]))
        assert bool((_bytes(got[end:]) == SENTINEL).all()), "permute wrote past expert_offsets[-1]"
    else:
        # Without padding expand_rows leaves 0xFF where no entry maps, as the kernel must.
        assert torch.equal(_bytes(got), _bytes(want))


def _check_unpermute(shape: Shape, recv_pos: torch.Tensor, weights: Optional[torch.Tensor], y: torch.Tensor,
                     got: torch.Tensor) -> None:
    """``got`` (0xFF before the kernel) is reduce_partials' rows where a slab row has a kept entry, 0xFF elsewhere."""
    entries = (shape.world, shape.max_tokens, shape.topk)
    want = routing.reduce_partials(y, recv_pos.view(entries), None if weights is None else weights.view(entries))
    want = want.view(shape.world * shape.max_tokens, -1)
    kept = (recv_pos.view(-1, shape.topk) >= 0).any(dim=1)
    assert bool(kept.any()), "a routing with no kept entry checks nothing"
    assert torch.equal(_bytes(got[kept]), _bytes(want[kept]))
    assert bool((_bytes(got[~kept]) == SENTINEL).all()), "unpermute wrote a slab row with no kept entry"


def _kernels(shape: Shape, dtype: torch.dtype, zero_padding: bool) -> PermuteKernels:
    return PermuteKernels(torch.device("cuda", torch.cuda.current_device()), dtype, shape.hidden, shape.topk,
                          fp8_rows=True, num_slab_rows=shape.world * shape.max_tokens,
                          num_local_experts=shape.num_local_experts, zero_padding=zero_padding,
                          capacity_rows=shape.capacity_rows())


# Why each case: worlds 1, 2, 4 (the slab rows of several sources, most past each source's T);
# alignment 1 (no padding) and 16; a capacity (dropped entries, -2, which move nothing and make no
# row of their own); f16 once; without zero padding (padding rows untouched). HIDDEN 640: the rows'
# last unit is partial (bf16: 80 vectors, f32: 160, packed FP8: 44). Two larger ones: slab rows
# enough that every block takes several batches, and the benchmark shape (T=4096, H=7168, top-8).
CASES = [
    pytest.param(Shape(1, 96, 640, 4, 8, 1, None), torch.bfloat16, True, id="w1-align1-bf16"),
    pytest.param(Shape(2, 96, 640, 4, 8, 16, None), torch.bfloat16, True, id="w2-align16-bf16"),
    pytest.param(Shape(4, 64, 640, 6, 4, 16, 24), torch.float32, True, id="w4-align16-capacity-f32"),
    pytest.param(Shape(2, 96, 640, 4, 8, 1, 12), torch.float16, True, id="w2-align1-capacity-f16"),
    pytest.param(Shape(4, 64, 640, 8, 4, 16, None), torch.bfloat16, False, id="w4-align16-bf16-no-padding"),
    pytest.param(Shape(4, 8192, 256, 8, 16, 16, None), torch.bfloat16, True, id="w4-many-rows-bf16"),
    pytest.param(Shape(1, 4096, 7168, 8, 256, 16, None), torch.bfloat16, True, id="w1-T4096-H7168-bf16"),
]


@pytest.mark.parametrize("shape, dtype, zero_padding", CASES)
def test_permute_and_unpermute_equal_the_reference(shape, dtype, zero_padding, requires_gpus):
    requires_gpus(1)
    gen = torch.Generator(device="cuda").manual_seed(shape.world * 1000 + shape.max_tokens)
    kernels = _kernels(shape, dtype, zero_padding)
    plan = _plan(shape, gen)
    recv_pos = plan.recv_pos.view(-1, shape.topk)
    slab_rows, capacity_rows = shape.world * shape.max_tokens, shape.capacity_rows()
    # Permute: the config dtype's rows, then packed FP8 rows.
    for row_dtype, cols in ((dtype, shape.hidden), (torch.uint8, fp8.packed_row_bytes(shape.hidden))):
        rows = _random_rows(slab_rows, cols, row_dtype, gen)
        got = _sentinel(capacity_rows, cols, row_dtype)
        kernels.permute(rows, recv_pos.data_ptr(), plan.expert_offsets, plan.tokens_per_expert, got)
        _check_permute(shape, plan, rows, got, zero_padding)
    # Unpermute: weighted and unweighted.
    y = _random_rows(capacity_rows, shape.hidden, dtype, gen)
    weights = torch.rand(slab_rows, shape.topk, generator=gen, device="cuda")
    for weighted in (True, False):
        got = _sentinel(slab_rows, shape.hidden, dtype)
        kernels.unpermute(y, recv_pos.data_ptr(), weights.data_ptr() if weighted else 0, got)
        _check_unpermute(shape, recv_pos, weights if weighted else None, y, got)


REPLAYS = 50


def test_graph_replays_read_the_routing_and_rows_of_each_step(requires_gpus):
    # One capture of permute (bf16 rows and packed FP8 rows) and weighted unpermute; before every
    # replay the routing (recv_pos, expert_offsets, tokens_per_expert, weights) and the rows are
    # rewritten in place and the outputs reset to the sentinel: each replay converts its own step's.
    requires_gpus(1)
    shape = Shape(2, 64, 640, 4, 8, 16, 4)
    gen = torch.Generator(device="cuda").manual_seed(7)
    kernels = _kernels(shape, torch.bfloat16, True)
    slab_rows, capacity_rows, packed_bytes = shape.world * shape.max_tokens, shape.capacity_rows(), \
        fp8.packed_row_bytes(shape.hidden)
    plan = _plan(shape, gen)
    recv_pos, offsets, counts = plan.recv_pos.view(-1, shape.topk).clone(), plan.expert_offsets.clone(), \
        plan.tokens_per_expert.clone()
    weights = torch.rand(slab_rows, shape.topk, generator=gen, device="cuda")
    rows = _random_rows(slab_rows, shape.hidden, torch.bfloat16, gen)
    packed = _random_rows(slab_rows, packed_bytes, torch.uint8, gen)
    y = _random_rows(capacity_rows, shape.hidden, torch.bfloat16, gen)
    out_rows = _sentinel(capacity_rows, shape.hidden, torch.bfloat16)
    out_packed = _sentinel(capacity_rows, packed_bytes, torch.uint8)
    out_sums = _sentinel(slab_rows, shape.hidden, torch.bfloat16)

    def step() -> None:
        kernels.permute(rows, recv_pos.data_ptr(), offsets, counts, out_rows)
        kernels.permute(packed, recv_pos.data_ptr(), offsets, counts, out_packed)
        kernels.unpermute(y, recv_pos.data_ptr(), weights.data_ptr(), out_sums)

    warm_up_on_side_stream(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(REPLAYS):
        plan = _plan(shape, gen)
        recv_pos.copy_(plan.recv_pos.view(-1, shape.topk))
        offsets.copy_(plan.expert_offsets)
        counts.copy_(plan.tokens_per_expert)
        weights.copy_(torch.rand(slab_rows, shape.topk, generator=gen, device="cuda"))
        rows.copy_(_random_rows(slab_rows, shape.hidden, torch.bfloat16, gen))
        packed.copy_(_random_rows(slab_rows, packed_bytes, torch.uint8, gen))
        y.copy_(_random_rows(capacity_rows, shape.hidden, torch.bfloat16, gen))
        for out in (out_rows, out_packed, out_sums):
            _bytes(out).fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        try:
            _check_permute(shape, plan, rows, out_rows, True)
            _check_permute(shape, plan, packed, out_packed, True)
            _check_unpermute(shape, recv_pos, weights, y, out_sums)
        except AssertionError as exc:
            raise AssertionError(f"replay {replay}: {exc}") from exc
