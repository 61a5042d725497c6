"""FileStore across two real Linux NFS clients (VMs), on each kind of NFS users run:
NFSv4.2 and NFSv3 with lockd from the kernel server, NFSv4.1 from the Compose cluster's own
nfs-ganesha container (MODE=nfs). The scenario is guest/filestore_pair.py, one process per
client; this side checks what each client saw.
"""

from __future__ import annotations

import pytest

from tests.support.vm_nfs import script, side_by_side

# the first test also waits for the VM image (minutes, once per machine) and the boot
pytestmark = [pytest.mark.vms, pytest.mark.timeout(1800)]

ADDS = 20  # per side: guest/filestore_pair.py


@pytest.mark.parametrize("mount", ["nfs4.2", "nfs3", "ganesha-nfs4.1"])
def test_filestore_operations_between_two_nfs_clients(nfs_hosts, mount):
    c1, c2 = nfs_hosts.clients[:2]
    path = f"{nfs_hosts.new_dir(mount, 'pair')}/store"
    a, b = side_by_side(lambda: script(c1, "filestore_pair.py", ["a", path], 240),
                        lambda: script(c2, "filestore_pair.py", ["b", path], 240))
    where = f"on {mount} ({nfs_hosts.mounts[mount].options})"

    # add from both ends: the exact sum, and every add saw a total no other add saw
    expected = ADDS * 1 + ADDS * 1000
    assert (a["sum"], b["sum"]) == (expected, expected), f"{where}: sum a={a['sum']} b={b['sum']}, want {expected}"
    totals = a["totals"] + b["totals"]
    assert len(set(totals)) == 2 * ADDS and max(totals) == expected, \
        f"{where}: two adds returned the same total (not atomic across clients): a={a['totals']} b={b['totals']}"

    # compare_set: exactly one winner, and both see its value
    winners = [side for side in (a, b) if side["compare_set"] == side["side"]]
    assert len(winners) == 1 and a["compare_set"] == b["compare_set"], \
        f"{where}: compare_set gave a={a['compare_set']!r} b={b['compare_set']!r}: want one winner both agree on"

    # wait on c1, woken by a set on c2
    assert a["before_wait"] is False, f"{where}: 'from-b' existed before b set it"
    assert a["woken_by"] == "set by b", f"{where}: c1's wait returned with {a['woken_by']!r}"

    # delete_key from c2, seen by c1
    assert (b["delete_first"], b["delete_again"]) == (True, False), \
        f"{where}: delete_key answered {b['delete_first']}, then {b['delete_again']} (want True, then False)"
    assert a["after_delete"] is False, f"{where}: c1 still sees the key c2 deleted"

    # num_keys: refcount/ and the 13 user keys live at the end (from-b was deleted)
    assert a["keys"] == b["keys"], f"{where}: the clients list different keys: {a['keys']} vs {b['keys']}"
    assert (a["num_keys"], b["num_keys"]) == (14, 14), \
        f"{where}: num_keys a={a['num_keys']} b={b['num_keys']}, want 14: {a['keys']}"
