#!/bin/sh
# Boot of a distlib test VM, after /sbin/distlib-vm-init (baked into the image) mounted the file
# systems and the host's read-only share at /opt/src. It runs from the share, so changing it
# needs no image rebuild. Then the agent (agent.py) takes over as PID 1: the host runs
# everything else through it.
#
# Kernel command line (tests/support/vm.py writes it):
#   distlib.name=NAME            the host name
#   distlib.lan=ADDR/PREFIX      the address on the VMs' LAN (the NIC whose MAC starts 52:54:00:4c)
#   distlib.hosts=N1=A1,N2=A2    /etc/hosts entries for the other VMs
# The NIC on QEMU's user network (MAC 52:54:00:00:...) gets 10.0.2.15/24 and NO default route:
# the only address there is the host's loopback (10.0.2.2); nothing else can be addressed.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

arg() { # the value of distlib.$1= on the kernel command line
    tr ' ' '\n' </proc/cmdline | while read -r w; do
        case "$w" in "distlib.$1="*) printf '%s\n' "${w#*=}" ;; esac
    done | head -n 1
}
nic_with_mac() { # the interface whose MAC starts with $1
    for d in /sys/class/net/*; do
        case "$(cat "$d/address")" in "$1"*) basename "$d"; return ;; esac
    done
}

name="$(arg name)"
hostname "${name:-vm}"
printf '%s\n' "${name:-vm}" >/etc/hostname
{
    printf '127.0.0.1 localhost\n'
    for pair in $(arg hosts | tr ',' ' '); do printf '%s %s\n' "${pair#*=}" "${pair%%=*}"; done
} >/etc/hosts

modprobe virtio_net
modprobe virtio_rng 2>/dev/null
ip link set lo up
user_nic="$(nic_with_mac 52:54:00:00:)"
if [ -n "$user_nic" ]; then
    ip addr add 10.0.2.15/24 dev "$user_nic"
    ip link set "$user_nic" up
fi
lan="$(arg lan)"
lan_nic="$(nic_with_mac 52:54:00:4c:)"
if [ -n "$lan" ] && [ -n "$lan_nic" ]; then
    ip addr add "$lan" dev "$lan_nic"
    ip link set "$lan_nic" up
fi
# Python's bytecode of the working tree: a writable share (tag "pyc") kept on the host between
# boots, so only the first VM of a change compiles it (pyc files carry their source's mtime)
mkdir -p /var/cache/distlib-pyc
mount -t 9p -o trans=virtio,version=9p2000.L pyc /var/cache/distlib-pyc 2>/dev/null || true
echo "distlib-vm: $name up in $(cut -d' ' -f1 /proc/uptime) s (user nic ${user_nic:-none}, lan ${lan:-none} on ${lan_nic:-none})"
exec python3 -u /opt/src/tests/platforms/guest/agent.py
