"""MoELayer on every GPU backend (contract: layer / autograd / graph replay), world size 2.

One spawn per backend runs every scenario (a spawn costs each rank an ``import torch``, the
process group and the kernels' first compile):

* forward and backward against the dense float32 reference (``tests/layer_checks.py``): the
  output and the gradients of the input, the router weight and every expert weight, for both
  expert implementations (``grouped_mm`` needs bf16; ``loop`` runs bf16 and float32);
* a whole training step of a two-MoE-layer model (forward, loss, backward, optimizer) captured
  once in a ``torch.cuda.CUDAGraph`` and replayed with new batches, against the same model
  trained eagerly; the optimizer step once outside the graph (eager, after each replay) and once
  inside it;
* decode: one graph per batch-size bucket (T = 16, 4, 1) on one layer and its dispatcher,
  captured into one memory pool, replayed interleaved with eager calls, against eager.

Graph and eager run the same kernels on the same inputs; tolerances (rather than bitwise
equality) only leave room for cuBLAS picking another algorithm for the graph pool's pointers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import moe_comm
from moe_comm.nn.layer import MoELayer
from capture import warm_up_on_side_stream
from gpu_backends import GPU_BACKENDS, dist_backend_for, gpus_needed
from layer_checks import BASE, FFN, TOLERANCE, assert_within, decode_graph_errors, layer_errors, rel_err
from multirank import run_ranks

pytestmark = pytest.mark.gpu

WORLD = 2
# Config name -> (overrides, scenarios). grouped_mm is the fast path (bf16 on sm_90/sm_100);
# loop is the fallback, run in float32 (where it is the only choice) and in bf16 (the same
# dtype as grouped_mm, against the reference only: the graphs are the same code in both dtypes).
# The token-major layout (training's, beside the GEMMs) runs the fast path and the captured training
# step: its permute and unpermute inside the graph, forward and backward.
LAYER_CONFIGS = {
    "bfloat16-grouped_mm": (dict(dtype="bfloat16", expert_impl="grouped_mm"), ("reference", "train", "decode")),
    "float32-loop": (dict(dtype="float32", expert_impl="loop"), ("reference", "train", "decode")),
    "bfloat16-loop": (dict(dtype="bfloat16", expert_impl="loop"), ("reference",)),
    "bfloat16-grouped_mm-token_major": (dict(dtype="bfloat16", expert_impl="grouped_mm", receive_layout="token_major"),
                                        ("reference", "train")),
}
# Graph against eager: the same arithmetic, so tighter than the reference's bf16 tolerance.
GRAPH_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TRAIN_STEPS = 5
WARMUP_STEPS = 3
DECODE_BUCKETS = (16, 4, 1)          # captured largest first, as serving engines do
DECODE_ORDER = (1, 16, 4, 4, 1, 16, 1, 4, 16, 1)


class _TwoMoeModel(nn.Module):
    """``x @ proj``, then two residual MoE layers: every weight's gradient crosses dispatch and combine."""

    def __init__(self, disp: moe_comm.Dispatcher, seed: int) -> None:
        super().__init__()
        cfg = disp.config
        gen = torch.Generator().manual_seed(seed)
        proj = torch.randn(cfg.hidden, cfg.hidden, generator=gen) / math.sqrt(cfg.hidden)
        self.proj = nn.Parameter(proj.to(device=disp.device, dtype=cfg.torch_dtype))
        self.moe = nn.ModuleList(MoELayer(cfg, FFN, dispatcher=disp, seed=seed + i) for i in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.proj
        for layer in self.moe:
            h = h + layer(h)
        return h


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def _train_step(model, optimizer, x, target) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(model(x), target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _train_graph(disp: moe_comm.Dispatcher, rank: int, optimizer_in_graph: bool) -> dict:
    """Two identical models on one dispatcher, one trained eagerly, one by graph replays; their relative differences.

    The optimizer is SGD with momentum: its state must exist before capture (the warm-up makes
    it), and its update is linear in the gradients, so a rounding difference between graph and
    eager stays a rounding difference (Adam's normalised update can turn noise-level gradients
    into full-size steps). Adam/AdamW go inside a graph only with ``capturable=True``.
    """
    cfg = disp.config
    device = disp.device
    gen = torch.Generator().manual_seed(300 + rank)

    def batch():
        x = torch.randn(cfg.max_tokens_per_rank, cfg.hidden, generator=gen).to(device=device, dtype=cfg.torch_dtype)
        return x, torch.randn(cfg.max_tokens_per_rank, cfg.hidden, generator=gen).to(device)

    eager, graphed = _TwoMoeModel(disp, 11), _TwoMoeModel(disp, 11)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_graph = torch.optim.SGD(graphed.parameters(), lr=0.05, momentum=0.9)
    static_x, static_target = batch()

    def warm_up():  # on both models with the same batches (it makes the momentum buffers too)
        for _ in range(WARMUP_STEPS):
            x, target = batch()
            _train_step(eager, opt_eager, x, target)
            _train_step(graphed, opt_graph, x, target)

    warm_up_on_side_stream(warm_up)

    graph = torch.cuda.CUDAGraph()
    # With the gradients set to None, backward under capture allocates them in the graph's pool:
    # every replay writes them afresh (no accumulation), and a step outside reads them there.
    opt_graph.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _loss(graphed(static_x), static_target)
        static_loss.backward()
        if optimizer_in_graph:
            opt_graph.step()

    errors = {}
    for step in range(TRAIN_STEPS):
        x, target = batch()
        static_x.copy_(x)
        static_target.copy_(target)
        graph.replay()
        if not optimizer_in_graph:
            opt_graph.step()
        want = _train_step(eager, opt_eager, x, target)
        errors[f"loss step {step}"] = rel_err(static_loss, want)
    for (name, got), (_, want) in zip(graphed.named_parameters(), eager.named_parameters()):
        errors[f"{name} after {WARMUP_STEPS + TRAIN_STEPS} steps"] = rel_err(got, want)
    disp.check()
    return errors


def _decode_graphs(disp: moe_comm.Dispatcher, rank: int) -> dict:
    """One captured forward per bucket on one layer, sharing a memory pool; replays against eager calls."""
    cfg = disp.config
    gen = torch.Generator().manual_seed(500 + rank)
    layer = MoELayer(cfg, FFN, dispatcher=disp, seed=21)

    def tokens(num_tokens):
        return torch.randn(num_tokens, cfg.hidden, generator=gen).to(device=disp.device, dtype=cfg.torch_dtype)

    errors = decode_graph_errors(layer, tokens, DECODE_BUCKETS, DECODE_ORDER)
    disp.check()
    return errors


def _layer_configs(backend_id: str) -> list:
    """The config of each of LAYER_CONFIGS, in its order, on ``backend_id``."""
    backend, section = GPU_BACKENDS[backend_id]
    return [moe_comm.load_config(None, backend=backend, **BASE, **overrides, **section)
            for overrides, _ in LAYER_CONFIGS.values()]


def _rank_main(rank: int, world: int, backend_id: str) -> dict:
    backend, _ = GPU_BACKENDS[backend_id]
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 tolerances assume float32 GEMMs
    results = {}
    for (name, (overrides, scenarios)), cfg in zip(LAYER_CONFIGS.items(), _layer_configs(backend_id)):
        with moe_comm.Dispatcher(cfg) as disp:
            assert disp.backend_name == backend, f"{name}: dispatcher runs {disp.backend_name}, not {backend}"
            impl = MoELayer(cfg, FFN, dispatcher=disp).expert_impl
            assert impl == overrides["expert_impl"], f"{name}: the layer runs {impl}"
            if "reference" in scenarios:
                results[(name, "reference")] = layer_errors(disp, rank, world, True, (16,), 1)
                # renormalize=False, [2, 5, H] tokens, two layers stacked on the one dispatcher
                results[(name, "reference, 2 layers")] = layer_errors(disp, rank, world, False, (2, 5), 2)
            if "train" in scenarios:
                results[(name, "train graph, optimizer outside")] = _train_graph(disp, rank, False)
                results[(name, "train graph, optimizer inside")] = _train_graph(disp, rank, True)
            if "decode" in scenarios:
                results[(name, "decode graphs")] = _decode_graphs(disp, rank)
    return results


# Every GPU backend: the layer must give the same results whichever transport moves the rows.
@pytest.mark.parametrize("backend_id", list(GPU_BACKENDS))
@pytest.mark.kernels.with_args(_layer_configs)
def test_layer_on_gpu_backend(backend_id, requires_gpus):
    gpus = requires_gpus(gpus_needed(backend_id, WORLD))
    dist_backend = dist_backend_for(WORLD, gpus)
    per_rank = run_ranks(_rank_main, WORLD, backend_id, reuse=backend_id, dist_backend=dist_backend, gpu=True,
                         timeout_s=300)
    for rank, results in enumerate(per_rank):
        for (name, check), errors in results.items():
            dtype = moe_comm.load_config(None, **LAYER_CONFIGS[name][0]).torch_dtype
            tolerance = (TOLERANCE if check.startswith("reference") else GRAPH_TOLERANCE)[dtype]
            if check == "reference, 2 layers":
                # bf16 rounding compounds through stacked layers: 2.3e-2 on 2x H200, the same on
                # every backend to all digits (the transports are bitwise equal), so arithmetic.
                tolerance *= 2
            assert_within(errors, tolerance, f"{backend_id}, rank {rank}, {name}, {check}")
