"""No module reads another package's private fields (issue 35): what a package keeps behind a
leading underscore is its own, so a reader may change it without looking elsewhere.

Packages: each subpackage of distlib (distlib.store, distlib.backends, distlib.launcher, ...)
with everything below it, and the top-level modules of distlib together (the public API layer).
A module breaks the rule when it imports a private name from another package's module, or reads
an attribute ``x._name`` (``x`` not ``self`` or ``cls``) where ``_name`` is defined (assigned,
or a function or class of that name) only in other packages: the private field of an object
another package made. Dunder names are not private.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parent.parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_of(module: str) -> str:
    """distlib.store.tcp.client -> distlib.store; distlib.collectives -> distlib."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[1] in SUBPACKAGES else parts[0]


SUBPACKAGES = {p.name for p in (ROOT / "distlib").iterdir() if (p / "__init__.py").exists()}


def modules() -> Dict[str, ast.Module]:
    found = {}
    for path in sorted((ROOT / "distlib").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return found


def crossings(trees: Dict[str, ast.Module], package_modules: Set[str]) -> List[str]:
    """Every crossing in ``trees`` (module -> its AST); ``package_modules``: the modules that
    are a package's __init__ (their relative imports start from themselves)."""
    defined: Dict[str, Set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for node in ast.walk(tree):
            names: List[str] = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            for name in names:
                if _private(name):
                    defined[name].add(package_of(module))
    found: List[str] = []
    for module, tree in trees.items():
        own = package_of(module)
        base = module.split(".") if module in package_modules else module.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    source = ".".join(base[:len(base) - node.level + 1] + ([source] if source else []))
                if source.split(".")[0] != "distlib" or package_of(source) == own:
                    continue
                found += [f"{module}:{node.lineno} imports {a.name} from {source}" for a in node.names
                          if _private(a.name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                owners = defined.get(node.attr, set())
                if owners and own not in owners:
                    found.append(f"{module}:{node.lineno} reads .{node.attr} (private to {', '.join(sorted(owners))})")
    return found


def _scan(sources: Dict[str, Tuple[str, bool]]) -> List[str]:
    """``sources``: module -> (code, is a package's __init__)."""
    return crossings({m: ast.parse(code) for m, (code, _) in sources.items()},
                     {m for m, (_, is_package) in sources.items() if is_package})


def test_the_scan_sees_a_private_field_read_and_a_private_import_across_packages():
    sources = {
        "distlib.store.file": ("class F:\n    def __init__(self):\n        self._fd = 1\n"
                               "def _helper():\n    pass\n", False),
        "distlib.store.hash": ("from .file import _helper\ndef g(f):\n    return f._fd\n", False),
        "distlib.launcher.agent": ("from ..store.file import _helper\ndef h(f):\n    return f._fd, f.__dict__\n",
                                   False),
    }
    assert _scan(sources) == ["distlib.launcher.agent:1 imports _helper from distlib.store.file",
                              "distlib.launcher.agent:3 reads ._fd (private to distlib.store)"]


def test_no_module_reads_another_packages_private_fields():
    trees = modules()
    packages = {m for m in trees if (ROOT / Path(*m.split(".")) / "__init__.py").exists()}
    assert crossings(trees, packages) == [], "make what another package needs public (and say why), or move it"
