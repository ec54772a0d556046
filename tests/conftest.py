"""Shared pytest setup: the harness importable from every test module, GPU skips, and the GPU
tests' order, kept ranks and kernel warm-up."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import pytest

# Test modules import the harness as ``multirank``; make that work whatever the rootdir and
# import mode, and in the spawned rank processes (they inherit sys.path).
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def pytest_collection_modifyitems(config, items):
    """Run the GPU tests parametrized by ``backend_id`` last, grouped by backend (in order of first
    appearance) and world size, each group in collection order: they run on kept ranks (``reuse``
    in ``multirank``), one pool at a time. The order is all this decides: a test whose ranks differ
    from its group's (a world size other than the ``world`` parameter's, or than ``DEFAULT_WORLD``
    for the tests without one, as all run today) only starts a pool of its own."""
    from gpu_backends import DEFAULT_WORLD

    def group(item) -> Optional[tuple[str, int]]:
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("gpu") is None or callspec is None or "backend_id" not in callspec.params:
            return None
        return callspec.params["backend_id"], callspec.params.get("world", DEFAULT_WORLD)

    groups = [group(item) for item in items]
    backends: dict[str, int] = {}
    for found in groups:
        if found is not None:
            backends.setdefault(found[0], len(backends))
    order = sorted(range(len(items)),
                   key=lambda n: (-1, 0, n) if groups[n] is None else (backends[groups[n][0]], groups[n][1], n))
    items[:] = [items[n] for n in order]


_KERNEL_WARM_UP = pytest.StashKey[object]()
_KERNEL_WARM_UP_LINE = pytest.StashKey[str]()
# Past this the warm-up is killed at the end of the session: its builds finish within a minute on
# the GPU machines, so only a hung NVRTC would keep it longer.
KERNEL_WARM_UP_TIMEOUT_S = 600


def pytest_collection_finish(session):
    """Start compiling the kernels of the selected GPU tests (``tests/kernel_warm_up.py``) in the background."""
    if session.config.option.collectonly:
        return
    import kernel_warm_up

    warm_up = kernel_warm_up.start(session.items)
    if warm_up is not None:
        session.config.stash[_KERNEL_WARM_UP] = warm_up


def pytest_sessionfinish(session, exitstatus):
    """Wait for the kernel warm-up, or stop it if the session was interrupted (the terminal summary
    says how it went)."""
    warm_up = session.config.stash.get(_KERNEL_WARM_UP, None)
    if warm_up is not None:
        timeout_s = 0 if exitstatus == pytest.ExitCode.INTERRUPTED else KERNEL_WARM_UP_TIMEOUT_S
        session.config.stash[_KERNEL_WARM_UP_LINE] = warm_up.finish(timeout_s)


def pytest_terminal_summary(terminalreporter, config):
    line = config.stash.get(_KERNEL_WARM_UP_LINE, None)
    if line is not None:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _kept_ranks():
    """Close the kept rank pool at the end of the session (an error there if a rank does not exit cleanly)."""
    yield
    import multirank

    multirank.close_pool()


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# The one way a test skips for want of GPUs. A fixture rather than a marker or skipif: several
# tests learn how many GPUs they need only from their parameters (a backend that can share a GPU
# needs one, the others one per rank), and they need the count present to choose how to spawn.
@pytest.fixture
def requires_gpus():
    """``requires_gpus(n)`` skips the calling test unless this machine has at least ``n`` CUDA GPUs;
    returns the number present.

    GPU tests also carry ``@pytest.mark.gpu`` so ``pytest -m gpu`` selects them.
    """

    def require(n: int) -> int:
        count = _cuda_device_count()
        if count < n:
            pytest.skip(f"needs {n} CUDA GPU(s); this machine has {count}")
        return count

    return require


@pytest.fixture
def nvrtc():
    """NVRTC's version; skips when NVRTC cannot be loaded here, and fails in CI (which installs it
    through the `test` extra)."""
    from moe_comm.cuda import jit
    from moe_comm.errors import CompileError
    from requirements import missing

    try:
        return jit.nvrtc_version()
    except CompileError as exc:
        missing("nvrtc", f"NVRTC is not available: {exc}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, and a counter of real NVRTC compilations."""
    from moe_comm.cuda import jit

    monkeypatch.setenv("MOE_COMM_CACHE_DIR", str(tmp_path))
    calls = []
    real = jit._nvrtc_compile

    def counting(name, source, headers, options):
        calls.append(name)
        return real(name, source, headers, options)

    monkeypatch.setattr(jit, "_nvrtc_compile", counting)
    return tmp_path, calls
