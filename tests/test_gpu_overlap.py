"""Overlap (contract: SM budget): dispatch/combine on a communication stream beside compute.

The guide's recipe on ``vmm`` with ``sm_budget`` set (1 rank, and 2 ranks time-sliced on one GPU
when only one is present), in both receive layouts: the communication stream waits for the inputs and
runs dispatch while a GEMM leaving the budget's SMs free (``moe_comm.gemm_sm_carveout``) runs on the
compute stream; the compute stream then waits for the rows and runs the experts (token-major: with the
permute and unpermute, every SM); the communication stream waits for their output and runs combine
beside a second GEMM; the tensors that cross streams are recorded on the stream that uses them
(allocator safety). Run eagerly and captured into one CUDA graph with both streams (replayed with new
tokens), it gives the results of the same calls run one after the other.
"""

from __future__ import annotations

import pytest
import torch

import moe_comm
from moe_comm.nn.receive_layout import combine_rows, expert_rows
from capture import warm_up_on_side_stream
from gpu_backends import dist_backend_for, gpus_needed
from multirank import run_ranks

pytestmark = pytest.mark.gpu

HIDDEN, TOKENS, EXPERTS, TOPK, BUDGET = 512, 128, 8, 2, 8
LAYOUTS = ("expert_major", "token_major")
REPLAYS = 3


def _overlapped(disp, comm: torch.cuda.Stream, x, idx, weights, a, b):
    """The recipe: dispatch and combine on ``comm``; ``a @ b`` beside each, and between them the experts
    (a scale) with the layout's permute and unpermute, on the current stream."""
    compute = torch.cuda.current_stream()
    comm.wait_stream(compute)  # the inputs were written on the compute stream
    with torch.cuda.stream(comm):
        for tensor in (x, idx, weights):
            tensor.record_stream(comm)  # read on comm: not reused before comm is done with them
        out = disp.dispatch(x, idx, weights)
    with moe_comm.gemm_sm_carveout(BUDGET):  # the GEMM leaves the budget's SMs to the communication
        product = a @ b  # overlaps the dispatch
    compute.wait_stream(comm)  # dispatch's rows arrived
    rows = expert_rows(disp, out)
    reduced = combine_rows(disp, rows.x * 2, out)
    reduced.record_stream(comm)  # allocated on the compute stream, read on comm
    comm.wait_stream(compute)
    with torch.cuda.stream(comm):
        z = disp.combine(reduced, out.handle)
    with moe_comm.gemm_sm_carveout(BUDGET):
        second = b @ a  # overlaps the combine
    compute.wait_stream(comm)
    z.record_stream(compute)  # allocated on comm, used on the compute stream from here on
    return z, product, second


def _configs() -> list:
    """The config of each receive layout, in the order of ``LAYOUTS``."""
    return [moe_comm.load_config(None, backend="vmm", num_experts=EXPERTS, topk=TOPK, hidden=HIDDEN,
                                 max_tokens_per_rank=TOKENS, dtype="bfloat16", sm_budget=BUDGET, receive_layout=layout)
            for layout in LAYOUTS]


def _rank_main(rank: int, world: int, layout: str) -> dict:
    cfg = _configs()[LAYOUTS.index(layout)]
    gen = torch.Generator().manual_seed(rank)
    with moe_comm.Dispatcher(cfg) as disp:
        device = disp.device

        def inputs():
            return (torch.randn(TOKENS, HIDDEN, generator=gen).to(device, torch.bfloat16),
                    torch.randint(0, EXPERTS, (TOKENS, TOPK), generator=gen).to(device),
                    torch.rand(TOKENS, TOPK, generator=gen).to(device),
                    torch.randn(1024, 1024, generator=gen).to(device, torch.bfloat16),
                    torch.randn(1024, 1024, generator=gen).to(device, torch.bfloat16))

        def sequential(x, idx, weights, a, b):
            out = disp.dispatch(x, idx, weights)
            rows = expert_rows(disp, out)
            z = disp.combine(combine_rows(disp, rows.x * 2, out), out.handle)
            with moe_comm.gemm_sm_carveout(BUDGET):  # the same GEMM kernels as the overlapped ones
                return z, a @ b, b @ a

        comm = torch.cuda.Stream(device)
        errors = {}
        sets = [inputs() for _ in range(REPLAYS + 1)]
        want = [sequential(*s) for s in sets]
        got = _overlapped(disp, comm, *sets[0])
        errors["eager"] = [torch.equal(g, w) for g, w in zip(got, want[0])]
        static = tuple(t.clone() for t in sets[0])
        warm_up_on_side_stream(lambda: _overlapped(disp, comm, *static))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = _overlapped(disp, comm, *static)
        for i in range(1, REPLAYS + 1):
            for dst, src in zip(static, sets[i]):
                dst.copy_(src)
            graph.replay()
            errors[f"replay {i}"] = [torch.equal(g, w) for g, w in zip(graph_out, want[i])]
        torch.cuda.synchronize(device)
        disp.check()
    return errors


# Token-major moves the permute and unpermute onto the compute stream: the recipe's other stream crossings.
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.kernels.with_args(_configs)
def test_overlap_recipe_eager_and_captured(world, layout, requires_gpus):
    gpus = requires_gpus(gpus_needed("vmm", world))
    per_rank = run_ranks(_rank_main, world, layout, dist_backend=dist_backend_for(world, gpus), gpu=True,
                         timeout_s=300)
    for rank, errors in enumerate(per_rank):
        assert all(all(same) for same in errors.values()), f"rank {rank}: combine and GEMMs equal? {errors}"
