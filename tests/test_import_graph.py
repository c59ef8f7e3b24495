"""The import graph of the ``kgp`` package has no cycle (imports inside functions and under ``TYPE_CHECKING`` included:
two modules held apart only by a type-checking import still cannot be read, tested or moved one without the other)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kgp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(name: str) -> bool:
    return (PACKAGE.parent / Path(*name.split(".")) / "__init__.py").exists()


def _exists(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def import_graph() -> dict[str, set[str]]:
    """Edges ``module -> kgp module it imports`` for every module of the package."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if _is_package(name) else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == "kgp")
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "kgp":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if _exists(sub) else target)
        edges.discard(name)
        graph[name] = {e for e in edges if _exists(e)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_kgp_import_graph_has_no_cycle():
    graph = import_graph()
    assert "kgp.models.persistence" in graph and "kgp.io" in graph["kgp.models.persistence"]
    assert "kgp.learning" in graph["kgp.plugin"]  # imported under TYPE_CHECKING only: counted
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def private_imports(root: Path) -> list[str]:
    """``file:line name`` for every ``from x import _name`` under ``root``: a module's private names stay in it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                found += [f"{path}:{node.lineno} {a.name}" for a in node.names if a.name[:1] == "_" != a.name[1:2]]
    return found


def test_no_private_name_is_imported_across_modules():
    plugins = PACKAGE.parent / "plugins"
    assert private_imports(PACKAGE) + private_imports(plugins) == []


def test_private_import_finder_finds_one(tmp_path):
    (tmp_path / "a.py").write_text("from __future__ import annotations\nfrom .b import public, _private\n")
    assert private_imports(tmp_path) == [f"{tmp_path / 'a.py'}:2 _private"]
