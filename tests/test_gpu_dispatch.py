"""Every GPU backend against the reference backend, bitwise.

Every rank runs the same inputs through a Dispatcher of the backend under test (GPU) and a
``reference`` Dispatcher (CPU, over a gloo group of its own) and compares: the dispatch layout
(``out.x`` rows up to ``expert_offsets[-1]``, offsets, counts, every routing tensor), combine
(weighted and not), redispatch, return_entry_values and the status word. Then a captured dispatch
-> experts -> combine step is replayed with fresh inputs, checked against the reference every time.

Backends: ``tests/gpu_backends.GPU_BACKENDS`` (vmm, nvshmem p2p and put, nccl symmetric and
collective). World sizes, one spawn each: 1 (no peers: every "remote" write is local), 2, 4 and 8.
``vmm`` also runs more ranks than there are GPUs, one GPU included (several ranks per GPU, gloo
default group: ranks that share a GPU exercise the spin-waits under time-slicing); the others
need one GPU per rank.

Outputs are pre-filled with a sentinel so an unwritten row shows: exactly for graph replays (the
static outputs are filled before every replay) and best-effort for eager calls (the caching
allocator is handed blocks of the outputs' sizes filled with the sentinel just before the call).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist

import moe_comm
from moe_comm import protocol
from moe_comm.backends.collective import CollectiveBackend
from gpu_backends import GPU_BACKENDS, dist_backend_for, gpus_needed
from multirank import run_ranks
from segments import padding_rows

pytestmark = pytest.mark.gpu

NUM_EXPERTS = 8
TOPK = 3                 # odd: metadata rows padded, 10 rows per 32-lane tile in the layout phase
HIDDEN = 2056            # 257 16-byte vectors (bf16): partial last chunk in every kernel
MAX_TOKENS = 40
ALIGN = 4
SENTINEL_BYTE = 0x7F     # int32 0x7f7f7f7f, float32 3.4e38, bf16 3.4e38: never a legitimate value
# Enough tokens for 4 chunks of dispatch's rows and of combine's partial rows (256 tokens each,
# protocol.MIN_CHUNK_TOKENS), the last one partial.
CHUNKED_MAX_TOKENS = 3 * 256 + 40
# More local experts than a dispatch block has threads (512): the layout's scans over the experts
# span every warp and two rounds, which NUM_EXPERTS (a few experts, one warp) never reaches.
MANY_LOCAL_EXPERTS = 1040
# Slab rows laid out by a single block: 1400 rows are 140 tiles of TOPK-entry rows, more than 8
# (LAYOUT_BATCH) per warp, so pass 2 of the layout reloads its batches instead of keeping pass 1's.
ONE_BLOCK_MAX_TOKENS = 1400


def _config(backend: str, dtype: str, **overrides):
    values = dict(
        backend=backend,
        num_experts=NUM_EXPERTS,
        topk=TOPK,
        hidden=HIDDEN,
        max_tokens_per_rank=MAX_TOKENS,
        dtype=dtype,
        expert_alignment=ALIGN,
        num_senders=8,          # several blocks: grid-stride loops and the last-block pattern
        timeout_s=60.0,
    )
    values.update(overrides)
    return moe_comm.load_config(None, **values)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (so -0.0 != 0.0 and NaN == NaN), on the CPU."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.view(torch.int16)
    if tensor.dtype == torch.float32:
        return tensor.view(torch.int32)
    return tensor


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a, b = _bits(got), _bits(want)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} element(s) differ, first at {bad[0].tolist()}: "
                             f"got {got.detach().cpu()[tuple(bad[0])]!r}, want {want[tuple(bad[0])]!r}")


def _poison_allocator(shapes_and_dtypes, device) -> None:
    """Best effort: leave sentinel-filled blocks of these sizes in torch's cache for the next allocations."""
    blocks = [torch.full((math.prod(shape) * dtype.itemsize,), SENTINEL_BYTE, dtype=torch.uint8, device=device)
              for shape, dtype in shapes_and_dtypes]
    del blocks


def _fill_sentinel(tensor: torch.Tensor) -> None:
    if tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.view(torch.uint8).fill_(SENTINEL_BYTE)


