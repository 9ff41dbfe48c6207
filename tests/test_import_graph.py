"""No import circle in kvspec: its static module import graph has no cycle.

The graph is read from the source with ``ast``: every ``import`` and ``from ... import``
of a kvspec module, at module level and inside functions (an import deferred into a
function still ties the two modules together), but not those under ``if TYPE_CHECKING:``,
which never run. ``from package import name`` is an edge to the submodule ``package.name``
where one exists, else to the package. Importing a submodule runs its package's
``__init__`` first, but that implicit edge is not counted: a package ``__init__`` that
re-exports its submodules is not a circle, while a submodule that imports a name back from
its package's ``__init__`` (``from . import name``, ``from kvspec.pkg import name``) is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvspec

ROOT = Path(kvspec.__file__).resolve().parent

# Circles known and owned elsewhere, each with the reason it is still here. An entry that is
# no longer a circle fails test_known_cycles_are_still_cycles: delete it then.
KNOWN_CYCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree``, outside ``if TYPE_CHECKING:`` bodies."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a kvspec module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Each kvspec module and the kvspec modules it imports (see the module docstring)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1])
                    source = f"{base}.{node.module}" if node.module else base
                else:
                    source = node.module or ""
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                    for a in node.names
                ]
            for target in targets:
                found = _known(target, modules) if target.startswith("kvspec") else None
                if found is not None and found != name:
                    edges.add(found)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert "kvspec.conformance.graphs.api" in graph
    assert "kvspec.protocols.errors" in graph["kvspec.protocols"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_in_kvspec() -> None:
    graph = import_graph()
    found = [c for c in cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    detail = [
        " <-> ".join(c) + ": " + "; ".join(
            f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c
        )
        for c in found
    ]
    assert detail == []


def test_known_cycles_are_still_cycles() -> None:
    found = {frozenset(c) for c in cycles(import_graph())}
    assert [sorted(c) for c in KNOWN_CYCLES if c not in found] == []


# Each engine is imported by its bridge alone: a module elsewhere that imported vLLM or
# SGLang would make kvspec's default install need that engine.
ENGINE_BRIDGES = {"vllm": "kvspec.vllm", "sglang": "kvspec.sglang"}


def test_only_the_engine_bridges_import_their_engine() -> None:
    bad = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        stack: list[ast.AST] = [tree]
        while stack:  # every import, TYPE_CHECKING ones too: mypy would need the engine
            node = stack.pop()
            stack.extend(ast.iter_child_nodes(node))
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                engine = target.split(".")[0]
                bridge = ENGINE_BRIDGES.get(engine)
                if bridge and name != bridge and not name.startswith(bridge + "."):
                    bad.append(f"{name} imports {target}")
    assert bad == []
