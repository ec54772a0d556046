"""The benchmark's baselines compute the same result as moe_comm, and the bench writes its tables."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from dataclasses import asdict

import pytest

import torch
import torch.distributed as dist

from moe_comm.tools.baselines import HostSplitAllToAll, PaddedAllToAll, SymmMemAllToAll2d, chunks_per_rank, covered_rows
from moe_comm.tools import bench
from moe_comm.config import RECEIVE_LAYOUTS, Config
from moe_comm.tools.bench import BenchOptions, bench_rank, make_routing, write_results
from multirank import run_ranks

EXPERTS, TOPK, HIDDEN, TOKENS = 8, 3, 16, 6


def _exchange(rows: torch.Tensor, send: list, recv: list) -> torch.Tensor:
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows[: sum(send)].contiguous(), recv, send)
    return out


class _GlooAllToAll2d(SymmMemAllToAll2d):
    """The NVSHMEM baseline on CPU ranks: torch's two ops emulated with gloo ``all_to_all_single``.

    The emulation follows torch 2.11's ``nvshmem_extension.cu``: ``all_to_all_vdev_2d`` writes the
    received chunks expert-block-major, each block's length rounded up to ``major_align`` (1) and at
    least 1; ``all_to_all_vdev_2d_offset`` reads chunks at the given offsets and writes them packed,
    rank-major. Both fill ``out_splits_offsets`` (lengths, starts).
    """

    def __init__(self, *args, max_chunks: int = 16, max_splits: int = 64) -> None:
        self.MAX_CHUNKS_PER_RANK = max_chunks
        self.MAX_SPLITS = max_splits
        super().__init__(*args)

    def _open_symmetric_memory(self) -> str:
        return "gloo"

    def _empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0x5A if dtype == torch.uint8 else -7, dtype=dtype)  # stale data must not leak

    def _exchange_2d(self, rows, out, in_splits, out_splits_offsets) -> None:
        world, chunks = self.world_size, self.num_chunks
        send_counts = in_splits.view(world, chunks)  # [destination rank, block]
        recv_counts = torch.empty_like(send_counts)  # [source rank, block]
        dist.all_to_all_single(recv_counts, send_counts)
        received = _exchange(rows, send_counts.sum(1).tolist(), recv_counts.sum(1).tolist())
        source_start = torch.cumsum(recv_counts.sum(1), 0) - recv_counts.sum(1)
        starts = torch.zeros(chunks, world, dtype=torch.int64)
        pos = 0
        for block in range(chunks):
            first = pos
            for src in range(world):
                count, at = int(recv_counts[src, block]), int(source_start[src] + recv_counts[src, :block].sum())
                starts[block, src] = pos
                out[pos:pos + count] = received[at:at + count]
                pos += count
            pos = first + max(pos - first, 1)  # major_align 1: an empty block takes one row
        out_splits_offsets[0] = recv_counts.t().reshape(-1)
        out_splits_offsets[1] = starts.reshape(-1)

    def _exchange_2d_offset(self, rows, out, in_splits_offsets, out_splits_offsets) -> None:
        world, chunks = self.world_size, self.num_chunks
        lengths, starts = in_splits_offsets[0].view(chunks, world), in_splits_offsets[1].view(chunks, world)
        send = torch.cat([rows[int(starts[b, p]):int(starts[b, p] + lengths[b, p])]
                          for p in range(world) for b in range(chunks)])
        recv_counts = torch.empty(world, chunks, dtype=torch.int64)  # [source rank, block]
        dist.all_to_all_single(recv_counts, lengths.t().contiguous())
        received = _exchange(send, lengths.sum(0).tolist(), recv_counts.sum(1).tolist())
        out[: received.shape[0]] = received
        out_splits_offsets[0] = recv_counts.reshape(-1)
        out_splits_offsets[1] = torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)


def _baselines_match(rank: int, world: int) -> None:
    generator = torch.Generator().manual_seed(rank)
    idx, weights = make_routing("skewed", TOKENS, EXPERTS, TOPK, generator)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    local = EXPERTS // world
    cpu = torch.device("cpu")
    baselines = (
        HostSplitAllToAll(EXPERTS), PaddedAllToAll(EXPERTS),
        # One expert per chunk (as torch's op takes up to 16), then blocks of two experts per chunk
        # (what the op's 16-chunk limit forces on the 128 experts per rank of the headline workload).
        _GlooAllToAll2d(EXPERTS, TOPK, TOKENS + 2, HIDDEN, x.dtype, cpu),
        _GlooAllToAll2d(EXPERTS, TOPK, TOKENS + 2, HIDDEN, x.dtype, cpu, None, max_chunks=2),
        # torch's ops give each of the world * chunks splits its own block (64 of them): fewer chunks.
        _GlooAllToAll2d(EXPERTS, TOPK, TOKENS + 2, HIDDEN, x.dtype, cpu, None, max_splits=2 * world),
    )
    assert [b.num_chunks for b in baselines[2:]] == [local, 2, 2]
    every_idx = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(every_idx, idx)
    mine = torch.cat(every_idx).reshape(-1) // local == rank
    for baseline in baselines:
        rows = baseline.dispatch(x, idx, weights)
        # Exactly the rows sent to this rank carry an expert id (padding and unwritten rows: -1).
        assert torch.equal(torch.sort(baseline.row_expert[baseline.row_expert >= 0]).values,
                           torch.sort(torch.cat(every_idx).reshape(-1)[mine] % local).values), baseline.name
        # Expert e's rows are scaled by e + 1, so a row combined under the wrong expert shows.
        assert rows.shape[0] == baseline.row_expert.shape[0]
        y = rows * (baseline.row_expert[:, None] + 1 + rank * local).float()
        z = baseline.combine(y)
        want = (x[:, None, :] * (weights * (idx + 1).float())[:, :, None]).sum(dim=1)
        torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5, msg=baseline.name)


def test_baselines_compute_the_moe_result():
    run_ranks(_baselines_match, 2)


def test_chunks_and_covered_rows():
    # torch's all_to_all_vdev_2d takes at most 16 chunks per rank: 128 experts go as 16 blocks of 8.
    assert [chunks_per_rank(n, 16) for n in (1, 4, 16, 128, 12, 17)] == [1, 4, 16, 16, 12, 1]
    # Chunks [0, 2), empty at 2, [3, 4) in 6 rows: rows 2, 4 and 5 are in none.
    splits_offsets = torch.tensor([[2, 0, 1], [0, 2, 3]])
    assert covered_rows(splits_offsets, 6).tolist() == [True, True, False, True, False, False]


def _timed_calls(rank: int, world: int) -> dict:
    """What _Timer.median_us runs and reports when the first call after each alignment is slow."""
    timer = bench._Timer(torch.device("cpu"), dist.group.WORLD, repeats=3, warmup=1)
    state = {"woke": False, "runs": 0}
    align = timer._align

    def aligned(on_gpu: bool) -> None:
        align(on_gpu)
        state["woke"] = True

    def run() -> None:
        state["runs"] += 1
        if state["woke"]:  # the host's wake-up after the aligning synchronize
            state["woke"] = False
            time.sleep(0.2)

    timer._align = aligned
    eager = timer.median_us(run, lambda i: None, calls=4)
    eager_runs, state["runs"] = state["runs"], 0
    replayed = timer.median_us(run, lambda i: None, replay=True, calls=4)
    return {"eager_us": eager, "eager_runs": eager_runs, "replay_us": replayed, "replay_runs": state["runs"]}


def test_eager_timing_leaves_the_wake_up_call_out():
    # Eager: one untimed call after each alignment, then 4 timed ones; a replay is timed from the start.
    got = run_ranks(_timed_calls, 1)[0]
    assert got["eager_runs"] == (1 + 3) * (1 + 4) and got["replay_runs"] == (1 + 3) * 4
    assert got["eager_us"] < 0.2e6 / 4 / 4, got
    assert got["replay_us"] >= 0.2e6 / 4, got


# Eager calls per timed measurement in the CPU ranks of these tests (the bench's 32 would only cost time here).
FEW_EAGER_CALLS = 2


def _bench_in_each_layout(rank: int, world: int, options: BenchOptions) -> list:
    """``bench_rank``'s rows with ``options`` in each receive layout (rank 0's; [] elsewhere)."""
    bench.EAGER_CALLS = FEW_EAGER_CALLS
    return [bench_rank(rank, world, dataclasses.replace(options, receive_layout=layout)) for layout in RECEIVE_LAYOUTS]


def test_bench_rows_and_files(tmp_path):
    options = BenchOptions(tokens=(4,), routings=("uniform",), hidden=128, num_experts=4, topk=2,
                           dtype="float32", backend="reference", repeats=2, warmup=1, fp8=True)
    rows, token_major_rows = run_ranks(_bench_in_each_layout, 2, options)[0]
    # Every baseline that cannot run on CPU ranks has a row that says why; the reference backend has no senders.
    assert [(r["system"], r["layout"], r["mode"], r["tokens"]) for r in rows] == [
        ("moe_comm", "expert_major", "eager", 4), ("moe_comm fp8 dispatch", "expert_major", "eager", 4),
        ("moe_comm fp8 dispatch, pre-quantized", "expert_major", "eager", 4),
        (HostSplitAllToAll.name, None, "unavailable", 4), (PaddedAllToAll.name, None, "unavailable", 4),
        (SymmMemAllToAll2d.name, None, "unavailable", 4)]
    assert [row["note"] for row in rows[3:]] == ["needs CUDA GPUs (NCCL)"] * 2 + ["needs CUDA GPUs (NVSHMEM)"]
    assert all(row["extra"]["combine_error"] is None for row in rows[3:])
    assert rows[0]["num_senders"] is None
    assert rows[0]["extra"]["combine_error"] < 1e-5
    # e4m3 rows: within their rounding (2^-4 of a block's largest value) of the exact result; the
    # pre-quantized pair of the same rows gives the same bytes, so the same error.
    assert 0 < rows[1]["extra"]["combine_error"] < 0.07
    assert rows[2]["extra"]["combine_error"] == rows[1]["extra"]["combine_error"]
    assert all(row[key] > 0 for row in rows[:3] for key in ("dispatch_us", "combine_us", "total_us", "step_us"))
    assert all(row["extra"]["host_loop_us"] > 0 for row in rows[:3]) and "host_loop_us" not in rows[5]["extra"]
    # --receive-layout token_major: the same rows in that layout, their correctness check through the
    # permute and unpermute giving the expert-major path's bits (so its very errors).
    assert [(r["system"], r["layout"]) for r in token_major_rows[:3]] == [
        (row["system"], "token_major") for row in rows[:3]]
    for expert_major, token_major in zip(rows[:3], token_major_rows):
        assert token_major["extra"]["combine_error"] == expert_major["extra"]["combine_error"], token_major
        assert all(token_major[key] > 0 for key in ("dispatch_us", "combine_us", "total_us", "step_us"))
    written = write_results(rows + token_major_rows[:1], {"world_size": 2, "device": "CPU"}, tmp_path, "smoke")
    assert json.loads((tmp_path / "smoke.json").read_text())["rows"] == rows + token_major_rows[:1]
    table = (tmp_path / "smoke.md").read_text()
    assert "| moe_comm | expert_major | eager | uniform | 4 |" in table
    assert "| moe_comm | token_major | eager | uniform | 4 |" in table
    assert f"| {SymmMemAllToAll2d.name} | - | unavailable | uniform | 4 |" in table and "needs CUDA GPUs" in table
    assert {p.suffix for p in written} >= {".json", ".md"}


def _identity_experts_calls(rank: int, world: int, options: BenchOptions) -> dict:
    """How often one workload's measurement runs the identity experts on a dispatch output (the
    expert-major rows' dequantization, token-major with the permute and unpermute): per dispatch dtype
    and receive layout, for each of ``Dispatcher.dequantize``, ``permute`` and ``unpermute``."""
    from moe_comm.dispatcher import Dispatcher
    bench.EAGER_CALLS = FEW_EAGER_CALLS
    calls = {}
    for name in ("dequantize", "permute", "unpermute"):
        def counted(self, *args, _method=getattr(Dispatcher, name), _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _method(self, *args, **kwargs)

        setattr(Dispatcher, name, counted)
    counts = {}
    work = bench._Workload(options, 4, "uniform", rank, torch.device("cpu"))
    for dispatch_dtype in (None, "float8_e4m3fn"):
        for layout in RECEIVE_LAYOUTS:
            calls.clear()
            bench._measure_moe_comm(options, work, None, None, dispatch_dtype=dispatch_dtype, receive_layout=layout)
            counts[(dispatch_dtype, layout)] = dict(calls)
    return counts


def test_dispatch_combine_leaves_the_identity_experts_out_and_the_whole_step_runs_them():
    # dispatch+combine (and combine alone) combine the rows of the first call's identity experts, run
    # once for the error check: no dequantization pass, no permute or unpermute in them. The whole step
    # runs them every time: (1 untimed + EAGER_CALLS) calls per median, warmup + repeats medians.
    options = BenchOptions(tokens=(4,), routings=("uniform",), hidden=128, num_experts=4, topk=2,
                           dtype="float32", backend="reference", repeats=2, warmup=1)
    steps = 1 + (options.warmup + options.repeats) * (1 + FEW_EAGER_CALLS)
    for counts in run_ranks(_identity_experts_calls, 2, options):
        for dispatch_dtype in (None, "float8_e4m3fn"):
            assert counts[(dispatch_dtype, "expert_major")] == {"dequantize": steps}, counts
            assert counts[(dispatch_dtype, "token_major")] == {"dequantize": steps, "permute": steps,
                                                              "unpermute": steps}, counts


def test_cpu_defaults_are_a_smoke_run_and_flags_win():
    # Without GPUs the GPU workload ran for over 12 minutes; the CPU defaults must stay small.
    options = bench._options(bench._parser().parse_args([]), gpus=0)
    assert (options.tokens, options.hidden, options.num_experts, options.backend) == ((1, 32, 128), 1024, 16,
                                                                                     "reference")
    assert bench._options(bench._parser().parse_args([]), gpus=2).tokens == BenchOptions().tokens
    given = bench._options(bench._parser().parse_args(["--tokens", "8", "--hidden", "64"]), gpus=0)
    assert (given.tokens, given.hidden, given.topk) == ((8,), 64, 4)
    # --overlap alone takes the standard budgets; with values, those.
    assert bench._options(bench._parser().parse_args(["--overlap"]), gpus=1).overlap_budgets == (132, 64, 24, 16, 8, 4)
    assert bench._options(bench._parser().parse_args(["--overlap", "24"]), gpus=1).overlap_budgets == (24,)
    assert bench._options(bench._parser().parse_args(["--fp8"]), gpus=1).fp8 and not given.fp8
    # --expert-alignment reaches the config every measurement is made with.
    aligned = bench._options(bench._parser().parse_args(["--expert-alignment", "1"]), gpus=1)
    assert (aligned.expert_alignment, given.expert_alignment) == (1, Config.expert_alignment)
    assert bench._config(aligned, 8, None).expert_alignment == 1
    # So does --no-zero-padding.
    unwritten = bench._options(bench._parser().parse_args(["--no-zero-padding"]), gpus=1)
    assert (unwritten.zero_padding, given.zero_padding) == (False, True)
    assert not bench._config(unwritten, 8, None).zero_padding
    assert bench._options(bench._parser().parse_args([]), gpus=1).overlap_budgets == ()
    # --receive-layout reaches the config of the workloads' rows.
    token_major = bench._options(bench._parser().parse_args(["--receive-layout", "token_major"]), gpus=0)
    assert (token_major.receive_layout, given.receive_layout) == ("token_major", "expert_major")
    assert bench._config(token_major, 8, None).token_major and not bench._config(given, 8, None).token_major


@pytest.mark.parametrize("argv, fragment", [
    (["--topk", "300"], "'topk': got 300"),
    (["--ranks", "3"], "a multiple of the world size (3)"),
    (["--ranks", "0"], "--ranks: got 0"),
    (["--tokens", "4", "0"], "--tokens: got 0"),
    (["--sm-budget", "0"], "--sm-budget: got 0"),
    (["--expert-alignment", "0"], "--expert-alignment: got 0"),
    (["--overlap", "24", "-1"], "--overlap: got -1"),
    (["--sweep-budget", "24", "--sweep-senders", "8", "0"], "--sweep-senders: got 0"),
    (["--sweep-senders", "8"], "no --sweep-budget was given"),
])
def test_bad_workload_is_one_line_before_any_rank_starts(argv, fragment, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --ranks counts CPU ranks
    assert bench.main(argv + ["--out", "/nonexistent/never-written"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-comm bench: error: ") and fragment in err and err.count("\n") == 1


def test_budget_sweep_times_every_sender_count_at_every_budget_in_every_layout(monkeypatch):
    measured = []

    def measure(options, work, group, sm_budget, dispatch_dtype=None, num_senders=None, eager=True,
                receive_layout=None):
        measured.append((work, sm_budget, num_senders, eager, dispatch_dtype, receive_layout))
        times = {"dispatch_us": 10.0 * num_senders, "combine_us": 5.0, "total_us": 10.0 * num_senders + 5.0,
                 "step_us": 10.0 * num_senders + 7.0}
        modes = {"graph": times, **({"eager": times} if eager else {})}
        return {"error": 0.0, "cross_bytes": 0, "received_bytes": 0, **modes}

    monkeypatch.setattr(bench, "_Workload", lambda options, num_tokens, routing, rank, device: num_tokens)
    monkeypatch.setattr(bench, "_measure_moe_comm", measure)
    args = bench._parser().parse_args(["--sweep-budget", "24", "16", "--sweep-senders", "8", "24"])
    options = bench._options(args, gpus=1)
    rows = bench._budget_sweep_rows(options, None, 0, torch.device("cpu"))
    # Graph-replayed only (the eager calls are not timed at all), both layouts side by side at every point
    # whatever --receive-layout says.
    points = [(tokens, budget, senders) for tokens in (128, 4096) for budget in (24, 16) for senders in (8, 24)]
    assert measured == [(*point, False, None, layout) for point in points for layout in RECEIVE_LAYOUTS]
    assert [(r.tokens, r.sm_budget, r.num_senders, r.layout, r.mode, r.dispatch_us, r.step_us) for r in rows] == [
        (tokens, budget, senders, layout, "graph (sm_budget sweep)", 10.0 * senders, 10.0 * senders + 7.0)
        for tokens, budget, senders in points for layout in RECEIVE_LAYOUTS]
    # Without --sweep-senders each budget is timed once, at --num-senders.
    measured.clear()
    options = bench._options(bench._parser().parse_args(["--sweep-budget", "24", "--num-senders", "12"]), gpus=1)
    assert [row.num_senders for row in bench._budget_sweep_rows(options, None, 0, torch.device("cpu"))] == [12] * 4
    # With --fp8 FP8 dispatch is timed at every point too, beside bf16.
    measured.clear()
    args = bench._parser().parse_args(["--sweep-budget", "24", "--sweep-senders", "8", "24", "--fp8"])
    rows = bench._budget_sweep_rows(bench._options(args, gpus=1), None, 0, torch.device("cpu"))
    assert [(r.tokens, r.num_senders, r.system, r.layout) for r in rows] == [
        (tokens, senders, system, layout) for tokens in (128, 4096) for senders in (8, 24)
        for system in ("moe_comm", "moe_comm fp8 dispatch") for layout in RECEIVE_LAYOUTS]
    assert [dtype for *_, dtype, _ in measured] == [None, None, "float8_e4m3fn", "float8_e4m3fn"] * 4


def test_overlap_times_every_budget_in_every_layout_on_gpus_only(monkeypatch):
    measured = []

    def measure(options, work, group, sm_budget, receive_layout):
        measured.append((work, sm_budget, receive_layout))
        return bench.Row(system="overlap", mode="graph", tokens=work, routing="uniform", layout=receive_layout,
                         sm_budget=sm_budget)

    monkeypatch.setattr(bench, "_Workload", lambda options, num_tokens, routing, rank, device: num_tokens)
    monkeypatch.setattr(bench, "_measure_overlap", measure)
    options = bench._options(bench._parser().parse_args(["--overlap", "24", "8"]), gpus=1)
    rows = bench._overlap_rows(options, None, 0, torch.device("cuda", 0))
    assert measured == [(4096, budget, layout) for budget in (24, 8) for layout in RECEIVE_LAYOUTS]
    assert [(row.sm_budget, row.layout) for row in rows] == [(budget, layout) for budget in (24, 8)
                                                             for layout in RECEIVE_LAYOUTS]
    assert bench._overlap_rows(options, None, 0, torch.device("cpu")) == []


def test_overlap_rows_keep_their_times_and_get_their_own_table(monkeypatch):
    # One rank: the gather hands back this rank's rows.
    monkeypatch.setattr(bench.dist, "all_gather_object", lambda out, rows, group=None: out.__setitem__(0, rows))
    times = {"comm_us": 400.0, "step_us": 700.0, "compute_whole_us": 1200.0, "compute_us": 1400.0, "both_us": 1500.0,
             "hidden": 0.75, "hidden_vs_whole": 0.25}
    row = asdict(bench.Row(system="overlap", mode="graph", tokens=4096, routing="uniform", layout="token_major",
                           total_us=1500.0, step_us=700.0, sm_budget=24, note="GEMM 8192^3 bf16",
                           extra={"combine_error": None, **times}))
    (merged,) = bench._average_over_ranks([row], 0, 1, None)
    assert merged["extra"] == {"combine_error": None, **times}
    table = bench.markdown_table([merged])
    assert "| token_major | 4096 | 24 | 400.0 | 700.0 | 1200.0 | 1400.0 | 1500.0 | 75% | 25% | GEMM 8192^3 bf16 |" \
        in table


def _run_script(name: str, args: list, tmp_path, hide_gpus: bool) -> subprocess.CompletedProcess:
    """``benchmarks/<name> *args`` as a user runs it from ``tmp_path`` (on the CPU with ``hide_gpus``)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(root / "benchmarks" / name), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_fp8_layer_benchmark_smoke_run(tmp_path):
    # benchmarks/bench_fp8_layer.py as a user runs it, on the CPU: a row per token count with the
    # FP8 layer's errors against the config-dtype layer, and its result files.
    result = _run_script("bench_fp8_layer.py", ["--tokens", "16", "--repeats", "1", "--out", str(tmp_path),
                                                "--name", "smoke"], tmp_path, hide_gpus=True)
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert row["tokens"] == 16 and row["dequantized_rows"] > 0
    for key in ("output_rel_err", "input_grad_rel_err", "weight_grad_rel_err"):
        assert 0 < row[key] < 0.08, row
    assert "| 16 |" in (tmp_path / "smoke.md").read_text()


