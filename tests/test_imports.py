"""No two modules of distlib (or of the deployment's and the benchmarks' packages) import each
other, directly or around a cycle.

Every import statement counts: at module level, inside functions (lazy imports) and under
``if TYPE_CHECKING`` alike, since each says the two modules know each other. An import of a
name from a package counts as an import of the package's submodule when one has that name.
"""

from tests.support.import_graph import PACKAGES, cycles, import_graph


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_relative_lazy_and_typing_imports():
    graph = import_graph()
    assert "distlib.store.tcp.codec" in graph["distlib.store.tcp.batch"]  # from .codec import ...
    assert "distlib.store.tcp.client" in graph["distlib.rendezvous"]  # inside a function
    assert "distlib.settings" in graph["distlib.store.tcp.server"]  # from ... import settings


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph(PACKAGES)) == []


def test_the_transport_does_not_import_the_store():
    graph = import_graph()
    for name in graph:
        if name.startswith("distlib.backends.gloo.transport"):
            assert not {m for m in graph[name] if m.startswith("distlib.store")}, name
