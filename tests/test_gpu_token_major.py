"""The token-major layout on every GPU backend: bitwise the expert-major path of the same backend.

Every rank builds two Dispatchers of one backend that differ only in ``receive_layout`` and runs the
same inputs through dispatch -> experts -> combine (expert-major) and dispatch -> permute -> experts ->
unpermute -> combine (token-major): the permuted rows (and FP8 scales), the segments and ``z`` must be
the same bits, and so must the gradients of ``x``, the router weights and the experts' parameters;
the token-major output's rows and local expert ids are checked against the expert-major routing.
Then both steps are captured in CUDA graphs and replayed 50 times with new routing every replay.
bf16, float32 and FP8 dispatch; drops over ``expert_capacity``; a 3-SM budget. Worlds 1, 2 and 4
(``vmm`` time-sliced on one GPU; the other backends need a GPU per rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_comm
from gpu_backends import GPU_BACKENDS, dist_backend_for, gpus_needed
from multirank import run_ranks
from token_major_checks import assert_same_rows, both_paths

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 8
TOPK = 3
HIDDEN = 2048       # a multiple of 128 (FP8); 128 vectors of bf16: whole units
MAX_TOKENS = 40
REPLAYS = 50


def _config(backend: str, section: dict, **overrides) -> moe_comm.Config:
    values = dict(backend=backend, num_experts=NUM_EXPERTS, topk=TOPK, hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS,
                  dtype="bfloat16", expert_alignment=4, num_senders=8, timeout_s=60.0, **section)
    values.update(overrides)
    return moe_comm.load_config(None, **values)


def _pair(backend: str, section: dict, **overrides) -> tuple[moe_comm.Dispatcher, moe_comm.Dispatcher]:
    """An expert-major and a token-major Dispatcher of the same config (built in the same order on every rank)."""
    return (moe_comm.Dispatcher(_config(backend, section, **overrides)),
            moe_comm.Dispatcher(_config(backend, section, receive_layout="token_major", **overrides)))


def _inputs(kind: str, num_tokens: int, dtype: torch.dtype, generator: torch.Generator, device):
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    idx = torch.topk(torch.rand(num_tokens, NUM_EXPERTS, generator=generator), TOPK).indices
    if kind == "holes":
        idx[torch.rand(num_tokens, TOPK, generator=generator) < 0.3] = -1
    elif kind == "one_expert":
        idx[:, 0] = NUM_EXPERTS - 1
        idx[:, 1:] = -1
    weights = torch.rand(num_tokens, TOPK, generator=generator)
    return x.to(device), idx.to(device), weights.to(device)


def _expert_scale(disp: moe_comm.Dispatcher, scale_table: torch.Tensor):
    """Experts that scale each row by its expert's factor (``scale_table [L]``): static shapes, capturable."""
    row_index = torch.arange(disp.capacity_rows, dtype=torch.int32, device=disp.device)

    def experts(out) -> torch.Tensor:
        expert = torch.searchsorted(out.expert_offsets, row_index, right=True).clamp_(max=scale_table.numel() - 1)
        # Rows past the last segment are unspecified (stale, maybe NaN): zeroed before they meet a weight,
        # or 0 * NaN would reach the scales' gradient.
        rows = torch.where((row_index < out.expert_offsets[-1])[:, None], out.x.float(), 0.0)
        return (rows * scale_table[expert][:, None]).to(out.x.dtype)
    return experts


def _assert_ids_and_rows(out_em, out_tm, x_by_rank_row: torch.Tensor) -> None:
    """The token-major output's local ids are the expert-major routing's segments, and each row with a kept
    entry is its token (the expert-major rows of its entries)."""
    recv_pos = out_em.handle.routing.recv_pos.reshape(-1, TOPK)
    expert = torch.searchsorted(out_em.expert_offsets, recv_pos, right=True).to(torch.int32)
    assert torch.equal(out_tm.topk_idx, torch.where(recv_pos >= 0, expert, -1)), "local expert ids"
    kept = recv_pos >= 0
    slab_rows = kept.any(dim=1).nonzero().squeeze(1)
    first = recv_pos[slab_rows, kept[slab_rows].int().argmax(dim=1)].long()
    assert torch.equal(out_tm.rows[slab_rows].view(torch.uint8), x_by_rank_row[first].view(torch.uint8)), "rows"


def _eager(em, tm, rank: int, dtype: torch.dtype, generator: torch.Generator, tag: str) -> None:
    """Eager steps of several routings and sizes (one rank empty), forward and backward."""
    device = em.device
    local = em.num_local_experts
    for kind, num_tokens in (("random", MAX_TOKENS - rank), ("holes", 17 + rank), ("one_expert", 9), ("random", 0)):
        x, idx, w = _inputs(kind, num_tokens, dtype, generator, device)
        scale = (1 + 0.25 * torch.arange(local, dtype=torch.float32, device=device))
        leaves = [(x.clone().requires_grad_(), w.clone().requires_grad_(), scale.clone().requires_grad_())
                  for _ in range(2)]
        out_em = em.dispatch(leaves[0][0], idx, leaves[0][1])
        z_em = em.combine(_expert_scale(em, leaves[0][2])(out_em), out_em.handle)
        out_tm = tm.dispatch(leaves[1][0], idx, leaves[1][1])
        permuted = tm.permute(out_tm)
        z_tm = tm.combine(tm.unpermute(_expert_scale(tm, leaves[1][2])(permuted), out_tm), out_tm.handle)
        what = f"{tag} {kind} T={num_tokens}"
        assert_same_rows(out_em, permuted)
        assert torch.equal(z_tm, z_em), what
        _assert_ids_and_rows(out_em, out_tm, out_em.x)
        grad = torch.randn(z_em.shape, generator=generator).to(dtype).to(device)
        z_em.backward(grad)
        z_tm.backward(grad)
        for (a, b, name) in zip(leaves[0], leaves[1], ("x", "topk_weights", "expert scales")):
            assert torch.equal(a.grad, b.grad), f"{what}: gradient of {name}"
    em.check()
    tm.check()


