"""``moe_comm.agreement.agree`` on 2 gloo ranks (CPU): results in rank order, failures on every rank."""

from __future__ import annotations

import pytest

from moe_comm.agreement import agree
from moe_comm.errors import BackendError, InputError
from multirank import run_ranks


def _rank_one_fails(rank: int) -> int:
    if rank == 1:
        raise InputError("rank one broke on purpose")
    return rank


def _outcomes(rank: int, world_size: int) -> list:
    results = agree(None, lambda: {"rank": rank, "square": rank * rank}, error=BackendError, what="the first step")

    with pytest.raises((InputError, BackendError)) as info:
        agree(None, lambda: _rank_one_fails(rank), error=BackendError, what="the second step")
    if rank == 1:  # its own error, unchanged
        assert type(info.value) is InputError and str(info.value) == "rank one broke on purpose"
    else:  # the caller's class, naming the failed rank and its error
        assert type(info.value) is BackendError
        assert str(info.value) == (
            "the second step failed on rank(s) [1] (rank 0 is fine):\nrank 1: InputError: rank one broke on purpose"
        )

    # An exception outside ``catch`` propagates before the exchange (here on every rank, so none waits).
    with pytest.raises(KeyError):
        agree(None, lambda: {}["missing"], error=BackendError, what="the third step", catch=(InputError,))

    # The ranks are still in step: the next exchange pairs up.
    return results + agree(None, lambda: rank + 10, error=BackendError, what="the last step")



def test_results_in_rank_order_and_failures_named_on_every_rank():
    results = run_ranks(_outcomes, 2, timeout_s=60)
    expected = [{"rank": 0, "square": 0}, {"rank": 1, "square": 1}, 10, 11]
    assert results == [expected, expected]
