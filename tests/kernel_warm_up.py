"""Compile the kernels of every selected GPU test at once, in the background, as the session starts.

On a cold kernel cache (a freshly started GPU machine) each GPU test's ranks compiled the kernels
of their configs when they reached them, so the suite waited on NVRTC test after test: about a
minute of a 2x H200 suite run, builds of NVSHMEM's put transport taking 4-14 s each. ``moe-comm
compile`` processes of every selected test's configs, started before the first test, run those
builds side by side on half the host's cores while the first tests run; the ranks then find each
build in the cache, or wait on its file lock while the warm-up compiles it.

A test names the configs its device dispatchers are built from with
``@pytest.mark.kernels.with_args(configs_of)`` (``with_args``: pytest takes a mark's lone function
argument for the function to mark): ``configs_of`` is called with the test's parameters it names
(``backend_id``, ``world``, ...) and returns a list of :class:`moe_comm.Config`. The ranks take
their configs from the same function (or from the helper it calls), so the warm-up and the test do
not drift apart. The warm-up only saves time: a build it does not cover is compiled by the test as
before, and one that fails to compile fails the test that needs it as well.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

import yaml

import moe_comm
from gpu_backends import DEFAULT_WORLD, gpus_needed

__all__ = ["KernelWarmUp", "selected_configs", "start"]


def selected_configs(items: Iterable, gpus: int) -> list[moe_comm.Config]:
    """The distinct configs of the ``kernels`` markers of ``items`` that can run on ``gpus`` GPUs,
    in the items' order (the order the tests run in, so their builds start in that order)."""
    configs: dict[moe_comm.Config, None] = {}  # an ordered set: configs are frozen, so hashable
    for item in items:
        marker = item.get_closest_marker("kernels")
        if marker is None:
            continue
        callspec = getattr(item, "callspec", None)
        params = dict(callspec.params) if callspec is not None else {}
        if "backend_id" in params and gpus_needed(params["backend_id"], params.get("world", DEFAULT_WORLD)) > gpus:
            continue  # the test skips here
        (configs_of,) = marker.args
        names = inspect.signature(configs_of).parameters
        configs.update(dict.fromkeys(configs_of(**{name: params[name] for name in names})))
    return list(configs)


class KernelWarmUp:
    """Running ``moe-comm compile`` processes of ``count`` configs in all: ``(process, log)`` pairs,
    their config files and logs in ``directory``."""

    def __init__(self, compiles: list[tuple[subprocess.Popen, Path]], count: int, directory: Path) -> None:
        self.compiles = compiles
        self.count = count
        self.directory = directory
        self.started = time.time()

    def finish(self, timeout_s: float) -> str:
        """Wait up to ``timeout_s`` for the compiles (killed past it) and remove ``directory``; one
        line that says how it went."""
        try:
            return self._wait(timeout_s)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        what = f"{len(self.compiles)} `moe-comm compile` processes of {self.count} configs"
        try:
            for process, _ in self.compiles:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for process, _ in self.compiles:
                process.kill()
                process.wait()
            return f"kernel warm-up: {what} killed after {timeout_s:.0f} s"
        for process, log in self.compiles:
            if process.returncode != 0:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                return (f"kernel warm-up: one of {what} failed with status {process.returncode} (the tests that "
                        "need its kernels fail on them too): " + " | ".join(tail))
        # A log's last line is its compile's summary: the newest one is the warm-up's end.
        seconds = max(log.stat().st_mtime for _, log in self.compiles) - self.started
        return f"kernel warm-up: the kernels of {self.count} configs compiled in {seconds:.1f} s ({what})"


def start(items: Iterable) -> Optional[KernelWarmUp]:
    """Start compiling the kernels of ``items`` (the selected tests) for this machine's GPU in
    background processes, each on its share of the configs; None without CUDA or when no selected
    test names configs.

    NOTE: several processes because the 36 builds of the 2-GPU suite took 34.5 s in one ``moe-comm
    compile`` (its builds in threads) against 13.7 s in 8 processes and 11.9 s in 16, on a 32-core
    2x H200 host. Half the cores: the other half runs the first tests meanwhile.
    """
    import torch

    from moe_comm.cuda import driver

    if not torch.cuda.is_available():
        return None
    configs = selected_configs(items, torch.cuda.device_count())
    if not configs:
        return None
    directory = Path(tempfile.mkdtemp(prefix="moe_comm-kernel-warm-up-"))
    command = [sys.executable, "-m", "moe_comm", "compile", "--arch", driver.arch_of(torch.device("cuda", 0))]
    # The package this session imports, whether installed or on the path.
    package_parent = str(Path(moe_comm.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    processes = max(1, min(len(configs), (os.cpu_count() or 2) // 2))
    compiles = []
    for number in range(processes):
        argv = list(command)
        # Every process starts with the configs of the first tests to run.
        for index in range(number, len(configs), processes):
            path = directory / f"config{index}.yaml"
            path.write_text(yaml.safe_dump(configs[index].to_dict(), sort_keys=True), encoding="utf-8")
            argv += ["--config", str(path)]
        log = directory / f"compile{number}.log"
        with open(log, "wb") as out:
            compiles.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=env), log))
    return KernelWarmUp(compiles, len(configs), directory)
