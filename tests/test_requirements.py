"""tests/requirements.py (contract: packaging, the test suite itself): a missing test dependency
skips its test on a developer's machine and fails it in CI, where the dependency is installed."""

from __future__ import annotations

import pytest

import requirements
from requirements import REQUIRED_IN_CI, missing, require

ABSENT = "moe_comm_tests_no_such_module"


def _outcome(call) -> BaseException:
    """What ``call`` stopped the test with: pytest's failure or skip exception (caught here, so a
    skip where a failure is expected fails this test instead of skipping it)."""
    try:
        call()
    except (pytest.fail.Exception, pytest.skip.Exception) as exc:
        return exc
    raise AssertionError("the call neither failed nor skipped the test")


@pytest.mark.parametrize("ci", ["true", "TRUE", "1"])
def test_in_ci_a_missing_required_module_fails_its_test(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(requirements, "REQUIRED_IN_CI", REQUIRED_IN_CI | {ABSENT})
    outcome = _outcome(lambda: require(ABSENT))
    assert isinstance(outcome, pytest.fail.Exception), repr(outcome)
    assert str(outcome).startswith(f"CI installs {ABSENT}, but it is missing here: {ABSENT} cannot be imported"), \
        str(outcome)


@pytest.mark.parametrize("ci", [None, "", "false", "0"])
def test_outside_ci_a_missing_module_skips_its_test(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(requirements, "REQUIRED_IN_CI", REQUIRED_IN_CI | {ABSENT})
    outcome = _outcome(lambda: require(ABSENT))
    assert isinstance(outcome, pytest.skip.Exception), repr(outcome)
    assert str(outcome).startswith(f"{ABSENT} cannot be imported"), str(outcome)


def test_in_ci_a_dependency_not_on_the_list_still_skips(monkeypatch):
    monkeypatch.setenv("CI", "true")
    outcome = _outcome(lambda: missing(ABSENT, "probed capability absent"))
    assert isinstance(outcome, pytest.skip.Exception) and str(outcome) == "probed capability absent", repr(outcome)


def test_a_present_module_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("json") is __import__("json")

