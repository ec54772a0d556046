"""``moe-comm bench``: moe_comm's dispatch/combine against the all-to-all baselines, side by side.

One rank per local GPU (or CPU ranks on the ``reference`` backend, for a smoke run). For every
workload (tokens per rank x routing) each system runs dispatch -> identity experts -> combine;
times are medians over ``repeats`` measurements taken after a warm-up, each between two CUDA
events (a host clock on CPU), with the inputs rotated over several sets so that caches do not
flatter. Before each measurement the ranks are aligned: for a graph replay on the GPU (a spin
kernel covers the host's enqueueing, then an all_reduce that every GPU leaves at the same moment,
then the start event), so the time is the replay's, as in a decode loop whose steps keep the ranks
in lockstep (a replay that a rank issued only after its GPU had left the all_reduce is counted: a
graph row says so in its note from 10% of a median's replays, and its JSON has the share); for
eager calls on the host (an all_reduce and a synchronize), then one untimed call, then
``EAGER_CALLS`` calls issued back to back between the events, and the time is per call: the
Python and launch work of a call shows wherever it exceeds the GPU's, as in a training or decode
loop. (The first call after a synchronize pays the host's wake-up, once per step in a loop, not
per call: on the GPU machines one eager dispatch took 150 us of host time there against 40 us
back to back, and with 8 timed calls that one call added ~20 us to each.) Right after each eager
median a fixed pure-Python loop is timed, the host's speed then (the JSON's ``host_loop_us``, the
slowest of a row's three and of the ranks): an eager row's note gives it, and says "host slow" from
``HOST_SLOW_NOTE_RATIO`` times the run's fastest.
moe_comm is measured eager and graph-replayed; the padded baseline graph-replayed; the
host-split baseline eager (it synchronises); torch's NVSHMEM ``all_to_all_vdev_2d`` baseline
graph-replayed, or eager with the reason in the table's note if torch refuses to capture it,
and listed as unavailable (with the reason) where it cannot run: no GPU or NVSHMEM, or this
process already uses another symmetric-memory provider (moe_comm's ``nccl`` symmetric
transport). Every system's combine result is checked once per workload against the expected
``sum_k w_k x_t``.

moe_comm's rows say their receive layout (``--receive-layout``, the config's; the budget sweep and the
overlap time both layouts side by side) and give two times of a step: dispatch+combine, the
communication kernels alone (combine takes the rows an earlier step's identity experts left it:
expert-major the experts' rows, token-major the reduced rows), and the whole step (dispatch, identity
experts, combine; token-major with the permute and unpermute around the experts).

Bandwidth is reported two ways: bytes that cross the link (rows sent to other ranks) and bytes
received including the rank's own rows (the convention DeepEP reports).

Results go to ``<out>/<name>.json``, ``.md`` and ``.png`` (the plot needs matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..agreement import agree
from .baselines import HostSplitAllToAll, PaddedAllToAll, SymmMemAllToAll2d
from ..config import DTYPES, RECEIVE_LAYOUTS, Config, load_config
from ..errors import ConfigError
from ..dispatcher import Dispatcher
from ..errors import BackendError
from ..nn.overlap import gemm_sm_carveout
from ..nn.receive_layout import combine_rows, expert_rows
from ..fp8 import packed_row_bytes, quantize

__all__ = ["BenchOptions", "bench_rank", "write_results", "main"]

# How many input sets the timed loops rotate over.
NUM_INPUT_SETS = 4
# Eager calls issued back to back per measurement.
# The untimed call before them runs its kernel before the start event: where the host is the
# slower side (decode sizes) it starts the timed calls up to that kernel's time ahead, ~1 us a call
# over 32 calls at T=128; where the GPU is slower the calls queue behind it anyway.
EAGER_CALLS = 32
# Share of a median's replays issued late (see _Timer.late_share) from which a row's note says so.
LATE_NOTE_SHARE = 0.1
# A fixed pure-Python loop, timed right after each eager median: the host's speed at that moment.
# Eager times at decode sizes are the host's Python and launch work, and on the GPU machines both
# it and such a loop ran ~1.5x slower in some processes or stretches of one (docs/design.md).
HOST_LOOP_ITERATIONS = 2000
HOST_LOOP_SAMPLES = 15
# From this ratio of an eager row's host loop time to the run's fastest, the row's note says so.
HOST_SLOW_NOTE_RATIO = 1.25
# Experts that the skewed routing favours.
NUM_HOT_EXPERTS = 8
# GPU cycles of the spin kernel before an aligning all_reduce (~500 us): longer than the host
# needs to enqueue the all_reduce, the events and a graph replay even in a slow process. At 200k
# (~100 us) one rank of 2x H200 issued 44 of 50 replays after its GPU had left the all_reduce,
# and T=1 dispatch+combine read 47.9 us against 22.8; at 1M no median had more than one late.
_ALIGN_SPIN_CYCLES = 1_000_000


@dataclass(frozen=True)
class BenchOptions:
    """What every rank measures.

    tokens: tokens per rank of the workloads. routings: ``uniform`` (``topk(abs(randn) + 1)``)
    and/or ``skewed`` (a few hot experts). hidden, num_experts, topk, dtype: the model shape.
    backend: moe_comm's backend. num_senders: its senders. sm_budget: the SMs of every kernel (None:
    the whole device). slab_copies: the config's (2: parity copies, no acks; 1: acks).
    expert_alignment: the config's (rows each expert segment of ``out.x`` is padded to; at decode sizes
    the zero padding is most of dispatch's bytes). zero_padding: the config's (False: the padding
    rows are left unwritten, as an inference deployment whose GEMMs need aligned segments runs).
    repeats: timed measurements per median.
    warmup: untimed runs first. baselines: also run the all-to-all baselines (CUDA only).
    budget_sweep / sweep_tokens: ``sm_budget`` values timed (graph-replayed, uniform routing) at these T.
    sender_sweep: ``num_senders`` values timed at each budget of the sweep (empty: ``num_senders`` alone), to
    choose how many of a budget's blocks send (the others expand meanwhile; at world 1 dispatch runs
    no senders, so the values time the same kernels).
    overlap_budgets / overlap_tokens: ``sm_budget`` values at which dispatch+combine runs beside a
    bf16 GEMM of ``overlap_gemm`` cubed on another stream (see :func:`_measure_overlap`), at this T.
    fp8: also time moe_comm with ``dispatch_dtype: float8_e4m3fn`` on every workload and at every
    point of the budget sweep (rows ``moe_comm fp8 dispatch``: the kernels quantize the bf16 rows;
    bytes are the packed e4m3 rows with their scales), and on every workload from a pre-quantized
    pair (rows ``moe_comm fp8 dispatch, pre-quantized``: the input DeepEP's FP8 dispatch takes).
    receive_layout: the config's, of the workloads' moe_comm rows (the budget sweep and the overlap time
    every layout).
    """

    tokens: tuple = (1, 32, 128, 512, 1024, 4096)
    routings: tuple = ("uniform", "skewed")
    hidden: int = 7168
    num_experts: int = 256
    topk: int = 8
    dtype: str = "bfloat16"
    backend: str = "auto"
    num_senders: int = Config.num_senders
    sm_budget: Optional[int] = None
    slab_copies: int = 2
    expert_alignment: int = Config.expert_alignment
    zero_padding: bool = Config.zero_padding
    repeats: int = 50
    warmup: int = 5
    baselines: bool = True
    budget_sweep: tuple = ()
    sweep_tokens: tuple = (128, 4096)
    sender_sweep: tuple = ()
    overlap_budgets: tuple = ()
    overlap_tokens: int = 4096
    overlap_gemm: int = 8192
    fp8: bool = False
    receive_layout: str = Config.receive_layout


@dataclass
class Row:
    """One measured (system, mode, workload): times in microseconds, bandwidths in GB/s.

    layout: moe_comm's receive layout (None for the baselines). total_us: dispatch+combine (moe_comm: the
    communication kernels alone); step_us: moe_comm's whole step with identity experts.
    """

    system: str
    mode: str
    tokens: int
    routing: str
    layout: Optional[str] = None
    dispatch_us: Optional[float] = None
    combine_us: Optional[float] = None
    total_us: Optional[float] = None
    step_us: Optional[float] = None
    cross_gbps: Optional[float] = None
    received_gbps: Optional[float] = None
    num_senders: Optional[int] = None
    sm_budget: Optional[int] = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, generator: torch.Generator):
    """``(topk_idx [T, K] int64, topk_weights [T, K] float32)`` on CPU for a routing kind."""
    scores = torch.randn(num_tokens, num_experts, generator=generator).abs() + 1
    if kind == "skewed":
        scores[:, :NUM_HOT_EXPERTS] += 1.5
    elif kind != "uniform":
        raise ValueError(f"routing: got {kind!r}, expected 'uniform' or 'skewed'")
    idx = torch.topk(scores, topk).indices
    weights = torch.rand(num_tokens, topk, generator=generator)
    return idx, weights / weights.sum(dim=1, keepdim=True)


class _Timer:
    """Median time of a callable with the ranks aligned first; CUDA events on GPU, a host clock on CPU."""

    def __init__(self, device: torch.device, group, repeats: int, warmup: int) -> None:
        self.device = device
        self.group = group
        self.repeats = repeats
        self.warmup = warmup
        self._flag = torch.zeros(1, device=device)
        # The largest share of one graph-replayed median_us's replays, on any rank, issued only after
        # the GPU had left the aligning all_reduce (their times include the host's delay).
        self.late_share = 0.0

    def _align(self, on_gpu: bool) -> Optional[torch.cuda.Event]:
        """Align the ranks; on the GPU returns an event recorded where the aligning all_reduce ends."""
        if on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda._sleep(_ALIGN_SPIN_CYCLES)
            dist.all_reduce(self._flag, group=self.group)
            aligned = torch.cuda.Event()
            aligned.record()
            return aligned
        dist.all_reduce(self._flag, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return None

    def median_us(self, run: Callable[[], None], prepare: Callable[[int], None], *, replay: bool = False,
                  calls: int = 1) -> float:
        """``prepare(i)`` (untimed: e.g. copy input set i into static buffers), then ``calls`` runs of
        ``run()`` back to back, timed together; returns the median time per run.

        ``replay``: ``run`` replays a CUDA graph; the ranks are then aligned on the GPU (see the module
        docstring), else on the host and one untimed ``run()`` takes the host's wake-up after it.
        """
        samples = []
        on_gpu = replay and self.device.type == "cuda"
        late = 0
        for i in range(self.warmup + self.repeats):
            prepare(i)
            aligned = self._align(on_gpu)
            if not replay:
                run()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                # The GPU past the all_reduce before the replay is even issued: it idles, and the
                # peers wait for this rank inside the timed replay.
                late += int(aligned is not None and i >= self.warmup and aligned.query())
                for _ in range(calls):
                    run()
                end.record()
                end.synchronize()
                elapsed_us = start.elapsed_time(end) * 1e3
            else:
                began = time.perf_counter()
                for _ in range(calls):
                    run()
                elapsed_us = (time.perf_counter() - began) * 1e6
            if i >= self.warmup:
                samples.append(elapsed_us / calls)
        if on_gpu:
            late_any = torch.tensor([late], device=self.device)
            dist.all_reduce(late_any, op=dist.ReduceOp.MAX, group=self.group)
            self.late_share = max(self.late_share, int(late_any.item()) / self.repeats)
        return statistics.median(samples)


def _host_loop_us() -> float:
    """Median time in us of ``HOST_LOOP_SAMPLES`` runs of a fixed pure-Python loop (no torch, no GPU)."""
    samples = []
    for _ in range(HOST_LOOP_SAMPLES):
        began = time.perf_counter()
        value = 0
        for i in range(HOST_LOOP_ITERATIONS):
            value = (value * 3 + i) & 0xFFFF
        samples.append((time.perf_counter() - began) * 1e6)
    return statistics.median(samples)


def _eager_times(timer: _Timer, dispatch: Callable[[], None], combine: Callable[[], None],
                 both: Callable[[], None], step: Optional[Callable[[], None]] = None) -> tuple[dict, float]:
    """Eager medians of ``dispatch``, ``combine``, ``both`` (dispatch+combine) and, when given, ``step`` (the
    whole step) (``EAGER_CALLS`` calls back to back each), and the slowest of the host loop times
    (:func:`_host_loop_us`) taken right after each."""
    times, loops = {}, []
    for key, run in (("dispatch_us", dispatch), ("combine_us", combine), ("total_us", both), ("step_us", step)):
        if run is None:
            continue
        times[key] = timer.median_us(run, _no_prepare, calls=EAGER_CALLS)
        loops.append(_host_loop_us())
    return times, max(loops)


def _expected(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Identity experts: ``z[t] = sum_k w[t, k] * x[t]`` in float32."""
    return x.float() * weights.sum(dim=1, keepdim=True)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest reference value (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    return float((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, short enough for a table cell."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _graph(device: torch.device, body: Callable[[], object]):
    """Capture ``body`` (already run eagerly once) into a CUDA graph; returns the graph and what body returned."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = body()
    return graph, result


def _tensors(inputs: tuple) -> list[torch.Tensor]:
    """The tensors of dispatch's inputs, a pre-quantized pair's two in place of ``x``."""
    return [t for item in inputs for t in (item if isinstance(item, tuple) else (item,))]


class _Workload:
    """Input sets of one (T, routing) for this rank, and static buffers the graphs read. ``source_x``:
    input set 0's config-dtype rows (combine's error is measured against them)."""

    def __init__(self, options: BenchOptions, num_tokens: int, routing: str, rank: int, device: torch.device):
        generator = torch.Generator().manual_seed(1000 * num_tokens + 17 * rank + (routing == "skewed"))
        dtype = DTYPES[options.dtype]
        self.sets = []
        for _ in range(NUM_INPUT_SETS):
            idx, weights = make_routing(routing, num_tokens, options.num_experts, options.topk, generator)
            x = torch.randn(num_tokens, options.hidden, generator=generator).to(dtype)
            self.sets.append((x.to(device), idx.to(device), weights.to(device)))
        self.static = tuple(t.clone() for t in self.sets[0])
        self.source_x = self.sets[0][0]
        self._turn = 0

    def pre_quantized(self) -> "_Workload":
        """The same sets with ``x`` given as its FP8 pair ``(x_fp8, x_scales)`` (:func:`moe_comm.quantize`)."""
        work = copy.copy(self)
        work.sets = [(quantize(x), idx, weights) for x, idx, weights in self.sets]
        pair, idx, weights = work.sets[0]
        work.static = (tuple(t.clone() for t in pair), idx.clone(), weights.clone())
        return work

    def load(self, i: int) -> None:
        """Copy input set ``i`` (mod the number of sets) into the static buffers the graphs read."""
        for dst, src in zip(_tensors(self.static), _tensors(self.sets[i % NUM_INPUT_SETS])):
            dst.copy_(src)

    def next_set(self) -> tuple:
        """The next input set in rotation (eager calls take it directly)."""
        self._turn = (self._turn + 1) % NUM_INPUT_SETS
        return self.sets[self._turn]


def _no_prepare(i: int) -> None:
    """Nothing to set up before a measurement (eager calls rotate their inputs themselves)."""


def _combine_input(disp: Dispatcher, out) -> torch.Tensor:
    """What combine takes after identity experts on the dispatch output ``out``: the experts' rows (token-major:
    permuted) in the config dtype (FP8 rows dequantized), which are their outputs too; token-major, reduced
    by the unpermute."""
    return combine_rows(disp, disp.dequantize(expert_rows(disp, out)), out)


def _moe_comm_step(disp: Dispatcher, inputs: tuple, fixed_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dispatch ``inputs`` (x, topk_idx, topk_weights), identity experts, combine: ``z [T, H]``.

    ``fixed_rows``: the rows to combine instead of this dispatch's identity experts' (those of an earlier
    call), so that the step is the communication kernels alone: no permute or unpermute, no FP8 rows'
    dequantization pass (an expert GEMM that takes FP8 would hand combine its own output)."""
    out = disp.dispatch(*inputs)
    return disp.combine(_combine_input(disp, out) if fixed_rows is None else fixed_rows, out.handle)


def _config(options: BenchOptions, max_tokens: int, sm_budget: Optional[int], dispatch_dtype: Optional[str] = None,
            num_senders: Optional[int] = None, receive_layout: Optional[str] = None):
    """The config of a measurement of at most ``max_tokens`` tokens a rank (``num_senders`` and
    ``receive_layout`` None: ``options``')."""
    return load_config(
        None, backend=options.backend, num_experts=options.num_experts, topk=options.topk, hidden=options.hidden,
        max_tokens_per_rank=max(max_tokens, 1), dtype=options.dtype,
        num_senders=options.num_senders if num_senders is None else num_senders,
        sm_budget=sm_budget, dispatch_dtype=dispatch_dtype, slab_copies=options.slab_copies,
        expert_alignment=options.expert_alignment, zero_padding=options.zero_padding,
        receive_layout=options.receive_layout if receive_layout is None else receive_layout,
    )


def _measure_moe_comm(options: BenchOptions, work: _Workload, group, sm_budget: Optional[int],
                      dispatch_dtype: Optional[str] = None, num_senders: Optional[int] = None, eager: bool = True,
                      receive_layout: Optional[str] = None) -> dict:
    """Times (per mode: eager, and graph-replayed on CUDA), the combine error and the bytes of one
    workload on moe_comm.

    ``dispatch_dtype``: the config's (FP8 dispatch quantizes the bf16 inputs inside the timed
    dispatch; the identity experts dequantize, in the whole step only).
    ``num_senders``, ``receive_layout``: the config's (None: ``options``').
    ``eager``: False leaves the eager calls untimed (the budget sweep's rows are graph-replayed only).
    Combine alone, and dispatch+combine, combine the rows of the first call's identity experts.
    """
    cfg = _config(options, work.source_x.shape[0], sm_budget, dispatch_dtype, num_senders, receive_layout)
    result = {}
    with Dispatcher(cfg, group=group) as disp:
        timer = _Timer(disp.device, group, options.repeats, options.warmup)
        work.load(0)
        x, weights = work.source_x, work.static[2]
        out = disp.dispatch(*work.static)
        fixed_rows = _combine_input(disp, out)
        result["error"] = _close(disp.combine(fixed_rows, out.handle), _expected(x, weights))
        routing = out.handle.routing
        others = torch.ones(disp.world_size, dtype=torch.bool, device=disp.device)
        others[disp.rank] = False
        row_bytes = options.hidden * x.element_size() if dispatch_dtype is None else packed_row_bytes(options.hidden)
        result["cross_bytes"] = int(routing.send_mask[:, others].sum()) * row_bytes
        result["received_bytes"] = int((routing.recv_pos != -1).any(dim=2).sum()) * row_bytes

        latest = {"out": out}

        def eager_dispatch() -> None:
            latest["out"] = disp.dispatch(*work.next_set())

        def eager_combine() -> None:
            disp.combine(fixed_rows, latest["out"].handle)

        if eager:
            result["eager"], result["host_loop_us"] = _eager_times(
                timer, eager_dispatch, eager_combine, lambda: _moe_comm_step(disp, work.next_set(), fixed_rows),
                lambda: _moe_comm_step(disp, work.next_set()))
        if disp.device.type == "cuda":
            graph_d, graph_out = _graph(disp.device, lambda: disp.dispatch(*work.static))
            graph_c, _ = _graph(disp.device, lambda: disp.combine(fixed_rows, graph_out.handle))
            graph_all, _ = _graph(disp.device, lambda: _moe_comm_step(disp, work.static, fixed_rows))
            graph_step, _ = _graph(disp.device, lambda: _moe_comm_step(disp, work.static))
            result["graph"] = {
                "dispatch_us": timer.median_us(graph_d.replay, work.load, replay=True),
                "combine_us": timer.median_us(graph_c.replay, _no_prepare, replay=True),
                "total_us": timer.median_us(graph_all.replay, work.load, replay=True),
                "step_us": timer.median_us(graph_step.replay, work.load, replay=True),
            }
            result["late_share"] = timer.late_share
        disp.check()
    return result


def _measure_baseline(baseline, options: BenchOptions, work: _Workload, device: torch.device, group,
                      graphs: bool) -> dict:
    """Times and the combine error of one baseline (graph-replayed if ``graphs``, else eager)."""
    timer = _Timer(device, group, options.repeats, options.warmup)
    x, _, weights = work.static
    rows = baseline.dispatch(*work.static)
    result = {"error": _close(baseline.combine(rows), _expected(x, weights))}
    latest = {"rows": rows}

    def dispatch() -> None:
        latest["rows"] = baseline.dispatch(*work.next_set())

    def step() -> None:
        baseline.combine(baseline.dispatch(*work.next_set()))

    if graphs:
        try:
            graph_d, graph_rows = _graph(device, lambda: baseline.dispatch(*work.static))
            graph_c, _ = _graph(device, lambda: baseline.combine(graph_rows))
            graph_all, _ = _graph(device, lambda: baseline.combine(baseline.dispatch(*work.static)))
            failure = None
        except RuntimeError as exc:  # torch refused to capture it: measure it eagerly, say why
            failure = f"eager: CUDA graph capture failed ({_first_line(exc)})"
        failures = agree(group, lambda: failure, error=BackendError, what="reporting CUDA graph capture")
        failure = next((f for f in failures if f is not None), None)  # replay only where every rank captured
        if failure is not None:
            result["note"] = failure
            return {**result, **_measure_baseline(baseline, options, work, device, group, graphs=False)}
        result["graph"] = {
            "dispatch_us": timer.median_us(graph_d.replay, work.load, replay=True),
            "combine_us": timer.median_us(graph_c.replay, _no_prepare, replay=True),
            "total_us": timer.median_us(graph_all.replay, work.load, replay=True),
        }
        result["late_share"] = timer.late_share
    else:
        result["eager"], result["host_loop_us"] = _eager_times(
            timer, dispatch, lambda: baseline.combine(latest["rows"]), step)
    return result


def _measure_overlap(options: BenchOptions, work: _Workload, group, sm_budget: int, receive_layout: str) -> Row:
    """The communication kernels (dispatch+combine, one CUDA graph) on a communication stream beside the
    compute stream's work, both issued together: each alone, both, and the share of the communication hidden.

    The compute stream's work is a bf16 GEMM and, token-major, after it the permute and unpermute of an
    earlier dispatch's rows (identity experts between them): the guide's recipe, where they run on the
    compute stream with every SM, like the experts' GEMMs. The GEMM comes first, so the communication runs
    beside it: the permute and unpermute are bound by HBM as the communication kernels are, and beside
    them it hides little (one H200, T=4096, 24 SMs: 39% with them first; docs/performance.md). The GEMM
    leaves the budget's SMs to the communication (:func:`moe_comm.gemm_sm_carveout`, as overlapped
    schedules must: cuBLAS's default path takes every SM). Two shares: ``hidden``, of the shorter job
    against both run one after the other with the same carveout, ``(comm + compute - both) / min(comm,
    compute)``, and ``hidden_vs_whole``, of the communication against the serial schedule on the whole
    device, ``(comm + compute_whole - both) / comm`` (what overlapping saves over not overlapping at all).
    1: fully hidden, 0: serial, < 0: slower.
    ``step_us``: the whole step (dispatch, identity experts, combine) alone at this budget.
    """
    device = work.static[0].device
    gen = torch.Generator().manual_seed(5)
    size = options.overlap_gemm
    a, b = (torch.randn(size, size, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    cfg = _config(options, work.source_x.shape[0], sm_budget, receive_layout=receive_layout)
    with Dispatcher(cfg, group=group) as disp:
        timer = _Timer(device, group, options.repeats, options.warmup)
        work.load(0)
        earlier = disp.dispatch(*work.static)
        fixed_rows = _combine_input(disp, earlier)
        disp.combine(fixed_rows, earlier.handle)  # every call runs eagerly once before it is captured
        comm_graph, _ = _graph(device, lambda: _moe_comm_step(disp, work.static, fixed_rows))
        step_graph, _ = _graph(device, lambda: _moe_comm_step(disp, work.static))
        # Expert-major, dispatch's rows are the experts' own: the compute stream has nothing of the layout's to run.
        local_graph = _graph(device, lambda: _combine_input(disp, earlier))[0] if cfg.token_major else None
        comm = torch.cuda.Stream(device)

        def compute() -> None:
            torch.mm(a, b)
            if local_graph is not None:
                local_graph.replay()

        def both() -> None:
            compute_stream = torch.cuda.current_stream()
            comm.wait_stream(compute_stream)
            with torch.cuda.stream(comm):
                comm_graph.replay()
            compute()
            compute_stream.wait_stream(comm)

        compute()
        times = {"comm_us": timer.median_us(comm_graph.replay, work.load, replay=True),
                 "step_us": timer.median_us(step_graph.replay, work.load, replay=True),
                 "compute_whole_us": timer.median_us(compute, _no_prepare, replay=True)}
        with gemm_sm_carveout(sm_budget):
            compute()
            times["compute_us"] = timer.median_us(compute, _no_prepare, replay=True)
            times["both_us"] = timer.median_us(both, work.load, replay=True)
        disp.check()
    shorter = min(times["comm_us"], times["compute_us"])
    times["hidden"] = (times["comm_us"] + times["compute_us"] - times["both_us"]) / shorter
    times["hidden_vs_whole"] = (times["comm_us"] + times["compute_whole_us"] - times["both_us"]) / times["comm_us"]
    local = ", then the permute and unpermute" if cfg.token_major else ""
    note = _with_late_note(f"GEMM {size}^3 bf16{local}, cuBLASLt leaving {sm_budget} SMs", timer.late_share)
    return Row(system="overlap", mode="graph", tokens=work.static[0].shape[0], routing="uniform", layout=receive_layout,
               total_us=times["both_us"], step_us=times["step_us"], num_senders=options.num_senders,
               sm_budget=sm_budget, note=note, extra={"combine_error": None, "late_replay_share": timer.late_share,
                                                      **times})


def _joined(note: str, clause: str) -> str:
    """``note`` with ``clause`` after it in one note cell (``; `` between them where both are there)."""
    return f"{note}; {clause}" if note else clause


def _with_late_note(note: str, late_share: float) -> str:
    """``note``, and from ``LATE_NOTE_SHARE`` of a median's replays issued late, a clause that says so."""
    if late_share < LATE_NOTE_SHARE:
        return note
    return _joined(note, f"host late for {100 * late_share:.0f}% of a median's replays (their times include the wait)")


def _rows(system: str, measured: dict, num_tokens: int, routing: str, num_senders: Optional[int],
          cross_bytes: float, received_bytes: float, sm_budget: Optional[int] = None,
          layout: Optional[str] = None) -> list[Row]:
    rows = []
    for mode in ("eager", "graph"):
        if mode not in measured:
            continue
        times = measured[mode]
        dispatch_us = times["dispatch_us"]
        note = measured.get("note", "")
        extra = {"combine_error": measured["error"]}
        if mode == "graph" and "late_share" in measured:
            extra["late_replay_share"] = measured["late_share"]
            note = _with_late_note(note, measured["late_share"])
        if mode == "eager" and "host_loop_us" in measured:
            extra["host_loop_us"] = measured["host_loop_us"]
        rows.append(Row(
            system=system, mode=mode, tokens=num_tokens, routing=routing, layout=layout, num_senders=num_senders,
            sm_budget=sm_budget,
            cross_gbps=cross_bytes / (dispatch_us * 1e3) if cross_bytes and dispatch_us else None,
            received_gbps=received_bytes / (dispatch_us * 1e3) if received_bytes and dispatch_us else None,
            note=note, extra=extra, **times,
        ))
    return rows


def _open_symm_baseline(options: BenchOptions, device: torch.device, group):
    """``(SymmMemAllToAll2d or None, reason it is unavailable)``, the same on every rank (collective)."""

    def agreed(reason: Optional[str]) -> Optional[str]:
        reasons = agree(group, lambda: reason, error=BackendError, what="reporting the NVSHMEM baseline's state")
        return next((r for r in reasons if r is not None), None)

    reason = agreed(SymmMemAllToAll2d.unavailable_reason(options.num_experts, device, group))
    if reason is not None:
        return None, reason
    baseline = None
    try:
        baseline = SymmMemAllToAll2d(options.num_experts, options.topk, max(options.tokens), options.hidden,
                                     DTYPES[options.dtype], device, group)
    except Exception as exc:  # e.g. torch's NCCL symmetric memory already in use, or the NVSHMEM heap is full
        reason = _first_line(exc)
    reason = agreed(reason)
    return (baseline, None) if reason is None else (None, reason)


def _symm_baseline_rows(state: list, options: BenchOptions, work: _Workload, device: torch.device, group,
                        num_tokens: int, routing: str) -> list[Row]:
    """Rows of the NVSHMEM baseline for one workload; ``state`` is ``[baseline, reason]``, opened on first use.

    It is opened after moe_comm's first dispatcher so that moe_comm's own backend picks torch's
    symmetric-memory provider first (a process can use one); once it fails it stays unavailable.
    """
    if not state:
        state.extend(_open_symm_baseline(options, device, group))
    baseline, reason = state
    if baseline is not None:
        try:
            measured = _measure_baseline(baseline, options, work, device, group, graphs=True)
            return _rows(SymmMemAllToAll2d.name, measured, num_tokens, routing, None, 0, 0)
        except Exception as exc:  # a failure of torch's op is reported, not fatal to the whole run
            state[:] = [None, f"failed: {_first_line(exc)}"]
            reason = state[1]
    return [_unavailable_row(SymmMemAllToAll2d.name, num_tokens, routing, reason)]


def _unavailable_row(system: str, num_tokens: int, routing: str, reason: str) -> Row:
    """The row of a baseline that cannot run here, with the reason (a table says what it left out)."""
    return Row(system=system, mode="unavailable", tokens=num_tokens, routing=routing, note=reason,
               extra={"combine_error": None})


def _budget_sweep_rows(options: BenchOptions, group, rank: int, device: torch.device) -> list[Row]:
    """Graph-replayed rows (uniform routing) of each ``sm_budget`` of ``options.budget_sweep`` at each
    of ``options.sweep_tokens``, once per ``num_senders`` of ``options.sender_sweep`` (default: ``num_senders``),
    in every receive layout; with ``options.fp8`` FP8 dispatch at each point too (its senders quantize,
    so their best number differs from bf16's)."""
    systems = (("moe_comm", None),) + ((("moe_comm fp8 dispatch", "float8_e4m3fn"),) if options.fp8 else ())
    rows = []
    for num_tokens in options.sweep_tokens if options.budget_sweep else ():
        work = _Workload(options, num_tokens, "uniform", rank, device)
        for budget in options.budget_sweep:
            for senders in options.sender_sweep or (options.num_senders,):
                for system, dispatch_dtype in systems:
                    for layout in RECEIVE_LAYOUTS:
                        moe = _measure_moe_comm(options, work, group, budget, dispatch_dtype=dispatch_dtype,
                                                num_senders=senders, eager=False, receive_layout=layout)
                        swept = _rows(system, moe, num_tokens, "uniform", senders, moe["cross_bytes"],
                                      moe["received_bytes"], budget, layout)
                        for row in swept:
                            row.mode = "graph (sm_budget sweep)"
                        rows += swept
    return rows


def _overlap_rows(options: BenchOptions, group, rank: int, device: torch.device) -> list[Row]:
    """The overlap rows (:func:`_measure_overlap`) of each ``sm_budget`` of ``options.overlap_budgets`` in every
    receive layout, at ``options.overlap_tokens`` (CUDA only: the other stream and the carveout are the GPU's)."""
    if not options.overlap_budgets or device.type != "cuda":
        return []
    work = _Workload(options, options.overlap_tokens, "uniform", rank, device)
    return [_measure_overlap(options, work, group, budget, layout)
            for budget in options.overlap_budgets for layout in RECEIVE_LAYOUTS]


def bench_rank(rank: int, world_size: int, options: BenchOptions) -> list[dict]:
    """Run every workload on this rank (collective); returns rank-averaged rows on rank 0, [] elsewhere."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    group = None
    rows: list[Row] = []
    symm_state: list = []  # the NVSHMEM baseline and why it is unavailable, once opened
    for routing in options.routings:
        for num_tokens in options.tokens:
            work = _Workload(options, num_tokens, routing, rank, device)
            # Sender blocks exist only in the device kernels: the CPU's reference backend has none.
            senders = options.num_senders if device.type == "cuda" else None
            layout = options.receive_layout
            moe = _measure_moe_comm(options, work, group, options.sm_budget)
            rows += _rows("moe_comm", moe, num_tokens, routing, senders,
                          moe["cross_bytes"], moe["received_bytes"], options.sm_budget, layout)
            if options.fp8:
                moe8 = _measure_moe_comm(options, work, group, options.sm_budget, dispatch_dtype="float8_e4m3fn")
                rows += _rows("moe_comm fp8 dispatch", moe8, num_tokens, routing, options.num_senders,
                              moe8["cross_bytes"], moe8["received_bytes"], options.sm_budget, layout)
                pairs = _measure_moe_comm(options, work.pre_quantized(), group, options.sm_budget,
                                          dispatch_dtype="float8_e4m3fn")
                rows += _rows("moe_comm fp8 dispatch, pre-quantized", pairs, num_tokens, routing, options.num_senders,
                              pairs["cross_bytes"], pairs["received_bytes"], options.sm_budget, layout)
            if options.baselines and device.type == "cuda":
                # The baselines move every assignment (no dedup): bytes are those moe_comm moves at best,
                # so their bandwidth columns stay empty rather than compare unlike quantities.
                host = _measure_baseline(HostSplitAllToAll(options.num_experts, group), options, work, device,
                                         group, graphs=False)
                rows += _rows(HostSplitAllToAll.name, host, num_tokens, routing, None, 0, 0)
                padded = _measure_baseline(PaddedAllToAll(options.num_experts, group), options, work, device,
                                           group, graphs=True)
                rows += _rows(PaddedAllToAll.name, padded, num_tokens, routing, None, 0, 0)
            elif options.baselines:
                rows += [_unavailable_row(baseline.name, num_tokens, routing, "needs CUDA GPUs (NCCL)")
                         for baseline in (HostSplitAllToAll, PaddedAllToAll)]
            if options.baselines:
                rows += _symm_baseline_rows(symm_state, options, work, device, group, num_tokens, routing)
            if rank == 0:
                print(f"moe-comm bench: {routing} T={num_tokens} done", file=sys.stderr, flush=True)
    rows += _budget_sweep_rows(options, group, rank, device)
    rows += _overlap_rows(options, group, rank, device)
    return _with_host_loop_notes(_average_over_ranks([asdict(row) for row in rows], rank, world_size, group))


def _average_over_ranks(rows: list[dict], rank: int, world_size: int, group) -> list[dict]:
    """Rank 0 gets every numeric column averaged over the ranks (the combine error: the worst rank's)."""
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, rows, group=group)
    if rank != 0:
        return []
    merged = []
    for per_rank in zip(*gathered):
        row = dict(per_rank[0])
        for key in ("dispatch_us", "combine_us", "total_us", "step_us", "cross_gbps", "received_gbps"):
            values = [r[key] for r in per_rank if r[key] is not None]
            row[key] = sum(values) / len(values) if values else None
        errors = [r["extra"]["combine_error"] for r in per_rank if r["extra"]["combine_error"] is not None]
        # Other extras (the overlap times) are rank 0's: the ranks ran them aligned.
        row["extra"] = {**row["extra"], "combine_error": max(errors) if errors else None}
        if "host_loop_us" in row["extra"]:  # the slowest host sets a collective eager step
            row["extra"]["host_loop_us"] = max(r["extra"]["host_loop_us"] for r in per_rank)
        merged.append(row)
    return merged


def _with_host_loop_notes(rows: list[dict]) -> list[dict]:
    """``rows``, each eager row's note giving its host loop time (``extra["host_loop_us"]``, which
    compares runs on like hosts), and saying "host slow" where it is ``HOST_SLOW_NOTE_RATIO`` or more
    times the run's fastest: that row's times are a slower host's, not the library's. (A run whose
    host is slow throughout shows only in the times themselves.)"""
    loops = [row["extra"]["host_loop_us"] for row in rows if "host_loop_us" in row["extra"]]
    fastest = min(loops, default=None)
    for row in rows:
        loop = row["extra"].get("host_loop_us")
        if loop is None:
            continue
        ratio = loop / fastest
        host = (f"host slow: Python loop {loop:.0f} us, {ratio:.1f}x this run's fastest"
                if ratio >= HOST_SLOW_NOTE_RATIO else f"host loop {loop:.0f} us")
        row["note"] = _joined(row["note"], host)
    return rows


def _cell(value: Optional[float], digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    """The results as a markdown table (one line per system, layout, mode and workload)."""
    lines = [
        "| system | layout | mode | routing | T | num_senders | sm_budget | dispatch us | combine us | "
        "dispatch+combine us | whole step us | dispatch GB/s (cross-link) | dispatch GB/s (received) | "
        "combine rel. error | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    overlap = [row for row in rows if row["system"] == "overlap"]
    for row in rows:
        if row["system"] == "overlap":
            continue
        error = row["extra"]["combine_error"]
        note = row.get("note", "").replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {row['system']} | {row['layout'] or '-'} | {row['mode']} | {row['routing']} | {row['tokens']} | "
            f"{row['num_senders'] or '-'} | {row.get('sm_budget') or 'all'} | "
            f"{_cell(row['dispatch_us'])} | {_cell(row['combine_us'])} | {_cell(row['total_us'])} | "
            f"{_cell(row['step_us'])} | {_cell(row['cross_gbps'])} | {_cell(row['received_gbps'])} | "
            f"{'-' if error is None else f'{error:.1e}'} | {note} |"
        )
    if overlap:
        lines += [
            "", "Overlap: dispatch+combine (one graph) on a communication stream beside the compute stream's work: "
            "a GEMM (token-major: then the permute and unpermute of an earlier step)",
            "", "| layout | T | sm_budget | comm alone us | whole step alone us | compute alone us (whole device) | "
            "compute alone us (carveout) | both us | shorter job hidden | comm hidden vs whole-device serial | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in overlap:
            t = row["extra"]
            lines.append(f"| {row['layout']} | {row['tokens']} | {row['sm_budget']} | {_cell(t['comm_us'])} | "
                         f"{_cell(t['step_us'])} | {_cell(t['compute_whole_us'])} | {_cell(t['compute_us'])} | "
                         f"{_cell(t['both_us'])} | {100 * t['hidden']:.0f}% | {100 * t['hidden_vs_whole']:.0f}% | "
                         f"{row['note']} |")
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], meta: dict, out_dir: Path, name: str) -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` and, with matplotlib, ``<name>.png``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    json_path = out_dir / f"{name}.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    written.append(json_path)
    md_path = out_dir / f"{name}.md"
    header = "\n".join(f"- {key}: {value}" for key, value in meta.items())
    md_path.write_text(f"# moe-comm bench: {name}\n\n{header}\n\n{markdown_table(rows)}")
    written.append(md_path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    figure, axis = plt.subplots(figsize=(8, 5))
    lines: dict = {}
    for row in rows:
        if (row["routing"] == "uniform" and "sweep" not in row["mode"] and row["system"] != "overlap"
                and row["total_us"] is not None):
            label = " ".join(part for part in (row["system"], row["layout"], f"({row['mode']})") if part)
            lines.setdefault(label, []).append((row["tokens"], row["total_us"]))
    for label, points in sorted(lines.items()):
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens per rank")
    axis.set_ylabel("dispatch + combine (us, median)")
    world = meta.get("world_size")
    axis.set_title(f"{world} rank{'' if world == 1 else 's'}, {meta.get('device')}: uniform routing")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    png_path = out_dir / f"{name}.png"
    figure.savefig(png_path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    written.append(png_path)
    return written


# Without GPUs the bench runs CPU ranks on the reference backend, as a smoke run: the GPU workload
# (hidden 7168, 256 experts, T up to 4096, two routings) took over 12 minutes there.
_CPU_WORKLOAD = {"tokens": (1, 32, 128), "routings": ("uniform",), "hidden": 1024, "num_experts": 16, "topk": 4,
                 "repeats": 10}
_OVERLAP_BUDGETS = (132, 64, 24, 16, 8, 4)
_WORKLOAD_FLAGS = {"tokens": "--tokens", "routings": "--routing", "hidden": "--hidden", "num_experts": "--experts",
                   "topk": "--topk", "repeats": "--repeats"}


def _parser() -> argparse.ArgumentParser:
    cpu = " ".join(f"{flag} {' '.join(map(str, _CPU_WORKLOAD[key])) if isinstance(_CPU_WORKLOAD[key], tuple) else _CPU_WORKLOAD[key]}"
                   for key, flag in _WORKLOAD_FLAGS.items())
    parser = argparse.ArgumentParser(
        prog="moe-comm bench", description=__doc__.split("\n\n")[0],
        epilog=f"Without GPUs the defaults are a CPU-sized smoke run (about 20 s on 2 cores): {cpu}.",
    )
    defaults = BenchOptions()
    parser.add_argument("--tokens", type=int, nargs="+", help=f"tokens per rank (GPU default {' '.join(map(str, defaults.tokens))})")
    parser.add_argument("--routing", nargs="+", choices=("uniform", "skewed"),
                        help=f"routings (GPU default {' '.join(defaults.routings)})")
    parser.add_argument("--hidden", type=int, help=f"hidden width (GPU default {defaults.hidden})")
    parser.add_argument("--experts", type=int, help=f"global experts (GPU default {defaults.num_experts})")
    parser.add_argument("--topk", type=int, help=f"experts per token (GPU default {defaults.topk})")
    parser.add_argument("--backend", default=defaults.backend)
    parser.add_argument("--num-senders", type=int, default=defaults.num_senders,
                        help="blocks of dispatch that push rows to peers, within --sm-budget (config num_senders)")
    parser.add_argument("--repeats", type=int, help=f"timed runs per median (GPU default {defaults.repeats})")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--sm-budget", type=int, default=None,
                        help="SMs of every dispatch/combine kernel (default: the whole device)")
    parser.add_argument("--slab-copies", type=int, default=defaults.slab_copies,
                        help="receive slab copies of the device backends (2: by call parity, no acks; 1: acks)")
    parser.add_argument("--expert-alignment", type=int, default=defaults.expert_alignment,
                        help="rows each expert segment of the dispatch output is padded to (default "
                             f"{defaults.expert_alignment}); at decode sizes the zero padding is most of "
                             "dispatch's bytes")
    parser.add_argument("--no-zero-padding", action="store_true",
                        help="leave the padding rows of the dispatch output unwritten (config zero_padding: "
                             "false, for inference with aligned segments)")
    parser.add_argument("--sweep-budget", type=int, nargs="*", default=[],
                        help=f"sm_budget values to time at T = {' '.join(map(str, defaults.sweep_tokens))}, "
                             "in every receive layout")
    parser.add_argument("--sweep-senders", type=int, nargs="+", default=[], metavar="NUM_SENDERS",
                        help="num_senders values to time at each --sweep-budget value (with several "
                             "ranks: at one, dispatch runs no senders)")
    parser.add_argument("--overlap", type=int, nargs="*", default=None, metavar="BUDGET",
                        help="time dispatch+combine beside a GEMM on another stream at these sm_budget values "
                             f"(default with no values: 132 64 24 16 8 4), T = {defaults.overlap_tokens}, "
                             "in every receive layout")
    parser.add_argument("--receive-layout", choices=RECEIVE_LAYOUTS, default=defaults.receive_layout,
                        help="the config's receive_layout of the workloads' rows (default "
                             f"{defaults.receive_layout}); --sweep-budget and --overlap time every layout")
    parser.add_argument("--fp8", action="store_true",
                        help="also time FP8 dispatch (dispatch_dtype float8_e4m3fn) on every workload and at "
                             "every --sweep-budget / --sweep-senders point; needs a hidden that is a multiple of 128")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks when there is no GPU")
    parser.add_argument("--name", default=None, help="results file name (default: from the machine)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="results folder (default: benchmarks/results under the current directory)")
    return parser


def _options(args: argparse.Namespace, gpus: int) -> BenchOptions:
    """The options of this run: the command line, else the GPU defaults, else the CPU-sized workload."""
    fallback = asdict(BenchOptions()) if gpus else {**asdict(BenchOptions()), **_CPU_WORKLOAD}
    given = {key: getattr(args, flag[2:]) for key, flag in _WORKLOAD_FLAGS.items()}
    chosen = {key: fallback[key] if value is None else value for key, value in given.items()}
    return BenchOptions(
        tokens=tuple(chosen["tokens"]), routings=tuple(chosen["routings"]), hidden=chosen["hidden"],
        num_experts=chosen["num_experts"], topk=chosen["topk"], backend=args.backend if gpus else "reference",
        num_senders=args.num_senders, repeats=chosen["repeats"], baselines=not args.no_baselines,
        sm_budget=args.sm_budget, slab_copies=args.slab_copies, expert_alignment=args.expert_alignment,
        zero_padding=not args.no_zero_padding, budget_sweep=tuple(args.sweep_budget),
        sender_sweep=tuple(args.sweep_senders),
        overlap_budgets=_OVERLAP_BUDGETS if args.overlap == [] else tuple(args.overlap or ()),
        dtype="bfloat16" if gpus else "float32", fp8=args.fp8, receive_layout=args.receive_layout,
    )


def _check_options(options: BenchOptions, world_size: int) -> None:
    """Refuse a workload no rank could run, before any rank starts (one line instead of N tracebacks).

    Raises:
        ConfigError: a size does not make a valid config for ``world_size`` ranks (names the option).
    """
    for name, values in (("--tokens", options.tokens), ("--repeats", (options.repeats,)),
                         ("--sweep-budget", options.budget_sweep), ("--num-senders", (options.num_senders,)),
                         ("--expert-alignment", (options.expert_alignment,)),
                         ("--sweep-senders", options.sender_sweep),
                         ("--overlap", options.overlap_budgets),
                         ("--sm-budget", () if options.sm_budget is None else (options.sm_budget,))):
        bad = [value for value in values if value < 1]
        if bad:
            raise ConfigError(f"{name}: got {' '.join(map(str, bad))}, expected positive integers")
    if options.sender_sweep and not options.budget_sweep:
        raise ConfigError("--sweep-senders: times num_senders at each --sweep-budget value, and no --sweep-budget "
                          "was given")
    _config(options, max(options.tokens), None, "float8_e4m3fn" if options.fp8 else None).check_world(world_size)


def main(argv: Optional[list] = None) -> int:
    """Entry point of ``moe-comm bench`` and ``benchmarks/bench_dispatch_combine.py``."""
    from .spawn import run_ranks

    args = _parser().parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    options = _options(args, gpus)
    world_size = gpus or args.ranks
    try:
        if world_size < 1:
            raise ConfigError(f"--ranks: got {args.ranks}, expected a positive number of CPU ranks")
        _check_options(options, world_size)
    except ConfigError as exc:
        print(f"moe-comm bench: error: {exc}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if gpus else "CPU"
    where = f"{gpus} GPU(s)" if gpus else f"{world_size} CPU ranks (reference backend; a smoke run, not a benchmark)"
    print(f"moe-comm bench: {where}; T = {' '.join(map(str, options.tokens))}, hidden {options.hidden}, "
          f"top-{options.topk} of {options.num_experts}; results go to {args.out.resolve()}", flush=True)
    results = run_ranks(bench_rank, world_size, options, dist_backend="nccl" if gpus else "gloo", gpu=bool(gpus),
                        timeout_s=1800.0)
    rows = results[0]
    name = args.name or f"{world_size}x{device.replace(' ', '-')}"
    meta = {"world_size": world_size, "device": device, "torch": torch.__version__, **asdict(options)}
    print(markdown_table(rows))
    for path in write_results(rows, meta, args.out, name):
        print(f"wrote {path}")
    return 0
