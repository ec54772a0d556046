"""The backend table and its builders, which backend ``auto`` picks, and the errors a backend gives when it cannot run here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import moe_comm
from moe_comm import backend_table
from moe_comm.backends import create_backend, registry, resolve_backend, resolve_backend_name
from moe_comm.backends.collective import CollectiveBackend
from multirank import run_ranks

ONE_HOST = [("node0", "boot-a"), ("node0", "boot-a")]
TWO_HOSTS = [("node0", "boot-a"), ("node1", "boot-b")]


@pytest.mark.parametrize(
    "device, hosts, expected",
    [
        (torch.device("cpu"), ONE_HOST, "reference"),      # no GPU: the CPU reference
        (torch.device("cuda", 0), ONE_HOST, "vmm"),        # one host: own VMM memory over NVLink
        (torch.device("cuda", 0), TWO_HOSTS, "nccl"),      # several hosts: NCCL's collective transport
    ],
)
def test_auto_choice(device, hosts, expected):
    assert resolve_backend_name(moe_comm.load_config(None, backend="auto"), device, hosts) == expected


def test_auto_across_hosts_takes_the_collective_transport_whatever_the_config_says():
    cfg = moe_comm.load_config(None, backend="auto", nccl={"transport": "symmetric"})
    assert resolve_backend(cfg, torch.device("cuda", 0), TWO_HOSTS).id == "nccl-collective"


def test_every_registry_entry_is_selectable_and_present():
    assert len({entry.id for entry in backend_table.ENTRIES}) == len(backend_table.ENTRIES)
    for entry in backend_table.ENTRIES:
        cfg = moe_comm.load_config(None, backend=entry.backend, **entry.config_overrides)
        assert backend_table.configured(entry.backend, cfg) is entry
        assert all(importlib.util.find_spec(name) is not None for name in entry.modules), entry.id
    assert moe_comm.config.BACKENDS == ("auto",) + backend_table.BACKEND_NAMES
    # Every entry of the table has a builder, and every builder an entry.
    assert set(registry.BUILDERS) == {entry.id for entry in backend_table.ENTRIES}


def test_an_explicit_backend_is_kept():
    cfg = moe_comm.load_config(None, backend="nvshmem")
    assert resolve_backend_name(cfg, torch.device("cpu"), TWO_HOSTS) == "nvshmem"


def _unusable_backends(rank: int, world: int) -> None:
    base = dict(num_experts=4, topk=2, hidden=8, max_tokens_per_rank=4, dtype="float32")
    # A GPU backend on a machine without CUDA says so at construction.
    for name in ("vmm", "nvshmem"):
        with pytest.raises(moe_comm.BackendError, match=f"backend '{name}' needs CUDA GPUs"):
            moe_comm.Dispatcher(moe_comm.load_config(None, backend=name, **base))
    cfg = moe_comm.load_config(None, backend="nccl", nccl={"transport": "collective"}, **base)
    # On CPU tensors the collective transport would run over gloo: that is 'reference', so say so.
    with pytest.raises(moe_comm.BackendError, match="backend 'nccl' needs CUDA GPUs.*use 'reference' on CPU"):
        moe_comm.Dispatcher(cfg)
    # The collective transport on CUDA tensors needs an NCCL group; this one is gloo.
    with pytest.raises(moe_comm.BackendError, match="needs a process group with nccl"):
        CollectiveBackend(cfg, None, torch.device("cuda", 0), "nccl")
    put = moe_comm.load_config(None, backend="nvshmem", nvshmem={"transport": "put"}, **base)
    with pytest.raises(moe_comm.BackendError, match="backend 'nvshmem' needs CUDA GPUs"):
        create_backend("nvshmem", put, None, torch.device("cpu"))


def test_unusable_backends_fail_at_construction():
    if torch.cuda.is_available():
        pytest.skip("checks the errors of a machine without CUDA")
    run_ranks(_unusable_backends, 1)
