"""Train a tiny Mixture-of-Experts language model with ``moe_comm.MoELayer`` on every local GPU.

    python examples/train_tiny_moe.py                     # one rank per local GPU (or 2 CPU ranks)
    python examples/train_tiny_moe.py --graph             # the whole training step as one CUDA graph
    python examples/train_tiny_moe.py --backend reference --world-size 4   # CPU ranks, gloo
    python examples/train_tiny_moe.py --fp8               # FP8 dispatch (e4m3 rows, float32 block scales)

``--fp8`` dispatches the tokens as e4m3 rows with one scale per 128 channels; the experts run on
the dequantized rows and the gradients pass straight through the quantization in the config dtype
(``Dispatcher.dequantize``).

The model: token embedding -> ``--layers`` blocks (RMSNorm, ``MoELayer``, residual) -> RMSNorm ->
output head. The residual stream is float32; each ``MoELayer`` runs in the config's dtype.
The data: sequences from a fixed random Markov chain (every token has ``SUCCESSORS`` equally likely
next tokens), so the next-token loss falls from ``ln(vocab)`` towards ``ln(SUCCESSORS)``.

Load balancing (on by default; ``--no-balancing`` turns it off): the Switch/GShard auxiliary loss
(``--aux-loss-coef``) is added to the training loss (``moe_comm.moe_aux_loss``), and the
aux-loss-free expert bias (``--bias-update-rate``) is updated after every optimizer step
(``moe_comm.update_expert_biases``, an all-reduce of the loads). Every step records each layer's
per-expert load (``MoELayer.expert_load``); at the end rank 0 prints the load spread (the busiest
expert's load over the mean, averaged over the layers, all ranks' tokens) of the first and last
steps. With ``--config`` the config's ``router`` section decides, unless a flag is given.

Parallelism: expert parallel for the experts (each rank holds ``num_experts / world`` of them)
and data parallel for everything else: each rank draws its own batches, and the gradients of the
replicated weights (embedding, norms, routers, head) are summed over the ranks. The loss is
divided by the world size before backward, so the experts' gradients (which already collect
every rank's tokens through dispatch/combine) and the summed replicated ones both belong to the
mean loss over all ranks.

``--graph`` (GPUs only) captures forward, loss, backward, the gradient all-reduce and the
optimizer step in one CUDA graph after a few eager warm-up steps, and replays it with each new
batch copied into the static input. The optimizer step is inside the graph, so it is AdamW with
``capturable=True`` (its step counter lives on the GPU). To keep the step outside instead,
capture up to the all-reduce and call ``optimizer.step()`` after every replay.

Rank 0 prints the loss of every step; the script exits with 1 if the loss (averaged over the
ranks and over the first and last ``WINDOW`` steps) did not go down by ``--min-drop``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import moe_comm
from moe_comm.errors import RankFailureError
from moe_comm.tools.spawn import run_ranks

SUCCESSORS = 4       # next tokens each token may be followed by: the loss floor is ln(4) = 1.39
WINDOW = 3           # steps averaged at the start and at the end for the "loss went down" check
WARMUP_STEPS = 3     # eager steps before a --graph capture (torch's whole-network capture recipe)
SPREAD_WINDOW = 5    # steps whose loads are summed for the load spread at the start and at the end
# The model used when no --config is given: small enough for CPU ranks.
TINY = dict(num_experts=8, topk=2, hidden=64, max_tokens_per_rank=128, expert_alignment=8)
# --fp8's hidden size for the built-in model: FP8 dispatch scales blocks of 128 channels.
FP8_HIDDEN = 128
# Its load balancing unless flags say otherwise: an auxiliary loss and the aux-loss-free bias. The
# bias rate is larger than DeepSeek-V3's 0.001 so that it acts within a few dozen steps.
BALANCING = dict(aux_loss_coef=0.01, bias_update_rate=0.01)


class TinyMoeLM(nn.Module):
    """Embedding, ``num_layers`` pre-norm residual MoE blocks, final norm and output head.

    Args:
        config: the moe_comm config (hidden, experts, dtype of the MoE layers).
        dispatcher: shared by every ``MoELayer`` (one set of buffers for the whole model).
        vocab, num_layers, ffn_hidden: sizes. seed: the MoE layers' weights.

    ``forward(tokens [B, S] int64) -> logits [B, S, vocab] float32``, on the dispatcher's device.
    """

    def __init__(self, config, dispatcher, vocab: int, num_layers: int, ffn_hidden: int, seed: int) -> None:
        super().__init__()
        device, hidden = dispatcher.device, config.hidden
        self.vocab = vocab
        self.embed = nn.Parameter(torch.randn(vocab, hidden, device=device) / math.sqrt(hidden))
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, device=device) for _ in range(num_layers))
        self.moe = nn.ModuleList(
            moe_comm.MoELayer(config, ffn_hidden, dispatcher=dispatcher, seed=seed + i) for i in range(num_layers)
        )
        self.final_norm = nn.RMSNorm(hidden, device=device)
        self.head = nn.Linear(hidden, vocab, bias=False, device=device)
        self.register_buffer("vocab_ids", torch.arange(vocab, device=device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A one-hot matmul instead of an embedding lookup: its backward is a plain GEMM, which a
        # CUDA graph captures (no host syncs, no data-dependent shapes) on every torch version.
        h = (tokens[..., None] == self.vocab_ids).float() @ self.embed
        for norm, moe in zip(self.norms, self.moe):
            h = h + moe(norm(h).to(moe.config.torch_dtype)).float()
        return self.head(self.final_norm(h))

    def expert_parameters(self) -> list[nn.Parameter]:
        """The weights this rank holds alone (its experts); every other weight is replicated."""
        return [p for layer in self.moe for p in (layer.w_gate_up, layer.w_down)]


class MarkovData:
    """Batches ``[B, S + 1]`` int64 on the CPU from one Markov chain (the same on every rank), drawn per rank."""

    def __init__(self, vocab: int, batch: int, seq_len: int, seed: int, rank: int) -> None:
        table_gen = torch.Generator().manual_seed(seed)
        self.successors = torch.stack([torch.randperm(vocab, generator=table_gen)[:SUCCESSORS] for _ in range(vocab)])
        self.gen = torch.Generator().manual_seed(seed * 1000 + 1 + rank)
        self.vocab, self.batch, self.seq_len = vocab, batch, seq_len

    def next(self) -> torch.Tensor:
        tokens = torch.empty(self.batch, self.seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(self.vocab, (self.batch,), generator=self.gen)
        choice = torch.randint(SUCCESSORS, (self.batch, self.seq_len), generator=self.gen)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens


def _train_rank(rank: int, world_size: int, config_dict: dict, options: dict) -> list:
    """One rank's training; returns the loss of every step averaged over the ranks (every rank returns it)."""
    config = moe_comm.load_config(config_dict)
    seq_len = options["seq_len"]
    batch = config.max_tokens_per_rank // seq_len
    torch.manual_seed(options["seed"])  # replicated weights start equal on every rank
    with moe_comm.Dispatcher(config) as dispatcher:
        device = dispatcher.device
        model = TinyMoeLM(config, dispatcher, options["vocab"], options["layers"], options["ffn_hidden"],
                          options["seed"])
        graph_mode = options["graph"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=options["lr"], capturable=graph_mode)
        local = {id(p) for p in model.expert_parameters()}
        replicated = [p for p in model.parameters() if id(p) not in local]
        data = MarkovData(options["vocab"], batch, seq_len, options["seed"], rank)
        static_batch = data.next().to(device)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            optimizer.zero_grad(set_to_none=True)
            logits = model(static_batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, model.vocab), static_batch[:, 1:].reshape(-1))
            # The balancing losses (zero without a coefficient) belong to this rank's tokens, as the task loss.
            ((loss + moe_comm.moe_aux_loss(model)) / world_size).backward()
            for p in replicated:
                dist.all_reduce(p.grad)
            optimizer.step()
            moe_comm.update_expert_biases(model)  # a collective; no-op for layers without a bias
            return loss.detach(), torch.stack([layer.expert_load for layer in model.moe])

        if rank == 0:
            print(f"rank 0: {model.moe[0]!r}", flush=True)
        history = torch.zeros(options["steps"], device=device)
        loads = torch.zeros(options["steps"], len(model.moe), config.num_experts, dtype=torch.int64, device=device)
        graph = None
        for i in range(options["steps"]):
            start = time.perf_counter()
            static_batch.copy_(data.next())
            if graph is not None:
                graph.replay()
            elif graph_mode and i == WARMUP_STEPS:
                graph, (loss, load) = _capture(step)
                graph.replay()  # capturing ran nothing: this replay is step i
            elif graph_mode and i < WARMUP_STEPS:
                loss, load = _on_side_stream(step)
            else:
                loss, load = step()
            history[i] = loss
            loads[i] = load
            if rank == 0:
                print(f"step {i + 1:4d}/{options['steps']}  loss {float(loss):.4f}  "
                      f"{(time.perf_counter() - start) * 1e3:7.1f} ms{'  (graph)' if graph is not None else ''}",
                      flush=True)
        dist.all_reduce(history)
        dist.all_reduce(loads)  # every expert's load over all ranks' tokens
        dispatcher.check()
    return (history / world_size).tolist(), loads.tolist()


