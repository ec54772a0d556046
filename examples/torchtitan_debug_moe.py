"""Train torchtitan's debug MoE model with moe_comm as its token dispatcher, under torchrun.

    torchrun --nproc-per-node 2 examples/torchtitan_debug_moe.py                  # 2 CPU ranks or 2 GPUs
    torchrun --nproc-per-node 2 examples/torchtitan_debug_moe.py --flavour qwen3 --steps 20

The same selection in torchtitan's own trainer (torchtitan 0.3.0 run from its repository, for the
tokenizer and data under ``tests/assets``, with a torch it supports):

    torchrun --nproc-per-node 2 -m torchtitan.train --module deepseek_v3 --config deepseek_v3_debugmodel \\
        --parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs \\
        --override.imports 'moe_comm.integrations.torchtitan.moe_comm_dispatcher={"num_max_tokens_per_rank": 16384}'

(``num_max_tokens_per_rank`` = ``training.local_batch_size * training.seq_len``, 8 x 2048 there;
``"moe_comm_config": {...}`` in the same JSON picks moe_comm's keys).

This script is the training loop of one's own: torchtitan's ``debugmodel`` of DeepSeek-V3 (or
Qwen3's ``debugmodel_moe``), its first ``--layers`` blocks, with the override applied through
torchtitan's ``apply_overrides``; ``moe_comm.integrations.torchtitan.expert_parallel`` keeps each
rank's block of experts and wires the EP mesh (what torchtitan's ``parallelize`` does in its
trainer). The experts are expert parallel, everything else data parallel: each rank trains on its
own fixed batch (the model memorises it, so the loss falls within a few steps); the replicated
weights' gradients are averaged over the ranks and the experts' divided by the world size (they
already collect every rank's tokens through combine's backward). On CPU ranks (gloo, moe_comm's
``reference`` backend) the attention is torchtitan's ``ScaledDotProductAttention``: FlexAttention
has no backward on CPU. Each rank prints ``rank r/W on <backend>: ...``; the script exits with 1 if
the loss did not fall by ``--min-drop``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.config import OverrideConfig, apply_overrides
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

from moe_comm.integrations.torchtitan import close_dispatchers, expert_parallel

OVERRIDE = "moe_comm.integrations.torchtitan.moe_comm_dispatcher"


def _model_config(flavour: str, layers: int, cpu: bool):
    if flavour == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import model_registry

        config = model_registry("debugmodel").model
    else:
        from torchtitan.models.qwen3 import model_registry

        config = model_registry("debugmodel_moe").model
    config.layers = config.layers[:layers]
    if cpu:
        for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return config


def _print_line(line: str) -> None:
    # One write per line (print writes the newline apart): the ranks share the terminal.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", choices=("deepseek_v3", "qwen3"), default="deepseek_v3")
    parser.add_argument("--layers", type=int, default=2, help="blocks of the debug model to keep (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank (default 2)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 0.003)")
    parser.add_argument("--min-drop", type=float, default=0.5, help="least fall of the loss (default 0.5)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        moe_comm_config = {"backend": "auto", "dtype": "float32"}
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        moe_comm_config = {"backend": "reference", "dtype": "float32"}
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        config = _model_config(args.flavour, args.layers, device.type == "cpu")
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"num_max_tokens_per_rank": args.batch * args.seq_len,
                                                            "moe_comm_config": moe_comm_config})]), config)
        torch.manual_seed(0)  # the same weights on every rank
        model = config.build()
        model.init_states()
        model.to(device)
        routed = expert_parallel(model, init_device_mesh(device.type, (world,)))
        backend = routed[0].token_dispatcher.dispatcher.backend_name
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len + 1),
                            generator=torch.Generator().manual_seed(rank)).to(device)
        losses = []
        for step in range(args.steps):
            logits = model(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            for name, param in model.named_parameters():
                if name.rsplit(".", 1)[-1] in ("w1_EFD", "w2_EDF", "w3_EFD"):
                    param.grad.div_(world)
                else:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            losses.append(mean.item())
            if rank == 0:
                _print_line(f"step {step + 1:3d}/{args.steps} loss {losses[-1]:.4f}")
        fell = losses[0] - losses[-1]
        verdict = "ok" if fell >= args.min_drop else f"FAILED (less than --min-drop {args.min_drop})"
        _print_line(f"rank {rank}/{world} on {backend}: {args.flavour} debug model, {len(routed)} MoE layers with "
                    f"{routed[0].inner_experts.num_experts} experts a rank, loss {losses[0]:.3f} -> {losses[-1]:.3f}: "
                    f"{verdict}")
        return 0 if fell >= args.min_drop else 1
    finally:
        close_dispatchers()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
