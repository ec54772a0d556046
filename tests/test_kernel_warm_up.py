"""The GPU suite's kernel warm-up (``tests/kernel_warm_up.py``): which configs it compiles, and the
``moe-comm compile`` it runs, on the CPU (NVRTC needs no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

import kernel_warm_up
import moe_comm


def _item(configs_of=None, **params):
    """A stand-in for a collected test: its ``kernels`` marker (if any) and its parameters."""
    marker = None if configs_of is None else pytest.mark.kernels.with_args(configs_of).mark
    callspec = SimpleNamespace(params=params) if params else None
    return SimpleNamespace(get_closest_marker=lambda name: marker if name == "kernels" else None, callspec=callspec)


def _shape(backend: str, hidden: int, **overrides) -> moe_comm.Config:
    return moe_comm.load_config(None, backend=backend, num_experts=4, topk=2, hidden=hidden, max_tokens_per_rank=8,
                                **overrides)


def test_configs_follow_the_tests_in_order_once_each_and_only_where_they_run():
    calls = []

    def by_backend(backend_id, world):
        calls.append((backend_id, world))
        return [_shape("vmm" if backend_id == "vmm" else "nccl", 32 * world)]

    def fixed():
        return [_shape("vmm", 64), _shape("vmm", 32)]

    items = [_item(by_backend, backend_id="vmm", world=2, shapes="ignored"), _item(), _item(fixed),
             _item(by_backend, backend_id="nccl-symmetric", world=2), _item(by_backend, backend_id="vmm", world=2),
             _item(by_backend, backend_id="nccl-symmetric", world=4)]
    configs = kernel_warm_up.selected_configs(items, gpus=2)
    assert [(c.backend, c.hidden) for c in configs] == [("vmm", 64), ("vmm", 32), ("nccl", 64)]
    # The function gets the parameters it names, and is not asked about a test that skips for want
    # of GPUs (NCCL: a GPU per rank); vmm ranks share one GPU.
    assert calls == [("vmm", 2), ("nccl-symmetric", 2), ("vmm", 2)]
    assert [(c.backend, c.hidden) for c in kernel_warm_up.selected_configs(items, gpus=1)] == [("vmm", 64), ("vmm", 32)]
    assert kernel_warm_up.selected_configs([_item(), _item(lambda: [])], gpus=8) == []


def test_every_marked_test_in_this_session_gives_configs_that_load_back(request, tmp_path):
    marked = [item for item in request.session.items if item.get_closest_marker("kernels") is not None]
    if not marked:
        pytest.skip("no test of this session carries the kernels marker")
    configs = kernel_warm_up.selected_configs(marked, gpus=8)
    assert configs
    for number, config in enumerate(configs):
        path = tmp_path / f"{number}.yaml"
        path.write_text(yaml.safe_dump(config.to_dict()), encoding="utf-8")
        assert moe_comm.load_config(path) == config


def _start_on_cpu(monkeypatch, configs, arch="sm_90"):
    """``kernel_warm_up.start`` as on a GPU machine of ``arch``, for tests that name ``configs``."""
    import torch

    from moe_comm.cuda import driver

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(driver, "arch_of", lambda device: arch)
    return kernel_warm_up.start([_item(lambda: configs)])


def test_the_warm_up_compiles_every_build_into_the_cache(cache, nvrtc, monkeypatch):
    directory, _ = cache
    monkeypatch.setattr(os, "cpu_count", lambda: 4)  # two processes, a config each
    warm_up = _start_on_cpu(monkeypatch, [_shape("vmm", 32, dtype="float32"), _shape("vmm", 32, dtype="bfloat16")])
    line = warm_up.finish(timeout_s=300)
    assert not warm_up.directory.exists()  # its config files and logs
    assert line.startswith("kernel warm-up: the kernels of 2 configs compiled in "), line
    assert line.endswith(" s (2 `moe-comm compile` processes of 2 configs)"), line
    # Dispatch and combine of rows of 32 channels of each dtype, top-2, for sm_90.
    built = sorted(path.name.split("-")[:2] for path in directory.glob("*_hidden32_topk2-sm90-*.cubin"))
    assert built == [["combine", "bf16_hidden32_topk2"], ["combine", "f32_hidden32_topk2"],
                     ["dispatch", "bf16_hidden32_topk2"], ["dispatch", "f32_hidden32_topk2"]], built


def test_a_failed_warm_up_says_so_with_the_compile_output(cache, nvrtc, monkeypatch):
    warm_up = _start_on_cpu(monkeypatch, [_shape("vmm", 32)], arch="sm_70")
    line = warm_up.finish(timeout_s=300)
    assert "configs failed with status" in line and "sm_70" in line, line


def test_no_warm_up_without_cuda_or_without_marked_tests(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_warm_up.start([_item(lambda: [_shape("vmm", 32)])]) is None
    assert _start_on_cpu(monkeypatch, []) is None


def test_a_warm_up_past_its_time_is_killed(tmp_path):
    directory = tmp_path / "warm-up"
    directory.mkdir()
    log = directory / "compile0.log"
    log.write_text("")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    start = time.monotonic()
    line = kernel_warm_up.KernelWarmUp([(sleeper, log)], 3, directory).finish(timeout_s=1)
    assert line == "kernel warm-up: 1 `moe-comm compile` processes of 3 configs killed after 1 s"
    assert sleeper.returncode is not None and time.monotonic() - start < 30 and not directory.exists()
