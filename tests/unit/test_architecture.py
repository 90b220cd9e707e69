"""The layout shows the architecture: small modules and classes, no import circle (not even through imports
made for type checking only: a module that needs another's type takes a Protocol defined below both), the
layers' import direction (protocols -> dataplane -> registry -> runtime/optimizer; optimizer and runtime know
no web framework), and no text that points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "service"
MAX_MODULE_LINES = 520
MAX_CLASS_LINES = 330
WEB = ("fastapi", "starlette", "uvicorn", "grpc", "httpx")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SERVICE.rglob("*.py")):
        parts = path.relative_to(SERVICE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path, *, typing_too: bool = False) -> set[str]:
    """Every module this one imports (at module level or inside functions; TYPE_CHECKING blocks aside unless
    ``typing_too``)."""
    tree = ast.parse(path.read_text())
    typing_only = set() if typing_too else {
        id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
        and "TYPE_CHECKING" in ast.unparse(block.test) for node in ast.walk(block)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _internal(imported: set[str]) -> set[str]:
    targets = set()
    for name in imported:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("service"):
            targets.add(name)
    return targets


GRAPH = {name: _internal(_imports(name, path)) - {name} for name, path in MODULES.items()}
TYPED_GRAPH = {name: _internal(_imports(name, path, typing_too=True)) - {name} for name, path in MODULES.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_classes_stay_small(name: str) -> None:
    source = MODULES[name].read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{name} has {len(source.splitlines())} lines"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert size <= MAX_CLASS_LINES, f"{name}.{node.name} has {size} lines"


@pytest.mark.parametrize("graph", [GRAPH, TYPED_GRAPH], ids=["at-run-time", "with-type-checking-imports"])
def test_no_import_circle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = [*stack[stack.index(nxt):], nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if not state.get(nxt):
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if not state.get(module):
            visit(module)


def test_the_layers_import_in_one_direction() -> None:
    rules = {
        "service.optimizer": ("service.api", "service.dataplane", "service.registry", "service.runtime",
                              "service.server"),
        "service.runtime": ("service.api", "service.dataplane", "service.registry", "service.server",
                            "service.optimizer"),
        "service.registry": ("service.api", "service.dataplane", "service.server"),
        "service.dataplane": ("service.api", "service.grpc", "service.server"),
        "service.api": ("service.grpc", "service.server"),
        "service.grpc": ("service.api", "service.server"),
    }
    for name, targets in GRAPH.items():
        for layer, forbidden in rules.items():
            if name == layer or name.startswith(layer + "."):
                bad = sorted(t for t in targets if any(t == f or t.startswith(f + ".") for f in forbidden))
                assert not bad, f"{name} imports {bad}"


def test_optimizer_and_runtime_know_no_web_framework() -> None:
    for name, path in MODULES.items():
        if name.startswith(("service.optimizer", "service.runtime", "service.registry", "service.dataplane")):
            web = sorted(i for i in _imports(name, path) if i.split(".")[0] in WEB)
            assert not web, f"{name} imports {web}"


OUTSIDE = re.compile(r"\.\./shared|/work/|anchors\.md|/home/|/root/")


def test_no_text_points_outside_the_repository() -> None:
    for name, path in MODULES.items():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not OUTSIDE.search(line), f"{name}:{number}: {line.strip()}"
