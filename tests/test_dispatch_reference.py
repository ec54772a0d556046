"""Dispatch/combine contract on the ``reference`` backend (gloo, CPU ranks).

Every rank function runs many scenarios inside one spawn (a spawn costs each rank an
``import torch``). World sizes 1, 2 and 4: 1 is the degenerate no-peer case, 2 the common
one, 4 has ranks that receive from several sources (order by source rank matters).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm.nn.reference import dense_moe, drop_over_capacity
from multirank import run_ranks

NUM_EXPERTS = 8
TOPK = 3
HIDDEN = 8
MAX_TOKENS = 12
ALIGN = 4


def _config(**overrides):
    base = dict(
        backend="reference",
        num_experts=NUM_EXPERTS,
        topk=TOPK,
        hidden=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        dtype="float32",
        expert_alignment=ALIGN,
    )
    base.update(overrides)
    return moe_comm.load_config(None, **base)


def _routing(kind: str, rank: int, world: int, generator: torch.Generator):
    """Every rank's inputs for one scenario (all ranks draw all of them, so each can check any rank)."""
    tokens = [MAX_TOKENS - r for r in range(world)]  # T < max_tokens_per_rank on every rank but 0
    if kind == "empty_rank":
        tokens[-1] = 0
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, HIDDEN, generator=generator))
        idx = torch.topk(torch.randn(t, NUM_EXPERTS, generator=generator).abs() + 1, TOPK).indices
        if kind == "minus_one":
            idx[torch.rand(t, TOPK, generator=generator) < 0.4] = -1
            if t:
                idx[0] = -1  # a token with no expert at all
        elif kind == "one_expert":
            idx[:, 0] = NUM_EXPERTS - 1
            idx[:, 1:] = -1
        ws.append(torch.rand(t, TOPK, generator=generator))
        idxs.append(idx)
    return xs, idxs, ws


def _expert_weights(generator: torch.Generator) -> torch.Tensor:
    return torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=generator, dtype=torch.float64) / HIDDEN**0.5


def _run_local_experts(out, weights_local: torch.Tensor) -> torch.Tensor:
    """y = out.x[segment j] @ W_j for each local expert's whole aligned segment (padding rows stay zero)."""
    ends = out.expert_offsets.tolist()
    pieces, start = [], 0
    for j, end in enumerate(ends):
        pieces.append(out.x[start:end] @ weights_local[j])
        start = end
    pieces.append(torch.zeros(out.x.shape[0] - start, HIDDEN, dtype=out.x.dtype))
    return torch.cat(pieces)


