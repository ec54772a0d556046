"""The built wheel ships what the installed package reads at run time (contract: packaging).

Kernels (``moe_comm/csrc``) and the embedded default config (``moe_comm/configs``) are read
with ``importlib.resources``; a wheel without them imports fine and fails only when used.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _offline_build_blocker() -> str | None:
    """Why a wheel cannot be built here without the network, or None if it can."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed (an offline build without build isolation needs it)"
    import setuptools

    major, minor = (int(part) for part in setuptools.__version__.split(".")[:2])
    # setuptools 70.1 brought bdist_wheel in; older ones need the separate `wheel` package.
    if (major, minor) < (70, 1) and importlib.util.find_spec("wheel") is None:
        return f"setuptools {setuptools.__version__} needs the `wheel` package to build a wheel offline"
    return None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    blocker = _offline_build_blocker()
    if blocker:
        pytest.skip(blocker)
    work = tmp_path_factory.mktemp("wheel")
    # Build from a copy so setuptools' build/ and egg-info never land in the source tree.
    source = work / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "moe_comm", source / "moe_comm", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (work / "dist").glob("moe_comm-*.whl")
    return built


def _source_files(pattern: str) -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in (ROOT / "moe_comm").glob(pattern)}


def test_wheel_contains_kernels_configs_and_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "moe_comm/configs/default.yaml" in names
    kernels = _source_files("csrc/*.cu") | _source_files("csrc/*.cuh")
    assert any(name.endswith(".cu") for name in kernels), "moe_comm/csrc has no .cu kernel sources"
    assert kernels <= names, f"kernels missing from the wheel: {sorted(kernels - names)}"
    # Every module of the source tree, so a new subpackage missing from pyproject's list is caught.
    modules = _source_files("**/*.py")
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "moe-comm = moe_comm.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_reads_its_resources(wheel, tmp_path):
    # Install into a bare directory and import from there only: resources must come from the wheel.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = (
        "import moe_comm, importlib.resources as r; from moe_comm.config import load_config;"
        "print(moe_comm.__file__); print(load_config().backend);"
        "print(sorted(p.name for p in r.files('moe_comm').joinpath('csrc').iterdir() if p.name.endswith('.cu')))"
    )
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    location, backend, kernels = result.stdout.splitlines()
    assert location.startswith(str(target))
    assert backend == "auto"
    assert kernels == str(sorted(Path(name).name for name in _source_files("csrc/*.cu")))