def _inputs(kind: str, num_tokens: int, world: int, dtype: torch.dtype, generator: torch.Generator,
            num_experts: int = NUM_EXPERTS):
    """x [T, H], topk_idx [T, K] (int64), topk_weights [T, K] on the CPU for one scenario."""
    local = num_experts // world
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    weights = torch.rand(num_tokens, TOPK, generator=generator)
    idx = torch.topk(torch.randn(num_tokens, num_experts, generator=generator).abs() + 1, TOPK).indices
    if kind == "minus_one":
        idx[torch.rand(num_tokens, TOPK, generator=generator) < 0.4] = -1
        if num_tokens:
            idx[0] = -1  # a token sent nowhere: combine must give zeros
    elif kind == "one_expert":
        idx[:, 0] = num_experts - 1
        idx[:, 1:] = -1
    elif kind == "one_rank":  # every assignment on rank 0, repeated experts allowed
        idx = torch.randint(0, local, (num_tokens, TOPK), generator=generator)
    elif kind == "invalid":
        if num_tokens > 3:
            idx[1, 2] = num_experts + 3
            idx[3, 0] = -7
            idx[3, 1] = 1 << 40  # does not fit in int32: must still count as invalid
    return x, idx, weights


def _expert_rows(out, rank: int, world: int, rows_used: torch.Tensor) -> torch.Tensor:
    """CPU expert outputs: row * (1 + 0.25 * global expert), NaN on every row no kept entry maps to."""
    local = out.expert_offsets.numel()
    capacity_rows = out.x.shape[0]
    rows = torch.arange(capacity_rows, dtype=torch.int32)
    expert = torch.searchsorted(out.expert_offsets.cpu(), rows, right=True).clamp(max=local - 1)
    scale = (1 + 0.25 * (rank * local + expert.double())).to(out.x.dtype)
    y = out.x.cpu() * scale[:, None]
    return torch.where(rows_used[:, None], y, torch.full_like(y, float("nan")))


def _rows_used(recv_pos: torch.Tensor, capacity_rows: int) -> torch.Tensor:
    used = torch.zeros(capacity_rows, dtype=torch.bool)
    kept = recv_pos[recv_pos >= 0].long()
    used[kept] = True
    return used


def _compare_dispatch(out, ref, tag: str, zero_padding: bool) -> None:
    _assert_bitwise(out.expert_offsets, ref.expert_offsets, f"{tag} expert_offsets")
    _assert_bitwise(out.tokens_per_expert, ref.tokens_per_expert, f"{tag} tokens_per_expert")
    end = int(ref.expert_offsets[-1])
    if zero_padding:
        _assert_bitwise(out.x[:end], ref.x[:end], f"{tag} out.x[:expert_offsets[-1]]")
    else:  # the padding rows are unspecified: the kept entries' rows
        kept = _rows_used(ref.handle.routing.recv_pos, ref.x.shape[0])
        _assert_bitwise(out.x.cpu()[kept], ref.x[kept], f"{tag} out.x (the kept entries' rows)")
    got, want = out.handle.routing, ref.handle.routing
    assert got.num_tokens == want.num_tokens
    for name in ("send_mask", "dest_rank", "recv_pos", "recv_weight"):
        _assert_bitwise(getattr(got, name), getattr(want, name), f"{tag} routing.{name}")


def _without_call_numbers(report):
    """``report`` with its first offences' call numbers reduced to whether there is one."""
    return dataclasses.replace(report, first_invalid_call=report.first_invalid_call is not None,
                               first_dropped_call=report.first_dropped_call is not None)


def _check_status(dev, ref, tag: str) -> None:
    got, want = dev.read_status(), ref.read_status()
    # The two dispatchers have not made the same calls (the graphs' warm-ups), so the calls of the
    # first offences are compared by presence; test_gpu_reliability checks their numbers.
    assert _without_call_numbers(got) == _without_call_numbers(want), \
        f"{tag}: device status {got} != reference status {want}"
    if not want.ok:
        for disp in (dev, ref):
            with pytest.raises(moe_comm.DeviceStatusError):
                disp.check()
    assert dev.read_status().ok and ref.read_status().ok


