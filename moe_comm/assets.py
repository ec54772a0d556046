"""Where the kernel sources (``csrc/``) and the YAML configs (``configs/``) are found.

The repository keeps them at its top level, beside the package (``csrc/``, ``configs/``), so a
reader finds them where the design names them. Three ways of running must all find them:

* an installed wheel: ``pyproject.toml`` maps the top-level folders into the package
  (``[tool.setuptools.package-dir]``: ``moe_comm.csrc = "csrc"``, ``moe_comm.configs = "configs"``),
  so the wheel holds ``csrc`` and ``configs``;
* an editable install and the source tree on ``PYTHONPATH`` (as on the GPU machines): the package
  has no such folders, and they are the siblings of the package directory.

:func:`asset_dir` looks inside the package first, then beside it; nothing else reads these paths.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import MoeCommError

if TYPE_CHECKING:  # importlib.abc's alias is deprecated; resources.abc is 3.11+
    from importlib.resources.abc import Traversable

__all__ = ["ASSET_DIRS", "asset_dir"]

ASSET_DIRS = ("csrc", "configs")
# A file every complete copy of each folder holds: a folder without it (an empty leftover of an
# older layout, say) is not taken.
_MARKERS = {"csrc": "common.cuh", "configs": "default.yaml"}


def asset_dir(name: str) -> Traversable:
    """The folder ``name`` (one of :data:`ASSET_DIRS`): ``moe_comm/<name>`` of an installed wheel,
    else ``<source tree>/<name>`` beside the package.

    A folder counts only with its marker file (``csrc/common.cuh``, ``configs/default.yaml``).

    Raises:
        MoeCommError: ``name`` is not an asset folder, or neither place has it (a broken install).
    """
    if name not in ASSET_DIRS:
        raise MoeCommError(f"asset folder: got {name!r}, expected one of {', '.join(ASSET_DIRS)}")
    packaged = resources.files("moe_comm").joinpath(name)
    if packaged.joinpath(_MARKERS[name]).is_file():
        return packaged
    beside = Path(__file__).resolve().parent.parent / name
    if beside.joinpath(_MARKERS[name]).is_file():
        return beside
    raise MoeCommError(
        f"moe_comm cannot find its {name}/ folder: not in the installed package ({packaged}) nor beside it "
        f"({beside}); reinstall moe_comm (pip install .) or run from a complete source tree"
    )
