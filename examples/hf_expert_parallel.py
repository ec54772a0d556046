"""A HuggingFace transformers MoE model made expert-parallel with one call, under torchrun.

    torchrun --nproc-per-node 2 examples/hf_expert_parallel.py                # CPU ranks or 2 GPUs
    torchrun --nproc-per-node 8 examples/hf_expert_parallel.py --model Qwen/Qwen3-30B-A3B

Without ``--model`` the model is a tiny random Qwen3-MoE built from its config (no download), the
same on every rank (seeded). The model is loaded on the CPU, made expert-parallel there (each
rank keeps ``num_experts / world`` experts; the others' weights are freed before anything reaches
the GPU), then moved to this rank's GPU. Each rank then runs its own prompts: one forward, whose
logits are compared with an unmodified copy of the model (``--check``, on by default for the tiny
model), and a greedy generation of ``--new-tokens`` tokens. Every rank generates exactly as many
tokens (``min_new_tokens``): each forward is a collective over the expert-parallel group.

The process group: ``nccl`` on GPUs (with the config's backend, ``auto`` = ``vmm`` on one node),
``gloo`` with the ``reference`` backend on CPU ranks. Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import transformers

from moe_comm.integrations.transformers import expert_parallel
from moe_comm.tools.spawn import exit_now


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
    return transformers.Qwen3MoeForCausalLM(config)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a transformers MoE checkpoint (default: a tiny random Qwen3-MoE)")
    parser.add_argument("--config", help="moe_comm YAML (default: the embedded default)")
    parser.add_argument("--batch", type=int, default=2, help="prompts per rank (default 2)")
    parser.add_argument("--prompt-len", type=int, default=8, help="tokens per prompt (default 8)")
    parser.add_argument("--new-tokens", type=int, default=8, help="tokens generated per prompt (default 8)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                        help="compare the logits with an unmodified copy (default: only for the tiny model)")
    args = parser.parse_args(argv)

    gpu = torch.cuda.is_available()
    if gpu:
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        dtype, options = torch.bfloat16, {}
    else:
        dist.init_process_group("gloo")
        device, dtype, options = torch.device("cpu"), torch.float32, {"backend": "reference"}
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.model is None:
        model = _tiny_model().to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    check = args.model is None if args.check is None else args.check
    unmodified = copy.deepcopy(model).to(device) if check else None

    # The longest forward is the prompts' prefill: batch x prompt_len tokens on this rank.
    expert_parallel(model, args.config, max_tokens_per_rank=args.batch * args.prompt_len, **options)
    model.to(device).eval()

    generator = torch.Generator().manual_seed(1 + rank)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len), generator=generator).to(device)
    with torch.no_grad():
        logits = model(prompts).logits
        error = (logits.float() - unmodified(prompts).logits.float()).abs().max().item() if check else None
        generated = model.generate(prompts, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                   do_sample=False, pad_token_id=0)
    model.moe_comm_dispatcher.check()
    # bf16 on GPUs: the two runs sum the experts in different orders.
    ok = error is None or error <= (1e-4 if dtype == torch.float32 else 5e-2) * logits.float().abs().max().item()
    verdict = "unchecked" if error is None else f"{'ok' if ok else 'WRONG'} (max logit error {error:.2e})"
    # One write per line: ranks share the terminal, and print's separate newline can interleave.
    sys.stdout.write(f"rank {rank}/{world} on {model.moe_comm_dispatcher.backend_name}: {verdict}; generated "
                     f"{generated.shape[1] - args.prompt_len} tokens per prompt: {generated[0, args.prompt_len:].tolist()}\n")
    # Release the dispatcher's buffers before the process group they were set up over.
    model.moe_comm_dispatcher.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))  # not sys.exit: torch's threads can abort C++'s static destructors
