"""The config's bounds at their edges (contract: config, layer / router): the largest valid value
is accepted and does what it says, one more is refused by name. An off-by-one in a bound passes
every test that only tries values far from it."""

from __future__ import annotations

import pytest
import torch

from moe_comm import ConfigError, load_config
from moe_comm.config import RouterConfig
from moe_comm.nn.router import select_experts

EXPERTS = 16


def test_topk_may_be_every_expert_and_no_more():
    assert load_config(None, num_experts=EXPERTS, topk=EXPERTS).topk == EXPERTS
    with pytest.raises(ConfigError, match=f"'topk': got {EXPERTS + 1}, expected at most num_experts \\({EXPERTS}\\)"):
        load_config(None, num_experts=EXPERTS, topk=EXPERTS + 1)


# DeepSeek-V3's shape (groups of several experts) and groups of one expert each, where the
# group bound is the topk bound's twin.
@pytest.mark.parametrize("n_group, topk_group", [(4, 2), (8, 3), (16, 5)])
def test_group_limited_topk_may_take_every_expert_of_the_kept_groups_and_no_more(n_group, topk_group):
    router = {"n_group": n_group, "topk_group": topk_group}
    kept = topk_group * EXPERTS // n_group
    cfg = load_config(None, num_experts=EXPERTS, topk=kept, router=router)
    assert (cfg.topk, cfg.router.n_group, cfg.router.topk_group) == (kept, n_group, topk_group)
    with pytest.raises(ConfigError) as info:
        load_config(None, num_experts=EXPERTS, topk=kept + 1, router=router)
    message = str(info.value)
    assert message.startswith(f"config key 'router.topk_group': got {topk_group}, expected enough groups for topk "
                              f"({kept + 1})"), message
    assert f"hold {kept}" in message, message


@pytest.mark.parametrize("n_group, topk_group", [(4, 2), (16, 5)])
def test_at_the_group_bound_a_token_takes_exactly_the_experts_of_its_kept_groups(n_group, topk_group):
    # The edge the bound allows must also route: every expert of the kept groups, none from the others.
    router = RouterConfig(score="sigmoid", n_group=n_group, topk_group=topk_group)
    size = EXPERTS // n_group
    kept = topk_group * size
    logits = torch.randn(32, EXPERTS, generator=torch.Generator().manual_seed(5))
    out = select_experts(logits, kept, router)
    for row in out.topk_idx.tolist():
        groups = {expert // size for expert in row}
        assert len(set(row)) == kept and len(groups) == topk_group, row
        assert set(row) == {g * size + e for g in groups for e in range(size)}, row
    assert torch.isfinite(out.topk_weights).all() and (out.topk_weights > 0).all()
