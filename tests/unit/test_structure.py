"""The package's shape, read from its source: sizes, private names, import cycles and layers.

These are the rules of docs/architecture.md, checked on every run so that the next change keeps them:
no class over 400 lines and no function over 60; no private name imported from another module; no import
cycle between modules (imports inside functions and ``TYPE_CHECKING`` blocks count); the layers below the
composition root import nothing from ``spotguard.config``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import spotguard

PACKAGE = Path(spotguard.__file__).parent
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
# Layers that take plain settings objects: the composition root (config, cli) sits above them.
BELOW_CONFIG = ("spotguard.storage", "spotguard.providers", "spotguard.trainer", "spotguard.peer")


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def modules() -> list[Module]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append(Module(".".join(parts), path, ast.parse(path.read_text(), str(path))))
    return found


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: Module, known: set[str]) -> Iterator[tuple[str, str | None, int]]:
    """(module imported, name imported from it or None, line) for every import anywhere in the source."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:
                    yield submodule, None, node.lineno
                else:
                    yield target, alias.name, node.lineno


def _spans(tree: ast.AST, kinds: tuple[type, ...]) -> Iterator[tuple[str, int]]:
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            yield node.name, (node.end_lineno or node.lineno) - node.lineno + 1


def long_classes() -> list[str]:
    return [
        f"{module.name}.{name}: {lines} lines"
        for module in modules()
        for name, lines in _spans(module.tree, (ast.ClassDef,))
        if lines > MAX_CLASS_LINES
    ]


def long_functions() -> list[str]:
    return [
        f"{module.name}.{name}: {lines} lines"
        for module in modules()
        for name, lines in _spans(module.tree, (ast.FunctionDef, ast.AsyncFunctionDef))
        if lines > MAX_FUNCTION_LINES
    ]


def private_imports() -> list[str]:
    everything = modules()
    known = {module.name for module in everything}
    found = []
    for module in everything:
        for target, name, line in imports_of(module, known):
            if not target.startswith("spotguard"):
                continue
            if name is not None and name.startswith("_") and not name.startswith("__") and target != module.name:
                found.append(f"{module.name}:{line} imports {target}.{name}")
            if any(part.startswith("_") and part != "__main__" for part in target.split(".")[1:]):
                found.append(f"{module.name}:{line} imports private module {target}")
    return found


def import_graph() -> dict[str, set[str]]:
    everything = modules()
    known = {module.name for module in everything}
    graph: dict[str, set[str]] = {module.name: set() for module in everything}
    for module in everything:
        for target, _, _ in imports_of(module, known):
            # A package's __init__ is not a dependency of its own submodules' import statements of siblings.
            if target in known and target != module.name:
                graph[module.name].add(target)
    return graph


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def config_imports_below_root() -> list[str]:
    everything = modules()
    known = {module.name for module in everything}
    return [
        f"{module.name}:{line} imports {target}"
        for module in everything
        if module.name.startswith(BELOW_CONFIG)
        for target, _, line in imports_of(module, known)
        if target == "spotguard.config" or target.startswith("spotguard.config.")
    ]


def test_no_class_is_over_400_lines() -> None:
    assert long_classes() == []


def test_no_function_is_over_60_lines() -> None:
    assert long_functions() == []


def test_no_private_name_is_imported_from_another_module() -> None:
    assert private_imports() == []


def test_no_modules_import_each_other() -> None:
    assert import_cycles() == []


def test_layers_below_the_composition_root_take_plain_settings() -> None:
    assert config_imports_below_root() == []


if __name__ == "__main__":
    for title, found in (
        ("classes over 400 lines", long_classes()),
        ("functions over 60 lines", long_functions()),
        ("private imports", private_imports()),
        ("import cycles", [" <-> ".join(cycle) for cycle in import_cycles()]),
        ("config imported below the root", config_imports_below_root()),
    ):
        print(f"== {title}: {len(found)}")
        for line in found:
            print("  ", line)
