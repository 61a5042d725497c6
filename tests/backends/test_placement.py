"""A backend never reads the launcher's or the rendezvous' variables itself: whoever creates it
gives it the process's identity (distlib/identity.py, read once by init_process_group)
(docs/architecture.md)."""

import ast
from pathlib import Path

import distlib.backends
from distlib.backends.join import local_facts
from distlib.backends.nccl.devices import choose_device
from distlib.identity import Identity

BACKENDS = Path(distlib.backends.__file__).parent
#: What a backend may read from the environment: its own transport's settings, not who or where it is.
ALLOWED = {"GLOO_SOCKET_IFNAME"}


def environment_reads(source: str) -> list:
    """(line, variable) of every os.environ / os.getenv read in ``source`` (variable: the name,
    "?" when it is not a literal, "os.environ" when the whole mapping is handed on)."""
    found, covered = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ":
            target, covered = node.slice, covered | {id(node.value)}
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
            target = node.args[0] if node.args else None
            covered |= {id(node.func), id(getattr(node.func, "value", None))}
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Identity.read"):
            found.append((node.lineno, "Identity.read"))  # reading the identity is the creator's job
            continue
        else:
            continue
        found.append((node.lineno, target.value if isinstance(target, ast.Constant) else "?"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "os.environ" and id(node) not in covered:
            found.append((node.lineno, "os.environ"))
    return found


def test_the_scan_sees_each_way_of_reading():
    sample = ('import os\nos.environ["RANK"]\nos.environ.get("LOCAL_RANK", "")\nos.getenv("GROUP_RANK")\n'
              'f(os.environ)\nIdentity.read()\n')
    names = {name for _, name in environment_reads(sample)}
    assert {"RANK", "LOCAL_RANK", "GROUP_RANK", "os.environ", "Identity.read"} <= names


def test_no_backend_reads_who_or_where_it_is_from_the_environment():
    offenders = []
    for path in sorted(BACKENDS.rglob("*.py")):
        for line, name in environment_reads(path.read_text()):
            if name not in ALLOWED:
                offenders.append(f"{path.relative_to(BACKENDS)}:{line} reads {name}")
    assert offenders == [], "a backend takes these from its creator (the identity it is given): " + "; ".join(offenders)


def test_the_join_record_says_what_the_identity_says_and_nothing_from_the_environment(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert "node" not in local_facts() and "local_world_size" not in local_facts()
    facts = local_facts(Identity(node_rank=1, local_world_size=2))
    assert (facts["node"], facts["local_world_size"]) == (1, 2)


def test_the_nccl_device_comes_from_the_given_identity_not_the_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert choose_device(None, None, Identity(), 0, 4) == (0, "the current cupy device")
    assert choose_device(None, None, Identity(local_rank=1), 0, 4) == (1, "LOCAL_RANK=1 of 4 visible device(s)")


def test_a_group_gets_the_identity_init_read(tmp_path, monkeypatch):
    """init_process_group reads the identity once and hands it to the default group's backend
    and to a new group's (GROUP_RANK and LOCAL_WORLD_SIZE in the join record)."""
    import json

    import distlib as dist

    monkeypatch.setenv("GROUP_RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        records = [json.loads(store.get(key)) for key in ("0//cpu//join/0", "1//cpu//join/0")
                   if store.check([key])]
        dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()
    assert len(records) == 2 and all((r["node"], r["local_world_size"]) == (5, 1) for r in records), records
