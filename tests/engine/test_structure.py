"""The engine's structure: its modules import one another one way (no cycle, counting imports made for type
hints only), and every object's attributes are created in its ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "kvbench" / "engine"
PACKAGE_ROOT = ENGINE.parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ENGINE.rglob("*.py"))}


def engine_imports(path: Path) -> set[str]:
    """Every engine module ``path`` imports anywhere in its text (``TYPE_CHECKING`` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name in MODULES and MODULES[name] != path}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        trail.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return trail[trail.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        trail.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_engine_has_no_import_cycle():
    graph = {name: engine_imports(path) for name, path in MODULES.items()}
    assert graph["kvbench.engine.cache.cache"] >= {"kvbench.engine.cache.layer"}  # the walk sees imports
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_the_cycle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


# Attributes transformers' cache-layer base creates in its own __init__.
INHERITED = {"is_initialized", "keys", "values", "device", "dtype"}


def late_attributes(path: Path) -> list[str]:
    """``Class.method: self.name`` for every attribute a method other than ``__init__`` creates."""
    late = []
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        known = set(INHERITED)
        for node in cls.body:  # class attributes and dataclass fields
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                known.add(node.target.id)
            elif isinstance(node, ast.Assign):
                known.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.FunctionDef) and node.name in ("__init__", "__post_init__"):
                known.update(self_targets(node))
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
            late += [f"{cls.name}.{method.name}: self.{name}" for name in sorted(self_targets(method) - known)]
    return late


def self_targets(function: ast.FunctionDef) -> set[str]:
    """Names assigned as ``self.name = …`` (or ``self.a, self.b = …``) in ``function``."""
    names = set()
    for node in ast.walk(function):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                    names.add(part.attr)
    return names


def test_every_engine_attribute_is_created_in_init():
    late = [entry for path in MODULES.values() for entry in late_attributes(path)]
    assert not late, late


def test_a_late_attribute_is_found(tmp_path):
    module = tmp_path / "late.py"
    module.write_text(
        "class A:\n    def __init__(self):\n        self.a = 1\n\n    def go(self):\n        self.a, self.b = 2, 3\n"
    )
    assert late_attributes(module) == ["A.go: self.b"]
