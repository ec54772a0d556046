"""The benchmark's baselines compute the same result as moe_comm, and the bench writes its tables."""

from __future__ import annotations

import json

import torch

from moe_comm.baselines import HostSplitAllToAll, PaddedAllToAll
from moe_comm.bench import BenchOptions, bench_rank, make_routing, write_results
from multirank import run_ranks

EXPERTS, TOPK, HIDDEN, TOKENS = 8, 3, 16, 6


def _baselines_match(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    idx, weights = make_routing("skewed", TOKENS, EXPERTS, TOPK, generator)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    local = EXPERTS // world
    for baseline in (HostSplitAllToAll(EXPERTS), PaddedAllToAll(EXPERTS)):
        rows = baseline.dispatch(x, idx, weights)
        # Expert e's rows are scaled by e + 1, so a row combined under the wrong expert shows.
        assert rows.shape[0] == baseline.row_expert.shape[0]
        y = rows * (baseline.row_expert[:, None] + 1 + rank * local).float()
        z = baseline.combine(y)
        want = (x[:, None, :] * (weights * (idx + 1).float())[:, :, None]).sum(dim=1)
        torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5, msg=baseline.name)


def test_baselines_compute_the_moe_result():
    run_ranks(_baselines_match, 2)


def test_bench_rows_and_files(tmp_path):
    options = BenchOptions(tokens=(4,), routings=("uniform",), hidden=16, num_experts=4, topk=2,
                           dtype="float32", backend="reference", repeats=2, warmup=1)
    rows = run_ranks(bench_rank, 2, options)[0]
    assert [(r["system"], r["mode"], r["tokens"]) for r in rows] == [("moe_comm", "eager", 4)]
    assert rows[0]["extra"]["combine_error"] < 1e-5
    assert all(rows[0][key] > 0 for key in ("dispatch_us", "combine_us", "total_us"))
    written = write_results(rows, {"world_size": 2, "device": "CPU"}, tmp_path, "smoke")
    assert json.loads((tmp_path / "smoke.json").read_text())["rows"] == rows
    assert "| moe_comm | eager | uniform | 4 |" in (tmp_path / "smoke.md").read_text()
    assert {p.suffix for p in written} >= {".json", ".md"}
