"""The package's floors: every import goes down a floor or stays on its own, and no import makes a circle.

The graph is read from the source with ``ast`` (nothing is imported), so an import inside a function
counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moe_comm

PACKAGE_DIR = Path(moe_comm.__file__).parent

# Each module's floor: the longest matching prefix decides. The package's __init__ re-exports the
# public names, the layer among them, so it stands on the layer's floor.
FLOORS = {
    # 0, the core: config, its checks and the data every floor reads.
    "moe_comm.errors": 0, "moe_comm.protocol": 0, "moe_comm.config": 0, "moe_comm.routing": 0,
    "moe_comm.fp8": 0, "moe_comm.agreement": 0, "moe_comm.private": 0, "moe_comm.assets": 0,
    "moe_comm.footprint": 0, "moe_comm.backend_table": 0,
    # 1, CUDA plumbing: NVRTC builds, the driver, the kernel launchers.
    "moe_comm.cuda": 1,
    # 2, symmetric memory and the backends (transports).
    "moe_comm.symm": 2, "moe_comm.backends": 2,
    # 3, the public API.
    "moe_comm.dispatcher": 3, "moe_comm.outputs": 3, "moe_comm.ops": 3, "moe_comm.autograd": 3,
    # 4, the MoE layer and its parts.
    "moe_comm.nn": 4, "moe_comm": 4,
    # 5, integrations with model libraries.
    "moe_comm.integrations": 5,
    # 6, the tools: the command line, bench, the rank launcher.
    "moe_comm.tools": 6, "moe_comm.__main__": 6,
}


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = ("moe_comm",) + path.relative_to(PACKAGE_DIR).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, in_type_checking: bool = False):
    """Every import statement under ``tree``, with whether it runs only for type checkers."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_type_checking
        yield from _imports(node, in_type_checking or (isinstance(node, ast.If) and _is_type_checking(node)))


def _targets(module: str, is_package: bool, node, modules) -> set[str]:
    """The package modules that ``node`` (an import statement in ``module``) imports."""
    if isinstance(node, ast.Import):
        named = [alias.name for alias in node.names]
        froms = []
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        named = [source]
        froms = [f"{source}.{alias.name}" for alias in node.names]
    targets = {name for name in froms if name in modules}
    if len(targets) < len(froms) or not froms:
        for name in named:
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules:
                targets.add(name)
    targets.discard(module)
    return targets


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every import, the imports that run): module -> the package modules it imports."""
    modules = _modules()
    every, running = {}, {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        every[module], running[module] = set(), set()
        for node, type_only in _imports(ast.parse(path.read_text())):
            targets = _targets(module, is_package, node, modules)
            every[module] |= targets
            if not type_only:
                running[module] |= targets
    return every, running


def floor_of(module: str) -> int:
    prefixes = [prefix for prefix in FLOORS if module == prefix or module.startswith(prefix + ".")]
    assert prefixes, f"{module} has no floor: add it to FLOORS in tests/test_layers.py"
    return FLOORS[max(prefixes, key=len)]


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports in ``graph`` (empty if there is none)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return []

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return []


def test_every_module_has_a_floor():
    for module in _modules():
        floor_of(module)


def test_no_import_goes_up_a_floor():
    every, _ = import_graph()
    upward = [f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
              for module, targets in sorted(every.items()) for target in sorted(targets)
              if floor_of(target) > floor_of(module)]
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    # Imports for type checkers alone never run, so they cannot make a circle at import time.
    _, running = import_graph()
    assert _cycle(running) == [], " -> ".join(_cycle(running))


def test_the_checks_see_a_circle_and_an_upward_import():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("from ..nn.layer import MoELayer\nfrom .. import protocol\n")
    modules = {"moe_comm.cuda.jit", "moe_comm.nn.layer", "moe_comm.protocol", "moe_comm"}
    targets = set().union(*(_targets("moe_comm.cuda.jit", False, node, modules) for node, _ in _imports(tree)))
    assert targets == {"moe_comm.nn.layer", "moe_comm.protocol"}
    assert floor_of("moe_comm.nn.layer") > floor_of("moe_comm.cuda.jit")