def _eager_step(dev, ref, rank, world, x, idx, weights, generator, tag) -> None:
    device = dev.device
    dtype = x.dtype
    num_tokens = x.shape[0]
    slab = (world, dev.config.max_tokens_per_rank, TOPK)
    _poison_allocator([((num_tokens, world), torch.bool), ((num_tokens, TOPK), torch.int32), (slab, torch.int32),
                       (slab, torch.float32), ((dev.capacity_rows, HIDDEN), dtype)], device)
    out = dev.dispatch(x.to(device), idx.to(device), weights.to(device))
    ref_out = ref.dispatch(x, idx, weights)
    _compare_dispatch(out, ref_out, tag, dev.config.zero_padding)

    routing, ref_routing = out.handle.routing, ref_out.handle.routing
    used = _rows_used(ref_routing.recv_pos, ref.capacity_rows)
    y = _expert_rows(ref_out, rank, world, used)
    _poison_allocator([((num_tokens, HIDDEN), dtype)], device)
    _assert_bitwise(dev.combine(y.to(device), out.handle), ref.combine(y, ref_out.handle), f"{tag} combine")

    backend, ref_backend = dev._backend, ref._backend
    _assert_bitwise(backend.combine(y.to(device), routing, weighted=False),
                    ref_backend.combine(y, ref_routing, weighted=False), f"{tag} unweighted combine")
    x2 = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    spread = backend.redispatch(x2.to(device), routing).cpu()
    ref_spread = ref_backend.redispatch(x2, ref_routing)
    _assert_bitwise(spread[used], ref_spread[used], f"{tag} redispatch (mapped rows)")
    row_vector = torch.randn(ref.capacity_rows, generator=generator)
    _assert_bitwise(backend.return_entry_values(row_vector.to(device), routing),
                    ref_backend.return_entry_values(row_vector, ref_routing), f"{tag} return_entry_values")
    _check_status(dev, ref, tag)


def _eager_scenarios(dev, ref, rank, world, dtype, generator, kinds) -> None:
    for kind in kinds:
        num_tokens = MAX_TOKENS - 3 * rank          # T < max_tokens_per_rank except on rank 0
        if kind == "empty":
            num_tokens = 0                           # T = 0 on every rank
        elif kind == "empty_rank" and rank == world - 1:
            num_tokens = 0                           # one rank sends nothing, still receives
        x, idx, weights = _inputs(kind, num_tokens, world, dtype, generator)
        if kind in ("random", "one_rank"):
            idx = idx.to(torch.int32)                # both index dtypes go through the kernels
        _eager_step(dev, ref, rank, world, x, idx, weights, generator, f"{kind} ({dtype}, rank {rank})")


