"""The layer diagram of docs/architecture.md, checked against the imports: every module of
distlib sits in one layer, and no import points to a layer above its own.

The table below is the diagram's; a new module must be placed in it (the test says so), which
keeps the map and the tree from drifting apart.
"""

from typing import Dict, Optional

from tests.support.import_graph import import_graph

#: Layer of each module, by the longest matching name prefix; higher numbers sit above.
LAYERS: Dict[str, int] = {
    # 7: the users' CI testing harness and its pytest plugin, on top of everything (docs/testing.md);
    # `import distlib` never loads it
    "distlib.testing": 7,
    # 6: launcher and command line (the command's scaffold, the master service as a subprocess,
    # what the nccl backend finds here)
    "distlib.cli": 6, "distlib.run": 6, "distlib.launcher": 6, "distlib.command": 6,
    "distlib.store_service": 6, "distlib.gpu_info": 6,
    # (the elastic launcher's modules, named so that the map shows them)
    "distlib.launcher.elastic_config": 6, "distlib.launcher.rounds": 6, "distlib.launcher.rounds_store": 6,
    "distlib.launcher.elastic_agent": 6, "distlib.launcher.output": 6, "distlib.launcher.outages": 6,
    # 5: the public API
    "distlib": 5, "distlib.distributed": 5, "distlib.collectives": 5,
    "distlib.object_collectives": 5, "distlib.debug": 5,
    # 4: process groups
    "distlib.group": 4,
    # 3: backends (gloo's algorithms among them), rendezvous
    "distlib.backends": 3, "distlib.backends.gloo.algorithms": 3, "distlib.rendezvous": 3,
    # 2: gloo's transport (its mesh and its shared memory) and the stores
    "distlib.backends.gloo.transport": 2, "distlib.store": 2,
    # 1: shared types (Work, ReduceOp, array helpers)
    "distlib.work": 1, "distlib.reduce_op": 1, "distlib.arrays": 1,
    # 0: foundation
    "distlib.errors": 0, "distlib.deadline": 0, "distlib.net": 0, "distlib.busy_poll": 0,
    "distlib.cpus": 0, "distlib.auth": 0, "distlib.tls": 0, "distlib.settings": 0, "distlib.slurm": 0,
    "distlib.refusals": 0, "distlib.exposure": 0, "distlib.subprocesses": 0, "distlib.identity": 0,
    "distlib.keyspace": 0, "distlib.printable": 0, "distlib.observers": 0,
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
                  if layer_of(m) < layer_of(t))


def test_the_check_sees_an_upward_import():
    assert upward_imports({"distlib.store.file": {"distlib.group"}, "distlib.group": {"distlib.errors"}}) == [
        "distlib.store.file (layer 2) imports distlib.group (layer 4)"]


def test_every_module_is_placed_in_a_layer():
    assert [m for m in import_graph() if placed_by(m) is None] == [], \
        "place the new module in LAYERS and in docs/architecture.md's diagram"


def test_no_import_points_to_a_layer_above():
    assert upward_imports(import_graph()) == []


#: gloo's transport: its modules' common prefix.
MESH = "distlib.backends.gloo.transport."
#: Inside gloo's transport/, the mesh's parts (docs/architecture.md, "The mesh"): the layer of each
#: within the transport; a module imports only transport modules of a lower one. The health of
#: the group sits below both the mesh and the shared-memory channel, which are given it.
TRANSPORT: Dict[str, int] = {
    "frames": 0, "early": 0, "address": 0, "shm": 0, "shm_wait": 0,
    "accept": 1, "matching": 1,
    "connection": 2,
    "health": 3,
    "progress": 4, "shm_channel": 4,
    "tcp": 5,
}
#: Standard modules that do I/O: the matching of receives and frames uses none (tests drive it).
SOCKETS = {"socket", "select", "selectors", "ssl"}


def transport_crossings(graph) -> list:
    """Imports between transport modules that do not point to a lower part."""
    def part(module: str) -> str:
        return module[len(MESH):]

    return sorted(f"{m} imports {t}" for m, targets in graph.items() if m.startswith(MESH)
                  for t in targets if t.startswith(MESH)
                  and TRANSPORT[part(t)] >= TRANSPORT[part(m)])


def test_the_check_sees_an_import_that_crosses_the_mesh_parts():
    assert transport_crossings({MESH + "matching": {MESH + "connection"}, MESH + "health": {MESH + "matching"}}) == [
        f"{MESH}matching imports {MESH}connection"]


def test_every_transport_module_is_placed_among_the_mesh_parts():
    modules = [m for m in import_graph() if m.startswith(MESH)]
    assert [m for m in modules if m[len(MESH):] not in TRANSPORT] == [], \
        "place the new module in TRANSPORT and in docs/architecture.md"


def test_the_mesh_parts_import_only_lower_ones():
    assert transport_crossings(import_graph()) == []


def test_the_matching_has_no_sockets():
    import ast
    from pathlib import Path

    import distlib.backends.gloo.transport.matching as matching

    tree = ast.parse(Path(matching.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported & SOCKETS == set()
