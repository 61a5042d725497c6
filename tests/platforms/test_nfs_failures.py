"""What users of a FileStore on NFS run into, on real NFS clients (VMs): a mount whose locks
are local, a host powered off in the middle of a rendezvous, the file of a crashed run, and
the NFS server restarted (a grace period) or down. Each must end in an error that names the
culprit within the timeout, never a hang; guest/store_steps.py and guest/rendezvous.py are the
guest sides, and markers on the VMs' own disks order the host's actions by their progress."""

from __future__ import annotations

import threading

import pytest

from tests.support.vm import VMError
from tests.support.vm_nfs import (GUEST_NFS, LEASE_S, in_grace, script, spawn_script, spawned_result,
                                  wait_for_marker, wait_grace_over)

# the first test also waits for the VM image (minutes, once per machine) and the boot
pytestmark = [pytest.mark.vms, pytest.mark.timeout(1800)]

LAN = {"GLOO_SOCKET_IFNAME": "eth1"}


def test_a_v3_nolock_mount_is_refused_naming_the_mount(nfs_hosts):
    mount = nfs_hosts.mounts["nfs3-nolock"]
    path = f"{mount.path}/nolock-store"
    got = script(nfs_hosts.clients[0], "store_steps.py", ["open", path], 120)
    error = got.get("error", "")
    assert error.startswith("DistStoreError: FileStore cannot safely use"), got
    for part in (path, f"mount {mount.path}", "source srv:/export", "mount option 'nolock'",
                 "Remount without 'nolock'"):
        assert part in error, f"{part!r} missing from: {error}"


def test_a_host_powered_off_mid_rendezvous_is_named_by_the_others(nfs_hosts):
    """Ranks 0 (c1) and 2 (the spare) start; rank 1 (c2) is started too but holds back before
    init_process_group. Once ranks 0 and 2 have written their join records, rank 2's host is powered off (no goodbye
    reaches anyone), and rank 1 goes. Ranks 0 and 1 must fail within their timeout, naming
    rank 2 and the address it published."""
    spare = nfs_hosts.spare()
    c1, c2 = nfs_hosts.clients[:2]
    directory = nfs_hosts.new_dir("nfs4.2", "poweroff")
    # the server keeps a powered-off client's locks until its lease runs out (up to 2 leases
    # after its last renewal); rank 1's join waits behind them, so the timeout outlasts that
    url, timeout = f"file://{directory}/store", 2 * LEASE_S + 15
    c2.sh("rm -f /tmp/go").check()
    results = {}

    def rank(vm, r, env):
        try:
            results[r] = script(vm, "rendezvous.py", [str(timeout), url, str(r), "3"], 300, env)
        except VMError as exc:  # rank 2: its VM is powered off under it
            results[r] = {"vm": vm.name, "lost": str(exc)}

    threads = [threading.Thread(target=rank, args=(c1, 0, LAN)), threading.Thread(target=rank, args=(spare, 2, LAN)),
               threading.Thread(target=rank, args=(c2, 1, {**LAN, "RENDEZVOUS_AFTER": "/tmp/go"}))]
    for t in threads:
        t.start()
    # rank 2's record is in its own view of the file (its flock unlock wrote it to the server);
    # it cannot get further before rank 1 joins. Rank 0's record too: a rank 0 that joined only
    # after the power-off would find the dead host the file's one user, and (once its lease
    # ran out) be told the file is a crashed run's, which it then is
    store = f"{directory}/store"
    spare.sh(f"until grep -a -q 'join/2' {store} && grep -a -q 'join/0' {store}; do sleep 0.2; done 2>/dev/null",
             timeout=200).check()
    spare.power_off()
    c2.sh("touch /tmp/go").check()
    for t in threads:
        t.join()
    assert "lost" in results[2], f"rank 2's VM was powered off, yet it answered: {results[2]}"
    for r in (0, 1):
        got = results[r]
        error = got.get("error", "")
        assert error, f"rank {r} on {got['vm']} did not fail: {got}"
        assert f"ranks 2 ({spare.lan_address}:" in error, \
            f"rank {r} does not name rank 2 and its address {spare.lan_address}: {error}"
        # the server holds the powered-off host's lock until its lease ends (LEASE_S): a call
        # queued behind it waits that long in the kernel, on top of the rank's own timeout
        bound = timeout + LEASE_S + 20
        assert got["seconds"] < bound, \
            f"rank {r} took {got['seconds']:.0f} s for a {timeout} s timeout (bound {bound} s, lease {LEASE_S} s)"


def test_the_store_file_of_a_crashed_run_is_named_and_the_documented_way_out_works(nfs_hosts):
    """A run killed on c1 leaves its store file; a new run on c2 is told so, with the files to
    remove; after removing them (the way out the message gives) it joins a fresh store."""
    c1, c2 = nfs_hosts.clients[:2]
    path = f"{nfs_hosts.new_dir('ganesha-nfs4.1', 'crash')}/store"
    crashed = c1.run(["python3", "/opt/src/tests/platforms/guest/store_steps.py", "crash", path], timeout=120)
    assert crashed.rc == -9, f"the crashing run exited {crashed.rc}: {crashed.err[-1500:]}"
    got = script(c2, "store_steps.py", ["rerun", path], 240)
    first = got["first"]
    assert first.startswith("DistStoreError: FileStore: store file " + path), got
    assert "from an earlier run whose processes are gone" in first, first
    assert got["removed"] == [path, path + ".distlib-live"], got
    assert got["second"] == "joined" and got["old_keys_seen"] is False, got


