"""Checkpoints of expert-parallel transformers models on 2 gloo ranks (contract: integrations): the
model's own ``save_pretrained`` writes every expert in transformers' format, which ``from_pretrained``
of the unmodified model class loads and runs as the unmodified model; a state dict of another
rank's experts is refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import VOCAB, build_model  # noqa: E402
from moe_comm import InputError  # noqa: E402
from moe_comm.integrations.transformers import expert_parallel  # noqa: E402
from multirank import run_ranks  # noqa: E402

WORLD = 2


def _rank_round_trip(rank: int, world: int, directory: str) -> dict:
    results = {}
    # An experts-interface family and an adapted block with DBRX's flat [E * F, H] expert weights.
    for arch in ("qwen3_moe", "dbrx"):
        unmodified = build_model(arch, num_experts=8)
        model = expert_parallel(build_model(arch, num_experts=8), backend="reference")
        model.save_pretrained(f"{directory}/{arch}")
        # Every rank returns from save_pretrained once rank 0 has written: each loads the checkpoint.
        loaded = type(unmodified).from_pretrained(f"{directory}/{arch}")
        input_ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            diff = (loaded(input_ids).logits - unmodified(input_ids).logits).abs().max().item()
        same = all(torch.equal(loaded.state_dict()[key], value) for key, value in unmodified.state_dict().items())
        results[arch] = dict(diff=diff, same=same, keys=sorted(loaded.state_dict()) == sorted(unmodified.state_dict()))
        model.moe_comm_dispatcher.close()
    return results


def test_save_pretrained_writes_every_expert_and_the_unmodified_class_loads_it(tmp_path):
    for rank, results in enumerate(run_ranks(_rank_round_trip, WORLD, str(tmp_path), timeout_s=120)):
        for arch, result in results.items():
            assert result == dict(diff=0.0, same=True, keys=True), f"rank {rank} {arch}: {result}"


def _rank_foreign(rank: int, world: int) -> dict:
    model = expert_parallel(build_model("qwen3_moe"), backend="reference")
    own = model.state_dict()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, own)
    messages = {}
    try:
        model.load_state_dict(gathered[1 - rank])
    except InputError as exc:
        messages["foreign"] = str(exc)
    without_ids = {key: value for key, value in own.items() if not key.endswith("moe_comm_expert_ids")}
    try:
        model.load_state_dict(without_ids, strict=False)
    except InputError as exc:
        messages["no_ids"] = str(exc)
    model.load_state_dict(own)
    return messages


def test_a_state_dict_of_another_ranks_experts_is_refused():
    for rank, messages in enumerate(run_ranks(_rank_foreign, WORLD, timeout_s=120)):
        mine, other = ([0, 1], [2, 3]) if rank == 0 else ([2, 3], [0, 1])
        assert f"holds experts {other}, but this rank holds experts {mine}" in messages["foreign"], messages
        assert "model.layers.0.mlp.experts.moe_comm_expert_ids" in messages["foreign"], messages
        assert "comes without model.layers.0.mlp.experts.moe_comm_expert_ids" in messages["no_ids"], messages
