#!/bin/sh
# NFS roles of a distlib test VM, run by the host through the agent (tests/support/vm_nfs.py).
#
#   nfs.sh server-start LEASE_S       the kernel NFS server: /export to the LAN, NFSv4.2 and v3
#                                      (rpcbind, rpc.statd, rpc.mountd, lockd), lease and grace
#                                      periods of LEASE_S seconds (Linux's default is 90)
#   nfs.sh server-restart DOWN_S      stop every nfsd thread (the server's NFSv4 state is gone),
#                                      wait DOWN_S seconds, start again: a new grace period
#   nfs.sh client-start               rpcbind and rpc.statd (NFSv3 locks need them on clients)
#   nfs.sh mount SOURCE DIR OPTIONS   mount -t nfs, DIR created
set -eu
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

running() { pgrep -x "$1" >/dev/null 2>&1; }

rpc_daemons() {
    mkdir -p /run/rpcbind /var/lib/nfs/sm /var/lib/nfs/sm.bak
    running rpcbind || rpcbind -w
    running rpc.statd || rpc.statd --no-notify
}

set_periods() {
    echo "$1" >/proc/fs/nfsd/nfsv4leasetime
    echo "$1" >/proc/fs/nfsd/nfsv4gracetime
    echo "$1" >/proc/sys/fs/nfs/nlm_grace_period
}

case "${1:-}" in
server-start)
    modprobe nfsd
    mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd
    mkdir -p /export /var/lib/nfs/v4recovery
    chmod 1777 /export
    printf '/export 192.168.76.0/24(rw,sync,no_subtree_check,no_root_squash,insecure)\n' >/etc/exports
    rpc_daemons
    set_periods "${2:-10}"
    exportfs -ra
    running rpc.mountd || rpc.mountd
    rpc.nfsd 4
    ;;
server-restart)
    rpc.nfsd 0
    set_periods "$(cat /proc/fs/nfsd/nfsv4leasetime)"
    sleep "${2:-2}"
    rpc.nfsd 4
    ;;
client-start)
    modprobe nfsv4
    modprobe nfsv3
    rpc_daemons
    ;;
mount)
    mkdir -p "$3"
    mount -t nfs -o "$4" "$2" "$3"
    ;;
*)
    echo "usage: nfs.sh server-start LEASE_S | server-restart DOWN_S | client-start | mount SOURCE DIR OPTIONS" >&2
    exit 2
    ;;
esac