def _grad_or_zeros(tensor: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(tensor) if tensor.grad is None else tensor.grad.clone()


def _check_layout(out, rank, world, xs, idxs, capacity=None):
    """Row by row: segment sizes, alignment, zero padding and the (source rank, token) order."""
    local = NUM_EXPERTS // world
    kept = drop_over_capacity(idxs, NUM_EXPERTS, capacity)
    start = 0
    for j in range(local):
        expert = rank * local + j
        expected_rows = [xs[s][t] for s in range(world) for t in range(kept[s].shape[0]) for k in range(TOPK)
                         if int(kept[s][t, k]) == expert]
        count = len(expected_rows)
        end = int(out.expert_offsets[j])
        assert int(out.tokens_per_expert[j]) == count
        assert end - start == -(-count // ALIGN) * ALIGN, "segment must be the count rounded up to the alignment"
        assert start % ALIGN == 0
        for i, row in enumerate(expected_rows):
            assert torch.equal(out.x[start + i], row), f"expert {expert} row {i}"
        assert torch.count_nonzero(out.x[start + count:end]) == 0, "alignment padding must be zero"
        start = end


def _scenarios(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(1234)
    grad_generator = torch.Generator().manual_seed(rank)
    weights = _expert_weights(generator)
    local = NUM_EXPERTS // world
    with moe_comm.Dispatcher(_config()) as disp:
        assert disp.backend_name == "reference" and disp.num_local_experts == local
        for kind in ("random", "minus_one", "one_expert", "empty_rank"):
            xs, idxs, ws = _routing(kind, rank, world, generator)
            x = xs[rank].clone().requires_grad_()
            w = ws[rank].clone().requires_grad_()
            weights_local = weights[rank * local:(rank + 1) * local].float().requires_grad_()
            out = disp.dispatch(x, idxs[rank], w)
            _check_layout(out, rank, world, xs, idxs)
            z = disp.combine(_run_local_experts(out, weights_local), out.handle)

            ref_x = xs[rank].double().requires_grad_()
            ref_w = ws[rank].double().requires_grad_()
            ref_weights = weights.clone().requires_grad_()
            ref = dense_moe(ref_x, idxs[rank], ref_w, lambda e, rows: rows @ ref_weights[e], NUM_EXPERTS)
            torch.testing.assert_close(z.double(), ref, rtol=1e-5, atol=1e-5, msg=kind)

            # Drawn from a per-rank generator: the shared one must stay in step on every rank.
            grad = torch.randn(ref.shape, generator=grad_generator, dtype=torch.float64)
            z.backward(grad.float())  # collective: every rank runs it, also one with no tokens
            if ref.grad_fn is not None:  # a rank with no tokens has no dense graph: its gradients are zero
                ref.backward(grad)
            torch.testing.assert_close(x.grad.double(), _grad_or_zeros(ref_x), rtol=1e-5, atol=1e-5, msg=kind)
            torch.testing.assert_close(w.grad.double(), _grad_or_zeros(ref_w), rtol=1e-5, atol=1e-5, msg=kind)
            # Each rank's dense reference only sees its own tokens: the experts' full gradient is the sum.
            dense_grad = _grad_or_zeros(ref_weights)
            dist.all_reduce(dense_grad)
            torch.testing.assert_close(weights_local.grad.double(), dense_grad[rank * local:(rank + 1) * local],
                                       rtol=1e-5, atol=1e-5, msg=kind)
            disp.check()

        # A handle stays valid after later dispatch calls, and results are bitwise reproducible.
        xs, idxs, ws = _routing("random", rank, world, generator)
        first = disp.dispatch(xs[rank], idxs[rank], ws[rank])
        y_first = _run_local_experts(first, weights[rank * local:(rank + 1) * local].float())
        z_first = disp.combine(y_first, first.handle)
        disp.dispatch(xs[rank] * 2, idxs[rank], ws[rank])
        assert torch.equal(disp.combine(y_first, first.handle), z_first)


def _bf16_scenario(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(99)
    weights = _expert_weights(generator)
    local = NUM_EXPERTS // world
    with moe_comm.Dispatcher(_config(dtype="bfloat16")) as disp:
        xs, idxs, ws = _routing("random", rank, world, generator)
        x = xs[rank].bfloat16()
        out = disp.dispatch(x, idxs[rank], ws[rank])
        _check_layout(out, rank, world, [v.bfloat16() for v in xs], idxs)
        z = disp.combine(_run_local_experts(out, weights[rank * local:(rank + 1) * local].bfloat16()), out.handle)
        assert z.dtype is torch.bfloat16
        ref = dense_moe(x.double(), idxs[rank], ws[rank].double(), lambda e, r: r @ weights[e], NUM_EXPERTS)
        torch.testing.assert_close(z.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_combine_matches_dense_reference(world):
    run_ranks(_run_all, world, timeout_s=180)


def _run_all(rank: int, world: int) -> None:
    _scenarios(rank, world)
    _bf16_scenario(rank, world)


def _capacity_and_invalid(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(7)
    weights = _expert_weights(generator)
    local = NUM_EXPERTS // world
    capacity = 3
    with moe_comm.Dispatcher(_config(expert_capacity=capacity)) as disp:
        xs, idxs, ws = _routing("random", rank, world, generator)
        out = disp.dispatch(xs[rank], idxs[rank], ws[rank])
        _check_layout(out, rank, world, xs, idxs, capacity=capacity)
        z = disp.combine(_run_local_experts(out, weights[rank * local:(rank + 1) * local].float()), out.handle)
        kept = drop_over_capacity(idxs, NUM_EXPERTS, capacity)
        ref = dense_moe(xs[rank].double(), kept[rank], ws[rank].double(), lambda e, r: r @ weights[e], NUM_EXPERTS)
        torch.testing.assert_close(z.double(), ref, rtol=1e-5, atol=1e-5)
        # The count of drops on this rank is exact: every assignment to its experts past the capacity.
        expected = sum(int(((i >= rank * local) & (i < (rank + 1) * local)).sum()) for i in idxs) - sum(
            int(((k >= rank * local) & (k < (rank + 1) * local)).sum()) for k in kept
        )
        report = disp.read_status()
        assert report.num_dropped == expected and report.num_invalid == 0
        if expected:
            with pytest.raises(moe_comm.DeviceStatusError, match=f"{expected} assignment\\(s\\) dropped"):
                disp.check()
        assert disp.read_status().ok, "check() clears the status"

    with moe_comm.Dispatcher(_config()) as disp:
        xs, idxs, ws = _routing("random", rank, world, generator)
        bad = idxs[rank].clone()
        bad[2, 1] = NUM_EXPERTS + 3  # out of range: dropped and reported, never written anywhere
        bad[4, 0] = -7
        out = disp.dispatch(xs[rank], bad, ws[rank])
        z = disp.combine(_run_local_experts(out, weights[rank * local:(rank + 1) * local].float()), out.handle)
        cleaned = bad.clone()
        cleaned[(cleaned < -1) | (cleaned >= NUM_EXPERTS)] = -1
        ref = dense_moe(xs[rank].double(), cleaned, ws[rank].double(), lambda e, r: r @ weights[e], NUM_EXPERTS)
        torch.testing.assert_close(z.double(), ref, rtol=1e-5, atol=1e-5)
        first = f"first: rank {rank}, token 2, in call 1 of"  # this Dispatcher's first call
        with pytest.raises(moe_comm.DeviceStatusError, match=f"2 expert id\\(s\\).*{first}"):
            disp.check()

    with moe_comm.Dispatcher(_config(check_every_step=True)) as disp:
        xs, idxs, ws = _routing("random", rank, world, generator)
        bad = idxs[rank].clone()
        bad[0, 0] = NUM_EXPERTS
        with pytest.raises(moe_comm.DeviceStatusError, match="outside"):
            disp.dispatch(xs[rank], bad, ws[rank])


@pytest.mark.parametrize("world", [2])
def test_capacity_drops_and_invalid_ids(world):
    run_ranks(_capacity_and_invalid, world, timeout_s=120)


def _bad_inputs(rank: int, world: int) -> None:
    disp = moe_comm.Dispatcher(_config())
    other = moe_comm.Dispatcher(_config())
    x = torch.randn(4, HIDDEN)
    idx = torch.zeros(4, TOPK, dtype=torch.int64)
    w = torch.ones(4, TOPK)
    cases = [
        ((x.double(), idx, w), "x: expected dtype float32, got torch.float64"),
        ((x[:, :4], idx, w), r"x: expected shape \[\*, 8\], got \(4, 4\)"),
        ((torch.randn(HIDDEN, 4).t(), idx, w), "x: expected a contiguous"),
        ((torch.randn(MAX_TOKENS + 1, HIDDEN), torch.zeros(MAX_TOKENS + 1, TOPK, dtype=torch.int64),
          torch.ones(MAX_TOKENS + 1, TOPK)), f"at most max_tokens_per_rank={MAX_TOKENS} rows, got {MAX_TOKENS + 1}"),
        ((x, idx[:3], w), r"topk_idx: expected shape \[4, 3\], got \(3, 3\)"),
        ((x, idx.float(), w), "topk_idx: expected dtype int32 or int64, got torch.float32"),
        ((x, idx, w[:, :2]), r"topk_weights: expected shape \[4, 3\], got \(4, 2\)"),
        ((x, idx, w.half()), "topk_weights: expected dtype float32"),
        ((x.to("meta"), idx, w), "x: expected a tensor on cpu, got one on meta"),
        (("tokens", idx, w), "x: expected a torch.Tensor, got str"),
    ]
    for args, message in cases:
        with pytest.raises(moe_comm.InputError, match=message):
            disp.dispatch(*args)
    out = disp.dispatch(x, idx, w)
    with pytest.raises(moe_comm.InputError, match=rf"y: expected shape \[{disp.capacity_rows}, 8\]"):
        disp.combine(out.x[:5], out.handle)
    with pytest.raises(moe_comm.InputError, match="another Dispatcher"):
        other.combine(out.x, out.handle)
    with pytest.raises(moe_comm.InputError, match="handle: expected the DispatchHandle"):
        disp.combine(out.x, None)
    disp.combine(out.x, out.handle)
    disp.close()
    disp.close()  # idempotent
    with pytest.raises(moe_comm.MoeCommError, match="closed"):
        disp.dispatch(x, idx, w)
    other.close()

    # Ranks that build their dispatchers from different configs are told so at construction.
    with pytest.raises(moe_comm.ConfigError, match="differs between ranks"):
        moe_comm.Dispatcher(_config(hidden=HIDDEN * (2 if rank == 1 else 1)))
    with pytest.raises(moe_comm.ConfigError, match="multiple of the world size"):
        moe_comm.Dispatcher(_config(num_experts=3, topk=2))


def test_bad_input_errors():
    run_ranks(_bad_inputs, 2, timeout_s=120)


def _lifecycle(rank: int, world: int) -> None:
    import gc
    import os

    def open_fds() -> dict:
        fds = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                fds[name] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:  # the listing's own descriptor, closed by now
                pass
        return fds

    x = torch.randn(4, HIDDEN)
    idx = torch.zeros(4, TOPK, dtype=torch.int64)
    w = torch.ones(4, TOPK)

    def rounds(count: int) -> None:
        for _ in range(count):
            with moe_comm.Dispatcher(_config()) as disp:
                out = disp.dispatch(x, idx, w)
                disp.combine(out.x, out.handle)
            with pytest.raises(moe_comm.MoeCommError, match="closed"):
                disp.dispatch(x, idx, w)

    rounds(5)  # the first rounds may open what torch.distributed keeps for later (its store connections)
    gc.collect()
    start = open_fds()
    rounds(50)
    gc.collect()
    end = open_fds()
    # torch.distributed opens and closes one socket of its own at arbitrary moments (seen on CPU
    # ranks, never more than one); a leak of moe_comm's would grow with the 50 rounds.
    changed = set(end.items()) ^ set(start.items())
    assert len(changed) <= 1 and all(target.startswith("socket:") for _, target in changed), (
        f"building and closing dispatchers changed the open file descriptors: {sorted(changed)}"
    )

def test_build_and_close_fifty_times():
    # Lifetime on the reference backend: context manager closes, a closed dispatcher refuses work,
    # and 50 build/close rounds leave the process's open files where they were.
    run_ranks(_lifecycle, 2, timeout_s=120)