def _on_side_stream(fn):
    """Run ``fn`` on a side stream: eager warm-up before a capture, as torch's CUDA-graph recipe asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = fn()
    torch.cuda.current_stream().wait_stream(side)
    return result


def _capture(step):
    """Capture ``step`` once; returns the graph and its static outputs (loss, loads)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def judge(losses: list, min_drop: float) -> tuple[str, bool]:
    """Did the loss fall by ``min_drop`` (relative) from the first ``WINDOW`` steps to the last? -> (summary, verdict)."""
    first, last = sum(losses[:WINDOW]) / WINDOW, sum(losses[-WINDOW:]) / WINDOW
    went_down = last < (1 - min_drop) * first  # False for NaN losses too
    verdict = "went down" if went_down else f"FAIL: did not fall by {min_drop:.0%}"
    return (f"mean loss over all ranks {first:.4f} (first {WINDOW} steps) -> {last:.4f} (last {WINDOW}); "
            f"floor ln({SUCCESSORS}) = {math.log(SUCCESSORS):.4f}: {verdict}"), went_down


def load_spread(loads: list) -> float:
    """max/mean expert load of ``loads [steps][layers][experts]`` summed over the steps, averaged over the layers.

    1.0 is an even load. Summing a few steps first keeps the sampling noise of one small batch
    (a few dozen assignments per expert here) from hiding the trend.
    """
    total = torch.tensor(loads, dtype=torch.float64).sum(dim=0)
    return float((total.max(dim=-1).values / total.mean(dim=-1)).mean())


