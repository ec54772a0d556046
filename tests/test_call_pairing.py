"""Calls pair up across ranks: uneven batches make as many calls on every rank, and a failure is the group's.

The CPU half of issue #54 on the ``reference`` backend (gloo, two ranks): batches of different sizes
per rank through two ``MoELayer``s sharing one Dispatcher and through a transformers model made
expert-parallel (before ``Dispatcher.split_batch`` the rank with fewer slices paired its next
layer's call with its peer's second slice and returned wrong numbers with no error); and the
Dispatcher's failure latch: calls of different layers that meet (their call tags differ) and a
status that says the group's calls were aborted makes ``check()``
raise, every later call raise at once, and a collective ``reset()`` bring the ranks back in step.
``tests/test_gpu_faults.py`` runs the device kernels' side (the abort word) on the GPU backends.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import moe_comm
from layer_checks import BASE, TOLERANCE, layer_errors
from moe_comm import protocol
from multirank import run_ranks
from requirements import require


def _uneven_layers(rank: int, world: int) -> dict:
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", **BASE)
    # max_tokens_per_rank 16: rank 0's 10 tokens are one call per layer, rank 1's 3 x 13 = 39 three.
    shape = (10,) if rank == 0 else (3, 13)
    with moe_comm.Dispatcher(cfg) as disp:
        return layer_errors(disp, rank, world, None, shape, num_layers=2)


def test_layers_with_uneven_batches_match_the_dense_reference():
    for errors in run_ranks(_uneven_layers, 2, timeout_s=120):
        worst = {name: value for name, value in errors.items() if value > TOLERANCE[torch.float32]}
        assert not worst, worst


def _split_counts(rank: int, world: int) -> list:
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", **BASE)
    size = cfg.max_tokens_per_rank
    with moe_comm.Dispatcher(cfg) as disp:
        tokens = (0, 2 * size + 1)[rank]  # rank 0 has nothing, rank 1 three slices' worth
        x, idx = torch.randn(tokens, cfg.hidden), torch.zeros(tokens, cfg.topk, dtype=torch.int64)
        pieces = disp.split_batch(x, idx)
        assert all(len(piece) == 2 for piece in pieces)
        assert torch.equal(torch.cat([p[0] for p in pieces]), x) and torch.equal(torch.cat([p[1] for p in pieces]), idx)
        return [p[0].shape[0] for p in pieces]


def test_split_batch_makes_as_many_calls_on_every_rank():
    size = BASE["max_tokens_per_rank"]
    assert run_ranks(_split_counts, 2, timeout_s=60) == [[0, 0, 0], [size, size, 1]]


def _split_without_a_peer(rank: int, world: int) -> float:
    # The dispatcher gets a group of its own: after the timeout its ranks are out of step.
    group = dist.new_group(backend="gloo")
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", timeout_s=1.0, **BASE)
    elapsed = 0.0
    with moe_comm.Dispatcher(cfg, group=group) as disp:
        if rank == 0:  # rank 1 makes no forward
            start = time.monotonic()
            with pytest.raises(moe_comm.CommTimeoutError, match="agreeing on the number of batch slices"):
                disp.split_batch(torch.randn(4, cfg.hidden))
            elapsed = time.monotonic() - start
        dist.barrier()
    return elapsed


def test_split_batch_waits_for_its_peers_at_most_timeout_s():
    elapsed = run_ranks(_split_without_a_peer, 2, timeout_s=60)[0]
    assert 0.9 < elapsed < 5.0, elapsed


def _uneven_transformers(rank: int, world: int) -> dict:
    from hf_models import build_model, compare_with_unmodified

    # max_tokens_per_rank 64: rank 0's 2 x 16 tokens are one call per layer, rank 1's 2 x 40 two.
    tokens = (2, 16) if rank == 0 else (2, 40)
    errors = compare_with_unmodified(build_model("qwen3_moe"), rank, tokens, torch.device("cpu"), torch.float32,
                                     backend="reference", max_tokens_per_rank=64)
    return {"logits": errors["logits"], "grads": errors["grads"][0]}


def test_transformers_model_with_uneven_batches_matches_the_unmodified_model():
    require("transformers")
    for errors in run_ranks(_uneven_transformers, 2, timeout_s=180):
        assert errors["logits"] < 1e-5 and errors["grads"] < 1e-4, errors


def _failure_latch_and_reset(rank: int, world: int) -> str:
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", **BASE)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(6, cfg.hidden, generator=generator)
    idx = torch.randint(0, cfg.num_experts, (6, cfg.topk), generator=generator)
    w = torch.rand(6, cfg.topk, generator=generator)
    with moe_comm.Dispatcher(cfg) as disp:
        out = disp.dispatch(x, idx, w)
        want = disp.combine(out.x, out.handle)
        disp.check()
        if rank == 1:
            # What the device kernels record when they find the group's abort word raised: rank 0 timed
            # out in dispatch waiting for rank 1 (the reference backend's status word is the same).
            word = protocol.ABORT_RAISED | protocol.TIMEOUT_TO_DEST_ARRIVAL << 32 | 1 << 16 | 0
            disp._backend.status[protocol.STATUS_ABORT] = word - (1 << 64)  # the int64 the kernels store
            with pytest.raises(moe_comm.GroupFailedError,
                               match=r"rank 1's calls were aborted because rank 0 timed out in dispatch: waiting for "
                                     r"a peer's tokens, waiting for rank 1; .*until reset\(\)"):
                disp.check()
            # Every later call raises at once, before any exchange, saying how to recover.
            with pytest.raises(moe_comm.GroupFailedError, match="out of step since an earlier failure.*reset()"):
                disp.dispatch(x, idx, w)
            with pytest.raises(moe_comm.GroupFailedError, match="out of step"):
                disp.combine(out.x, out.handle)
        disp.reset()  # collective: both ranks
        assert disp.read_status().ok
        again = disp.dispatch(x, idx, w)
        assert torch.equal(disp.combine(again.x, again.handle), want)
        disp.check()
    return "ok"


def test_a_group_failure_latches_until_a_collective_reset():
    assert run_ranks(_failure_latch_and_reset, 2, timeout_s=60) == ["ok", "ok"]


def _layers_in_different_orders(rank: int, world: int) -> str:
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", **BASE)
    x = torch.randn(8, cfg.hidden, generator=torch.Generator().manual_seed(rank))
    with moe_comm.Dispatcher(cfg) as disp:
        first, second = (moe_comm.MoELayer(cfg, 8, dispatcher=disp, seed=seed) for seed in (1, 2))
        for layer in (first, second):  # in step: the tags agree
            layer(x)
        disp.check()
        with pytest.raises(moe_comm.InputError, match=r"call_tag: expected an int in \[0, 4096\), got 4096"):
            disp.dispatch(x, torch.zeros(8, cfg.topk, dtype=torch.int64), torch.ones(8, cfg.topk), call_tag=4096)
        # Rank 1 runs the layers in the other order: each call meets the other layer's call.
        for layer in (first, second) if rank == 0 else (second, first):
            layer(x)
        peer_tag, own_tag = (disp.call_tag(1), disp.call_tag(0)) if rank == 0 else (disp.call_tag(0), disp.call_tag(1))
        with pytest.raises(moe_comm.GroupFailedError,
                           match=rf"rank {rank}'s dispatch \(call tag {own_tag}\) met a call of another layer or batch "
                                 rf"slice on rank {1 - rank} \(call tag {peer_tag}\): the ranks made different calls"):
            disp.check()
        disp.reset()
        first(x)
        disp.check()
    return "ok"


def test_calls_of_different_layers_fail_on_every_rank():
    assert run_ranks(_layers_in_different_orders, 2, timeout_s=60) == ["ok", "ok"]


def _compiled_calls_of_different_tags(rank: int, world: int) -> str:
    cfg = moe_comm.load_config(None, backend="reference", dtype="float32", **BASE)
    x = torch.randn(8, cfg.hidden, generator=torch.Generator().manual_seed(rank))
    idx = torch.zeros(8, cfg.topk, dtype=torch.int64)
    w = torch.ones(8, cfg.topk)
    with moe_comm.Dispatcher(cfg) as disp:
        def step(x, call_tag):
            out = disp.dispatch(x, idx, w, call_tag=call_tag)
            return disp.combine(out.x, out.handle)

        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        compiled(x, 7)  # in step: both ranks' graphs carry tag 7
        disp.check()
        compiled(x, 7 + rank)  # another call site's graph on rank 1: the tags differ
        with pytest.raises(moe_comm.GroupFailedError, match=rf"call tag {7 + rank}\) met a call of another layer"):
            disp.check()
        disp.reset()
    return "ok"


def test_compiled_calls_of_different_tags_fail_on_every_rank():
    # The tag is an argument of the custom op, so a compiled graph carries each call site's own.
    assert run_ranks(_compiled_calls_of_different_tags, 2, timeout_s=120) == ["ok", "ok"]


def test_abort_word_decoding():
    word = protocol.ABORT_RAISED | protocol.TIMEOUT_TO_SOURCE_ARRIVAL << 32 | protocol.ABORT_NO_PEER << 16 | 5
    report = protocol.decode_abort(word - (1 << 64))  # as an int64 status field reads on the host
    assert report == protocol.AbortReport(failed_rank=5, phase=protocol.TIMEOUT_PHASES[4], peer=None)
    assert protocol.decode_abort(0) is None
    values = [0] * protocol.STATUS_FIELDS
    values[protocol.STATUS_ABORT] = word
    status = protocol.decode_status(values)
    assert not status.ok and status.broken and status.abort.failed_rank == 5
    # The abort word sits right after the flags, inside the flags region, before every slab.
    for world in (1, 2, 8, 64):
        regions = protocol.SymmetricRegions.plan(world, 16, 2, 64)
        assert regions.abort_offset == protocol.CHANNELS * protocol.FLAG_KINDS * world * 8
        assert regions.abort_offset + 8 <= regions.meta_offset
