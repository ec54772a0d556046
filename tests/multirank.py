"""The test suite's multi-rank harness: ``moe_comm.spawn.run_ranks`` with failures as ``AssertionError``.

There is one implementation of spawning ranks (``moe_comm.spawn``, also used by ``moe-comm run``);
this wrapper only turns its ``RankFailureError`` into the ``AssertionError`` pytest reports as a
test failure, with every failed rank's traceback (or stacks, for a rank that hung) in the message.

Rank functions must be module-level functions of a test module (they are pickled by name) and
should run many scenarios per call: every spawn costs each rank a fork, a process group and
usually a CUDA context (torch is imported once, by ``moe_comm.spawn``'s fork server).
"""

from __future__ import annotations

from typing import Any, Callable

from moe_comm.errors import RankFailureError
from moe_comm.spawn import run_ranks as _run_ranks

__all__ = ["run_ranks"]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list:
    """``moe_comm.spawn.run_ranks`` (same arguments); raises ``AssertionError`` if any rank failed or hung."""
    try:
        return _run_ranks(fn, world_size, *args, **kwargs)
    except RankFailureError as exc:
        raise AssertionError(str(exc)) from None