def test_row_copy_benchmark_says_it_needs_a_gpu(tmp_path):
    result = _run_script("bench_row_copy.py", ["--rows", "8"], tmp_path, hide_gpus=True)
    assert result.returncode != 0 and "needs a CUDA GPU" in result.stderr, result.stdout + result.stderr


@pytest.mark.gpu
def test_row_copy_benchmark_checks_and_times_every_kernel(tmp_path, requires_gpus, monkeypatch):
    # Each kernel's rows are checked against torch's indexing before it is timed; 130 rows of 2056
    # values leave partial parts and more rows than warps. In this process: no second torch import.
    import importlib.util

    requires_gpus(1)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_row_copy.py"
    spec = importlib.util.spec_from_file_location("bench_row_copy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["bench_row_copy.py", "--rows", "130", "--hidden", "2056", "--sms", "1", "3",
                                      "--repeats", "2", "--out", str(tmp_path), "--name", "smoke"])
    script.main()
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert [(r["kernel"], r["sms"]) for r in rows] == [
        (kernel, sms) for kernel in ("vector", "bulk", "sum (combine's shape)") for sms in (1, 3)]
    assert all(r["us"] > 0 for r in rows)


def test_graph_rows_say_when_the_host_issued_replays_late():
    times = {"dispatch_us": 10.0, "combine_us": 5.0, "total_us": 14.0}
    measured = {"error": 0.0, "eager": dict(times), "graph": dict(times), "late_share": 0.44}
    eager, graph = bench._rows("moe_comm", measured, 1, "uniform", 48, 0, 0)
    assert "host late for 44% of a median's replays" in graph.note and eager.note == ""
    assert graph.extra["late_replay_share"] == 0.44 and "late_replay_share" not in eager.extra
    quiet = bench._rows("moe_comm", {**measured, "late_share": 0.02, "note": "eager: why"}, 1, "uniform", 48, 0, 0)
    assert quiet[1].note == "eager: why" and quiet[1].extra["late_replay_share"] == 0.02


def test_eager_rows_say_when_the_host_ran_slow():
    times = {"dispatch_us": 10.0, "combine_us": 5.0, "total_us": 14.0}
    eager, graph = bench._rows("moe_comm", {"error": 0.0, "eager": dict(times), "graph": dict(times),
                                            "host_loop_us": 80.0}, 1, "uniform", 48, 0, 0)
    assert eager.extra["host_loop_us"] == 80.0 and "host_loop_us" not in graph.extra
    rows = [{"note": "", "extra": {"host_loop_us": 100.0}}, {"note": "eager: why", "extra": {"host_loop_us": 131.0}},
            {"note": "", "extra": {"host_loop_us": 124.0}}, {"note": "", "extra": {"combine_error": None}}]
    noted = bench._with_host_loop_notes(rows)
    assert [row["note"] for row in noted] == [
        "host loop 100 us", "eager: why; host slow: Python loop 131 us, 1.3x this run's fastest", "host loop 124 us",
        ""]
    assert bench._with_host_loop_notes([{"note": "", "extra": {}}]) == [{"note": "", "extra": {}}]
