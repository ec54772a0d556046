"""Collective steps whose outcome every rank learns: each rank's result, or which ranks failed and why.

A rank that raises in a collective setup step while its peers go on to the next collective leaves
them waiting until their timeout. :func:`agree` runs the step's local part, then exchanges every
rank's result or error in one ``all_gather_object``, so every rank raises at once (the failing
rank its own error, the others an error naming it) or every rank goes on with every rank's
result.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from .errors import MoeCommError

__all__ = ["agree"]

T = TypeVar("T")


def agree(
    group: Optional[dist.ProcessGroup],
    local: Callable[[], T],
    *,
    error: type[MoeCommError],
    what: str,
    catch: tuple[type[BaseException], ...] = (Exception,),
) -> list[T]:
    """Run ``local()`` on this rank and exchange every rank's outcome (collective over ``group``).

    Args:
        group: the process group (None: the default group); every rank of it calls ``agree``.
        local: this rank's part; its result must be picklable (it crosses to every rank).
        error: the class of the error raised on the ranks where ``local`` succeeded.
        what: the step, as the start of that error's message (``"<what> failed on rank(s) ..."``).
        catch: the exceptions of ``local`` that are reported to every rank; others propagate here
            at once, before the exchange.

    Returns:
        Every rank's result of ``local()``, in rank order.

    Raises:
        The exception ``local`` raised on this rank; else ``error`` naming each rank that failed,
        with its exception's type and message, when ``local`` failed on any rank.
    """
    try:
        result, failure = local(), None
    except catch as exc:
        result, failure = None, exc
    entries: list = [None] * dist.get_world_size(group)
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    dist.all_gather_object(entries, (message, result), group=group)
    if failure is not None:
        raise failure
    failed = {rank: text for rank, (text, _) in enumerate(entries) if text is not None}
    if failed:
        raise error(
            f"{what} failed on rank(s) {list(failed)} (rank {dist.get_rank(group)} is fine):\n"
            + "\n".join(f"rank {rank}: {text}" for rank, text in failed.items())
        )
    return [result for _, result in entries]
