"""No import circles between the files of ``src/xpkernels`` and ``backends/``.

The graph is built from the source alone (``ast``; nothing is imported), one
node per ``.py`` file, one edge per ``import`` / ``from ... import`` that names
another file of the package -- at module level and inside functions alike (a
function-local import is still a dependency; hiding a circle in a function
does not break it). The rules:

- relative imports are resolved against the importing file's package;
  ``xpkernels.backends.*`` is the ``backends/`` tree;
- importing a package is importing its ``__init__.py``;
- ``from pkg import name`` where ``name`` is a submodule of ``pkg`` is an
  edge to that submodule (and not to ``pkg/__init__.py``), otherwise to
  ``pkg/__init__.py``;
- the parent packages Python initialises on the way to a submodule are not
  edges (every package's ``__init__`` would otherwise "import" all of its
  children and "be imported" by them);
- imports under ``if TYPE_CHECKING:`` are not edges: they never run, they
  exist only for the type checker;
- imports by string (``importlib.import_module``) are not edges. They are
  reserved for a lower layer loading a plug-in by name (the lazy public
  names of ``xpkernels/__init__.py``, the backend table of ``registry``,
  ``_torch_plugin``, which loads the torch layer's autograd recorders for
  ``_autograd.record``) or an upper layer loading what it builds on by
  name (``torch/_declared`` and ``cli/bench_cases``, the fronts), and must be
  documented where they happen; never to hide an edge that would close a
  circle.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Import-name prefix -> the directory holding it.
ROOTS = {"xpkernels": REPO / "src" / "xpkernels", "xpkernels.backends": REPO / "backends"}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the roots."""
    modules = {}
    for prefix, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if name in modules and modules[name] != path:
                raise AssertionError(f"{name} is both {modules[name]} and {path}")
            modules[name] = path
    return modules


MODULES = _modules()
FILES = {path: name for name, path in MODULES.items()}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module):
    """Every import node of ``tree`` that runs (so not the body of ``if TYPE_CHECKING:``)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the body is for the type checker only
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(name: str) -> str | None:
    """The package module an imported dotted name loads (the longest known prefix), or None."""
    if name != "xpkernels" and not name.startswith("xpkernels."):
        return None
    while name not in MODULES:
        name, _, _ = name.rpartition(".")
        if not name:
            return None
    return name


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom):
    """The package modules one import statement names."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _resolve(alias.name)
            if target is not None:
                yield target
        return
    if node.level:
        base = module.split(".")
        if not is_package:
            base.pop()
        if node.level > 1:
            base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        target = submodule if submodule in MODULES else _resolve(source)
        if target is not None:
            yield target


def _graph() -> dict[str, dict[str, str]]:
    """Module -> {imported module: where (``file:line: statement``)}."""
    graph: dict[str, dict[str, str]] = {}
    for path, module in FILES.items():
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        edges = graph.setdefault(module, {})
        for node in _imports(tree):
            for target in _targets(module, path.name == "__init__.py", node):
                if target not in edges:
                    where = f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"
                    edges[target] = where
    return graph


def _components(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Strongly connected components with a cycle (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def _cycle(graph: dict[str, dict[str, str]], component: list[str]) -> list[str]:
    """One shortest cycle through the component's first module, as a list of modules."""
    start, members = component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child not in members:
                continue
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(parent[chain[-1]])
                return [start, *reversed(chain[:-1]), start] if len(chain) > 1 else [start, start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def _report(graph, components) -> str:
    lines = [f"{len(components)} import circle(s) between package files:"]
    for component in components:
        files = ", ".join(str(MODULES[m].relative_to(REPO)) for m in component)
        lines.append(f"\n- {len(component)} files: {files}")
        lines.append("  for example:")
        chain = _cycle(graph, component)
        for a, b in zip(chain, chain[1:]):
            lines.append(f"    {a} -> {b}   ({graph[a][b]})")
    return "\n".join(lines)


def test_the_graph_sees_the_package():
    graph = _graph()
    assert "xpkernels" in graph and "xpkernels.backends" in graph
    assert "xpkernels._autograd" in graph
    assert "xpkernels.backends.protocol" in graph
    # relative, absolute and backends imports all resolve to edges
    assert "xpkernels.buffers" in graph["xpkernels._autograd"]
    assert "xpkernels.registry" in graph["xpkernels._checks"]
    assert "xpkernels.backends.protocol" in graph["xpkernels.registry"]
    # function-local imports are edges too, and a package import names its __init__
    assert "xpkernels.mods" in graph["xpkernels._autograd"]


def test_every_internal_import_names_a_file():
    """An import of ``xpkernels...`` the graph cannot place would hide its edge."""
    missing = []
    for path, module in FILES.items():
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                if name.startswith("xpkernels") and name not in MODULES:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert not missing, "imports naming no file:\n" + "\n".join(missing)


def test_no_import_cycles():
    graph = _graph()
    components = _components(graph)
    if components:
        pytest.fail(_report(graph, components), pytrace=False)
