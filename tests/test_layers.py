"""The layer diagram of docs/architecture.md, checked against the imports: every module of
distlib sits in one layer, and no import points to a layer above its own.

The table below is the diagram's; a new module must be placed in it (the test says so), which
keeps the map and the tree from drifting apart.
"""

from typing import Dict, Optional

from tests.test_imports import import_graph

#: Layer of each module, by the longest matching name prefix; higher numbers sit above.
LAYERS: Dict[str, int] = {
    # 7: the tools, apart (only the command line reaches them, checked by tests/tools/test_layering.py)
    "distlib.tools": 7,
    # 6: launcher and command line
    "distlib.cli": 6, "distlib.run": 6, "distlib.launcher": 6,
    # (the elastic launcher's modules, named so that the map shows them)
    "distlib.launcher.elastic_config": 6, "distlib.launcher.rounds": 6, "distlib.launcher.rounds_store": 6,
    "distlib.launcher.elastic_agent": 6, "distlib.launcher.output": 6,
    # 5: the public API
    "distlib": 5, "distlib.distributed": 5, "distlib.collectives": 5,
    "distlib.object_collectives": 5, "distlib.debug": 5,
    # 4: process groups
    "distlib.group": 4,
    # 3: backends, their algorithms, rendezvous
    "distlib.backends": 3, "distlib.algorithms": 3, "distlib.rendezvous": 3,
    # 2: transports and stores
    "distlib.transport": 2, "distlib.store": 2,
    # 1: shared types (Work, ReduceOp, array helpers)
    "distlib.work": 1, "distlib.reduce_op": 1, "distlib.arrays": 1,
    # 0: foundation
    "distlib.errors": 0, "distlib.deadline": 0, "distlib.net": 0, "distlib.busy_poll": 0,
    "distlib.cpus": 0, "distlib.auth": 0, "distlib.tls": 0, "distlib.settings": 0, "distlib.slurm": 0,
    "distlib.refusals": 0, "distlib.exposure": 0,
}


def placed_by(module: str) -> Optional[str]:
    """The longest prefix of LAYERS that names ``module`` (the package itself names only itself)."""
    found = [p for p in LAYERS if module == p or (p != "distlib" and module.startswith(p + "."))]
    return max(found, key=len) if found else None


def layer_of(module: str) -> int:
    return LAYERS[placed_by(module)]


def upward_imports(graph) -> list:
    return sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                  for m, targets in graph.items() for t in targets
                  if layer_of(m) < layer_of(t) and not (m == "distlib.cli" and t.startswith("distlib.tools")))


def test_the_check_sees_an_upward_import():
    assert upward_imports({"distlib.store.file": {"distlib.group"}, "distlib.group": {"distlib.errors"}}) == [
        "distlib.store.file (layer 2) imports distlib.group (layer 4)"]


def test_every_module_is_placed_in_a_layer():
    assert [m for m in import_graph() if placed_by(m) is None] == [], \
        "place the new module in LAYERS and in docs/architecture.md's diagram"


def test_no_import_points_to_a_layer_above():
    assert upward_imports(import_graph()) == []
