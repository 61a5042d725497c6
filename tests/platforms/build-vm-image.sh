#!/usr/bin/env bash
# Build (once) the Linux VM image the platform tests boot under QEMU, and the host tools that
# boot it; cached under ~/.cache/distlib/<name>, so every later run takes well under a second.
#
#   tests/platforms/build-vm-image.sh            prints the image's directory on stdout
#
# The image is Debian's own kernel and a Debian root, booted by QEMU's system emulation (TCG:
# this kind of host's /dev/kvm boots no stock kernel). The image's directory holds:
#   vmlinux      the kernel of Debian's linux-image package, decompressed (boots ~3 s faster
#                under emulation than the compressed bzImage)
#   initrd.img   a busybox initramfs that loads the virtio disk's modules, mounts root.img
#                and switches to it
#   root.img     an ext4 image of `debootstrap --variant=minbase` with VM_PACKAGES, the
#                kernel's modules for VM_MODULES (and what they need), and /sbin/distlib-vm-init,
#                which mounts the host's read-only 9p share (tag "src") at /opt/src and runs
#                tests/platforms/guest/boot.sh from it: the code under test and the guest's
#                own scripts come from the working tree, so changing them needs no rebuild
#   qemu/        qemu-system-x86_64 and its libraries (see below)
#   image.env    what was built, from what
#
# Host tools. debootstrap is installed with apt-get when missing (as docker/offline-prepare.sh
# does). QEMU and busybox are NOT installed into the host: Debian's qemu-system-x86 would
# replace a newer qemu-utils the host may have; instead apt downloads the packages the host
# lacks for them and they are unpacked into the cache (qemu runs with LD_LIBRARY_PATH).
#
# Environment:
#   VM_IMAGE_NAME   the cache's name (default nfs-vm): ~/.cache/distlib/$VM_IMAGE_NAME
#   VM_PACKAGES     Debian packages of the root, comma-separated (default: the NFS tests' set)
#   VM_MODULES      kernel modules the root gets, with their dependencies (default: NFS client
#                   and server, 9p, virtio networking)
#   DISTLIB_CACHE   default ~/.cache/distlib
#   DEBIAN_MIRROR   default: taken from the host's apt sources (docker/offline-prepare.sh)
# The cache key hashes this script and the two lists, so a changed list builds a new image;
# a directory is complete only once its image.env exists (written last, after a rename).
set -euo pipefail

