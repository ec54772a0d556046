"""One dispatch -> experts -> combine step under torchrun, on GPUs or CPU ranks.

    torchrun --nproc-per-node 8 examples/torchrun_step.py                     # one node, one rank per GPU
    torchrun --nproc-per-node 2 examples/torchrun_step.py                     # CPU-only host: 2 gloo ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        examples/torchrun_step.py --config configs/multi-node-nccl.yaml       # run on every node

The process group: ``nccl`` for every GPU backend (``nccl`` collective moves the rows through
it; ``vmm``, ``nvshmem`` and ``nccl`` symmetric use it for their setup), ``gloo`` for the
``reference`` backend on CPU ranks. Each rank checks its combined output against the dense sum
``sum_k w_k * 2 * x_t`` of experts that double their rows, and exits non-zero if it differs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.tools.spawn import exit_now


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="moe_comm YAML (default: the embedded default)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per rank (at most max_tokens_per_rank)")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    if gpu:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        device = torch.device("cuda", local_rank)
        config = moe_comm.load_config(args.config)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        config = moe_comm.load_config(args.config, backend="reference")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, config.hidden, generator=generator).to(device, config.torch_dtype)
    topk_idx = torch.randint(0, config.num_experts, (args.tokens, config.topk), generator=generator).to(device)
    topk_weights = torch.rand(args.tokens, config.topk, generator=generator).to(device)

    with moe_comm.Dispatcher(config) as dispatcher:
        out = dispatcher.dispatch(x, topk_idx, topk_weights)
        y = out.x * 2  # the experts: each doubles its rows
        z = dispatcher.combine(y, out.handle)
        dispatcher.check()
    expected = (topk_weights.sum(dim=1, keepdim=True) * 2 * x.float()).to(config.torch_dtype)
    ok = torch.allclose(z.float(), expected.float(), rtol=2e-2, atol=2e-2)
    error = (z.float() - expected.float()).abs().max().item()
    # One write per line: ranks share the terminal, and print's separate newline can interleave.
    sys.stdout.write(f"rank {rank}/{dist.get_world_size()} on {dispatcher.backend_name}: "
                     f"{'ok' if ok else 'WRONG'} (max error {error:.2e})\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # not sys.exit: torch's threads can abort C++'s static destructors
