"""``moe-comm run`` refuses, before any rank starts, a config whose ranks cannot fit in the host's (CPU)
or the device's (GPU) memory, naming the key to lower (contract: CLI)."""

from __future__ import annotations

import types

import pytest
import torch

from moe_comm import ConfigError, load_config
from moe_comm.tools import cli, job, spawn
from moe_comm.assets import asset_dir
from moe_comm.footprint import footprint, run_memory


@pytest.fixture
def no_ranks(monkeypatch):
    """Fail the test if any rank is started: the check must come first."""
    def started(*args, **kwargs):
        raise AssertionError("moe-comm run started ranks for a config that cannot fit")

    monkeypatch.setattr(spawn, "run_ranks", started)


def test_single_node_training_on_a_cpu_host_is_refused_up_front(no_ranks, monkeypatch, capsys):
    # 2 CPU ranks of the training config hold every expert's float32 reference: hundreds of GiB.
    monkeypatch.setattr(job, "_host_available_bytes", lambda: 64 * 2**30)
    training = str(asset_dir("configs") / "single-node-training.yaml")
    assert cli.main(["run", "--config", training, "--backend", "reference"]) == 2
    error = capsys.readouterr().err
    for words in ("(2 ranks x ", "of the 64.0 GiB this host has available", "lower config key 'num_experts' first",
                  "the dense reference of all 256 experts"):
        assert words in error, error


def test_the_largest_holder_names_its_key(monkeypatch):
    # Tiny experts and long slabs: the dispatcher's exchange slabs and the step's rows dominate.
    config = load_config(None, backend="reference", num_experts=4, hidden=4096, max_tokens_per_rank=65536,
                         dtype="float32")
    terms = run_memory(config, 2, "reference", ffn_hidden=8)
    assert [term.lower for term in terms][:2] == ["max_tokens_per_rank", "max_tokens_per_rank"], terms
    # The dispatcher's term is the footprint `moe-comm info --config` reports.
    assert terms[1].nbytes == 2 * footprint(config, 2, "reference").slab_bytes, terms
    monkeypatch.setattr(job, "_host_available_bytes", lambda: 2**30)
    with pytest.raises(ConfigError, match="lower config key 'max_tokens_per_rank' first"):
        job.check_fits(config, 2, "reference", 8, gpu=False)
    monkeypatch.setattr(job, "_host_available_bytes", lambda: 2 * sum(term.nbytes for term in terms))
    job.check_fits(config, 2, "reference", 8, gpu=False)


def test_a_gpu_rank_is_held_to_its_devices_memory(monkeypatch):
    config = load_config(asset_dir("configs") / "single-node-training.yaml")
    h200 = types.SimpleNamespace(total_memory=141 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    with pytest.raises(ConfigError) as info:
        job.check_fits(config, 8, "vmm", 3584, gpu=True)
    assert "of the 141.0 GiB of GPU 0" in str(info.value) and "'num_experts'" in str(info.value), str(info.value)
    # The default config fits on one H200.
    job.check_fits(load_config(None), 8, "vmm", 3584, gpu=True)
