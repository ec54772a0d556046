"""Contract of moe_comm.cuda.driver: loading compiled kernels and launching them (GPU).

Every test needs a CUDA GPU and NVRTC; it skips without them.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from moe_comm.cuda import driver
from moe_comm.errors import BackendError
from toy_kernels import SHARED_SOURCE, TOY_SOURCE


@pytest.fixture
def device(requires_gpus) -> torch.device:
    """The current CUDA device; skips the test on a machine without one."""
    requires_gpus(1)
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.gpu
def test_load_and_launch(cache, device):
    fn = driver.load_function(device, "toy", "fill_value", {"VALUE": 7}, source=TOY_SOURCE)
    assert driver.load_function(device, "toy", "fill_value", {"VALUE": 7}, source=TOY_SOURCE) is fn
    x = torch.zeros(1000, device=device)
    fn.launch((x.numel() + 255) // 256, 256, [(x.data_ptr(), ctypes.c_void_p), (x.numel(), ctypes.c_int)])
    torch.cuda.synchronize(device)
    assert torch.equal(x, torch.full_like(x, 7.0))


@pytest.mark.gpu
def test_launch_from_a_fresh_thread(cache, device):
    """A thread that made no CUDA call has no current context; launching there must still work."""
    import threading

    fn = driver.load_function(device, "toy", "fill_value", {"VALUE": 9}, source=TOY_SOURCE)
    x = torch.zeros(64, device=device)
    stream = torch.cuda.current_stream(device)
    errors = []

    def body():
        try:
            fn.launch(1, 64, [(x.data_ptr(), ctypes.c_void_p), (64, ctypes.c_int)], stream=stream)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize(device)
    assert torch.equal(x, torch.full_like(x, 9.0))


@pytest.mark.gpu
def test_launch_while_another_device_is_current(cache, requires_gpus):
    """Launching device 0's kernel while the thread's current device is another one."""
    requires_gpus(2)
    device = torch.device("cuda", 0)
    fn = driver.load_function(device, "toy", "fill_value", {"VALUE": 11}, source=TOY_SOURCE)
    x = torch.zeros(64, device=device)
    with torch.cuda.device(1):
        fn.launch(1, 64, [(x.data_ptr(), ctypes.c_void_p), (64, ctypes.c_int)])
        assert torch.cuda.current_device() == 1
    torch.cuda.synchronize(device)
    assert torch.equal(x, torch.full_like(x, 11.0))


@pytest.mark.gpu
def test_dynamic_shared_memory_past_48_kib(cache, device):
    fn = driver.load_function(device, "shared", "through_shared", source=SHARED_SOURCE)
    n = 100 * 1024 // 4  # 100 KiB of floats: needs the opt-in attribute
    src = torch.arange(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    fn.launch(1, 256, [(src.data_ptr(), ctypes.c_void_p), (dst.data_ptr(), ctypes.c_void_p), (n, ctypes.c_int)],
              shared_bytes=n * 4)
    torch.cuda.synchronize(device)
    assert torch.equal(dst, src.flip(0))


@pytest.mark.gpu
def test_capture_replays_a_cached_function_and_refuses_to_compile(cache, device):
    directory, calls = cache
    fn = driver.load_function(device, "toy", "fill_value", {"VALUE": 4}, source=TOY_SOURCE)
    x = torch.zeros(256, device=device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.graph(graph, stream=stream):
        again = driver.load_function(device, "toy", "fill_value", {"VALUE": 4}, source=TOY_SOURCE)
        again.launch(1, 256, [(x.data_ptr(), ctypes.c_void_p), (256, ctypes.c_int)])
        with pytest.raises(BackendError, match="before the capture"):
            driver.load_function(device, "toy", "fill_value", {"VALUE": 5}, source=TOY_SOURCE)
    assert again is fn and calls == ["toy"]
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(x, torch.full_like(x, 4.0))


@pytest.mark.gpu
def test_unknown_entry_names_it(cache, device):
    with pytest.raises(BackendError, match="no_such_entry"):
        driver.load_function(device, "toy", "no_such_entry", {"VALUE": 1}, source=TOY_SOURCE)
