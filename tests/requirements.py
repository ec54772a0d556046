"""The one rule for a test whose dependency is missing: skip it, except in CI, where it fails.

CI (``CI=true``, as ``.ci/run`` and most CI services set it) installs every dependency on
``REQUIRED_IN_CI`` (the ``test`` extra and ``.ci/run``), so there a missing one is a broken
install to report, not a reason to skip. Elsewhere (a developer's machine without the extras)
the test skips and says what it lacks.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

__all__ = ["REQUIRED_IN_CI", "in_ci", "missing", "require"]

# The dependencies CI installs: a name here fails its tests in CI when missing. Each is a module
# name (for ``require``) or the name a test passes to ``missing`` for a capability it probes itself.
REQUIRED_IN_CI = frozenset({
    "transformers",  # the `test` extra
    "nvrtc",  # nvidia-cuda-nvrtc, the `test` extra
    "nvshmem_headers",  # nvidia-nvshmem-cu13 and nvidia-cuda-cccl, the `nvshmem-cu13` extra
    "setuptools",  # .ci/run installs setuptools>=70.1 for the offline wheel build
    "torchtitan",  # .ci/run installs it without its training stack, as the README says
    "grouped_mm",  # torch._grouped_mm on the CPU: the torch that .ci/run pins has it
})


def in_ci() -> bool:
    """True when the environment says this is a CI run (``CI`` set to ``true`` or ``1``, any case)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def missing(dependency: str, reason: str) -> NoReturn:
    """Stop the calling test for want of ``dependency``: a failure in CI if it is on ``REQUIRED_IN_CI``, else a skip.

    Works at module level too (the skip then skips the module; the failure is a collection error).
    """
    if in_ci() and dependency in REQUIRED_IN_CI:
        pytest.fail(f"CI installs {dependency}, but it is missing here: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str) -> ModuleType:
    """Import ``module`` and return it, or stop the calling test through :func:`missing` if it cannot be imported."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(module, f"{module} cannot be imported: {exc}")
