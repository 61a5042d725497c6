"""The import graph of the repository's three packages (the library, the deployment, the
benchmarks), read from their source with ``ast``, and the cycles in it. The layering tests
(tests/test_imports.py, tests/test_layers.py, tests/tools/test_layering.py) hold the packages
to it.

Every import statement counts: at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING`` alike, since each says the two modules know each other. An import of a
name from a package counts as an import of the package's submodule when one has that name.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[2]
#: The repository's three packages: (the package's folder, the folder its names start from).
LIBRARY = (ROOT / "distlib", ROOT)
PACKAGES = (LIBRARY, (ROOT / "deploy" / "distlib_deploy", ROOT / "deploy"),
            (ROOT / "bench" / "distlib_bench", ROOT / "bench"))


def _modules(packages=(LIBRARY,)) -> Dict[str, Path]:
    modules = {}
    for package, base in packages:
        for path in package.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph(packages=(LIBRARY,)) -> Dict[str, Set[str]]:
    """module -> the modules of ``packages`` (default: the library) it imports."""
    modules = _modules(packages)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules:
                        graph[name].add(sub)
                    elif target in modules:
                        graph[name].add(target)
        graph[name].discard(name)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found