def _graphs(em, tm, rank: int, dtype: torch.dtype, generator: torch.Generator, tag: str) -> None:
    """Both steps captured once and replayed with new routing and tokens every replay."""
    device = em.device
    scale = 1 + 0.25 * torch.arange(em.num_local_experts, dtype=torch.float32, device=device)
    static = dict(zip(("x", "idx", "w"), _inputs("random", MAX_TOKENS - 1 - rank, dtype, generator, device)))

    def step_em():
        out = em.dispatch(static["x"], static["idx"], static["w"])
        return out, em.combine(_expert_scale(em, scale)(out), out.handle)

    def step_tm():
        out = tm.dispatch(static["x"], static["idx"], static["w"])
        permuted = tm.permute(out)
        return permuted, tm.combine(tm.unpermute(_expert_scale(tm, scale)(permuted), out), out.handle)

    captured = []
    for step in (step_em, step_tm):
        step()  # warm-up of the same calls, eager
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        captured.append((graph, outputs))
    kinds = ("random", "holes", "one_expert")
    for replay in range(REPLAYS):
        x, idx, w = _inputs(kinds[replay % 3], static["x"].shape[0], dtype, generator, device)
        static["x"].copy_(x)
        static["idx"].copy_(idx)
        static["w"].copy_(w)
        for graph, (_, z) in captured:
            z.fill_(float("nan"))
            graph.replay()
        (_, (out_em, z_em)), (_, (permuted, z_tm)) = captured
        assert_same_rows(out_em, permuted)
        assert torch.equal(z_tm, z_em), f"{tag} replay {replay}"
    em.check()
    tm.check()


def _rank_main(rank: int, world: int, backend_id: str) -> None:
    backend, section = GPU_BACKENDS[backend_id]
    generator = torch.Generator().manual_seed(77 + rank)
    for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        em, tm = _pair(backend, section, dtype=dtype_name)
        _eager(em, tm, rank, dtype, generator, f"{backend_id} {dtype_name} rank {rank}")
        _graphs(em, tm, rank, dtype, generator, f"{backend_id} {dtype_name} rank {rank}")
        em.close()
        tm.close()
    # FP8 dispatch: the permuted e4m3 rows and their scales are the expert-major dispatch's.
    em, tm = _pair(backend, section, dispatch_dtype="float8_e4m3fn")
    x, idx, w = _inputs("holes", MAX_TOKENS - rank, torch.bfloat16, generator, em.device)
    scale = torch.rand(HIDDEN, generator=generator).to(em.device) + 0.5
    out_em, z_em, _, permuted, z_tm = both_paths(em, tm, x, idx, w,
                                                 lambda out: (out.x.float() * scale).to(torch.bfloat16))
    assert_same_rows(out_em, permuted)
    assert torch.equal(z_tm, z_em), "fp8"
    em.close()
    tm.close()
    # Drops over the capacity, and a budget of 3 SMs (several roles on one block).
    for overrides in (dict(expert_capacity=5), dict(sm_budget=3, num_senders=1)):
        em, tm = _pair(backend, section, **overrides)
        x, idx, w = _inputs("random", MAX_TOKENS - rank, torch.bfloat16, generator, em.device)
        scale = torch.rand(HIDDEN, generator=generator).to(em.device) + 0.5
        out_em, z_em, _, permuted, z_tm = both_paths(em, tm, x, idx, w,
                                                     lambda out: (out.x.float() * scale).to(torch.bfloat16))
        assert_same_rows(out_em, permuted)
        assert torch.equal(z_tm, z_em), str(overrides)
        for disp in (em, tm):
            if "expert_capacity" in overrides:
                with pytest.raises(moe_comm.DeviceStatusError, match="dropped over expert_capacity=5"):
                    disp.check()
            disp.close()
    dist.barrier()


def _kernel_configs(backend_id: str) -> list:
    backend, section = GPU_BACKENDS[backend_id]
    return [_config(backend, section, receive_layout=layout, dtype=dtype)
            for layout in ("expert_major", "token_major") for dtype in ("bfloat16", "float32")]


@pytest.mark.kernels.with_args(_kernel_configs)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("backend_id", list(GPU_BACKENDS))
def test_token_major_is_bitwise_the_expert_major_path(backend_id, world, requires_gpus):
    present = requires_gpus(gpus_needed(backend_id, world))
    run_ranks(_rank_main, world, backend_id, dist_backend=dist_backend_for(world, present), gpu=True, timeout_s=600)
