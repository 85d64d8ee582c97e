"""The shape of the package, read from the code (docs/architecture.md's map): no
module over 700 lines, no import circle between modules when they are imported,
and no two of trionserve's packages importing each other (an arrow that runs back
up). Each check names what breaks it."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import trionserve

PACKAGE = Path(trionserve.__file__).parent
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """Every statement under ``node``, at any depth, as ``ast.walk`` finds them:
    expressions, which hold no statement (an import is one), are not entered."""
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, ast.expr):
            yield child
            yield from _statements(child)


def _imports(path: Path, module: str, *, run_time_only: bool) -> tuple[str, ...]:
    """The modules ``module`` names in its imports (with ``from m import n``, also
    ``m.n``): at import time only (top level, outside ``if TYPE_CHECKING``), or
    anywhere (in functions and for the type checker too)."""
    return _both_imports(path, module)[0 if run_time_only else 1]


@functools.cache
def _both_imports(path: Path, module: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """:func:`_imports` at import time and anywhere, from one parse of the module
    (the tree is not kept: the checks need only the names)."""
    tree = ast.parse(path.read_text())
    return (
        tuple(_imported(tree, path, module, run_time_only=True)),
        tuple(_imported(tree, path, module, run_time_only=False)),
    )


def _imported(tree: ast.Module, path: Path, module: str, *, run_time_only: bool) -> Iterator[str]:
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]

    def names(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = node.module or ""
        if node.level:
            parent = package[: len(package) - (node.level - 1)]
            base = ".".join(parent + ([node.module] if node.module else []))
        yield base
        yield from (f"{base}.{alias.name}" for alias in node.names)

    if not run_time_only:
        for node in _statements(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield from names(node)
        return

    def top_level(body: list[ast.stmt]) -> Iterator[str]:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                yield from names(node)
            elif isinstance(node, ast.If):
                if not _is_type_checking(node.test):
                    yield from top_level(node.body)
                yield from top_level(node.orelse)
            elif isinstance(node, ast.Try):
                yield from top_level(node.body)
                for handler in node.handlers:
                    yield from top_level(handler.body)
                yield from top_level(node.orelse)
                yield from top_level(node.finalbody)

    yield from top_level(tree.body)


def _graph(*, run_time_only: bool) -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {
            imported
            for imported in _imports(path, name, run_time_only=run_time_only)
            if imported in modules and imported != name
        }
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                strong(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            strong(node)
    return found


def _package(module: str) -> str:
    """The top-level part of trionserve a module belongs to (``actors``,
    ``backends``, ``server``, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_no_module_is_over_700_lines():
    long = {
        str(path.relative_to(PACKAGE.parent)): lines
        for path in PACKAGE.rglob("*.py")
        if "_generated" not in path.parts
        and (lines := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these modules along a seam (over {MAX_LINES} lines): {long}"


def test_no_import_circle_at_run_time():
    assert _cycles(_graph(run_time_only=True)) == []


def test_no_two_packages_import_each_other():
    arrows = {
        (_package(module), _package(imported))
        for module, imports in _graph(run_time_only=False).items()
        for imported in imports
        if _package(module) != _package(imported)
    }
    both_ways = sorted((a, b) for a, b in arrows if (b, a) in arrows and a < b)
    assert both_ways == [], f"packages that import each other: {both_ways}"


def test_the_checks_see_a_circle_and_an_upward_arrow():
    """The checks can fail: a made-up graph with a circle and two packages that
    import each other is caught by both."""
    graph = {
        "trionserve.a.x": {"trionserve.a.y"},
        "trionserve.a.y": {"trionserve.a.x", "trionserve.b.z"},
        "trionserve.b.z": {"trionserve.a.x"},
    }
    assert _cycles(graph) == [["trionserve.a.x", "trionserve.a.y", "trionserve.b.z"]]
    assert _package("trionserve.b.z") == "b"
