"""A successful run never aborts at exit, whether or not it closes anything (contract: lifetime).

Short two-rank runs of fresh interpreters (``tests/exit_rank.py``) that end right after their last
combine without closing the Dispatcher or the process group. Before the reference backend waited
for gloo's worker to drop each exchange, the worker could still be waiting for the GIL when the
interpreter finalized, and the rank aborted ("terminate called without an active exception",
SIGABRT): about one run in two with this script's long GIL switch interval, 4 of ~150 in issue 58.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import moe_comm

SCRIPT = Path(__file__).resolve().parent / "exit_rank.py"
# As many as fit in ~20 s on 2 cores (each run starts two interpreters that import torch).
RUNS = 5
_PACKAGE_PARENT = str(Path(moe_comm.__file__).resolve().parent.parent)


def test_short_runs_that_close_nothing_exit_cleanly():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_PACKAGE_PARENT, os.environ.get("PYTHONPATH")])))
    for run in range(RUNS):
        # Rank 0 hosts the store (the abort needs it: with the store elsewhere it was not seen), on a port
        # that was free a moment ago.
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        ranks = [subprocess.Popen([sys.executable, str(SCRIPT), str(rank), str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
        for rank, process in enumerate(ranks):
            try:
                _, err = process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                for other in ranks:
                    other.kill()
                raise AssertionError(f"run {run}: rank {rank} did not finish within 60 s") from None
            assert process.returncode == 0, f"run {run}: rank {rank} exited with {process.returncode}:\n{err[-2000:]}"
