"""Every way of running finds the kernels and the default config (contract: packaging).

The kernel sources (``csrc/``) and the configs (``configs/``) sit at the repository's top level;
``moe_comm.assets`` finds them inside an installed wheel (mapped there as ``moe_comm/csrc`` and
``moe_comm/configs``) or beside the package (an editable install, the source tree on
``PYTHONPATH``). A copy without them imports fine and fails only when used, so each way is run.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from requirements import missing

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
        missing("setuptools", blocker)
    work = tmp_path_factory.mktemp("wheel")
    # Build from a copy so setuptools' build/ and egg-info never land in the source tree.
    source = _copy_source_tree(work / "src")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = (work / "dist").glob("moe_comm-*.whl")
    return built


def _copy_source_tree(destination: Path) -> Path:
    """What a source distribution holds: the package, the top-level csrc/ and configs/, the metadata."""
    destination.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, destination / name)
    for name in ("moe_comm", "csrc", "configs"):
        shutil.copytree(ROOT / name, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def _source_files(folder: str, pattern: str) -> set[str]:
    """``folder/pattern`` of the source tree, as the wheel names them (under ``moe_comm/``)."""
    inside = "moe_comm" if folder == "moe_comm" else f"moe_comm/{folder}"
    return {f"{inside}/{path.relative_to(ROOT / folder).as_posix()}" for path in (ROOT / folder).glob(pattern)}


_ASSET_PROBE = (
    "import moe_comm; from moe_comm.assets import asset_dir; from moe_comm.config import load_config;"
    "print(moe_comm.__file__); print(asset_dir('csrc')); print(load_config().backend);"
    "print(sorted(p.name for p in asset_dir('csrc').iterdir() if p.name.endswith('.cu')))"
)


def _probe_assets(env: dict, cwd: Path, activate: str = "") -> tuple[str, str, str, str]:
    """Run :data:`_ASSET_PROBE` in a fresh interpreter, after ``activate`` (which then runs without
    site directories); returns (package file, csrc, backend, kernels)."""
    flags = ["-S"] if activate else []
    result = subprocess.run([sys.executable, *flags, "-c", activate + _ASSET_PROBE], capture_output=True,
                            text=True, cwd=cwd, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(result.stdout.splitlines())


def _kernel_names() -> str:
    return str(sorted(path.name for path in (ROOT / "csrc").glob("*.cu")))


def test_wheel_contains_kernels_configs_and_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "moe_comm/configs/default.yaml" in names
    configs = _source_files("configs", "*.yaml")
    assert configs <= names, f"configs missing from the wheel: {sorted(configs - names)}"
    kernels = _source_files("csrc", "*.cu") | _source_files("csrc", "*.cuh")
    assert any(name.endswith(".cu") for name in kernels), "csrc/ has no .cu kernel sources"
    assert kernels <= names, f"kernels missing from the wheel: {sorted(kernels - names)}"
    # Every module of the source tree, so a new subpackage missing from pyproject's list is caught.
    modules = _source_files("moe_comm", "**/*.py")
    assert modules <= names, f"modules missing from the wheel: {sorted(modules - names)}"
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "moe-comm = moe_comm.tools.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_reads_its_resources(wheel, tmp_path):
    # Install into a bare directory and import from there only: resources must come from the wheel.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    location, csrc, backend, kernels = _probe_assets(dict(os.environ, PYTHONPATH=str(target)), tmp_path)
    assert location.startswith(str(target))
    assert csrc == str(target / "moe_comm" / "csrc")
    assert backend == "auto"
    assert kernels == _kernel_names()


def test_source_tree_on_pythonpath_reads_its_resources(tmp_path):
    # As on the GPU machines: no install, the tree on PYTHONPATH (it wins over an installed copy).
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    tree = _copy_source_tree(tmp_path / "tree")
    # Leftovers of the old layout (empty folders where csrc/ and configs/ once were inside the
    # package, as a synced copy keeps them) must not be taken for the real ones.
    (tree / "moe_comm" / "configs").mkdir()
    (tree / "moe_comm" / "csrc" / "__pycache__").mkdir(parents=True)
    location, csrc, backend, kernels = _probe_assets(dict(os.environ, PYTHONPATH=str(tree)), tmp_path)
    assert location == str(tree / "moe_comm" / "__init__.py")
    assert csrc == str(tree / "csrc")
    assert (backend, kernels) == ("auto", _kernel_names())


def test_editable_install_reads_its_resources(tmp_path):
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip(f"no source tree at {ROOT} (tests run from an installed copy)")
    blocker = _offline_build_blocker()
    if blocker:
        missing("setuptools", blocker)
    tree = _copy_source_tree(tmp_path / "tree")
    prefix = tmp_path / "prefix"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--ignore-installed", "-q",
         "--prefix", str(prefix), "-e", str(tree)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (site_dir,) = {path.parent for path in prefix.glob("lib/python*/site-packages/*.pth")}
    # The editable install's .pth files take effect in a site directory. The probe starts without
    # site directories (-S) and adds that one first: a .pth imports its finder module by a name that
    # an editable install of this environment (a developer's) would otherwise have taken already.
    # Then this environment's site directories (torch, yaml), and what the editable install added
    # (paths, import finders) goes first, so that a regular install of moe_comm (CI has one) cannot
    # shadow it. The probe runs outside every tree.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    activate = (
        "import site, sys; paths, finders = list(sys.path), list(sys.meta_path);"
        f"site.addsitedir({str(site_dir)!r});"
        "added, found = [p for p in sys.path if p not in paths], [f for f in sys.meta_path if f not in finders];"
        f"[site.addsitedir(p) for p in {site.getsitepackages()!r}];"
        "sys.path[:] = added + [p for p in sys.path if p not in added];"
        "sys.meta_path[:] = found + [f for f in sys.meta_path if f not in found];"
    )
    location, csrc, backend, kernels = _probe_assets(env, tmp_path, activate)
    assert location == str(tree / "moe_comm" / "__init__.py")
    assert csrc == str(tree / "csrc")
    assert (backend, kernels) == ("auto", _kernel_names())
