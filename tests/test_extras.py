"""The install extras (contract: packaging): the `test` extra brings no GPU-only wheels to a CPU run,
transformers is pinned to a tested range that the installed release lies in, and CI installs the
project with the same extras as the README's test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# Wheels that only a GPU run uses: NVSHMEM and the headers its device API compiles against.
GPU_ONLY = {"nvidia-nvshmem-cu12", "nvidia-nvshmem-cu13", "nvidia-cuda-cccl", "nvidia-cuda-runtime"}


def _extras() -> dict[str, list[Requirement]]:
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(text) for text in reqs] for name, reqs in project["optional-dependencies"].items()}


def _resolved(extras: dict, name: str) -> list[Requirement]:
    """The requirements of extra ``name``, its references to this project's other extras expanded."""
    resolved = []
    for req in extras[name]:
        if req.name == "moe_comm":
            for extra in sorted(req.extras):
                resolved += _resolved(extras, extra)
        else:
            resolved.append(req)
    return resolved


def test_the_test_extra_brings_no_gpu_only_wheels():
    names = {req.name for req in _resolved(_extras(), "test")}
    assert "pytest" in names and "transformers" in names and "nvidia-cuda-nvrtc" in names, names
    assert not names & GPU_ONLY, f"the test extra pulls GPU-only wheels: {sorted(names & GPU_ONLY)}"


def test_transformers_is_pinned_to_a_tested_range_holding_the_installed_release():
    transformers = pytest.importorskip("transformers")
    (req,) = [req for req in _resolved(_extras(), "test") if req.name == "transformers"]
    uppers = [spec for spec in req.specifier if spec.operator in ("<", "<=")]
    assert uppers, f"transformers has no upper bound in the test extra: {req}"
    assert Version("5.0") in req.specifier or Version("5.0.0") in req.specifier, req
    assert Version(transformers.__version__) in req.specifier, \
        f"installed transformers {transformers.__version__} lies outside the tested range {req.specifier}"


def _installed_extras(text: str) -> set[str]:
    match = re.search(r'pip install (?:-q |-e )*"\.\[([^\]]+)\]"', text)
    assert match, "no pip install of the project with extras found"
    return set(match.group(1).split(","))


def test_ci_installs_the_extras_of_the_readmes_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^(pip install .*&& pytest)$", readme, re.MULTILINE)
    assert command, "the README has no `pip install ... && pytest` test command"
    assert _installed_extras(command.group(1)) == _installed_extras(ci), (command.group(1), ci)
