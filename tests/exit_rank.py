"""One rank of a short two-rank run that ends as a user's script does: ``python tests/exit_rank.py RANK PORT``.

Joins a gloo group of two (rank 0 hosts the rendezvous store on PORT, as ``tcp://`` does), builds a
``reference`` Dispatcher, makes one dispatch/combine and returns, closing nothing (neither the
Dispatcher nor the process group): the interpreter then finalizes with everything alive, as at the
end of a script. The GIL switch interval is long, so that nothing but a blocking call hands the GIL
to another thread (gloo's workers among them) between the last exchange and the exit.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import moe_comm

sys.setswitchinterval(100.0)
rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
dispatcher = moe_comm.Dispatcher(moe_comm.load_config(None, backend="reference", num_experts=4, topk=2, hidden=16,
                                                      max_tokens_per_rank=8, dtype="float32"))
gen = torch.Generator().manual_seed(rank)
out = dispatcher.dispatch(torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8, 2), generator=gen),
                          torch.rand(8, 2, generator=gen))
combined = dispatcher.combine(out.x, out.handle)