def _waiting(vm, path: str, timeout_s: int):
    """Start store_steps.py's ``wait`` for the key "after" on ``vm`` (a thread) and return once
    it waits: (the thread, the dict its result will fill)."""
    vm.sh("rm -f /tmp/waiting").check()
    waiter = {}
    thread = threading.Thread(target=lambda: waiter.update(
        script(vm, "store_steps.py", ["wait", path, "after", str(timeout_s)], timeout_s + 120)))
    thread.start()
    wait_for_marker(vm, "/tmp/waiting", 200)
    return thread, waiter


def test_a_wait_spanning_an_nfs_server_restart_ends_when_the_server_is_back(nfs_hosts):
    """c1 waits for a key; the kernel server restarts (down 3 s, then a grace period of LEASE_S, 20 s);
    c2 sets the key. The wait returns the value, and while c1's calls were blocked it said so,
    naming the server."""
    c1, c2 = nfs_hosts.clients[:2]
    path = f"{nfs_hosts.new_dir('nfs4.2', 'restart')}/store"
    thread, waiter = _waiting(c1, path, 180)
    nfs_hosts.server.run(["/bin/sh", GUEST_NFS, "server-restart", "3"], timeout=120).check()
    setter = script(c2, "store_steps.py", ["set", path, "after", "180"], 300)
    thread.join()
    assert setter.get("ok"), setter
    assert waiter.get("value") == "set after the restart", waiter
    warned = [line for line in waiter["stderr"].splitlines() if line.startswith("WARNING")]
    assert any("NFS server srv:/export (mount /mnt/nfs4.2, nfs4)" in line for line in warned), \
        f"c1 never said it was waiting for the server: {waiter['stderr'][-2000:]}"


def test_a_live_user_whose_host_missed_the_grace_period_is_not_taken_for_a_dead_run(nfs_hosts):
    """c1 joins a store and waits for a key; its VM is frozen while the kernel server restarts
    and stays frozen until the grace period is over, so c1's client cannot reclaim its liveness
    lock (Linux then drops it without telling the process). c2 then joins and sets the key: it
    must join (c1 is alive, and renews its lock while it waits), not refuse the file as a
    crashed run's; and c1's wait returns the value."""
    c1, c2 = nfs_hosts.clients[:2]
    path = f"{nfs_hosts.new_dir('nfs4.2', 'lostlock')}/store"
    thread, waiter = _waiting(c1, path, 240)
    c1.freeze()
    try:
        nfs_hosts.server.run(["/bin/sh", GUEST_NFS, "server-restart", "3"], timeout=120).check()
        assert in_grace(nfs_hosts.server), "the restart began no grace period: c1 would lose nothing"
        # the grace period ends while c1 stands still (as the server says: it may run past
        # LEASE_S while the other clients reclaim, and a thawed c1 would reclaim its lock then)
        wait_grace_over(nfs_hosts.server, 4 * LEASE_S + 60)
    finally:
        c1.thaw()
    setter = script(c2, "store_steps.py", ["set", path, "after", "240"], 360)
    thread.join()
    assert setter.get("ok"), f"c2 was refused although c1 is alive and waiting: {setter}"
    assert waiter.get("value") == "set after the restart", waiter


def test_a_call_on_a_server_that_stays_down_gives_up_naming_the_server(nfs_hosts):
    """nfsd stopped for good (until the test ends): c1's set must give up after its bound (6 s
    here) with an error naming the server, not hang on the hard mount."""
    c1 = nfs_hosts.clients[0]
    path = f"{nfs_hosts.new_dir('nfs4.2', 'down')}/store"
    c1.sh("rm -f /tmp/joined /tmp/go").check()
    # in the background: once it has given up, its process cannot exit before the server is back
    # (closing a file on a hard mount waits for the server)
    label = spawn_script(c1, "store_steps.py", ["stalled", path, "6"])
    wait_for_marker(c1, "/tmp/joined", 200)
    nfs_hosts.server.sh("rpc.nfsd 0").check()
    try:
        c1.sh("touch /tmp/go").check()
        got = spawned_result(c1, label, 120)
    finally:
        nfs_hosts.server.sh("rpc.nfsd 4").check()
    error = got.get("error", "")
    assert "got no answer from the file system for 6.0s" in error, got
    assert "NFS server srv:/export (mount /mnt/nfs4.2, nfs4)" in error, error
    assert got["seconds"] < 6 + 10, f"gave up after {got['seconds']:.1f} s for a 6 s bound"
    assert "has waited" in got["stderr"] and "srv:/export" in got["stderr"], got["stderr"][-2000:]