def _graph_scenarios(dev, ref, rank, world, dtype, generator) -> None:
    """Two graphs (different T) on one dispatcher, replayed with fresh inputs, eager calls in between."""
    device = dev.device
    local = NUM_EXPERTS // world
    capacity_rows = dev.capacity_rows
    scale_table = (1 + 0.25 * (rank * local + torch.arange(local, dtype=torch.float64))).to(dtype).to(device)
    row_index = torch.arange(capacity_rows, dtype=torch.int32, device=device)

    def experts(out):  # static shapes only: capturable
        expert = torch.searchsorted(out.expert_offsets, row_index, right=True).clamp_(max=local - 1)
        return out.x * scale_table[expert][:, None]

    graphs, unwritten_rows = [], []
    for num_tokens in (MAX_TOKENS - 1 - rank, 5 + rank):
        x, idx, weights = _inputs("random", num_tokens, world, dtype, generator)
        static = dict(x=x.to(device), idx=idx.to(device), weights=weights.to(device))
        out = dev.dispatch(static["x"], static["idx"], static["weights"])  # eager warm-up of the same calls
        dev.combine(experts(out), out.handle)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dev.dispatch(static["x"], static["idx"], static["weights"])
            z = dev.combine(experts(out), out.handle)
        graphs.append((graph, static, out, z))

    def replay(which: int, kind: str, tag: str) -> None:
        graph, static, out, z = graphs[which]
        num_tokens = static["x"].shape[0]
        x, idx, weights = _inputs(kind, num_tokens, world, dtype, generator)
        static["x"].copy_(x)
        static["idx"].copy_(idx)
        static["weights"].copy_(weights)
        routing = out.handle.routing
        for tensor in (out.x, out.expert_offsets, out.tokens_per_expert, z, routing.send_mask, routing.dest_rank,
                       routing.recv_pos, routing.recv_weight):
            _fill_sentinel(tensor)
        graph.replay()
        ref_out = ref.dispatch(x, idx, weights)
        _compare_dispatch(out, ref_out, tag, dev.config.zero_padding)
        if not dev.config.zero_padding:
            # The device kernels leave them as they were (the sentinel bytes filled before the replay);
            # the collective backend's torch code fills a new buffer's with 0xFF.
            padding = padding_rows(ref_out)
            want = 0xFF if isinstance(dev._backend, CollectiveBackend) else SENTINEL_BYTE
            assert (out.x.cpu()[padding].view(torch.uint8) == want).all(), f"{tag}: padding rows written"
            unwritten_rows.append(padding.numel())
        rows = torch.arange(capacity_rows, dtype=torch.int32)
        expert = torch.searchsorted(ref_out.expert_offsets, rows, right=True).clamp(max=local - 1)
        y = ref_out.x * scale_table.cpu()[expert][:, None]
        _assert_bitwise(z, ref.combine(y, ref_out.handle), f"{tag} combine")

    kinds = ("random", "minus_one", "one_expert", "one_rank")
    for step in range(50):
        replay(step % 2, kinds[step % len(kinds)], f"replay {step} ({dtype}, rank {rank})")
        if step % 10 == 4:  # eager calls between replays share the epochs with the graphs
            x, idx, weights = _inputs("random", MAX_TOKENS - rank, world, dtype, generator)
            _eager_step(dev, ref, rank, world, x, idx, weights, generator, f"eager after replay {step}")
    assert dev.config.zero_padding or sum(unwritten_rows) > 0, "no replay had padding rows to leave unwritten"

    # A burst of replays with no host sync in between, one rank starting late: the device of the
    # other rank runs ahead and must not overwrite slabs still being read (slab copies by parity).
    graph, static, out, z = graphs[0]
    if rank == 0:
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the burst on rank 0
    for _ in range(10):
        graph.replay()
    ref_out = ref.dispatch(static["x"].cpu(), static["idx"].cpu(), static["weights"].cpu())
    _compare_dispatch(out, ref_out, "burst", dev.config.zero_padding)
    rows = torch.arange(capacity_rows, dtype=torch.int32)
    expert = torch.searchsorted(ref_out.expert_offsets, rows, right=True).clamp(max=local - 1)
    y = ref_out.x * scale_table.cpu()[expert][:, None]
    _assert_bitwise(z, ref.combine(y, ref_out.handle), "burst combine")
    _check_status(dev, ref, "graphs")


def _capacity_scenarios(rank, world, gloo, backend: str, section: dict) -> None:
    """Drops over expert_capacity (single-block kernels: num_senders=1): counts and first offender match."""
    generator = torch.Generator().manual_seed(500 + rank)
    with moe_comm.Dispatcher(_config(backend, "float32", expert_capacity=5, num_senders=1, **section)) as dev, \
            moe_comm.Dispatcher(_config("reference", "float32", expert_capacity=5, num_senders=1), group=gloo) as ref:
        assert dev.capacity_rows == ref.capacity_rows
        _eager_scenarios(dev, ref, rank, world, torch.float32, generator, ("random", "one_expert", "one_rank"))


def _chunked_scenarios(rank, world, gloo, backend: str, section: dict) -> None:
    """Rows and partial rows in several chunks: every chunk carrying tokens (the last one partial,
    T < max_tokens_per_rank on all ranks but 0), then T ending inside the second chunk, then a few
    tokens. The layout group is sized for full slabs (4 blocks per 808 slab rows): the second and
    third calls fill only some of them, the third one (no barrier among the layout blocks)."""
    generator = torch.Generator().manual_seed(700 + rank)
    chunked = dict(max_tokens_per_rank=CHUNKED_MAX_TOKENS)
    with moe_comm.Dispatcher(_config(backend, "bfloat16", **chunked, **section)) as dev, \
            moe_comm.Dispatcher(_config("reference", "bfloat16", **chunked), group=gloo) as ref:
        for num_tokens in (CHUNKED_MAX_TOKENS - 3 * rank, 300 - rank, 5 + rank):
            x, idx, weights = _inputs("random", num_tokens, world, torch.bfloat16, generator)
            _eager_step(dev, ref, rank, world, x, idx, weights, generator, f"chunked, T={num_tokens} (rank {rank})")


