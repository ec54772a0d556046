"""The test suite's multi-rank harness: ``moe_comm.tools.spawn.run_ranks`` with failures as ``AssertionError``.

There is one implementation of spawning ranks (``moe_comm.tools.spawn``, also used by ``moe-comm run``);
this wrapper turns its ``RankFailureError`` into the ``AssertionError`` pytest reports as a test
failure, with every failed rank's traceback (or stacks, for a rank that hung) in the message.

Rank functions must be module-level functions of a test module (they are pickled by name) and
should run many scenarios per call: every spawn costs each rank a fork, a process group and
usually a CUDA context (torch is imported once, by ``moe_comm.tools.spawn``'s fork server).

GPU tests pass ``reuse=<backend id>``: their calls then run on a ``moe_comm.tools.spawn.RankPool``
kept across tests while the (reuse key, world size, process-group backend, gpu, env) stays the
same, so the tests of one backend and world size pay the start of NCCL or NVSHMEM once instead
of once per test. The key separates what a process cannot switch (torch picks its
symmetric-memory provider once per process). One pool lives at a time: no idle ranks hold a GPU
or keep a proxy thread busy (NVSHMEM's) under other tests, and no two NVSHMEM jobs share a GPU.
``conftest.py`` therefore runs the pooled GPU tests grouped by backend and world size; a pool is
closed when the next call's key differs and at the end of the session, and a failed call ends it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from moe_comm.errors import RankFailureError
from moe_comm.tools.spawn import RankPool
from moe_comm.tools.spawn import run_ranks as _run_ranks

__all__ = ["close_pool", "run_ranks"]

_kept: Optional[tuple[tuple, RankPool]] = None  # (key, pool): the one pool alive


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, reuse: Optional[str] = None,
              dist_backend: str = "gloo", gpu: bool = False, env: Optional[Mapping[str, str]] = None,
              timeout_s: float = 120.0, **kwargs: Any) -> list:
    """``moe_comm.tools.spawn.run_ranks`` (same arguments), or with ``reuse`` a call on a kept pool of
    ranks (``delay_rank`` is then refused); raises ``AssertionError`` if any rank failed or hung."""
    try:
        if reuse is None:
            close_pool()  # one set of ranks at a time
            return _run_ranks(fn, world_size, *args, dist_backend=dist_backend, gpu=gpu, env=env,
                              timeout_s=timeout_s, **kwargs)
        if "delay_rank" in kwargs:
            raise TypeError("run_ranks: delay_rank needs fresh ranks; it cannot be combined with reuse")
        return _pool(reuse, world_size, dist_backend, gpu, env, timeout_s).run(fn, *args, timeout_s=timeout_s,
                                                                                  **kwargs)
    except RankFailureError as exc:
        raise AssertionError(str(exc)) from None


def _pool(reuse: str, world_size: int, dist_backend: str, gpu: bool, env: Optional[Mapping[str, str]],
          timeout_s: float) -> RankPool:
    """The pool of this key, started if need be once the pool of another key is closed."""
    global _kept
    key = (reuse, world_size, dist_backend, gpu, tuple(sorted((env or {}).items())))
    if _kept is not None and (_kept[0] != key or _kept[1].closed):
        close_pool()
    if _kept is None:
        _kept = key, RankPool(world_size, dist_backend=dist_backend, gpu=gpu, env=env, timeout_s=timeout_s)
    return _kept[1]


def close_pool() -> None:
    """Close the kept pool, if any; raises ``AssertionError`` naming the ranks that did not exit cleanly."""
    global _kept
    if _kept is None:
        return
    (key, pool), _kept = _kept, None
    try:
        pool.close()
    except RankFailureError as exc:
        raise AssertionError(f"the kept ranks of {key} (reuse key, world, ...) did not exit cleanly: {exc}") from None