log() { printf 'build-vm-image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SUITE=bookworm
NAME="${VM_IMAGE_NAME:-nfs-vm}"
PACKAGES="${VM_PACKAGES:-python3,python3-numpy,nfs-common,rpcbind,kmod,iproute2,procps,nfs-kernel-server}"
MODULES="${VM_MODULES:-nfsv4 nfsv3 nfsd 9p 9pnet_virtio virtio_net virtio_rng}"
# What the initramfs loads to reach the root disk (with their dependencies)
BOOT_MODULES="virtio_pci virtio_blk crc32c_generic ext4"
CACHE="${DISTLIB_CACHE:-$HOME/.cache/distlib}/$NAME"
export PATH="$PATH:/usr/sbin:/sbin"

key="$(printf '%s\n' "$SUITE" "$PACKAGES" "$MODULES" "$BOOT_MODULES" | cat - "${BASH_SOURCE[0]}" | sha256sum | cut -c1-12)"
IMAGE_DIR="$CACHE/image-$key"
if [ -f "$IMAGE_DIR/image.env" ]; then
    printf '%s\n' "$IMAGE_DIR"
    exit 0
fi
[ "$(id -u)" = 0 ] || die "building the VM image needs root (debootstrap, mknod): run it once as root"
command -v apt-get >/dev/null 2>&1 || die "building the VM image needs a Debian host (apt-get)"
started=$SECONDS
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9 # one build at a time; a second caller waits, then finds the image
if [ -f "$IMAGE_DIR/image.env" ]; then
    printf '%s\n' "$IMAGE_DIR"
    exit 0
fi
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
LOGS="$CACHE/logs"
mkdir -p "$LOGS"
cleanup() {
    local m
    # debootstrap leaves proc/sys mounted in the tree when it fails
    awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do umount -l "$m" || true; done
    rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

apt_quiet() { # apt-get with a log; one `apt-get update` and a retry when the lists are stale
    local logf="$LOGS/apt.log"
    if ! DEBIAN_FRONTEND=noninteractive apt-get "$@" >>"$logf" 2>&1; then
        apt-get update -qq >>"$logf" 2>&1 || true
        DEBIAN_FRONTEND=noninteractive apt-get "$@" >>"$logf" 2>&1 ||
            die "apt-get $* failed (log: $logf)"
    fi
}

# --- host tools ------------------------------------------------------------------------------------
command -v debootstrap >/dev/null 2>&1 || { log "installing debootstrap with apt-get"; apt_quiet install -y -qq debootstrap; }
command -v mkfs.ext4 >/dev/null 2>&1 || { log "installing e2fsprogs with apt-get"; apt_quiet install -y -qq e2fsprogs; }
command -v depmod >/dev/null 2>&1 || { log "installing kmod with apt-get"; apt_quiet install -y -qq kmod; }

# QEMU and busybox: the packages the host lacks for them, downloaded by apt (resolved against
# the host's own dpkg status) and unpacked into $WORK/tools; a host that has qemu-system-x86_64
# installed uses its own
mkdir -p "$WORK/debs/partial" "$WORK/tools"
if HOST_QEMU="$(command -v qemu-system-x86_64)"; then
    log "using the host's $HOST_QEMU"
else
    log "downloading qemu-system-x86 (and the libraries the host lacks for it) with apt"
    apt_quiet install --download-only --yes --no-install-recommends \
        -o Dir::Cache::archives="$WORK/debs/" -o Debug::NoLocking=1 qemu-system-x86
fi
kernel_pkg="$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')"
[ -n "$kernel_pkg" ] || { apt-get update -qq >>"$LOGS/apt.log" 2>&1 || true
    kernel_pkg="$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/ { print $2; exit }')"; }
[ -n "$kernel_pkg" ] || die "apt knows no linux-image-amd64 (log: $LOGS/apt.log)"
log "downloading $kernel_pkg and busybox-static"
(cd "$WORK/debs" && apt_quiet download "$kernel_pkg" busybox-static)
for deb in "$WORK"/debs/*.deb; do
    case "$(basename "$deb")" in
    linux-image-*) dpkg-deb -x "$deb" "$WORK/kernel" ;;
    *) dpkg-deb -x "$deb" "$WORK/tools" ;;
    esac
done
BUSYBOX="$WORK/tools/bin/busybox"
[ -x "$BUSYBOX" ] || die "busybox is not in the downloaded packages (log: $LOGS/apt.log)"
if [ -n "$HOST_QEMU" ]; then
    QEMU_BIN="$HOST_QEMU" QEMU_DATA=/usr/share/qemu QEMU_LIBS=""
else
    QEMU_BIN="$WORK/tools/usr/bin/qemu-system-x86_64"
    [ -x "$QEMU_BIN" ] || die "qemu-system-x86_64 is not in the downloaded packages (log: $LOGS/apt.log)"
    missing="$(LD_LIBRARY_PATH="$WORK/tools/usr/lib/x86_64-linux-gnu:$WORK/tools/lib/x86_64-linux-gnu" \
        ldd "$QEMU_BIN" | awk '/not found/ { print $1 }' | tr '\n' ' ')"
    [ -z "$missing" ] || die "qemu-system-x86_64 lacks libraries: $missing"
    QEMU_BIN="$IMAGE_DIR/qemu/usr/bin/qemu-system-x86_64" QEMU_DATA="$IMAGE_DIR/qemu/usr/share/qemu"
    QEMU_LIBS="$IMAGE_DIR/qemu/usr/lib/x86_64-linux-gnu:$IMAGE_DIR/qemu/lib/x86_64-linux-gnu"
fi

# --- the kernel ---------------------------------------------------------------------------------------
kver="$(basename "$(ls -d "$WORK"/kernel/lib/modules/*)")"
log "kernel $kver: decompressing vmlinuz"
python3 "$HERE/../support/vm_kernel.py" "$WORK/kernel/boot/vmlinuz-$kver" "$WORK/vmlinux"
depmod -b "$WORK/kernel" "$kver"
modules_of() { # the module files $@ need, dependencies first (paths under lib/modules/$kver)
    modprobe -a -d "$WORK/kernel" -S "$kver" --show-depends "$@" | awk '$1 == "insmod" { print $2 }' |
        sed "s|^$WORK/kernel/||" | awk '!seen[$0]++'
}

# --- the root ------------------------------------------------------------------------------------------
# debootstrap's tree is kept as a tarball keyed by the package list, so a change to anything
# else (modules, initramfs, this script's later steps) does not run debootstrap again
ROOTFS="$WORK/root"
mkdir -p "$ROOTFS"
root_tar="$CACHE/debootstrap-$(printf '%s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12).tar"
if [ -f "$root_tar" ]; then
    log "debootstrap tree from $root_tar"
    tar -C "$ROOTFS" -xf "$root_tar"
else
    mirror="$(bash "$ROOT/docker/offline-prepare.sh" --print-debian-mirror)"
    log "debootstrap --variant=minbase $SUITE with $PACKAGES (about 2 minutes; log: $LOGS/debootstrap.log)"
    DEBIAN_FRONTEND=noninteractive debootstrap --variant=minbase --components=main --include="$PACKAGES" \
        "$SUITE" "$ROOTFS" "$mirror" >"$LOGS/debootstrap.log" 2>&1 ||
        { tail -n 15 "$LOGS/debootstrap.log" >&2; die "debootstrap failed (log: $LOGS/debootstrap.log)"; }
    awk -v w="$ROOTFS/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do umount -l "$m"; done
    rm -rf "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/usr/share/doc/* \
        "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/* "$ROOTFS"/var/log/*
    rm -f "$CACHE"/debootstrap-*.tar
    tar -C "$ROOTFS" -cf "$root_tar.tmp" . && mv "$root_tar.tmp" "$root_tar"
fi
# the kernel's modules the root needs, and a module index for them
read -ra module_list <<<"$MODULES"
read -ra boot_module_list <<<"$BOOT_MODULES"
for f in $(modules_of "${module_list[@]}") lib/modules/"$kver"/modules.order lib/modules/"$kver"/modules.builtin \
    lib/modules/"$kver"/modules.builtin.modinfo; do
    mkdir -p "$ROOTFS/$(dirname "$f")"
    cp "$WORK/kernel/$f" "$ROOTFS/$f"
done
depmod -b "$ROOTFS" "$kver"
cat >"$ROOTFS/sbin/distlib-vm-init" <<'EOF'
#!/bin/sh
# PID 1 of a distlib test VM: the file systems, the host's share, then the guest's boot script
# from the working tree (tests/platforms/guest/boot.sh).
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
modprobe 9pnet_virtio && modprobe 9p
mkdir -p /opt/src
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 src /opt/src ||
    { echo "distlib-vm-init: cannot mount the 9p share 'src'"; echo o >/proc/sysrq-trigger; }
exec /bin/sh /opt/src/tests/platforms/guest/boot.sh
EOF
chmod 0755 "$ROOTFS/sbin/distlib-vm-init"
# no daemon of the root starts by itself (there is no init system); the server's exports and
# the guest's name are written at boot
rm -f "$ROOTFS/etc/hostname"
size_mb=$(( $(du -sm "$ROOTFS" | cut -f1) + 256 ))
log "mkfs.ext4 -d: root.img (${size_mb} MB, sparse)"
mkfs.ext4 -q -F -L distlib-root -d "$ROOTFS" "$WORK/root.img" "${size_mb}M" >&2

# --- the initramfs -----------------------------------------------------------------------------------------
INITRD="$WORK/initrd"
mkdir -p "$INITRD"/{bin,dev,proc,sys,newroot,mods}
cp "$BUSYBOX" "$INITRD/bin/busybox"
boot_files="$(modules_of "${boot_module_list[@]}")"
{
    printf '#!/bin/busybox sh\n'
    printf '/bin/busybox mount -t devtmpfs devtmpfs /dev\n/bin/busybox mount -t proc proc /proc\n'
    for f in $boot_files; do
        cp "$WORK/kernel/$f" "$INITRD/mods/"
        printf '/bin/busybox insmod /mods/%s 2>/dev/null\n' "$(basename "$f")"
    done
    cat <<'EOF'
i=0
while [ ! -b /dev/vda ] && [ $i -lt 200 ]; do /bin/busybox usleep 50000; i=$((i + 1)); done
/bin/busybox mount -t ext4 -o rw /dev/vda /newroot || { echo "initrd: cannot mount /dev/vda"; echo o >/proc/sysrq-trigger; }
/bin/busybox umount /proc
/bin/busybox umount /dev
exec /bin/busybox switch_root /newroot /sbin/distlib-vm-init
EOF
} >"$INITRD/init"
chmod 0755 "$INITRD/init"
(cd "$INITRD" && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null | gzip -1 >"$WORK/initrd.img")

# --- into the cache ---------------------------------------------------------------------------------------------
OUT="$WORK/out"
mkdir -p "$OUT/qemu"
mv "$WORK/vmlinux" "$WORK/initrd.img" "$WORK/root.img" "$OUT/"
rm -rf "$WORK/tools/bin" "$WORK/tools/usr/share/doc" "$WORK/tools/usr/share/man"
[ -n "$HOST_QEMU" ] || mv "$WORK/tools/"* "$OUT/qemu/"
rm -rf "$IMAGE_DIR"
mv "$OUT" "$IMAGE_DIR"
cat >"$IMAGE_DIR/image.env" <<EOF
# $NAME: built $(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - started)) s by tests/platforms/build-vm-image.sh
KERNEL_PACKAGE=$kernel_pkg
KERNEL_VERSION=$kver
SUITE=$SUITE
PACKAGES=$PACKAGES
MODULES=$MODULES
QEMU=$QEMU_BIN
QEMU_DATA=$QEMU_DATA
QEMU_LIBS=$QEMU_LIBS
BUILD_SECONDS=$((SECONDS - started))
EOF
# older images of this name go: their key is not this one
for old in "$CACHE"/image-*; do [ "$old" = "$IMAGE_DIR" ] || rm -rf "$old"; done
log "built $IMAGE_DIR in $((SECONDS - started)) s ($(du -sh --apparent-size "$IMAGE_DIR" | cut -f1) apparent)"
printf '%s\n' "$IMAGE_DIR"