def _no_padding_scenario(rank, world, gloo, backend: str, section: dict) -> None:
    """expert_alignment 1 (configs/single-node-decode.yaml's): the segments back to back, no padding
    row for the padding roles to zero, eager and graph-replayed, bitwise the reference."""
    generator = torch.Generator().manual_seed(1400 + rank)
    with moe_comm.Dispatcher(_config(backend, "bfloat16", expert_alignment=1, **section)) as dev, \
            moe_comm.Dispatcher(_config("reference", "bfloat16", expert_alignment=1), group=gloo) as ref:
        assert dev.capacity_rows == ref.capacity_rows == world * MAX_TOKENS * TOPK
        _eager_scenarios(dev, ref, rank, world, torch.bfloat16, generator, ("random", "one_expert", "empty"))
        _graph_scenarios(dev, ref, rank, world, torch.bfloat16, generator)


def _unwritten_padding_scenario(rank, world, gloo, backend: str, section: dict) -> None:
    """zero_padding off: the kept entries' rows bitwise the reference's, eager and graph-replayed (a
    replay leaves the padding rows as they were), and on chunked rows (the batched expansion)."""
    generator = torch.Generator().manual_seed(1500 + rank)
    for tokens in (MAX_TOKENS, CHUNKED_MAX_TOKENS):
        sizes = dict(zero_padding=False, max_tokens_per_rank=tokens)
        with moe_comm.Dispatcher(_config(backend, "bfloat16", **sizes, **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16", **sizes), group=gloo) as ref:
            if tokens == MAX_TOKENS:
                _eager_scenarios(dev, ref, rank, world, torch.bfloat16, generator, ("random", "one_expert", "empty"))
                _graph_scenarios(dev, ref, rank, world, torch.bfloat16, generator)
            else:
                x, idx, weights = _inputs("random", tokens - 3 * rank, world, torch.bfloat16, generator)
                tag = f"unwritten padding, T={x.shape[0]} (rank {rank})"
                _eager_step(dev, ref, rank, world, x, idx, weights, generator, tag)


# SM budgets: one SM (every role on one block: metadata, rows, layout, expansion), three (fewer
# blocks than senders asked for), and the chunked rows on three (chunk flags with few senders,
# arrival batches by ticket).
SM_BUDGETS = (1, 3)


def _budget_scenarios(rank, world, gloo, backend: str, section: dict) -> None:
    """Every kernel on a bounded number of SMs, eager and graph-replayed: bitwise the reference."""
    for budget in SM_BUDGETS:
        generator = torch.Generator().manual_seed(1100 + 10 * budget + rank)
        with moe_comm.Dispatcher(_config(backend, "bfloat16", sm_budget=budget, **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16"), group=gloo) as ref:
            _eager_scenarios(dev, ref, rank, world, torch.bfloat16, generator, ("random", "one_rank", "empty"))
            _graph_scenarios(dev, ref, rank, world, torch.bfloat16, generator)
    generator = torch.Generator().manual_seed(1200 + rank)
    chunked = dict(max_tokens_per_rank=CHUNKED_MAX_TOKENS)
    # Every block a sender; then one sender beside a group of two blocks, which it joins in the
    # arrivals once its rows are out (batches by ticket; two calls: the tickets of both parities).
    for num_senders in (SM_BUDGETS[-1], 1):
        with moe_comm.Dispatcher(_config(backend, "bfloat16", sm_budget=SM_BUDGETS[-1], num_senders=num_senders, **chunked,
                                         **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16", **chunked), group=gloo) as ref:
            for call in range(2):
                x, idx, weights = _inputs("random", CHUNKED_MAX_TOKENS - 3 * rank - call, world, torch.bfloat16,
                                          generator)
                tag = f"chunked on {SM_BUDGETS[-1]} SMs, {num_senders} sending, call {call} (rank {rank})"
                _eager_step(dev, ref, rank, world, x, idx, weights, generator, tag)


# An SM budget under which the many experts' padding (~360 rows of 3 units at T=40, ~600 at 300)
# is more than one batch per padding block: it goes by ticket, at decode sizes at one rank the
# blocks that copied the own rows joining, past them (300 tokens: two layout blocks) the layout
# blocks once their layout is done.
PADDING_TICKETS_BUDGET = 8
MANY_EXPERTS_MAX_TOKENS = 300


def _many_experts_scenario(rank, world, gloo, backend: str, section: dict) -> None:
    """MANY_LOCAL_EXPERTS local experts, tokens spread over all of them: offsets, counts and the
    expert-major rows (and their zero padding) must still match the reference bitwise, on the whole
    device and on PADDING_TICKETS_BUDGET SMs, at decode sizes and past them, two calls each (the
    tickets of both epoch parities)."""
    generator = torch.Generator().manual_seed(900 + rank)
    num_experts = MANY_LOCAL_EXPERTS * world
    sized = dict(num_experts=num_experts, max_tokens_per_rank=MANY_EXPERTS_MAX_TOKENS)
    for budget in (None, PADDING_TICKETS_BUDGET):
        with moe_comm.Dispatcher(_config(backend, "bfloat16", sm_budget=budget, **sized, **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16", **sized), group=gloo) as ref:
            for call in range(4):
                num_tokens = (MAX_TOKENS if call < 2 else MANY_EXPERTS_MAX_TOKENS) - 3 * rank - call % 2
                x, idx, weights = _inputs("random", num_tokens, world, torch.bfloat16, generator,
                                          num_experts=num_experts)
                tag = f"{MANY_LOCAL_EXPERTS} local experts, sm_budget {budget}, call {call} (rank {rank})"
                _eager_step(dev, ref, rank, world, x, idx, weights, generator, tag)


def _one_layout_block_scenario(rank, world, gloo, backend: str, section: dict) -> None:
    """Every slab row on one layout block (protocol.LAYOUT_ROWS_PER_BLOCK raised in this rank
    process), several batches per warp: the layout must still match the reference bitwise."""
    generator = torch.Generator().manual_seed(1100 + rank)
    rows_per_block = protocol.LAYOUT_ROWS_PER_BLOCK
    protocol.LAYOUT_ROWS_PER_BLOCK = world * ONE_BLOCK_MAX_TOKENS
    try:
        sized = dict(max_tokens_per_rank=ONE_BLOCK_MAX_TOKENS)
        with moe_comm.Dispatcher(_config(backend, "bfloat16", **sized, **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16", **sized), group=gloo) as ref:
            x, idx, weights = _inputs("random", ONE_BLOCK_MAX_TOKENS - 3 * rank, world, torch.bfloat16, generator)
            _eager_step(dev, ref, rank, world, x, idx, weights, generator, f"one layout block (rank {rank})")
    finally:
        protocol.LAYOUT_ROWS_PER_BLOCK = rows_per_block


def _timeout_scenario(rank, world, gloo) -> None:
    """A peer that never dispatches is reported (phase and peer) instead of hanging the device."""
    dist.barrier(group=gloo)
    with moe_comm.Dispatcher(_config("vmm", "bfloat16", timeout_s=3.0)) as dev:
        if rank == 0:
            x, idx, weights = _inputs("random", 4, world, torch.bfloat16, torch.Generator().manual_seed(1))
            dev.dispatch(x.to(dev.device), idx.to(dev.device), weights.to(dev.device))
            torch.cuda.synchronize()
            with pytest.raises(moe_comm.DeviceStatusError, match=r"timed out.*peer rank 1"):
                dev.check()
        dist.barrier(group=gloo)


AHEAD_CALLS = 6  # consecutive calls with the last rank delayed before each: three parity rounds


def _ahead_scenario(rank, world, gloo, backend: str, section: dict) -> None:
    """The last rank's stream sleeps before each of AHEAD_CALLS dispatch + combine calls, issued with
    no host sync in between and fresh routing every call, so the other ranks' devices run ahead
    across the parity boundary of the slab copies and write the next call into the delayed rank's
    memory while it still expands the last one. With both slab_copies every kept output must equal
    the reference's: two copies by parity, one by the acks."""
    for copies in protocol.SLAB_COPIES:
        generator = torch.Generator().manual_seed(1300 + 10 * copies + rank)
        with moe_comm.Dispatcher(_config(backend, "bfloat16", slab_copies=copies, **section)) as dev, \
                moe_comm.Dispatcher(_config("reference", "bfloat16"), group=gloo) as ref:
            calls = []
            for call in range(AHEAD_CALLS):
                kind = ("random", "one_rank", "minus_one")[call % 3]
                inputs = _inputs(kind, MAX_TOKENS - 3 * rank - call, world, torch.bfloat16, generator)
                if rank == world - 1:
                    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before each call
                out = dev.dispatch(*(t.to(dev.device) for t in inputs))
                calls.append((inputs, out, dev.combine(out.x * 2, out.handle)))  # * 2: exact in bf16
            for call, (inputs, out, z) in enumerate(calls):
                tag = f"call {call} ahead, slab_copies {copies} (rank {rank})"
                ref_out = ref.dispatch(*inputs)
                _compare_dispatch(out, ref_out, tag, dev.config.zero_padding)
                _assert_bitwise(z, ref.combine(ref_out.x * 2, ref_out.handle), f"{tag} combine")
            _check_status(dev, ref, f"ahead, slab_copies {copies}")


# Capacity drops, no padding, SM budgets, many local experts and the one-block layout are decided on each
# rank alone (the peers only fill its slabs, as at every world): worlds 1 and 2 check them, and
# worlds 4 and 8 (the two slowest tests of the GPU suite when their ranks time-slice one GPU) run
# the scenarios whose work grows with the peers: every routing eager and replayed, chunked
# arrivals, ranks ahead.
PER_RANK_SCENARIOS_MAX_WORLD = 2


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _device_configs(backend_id: str) -> list:
    """The device config of each dtype in DTYPES on ``backend_id``: every scenario's config has the
    kernel builds of one of them (the one-layout-block scenario's own header aside)."""
    backend, section = GPU_BACKENDS[backend_id]
    return [_config(backend, dtype_name, **section) for dtype_name in DTYPES]


def _rank_main(rank: int, world: int, backend_id: str) -> None:
    backend, section = GPU_BACKENDS[backend_id]
    gloo = dist.new_group(backend="gloo")
    configs = dict(zip(DTYPES, _device_configs(backend_id)))
    for dtype_name, dtype in DTYPES.items():
        generator = torch.Generator().manual_seed(1000 * world + rank)
        with moe_comm.Dispatcher(configs[dtype_name]) as dev, \
                moe_comm.Dispatcher(_config("reference", dtype_name), group=gloo) as ref:
            assert dev.backend_name == backend and ref.backend_name == "reference"
            assert dev.capacity_rows == ref.capacity_rows
            _eager_scenarios(dev, ref, rank, world, dtype, generator,
                             ("random", "minus_one", "one_expert", "one_rank", "empty", "empty_rank", "invalid"))
            _graph_scenarios(dev, ref, rank, world, dtype, generator)
    _chunked_scenarios(rank, world, gloo, backend, section)
    if world <= PER_RANK_SCENARIOS_MAX_WORLD:
        _capacity_scenarios(rank, world, gloo, backend, section)
        _no_padding_scenario(rank, world, gloo, backend, section)
        _unwritten_padding_scenario(rank, world, gloo, backend, section)
        _budget_scenarios(rank, world, gloo, backend, section)
        _many_experts_scenario(rank, world, gloo, backend, section)
        _one_layout_block_scenario(rank, world, gloo, backend, section)
    if world > 1:
        _ahead_scenario(rank, world, gloo, backend, section)
    if world == 2 and backend_id == "vmm":
        _timeout_scenario(rank, world, gloo)


# Every backend bitwise equal to the reference, so all of them give identical outputs for the same
# inputs. One spawn per (backend, world): torch's symmetric-memory provider is chosen once per process.
@pytest.mark.kernels.with_args(_device_configs)
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("backend_id", list(GPU_BACKENDS))
def test_backend_matches_reference(backend_id, world, requires_gpus):
    present = requires_gpus(gpus_needed(backend_id, world))
    dist_backend = dist_backend_for(world, present)
    run_ranks(_rank_main, world, backend_id, reuse=backend_id, dist_backend=dist_backend, gpu=True, timeout_s=600)