def spread_summary(loads: list) -> tuple[str, bool]:
    """The load spread of the first ``SPREAD_WINDOW`` steps and of the last -> (summary, fell)."""
    first, last = load_spread(loads[:SPREAD_WINDOW]), load_spread(loads[-SPREAD_WINDOW:])
    fell = last < first
    return (f"load spread (max/mean expert load over all ranks, mean of the layers; 1.0 = even) {first:.3f} "
            f"(first {SPREAD_WINDOW} steps) -> {last:.3f} (last {SPREAD_WINDOW}): "
            f"{'fell' if fell else 'did not fall'}"), fell


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="moe_comm YAML config (default: a tiny built-in model)")
    parser.add_argument("--backend", help="override the config's backend (vmm, nvshmem, nccl, reference, auto)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    parser.add_argument("--world-size", type=int,
                        help="ranks (default: one per local GPU; 2 CPU ranks with the reference backend)")
    parser.add_argument("--graph", action="store_true", help="capture the training step in a CUDA graph (GPUs)")
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate (default 0.01)")
    parser.add_argument("--layers", type=int, default=2, help="MoE blocks (default 2)")
    parser.add_argument("--vocab", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--ffn-hidden", type=int, help="expert width (default: 2 x hidden)")
    parser.add_argument("--min-drop", type=float, default=0.1,
                        help="required relative fall of the loss, first to last steps (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aux-loss-coef", type=float,
                        help=f"router.aux_loss_coef (default {BALANCING['aux_loss_coef']}, or the config's)")
    parser.add_argument("--bias-update-rate", type=float,
                        help=f"router.bias_update_rate (default {BALANCING['bias_update_rate']}, or the config's)")
    parser.add_argument("--fp8", action="store_true",
                        help="dispatch in FP8 (dispatch_dtype float8_e4m3fn; the built-in model's hidden becomes "
                             f"{FP8_HIDDEN}, one scale block)")
    parser.add_argument("--no-balancing", action="store_true",
                        help="no balancing loss and no expert bias (the plain router: watch the load spread grow)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    overrides = {} if args.backend is None else {"backend": args.backend}
    if args.config is None:
        overrides = {**TINY, "router": dict(BALANCING), **overrides}
    balancing = {key: value for key, value in (("aux_loss_coef", args.aux_loss_coef),
                                               ("bias_update_rate", args.bias_update_rate)) if value is not None}
    if args.no_balancing:
        balancing = dict(aux_loss_coef=0.0, seq_aux_loss_coef=0.0, z_loss_coef=0.0, bias_update_rate=0.0)
    if balancing:
        overrides["router"] = {**overrides.get("router", {}), **balancing}
    if args.fp8:
        overrides["dispatch_dtype"] = "float8_e4m3fn"
        if args.config is None:
            overrides["hidden"] = FP8_HIDDEN
    try:
        config = moe_comm.load_config(args.config, **overrides)
    except moe_comm.ConfigError as exc:
        print(f"train_tiny_moe: {exc}", file=sys.stderr)
        return 2
    gpu = config.backend != "reference" and torch.cuda.is_available()
    if args.config is None:
        # bf16 where GPUs run it (and torch._grouped_mm can); float32 on CPU ranks, where 16-bit
        # GEMMs are slow.
        config = moe_comm.load_config(config.to_dict(), dtype="bfloat16" if gpu else "float32")
    world_size = args.world_size or (torch.cuda.device_count() if gpu else 2)
    problems = []
    if args.graph and not gpu:
        problems.append("--graph needs CUDA GPUs (the CPU ranks of the reference backend cannot be captured)")
    if gpu and world_size > torch.cuda.device_count():
        problems.append(f"--world-size {world_size}: one rank per GPU, and this machine has {torch.cuda.device_count()}")
    if world_size < 1:
        problems.append(f"--world-size: got {world_size}, expected at least 1")
    elif config.num_experts % world_size:
        problems.append(f"--world-size {world_size}: the {config.num_experts} experts must split evenly over the "
                        "ranks (expert-parallel); use a divisor of num_experts")
    if args.steps < 2 * WINDOW or (args.graph and args.steps <= WARMUP_STEPS):
        problems.append(f"--steps: got {args.steps}, expected at least {max(2 * WINDOW, WARMUP_STEPS + 1)}")
    if config.max_tokens_per_rank % args.seq_len:
        problems.append(f"--seq-len {args.seq_len} must divide max_tokens_per_rank ({config.max_tokens_per_rank}): "
                        "each step feeds max_tokens_per_rank tokens per rank")
    if problems:
        print("train_tiny_moe: " + "; ".join(problems), file=sys.stderr)
        return 2
    options = dict(steps=args.steps, graph=args.graph, lr=args.lr, layers=args.layers, vocab=args.vocab,
                   seq_len=args.seq_len, ffn_hidden=args.ffn_hidden or 2 * config.hidden, seed=args.seed)
    where = f"{world_size} GPU ranks (nccl)" if gpu else f"{world_size} CPU ranks (gloo)"
    print(f"train_tiny_moe: {where}, backend {config.backend}, experts {config.num_experts} top-{config.topk}, "
          f"hidden {config.hidden}, {config.dtype}, {config.max_tokens_per_rank} tokens/rank/step, "
          f"aux loss {config.router.aux_loss_coef}, bias rate {config.router.bias_update_rate}, "
          f"{args.steps} steps{', FP8 dispatch' if config.dispatch_dtype else ''}{', CUDA graph' if args.graph else ''}",
          flush=True)
    try:
        per_rank = run_ranks(_train_rank, world_size, config.to_dict(), options, dist_backend="nccl" if gpu else "gloo",
                             gpu=gpu, timeout_s=600)
    except RankFailureError as exc:
        print(f"train_tiny_moe: FAIL: {exc}", file=sys.stderr)
        return 1
    losses, loads = per_rank[0]
    print(f"train_tiny_moe: {spread_summary(loads)[0]}", flush=True)
    summary, went_down = judge(losses, args.min_drop)
    print(f"train_tiny_moe: {summary}", flush=True)
    return 0 if went_down else 1

if __name__ == "__main__":
    sys.exit(main())
