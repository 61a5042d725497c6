#!/usr/bin/env bash
# Build (once) the Kubernetes 1.20 server binaries the Helm chart's real-cluster lane runs, from
# Debian's own source package, and etcd from Debian's etcd-server; cached under
# ~/.cache/distlib/kube-1.20, so every later run takes well under a second.
#
#   tests/platforms/build-kube.sh          prints the build's directory on stdout
#
# The directory holds:
#   bin/kube-apiserver bin/kube-controller-manager bin/kube-scheduler bin/kubelet
#                the four binaries of `make WHAT=...` in the source package's tree, with
#                tests/platforms/kube/*.patch applied first (see docs/cluster.md for why)
#   bin/etcd     from Debian's etcd-server package (downloaded and unpacked, not installed:
#                no service starts on the host)
#   bin/pause    the pod sandbox's process, build/pause/linux/pause.c of the same tree, static
#   build.env    what was built, from what (written last: the directory is complete once it exists)
#
# Nothing is installed into the host but rsync (the source tree's make needs it): Go comes from
# Debian's golang-1.19-go/-src packages unpacked into a scratch directory; the source package is
# fetched with a private apt configuration (a deb-src line for the host's Debian mirror, its own
# lists), so the host's apt sources stay as they are. 7-11 minutes on 2 cores (410 s alone, 654 s beside other builds).
#
# Environment:
#   DISTLIB_CACHE   default ~/.cache/distlib
#   DEBIAN_MIRROR   default: taken from the host's apt sources (docker/offline-prepare.sh)
# The cache key hashes the inputs (the package names, WHAT, FORMAT below) and the patches, so a
# changed patch builds again.
set -euo pipefail

log() { printf 'build-kube: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
SUITE=bookworm
SOURCE_PACKAGE=kubernetes
GO_PACKAGES="golang-1.19-go golang-1.19-src"
WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler cmd/kubelet"
CACHE="${DISTLIB_CACHE:-$HOME/.cache/distlib}/kube-1.20"

# What the build is made of; bump FORMAT when this script changes what it produces (editing its
# comments or messages does not rebuild)
FORMAT=1
key="$(printf '%s\n' "$FORMAT" "$SUITE" "$SOURCE_PACKAGE" "$GO_PACKAGES" "$WHAT" | cat - "$HERE"/kube/*.patch |
    sha256sum | cut -c1-12)"
OUT_DIR="$CACHE/build-$key"
if [ -f "$OUT_DIR/build.env" ]; then
    printf '%s\n' "$OUT_DIR"
    exit 0
fi
command -v apt-get >/dev/null 2>&1 || die "building Kubernetes needs a Debian host (apt-get, dpkg-source)"
started=$SECONDS
mkdir -p "$CACHE"
exec 9>"$CACHE/.build.lock"
flock 9 # one build at a time; a second caller waits, then finds the build
if [ -f "$OUT_DIR/build.env" ]; then
    printf '%s\n' "$OUT_DIR"
    exit 0
fi
LOGS="$CACHE/logs"
mkdir -p "$LOGS"
WORK="$(mktemp -d "$CACHE/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

apt_quiet() { # apt-get with a log; one `apt-get update` and a retry when the lists are stale
    local logf="$LOGS/apt.log"
    if ! DEBIAN_FRONTEND=noninteractive apt-get "$@" >>"$logf" 2>&1; then
        [ "$(id -u)" = 0 ] && { apt-get update -qq >>"$logf" 2>&1 || true; }
        DEBIAN_FRONTEND=noninteractive apt-get "$@" >>"$logf" 2>&1 ||
            die "apt-get $* failed (log: $logf)"
    fi
}

# --- host tools -----------------------------------------------------------------------------------
if ! command -v rsync >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "the Kubernetes tree's make needs rsync: install it (apt-get install rsync)"
    log "installing rsync with apt-get"
    apt_quiet install -y -qq --no-install-recommends rsync
fi
command -v gcc >/dev/null 2>&1 || die "building the pause binary needs gcc"

# --- Go, etcd: Debian's packages, unpacked --------------------------------------------------------
mkdir -p "$WORK/debs" "$WORK/unpacked"
log "downloading $GO_PACKAGES etcd-server"
# shellcheck disable=SC2086 # GO_PACKAGES is a list
(cd "$WORK/debs" && apt_quiet download $GO_PACKAGES etcd-server)
for deb in "$WORK"/debs/*.deb; do dpkg-deb -x "$deb" "$WORK/unpacked"; done
GOROOT="$(ls -d "$WORK"/unpacked/usr/lib/go-1.*)"
[ -x "$GOROOT/bin/go" ] || die "no go binary in the unpacked $GO_PACKAGES"
ETCD="$WORK/unpacked/usr/bin/etcd"
[ -x "$ETCD" ] || die "no etcd binary in the unpacked etcd-server package"

# --- the source package ---------------------------------------------------------------------------
# a private apt configuration: the host's mirror with a deb-src line, lists of its own
mirror="$(bash "$ROOT/docker/offline-prepare.sh" --print-debian-mirror)"
APT="$WORK/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/src"
printf 'deb-src %s %s main\n' "$mirror" "$SUITE" >"$APT/sources.list"
apt_private() {
    apt_quiet -o Dir::Etc::SourceList="$APT/sources.list" -o Dir::Etc::SourceParts=/nonexistent \
        -o Dir::State::Lists="$APT/lists" -o Dir::Cache="$APT/cache" -o Debug::NoLocking=1 "$@"
}
log "apt-get source $SOURCE_PACKAGE from $mirror (private lists; log: $LOGS/apt.log)"
apt_private update
(cd "$APT/src" && apt_private source --download-only "$SOURCE_PACKAGE")
dsc="$(ls "$APT"/src/*.dsc)"
log "unpacking $(basename "$dsc")"
mkdir -p "$WORK/src/k8s.io"
dpkg-source --no-check -x "$dsc" "$WORK/src/k8s.io/kubernetes" >>"$LOGS/dpkg-source.log" 2>&1 ||
    die "dpkg-source -x $dsc failed (log: $LOGS/dpkg-source.log)"
TREE="$WORK/src/k8s.io/kubernetes"
for p in "$HERE"/kube/*.patch; do
    log "applying $(basename "$p")"
    patch -d "$TREE" -p1 --forward <"$p" >&2 || die "$(basename "$p") does not apply to the tree"
done

# --- build ------------------------------------------------------------------------------------------
# the upstream version the package holds ("1.20.5+really1.20.2-1.1+deb12u1" -> v1.20.2): what the
# binaries report (the tree has no .git to describe)
version="v$(sed -n 's/^Version: //p' "$dsc" | sed 's/.*really//; s/[-+].*//')"
log "make WHAT=\"$WHAT\" with $("$GOROOT/bin/go" version | cut -d' ' -f3) (7-11 minutes; log: $LOGS/make.log)"
(cd "$TREE" && env GOROOT="$GOROOT" PATH="$GOROOT/bin:$PATH" GOPATH="$WORK" GOCACHE="$WORK/gocache" \
    KUBE_GIT_VERSION="$version" KUBE_GIT_TREE_STATE=clean \
    make WHAT="$WHAT" >"$LOGS/make.log" 2>&1) ||
    { tail -n 20 "$LOGS/make.log" >&2; die "make WHAT=\"$WHAT\" failed (log: $LOGS/make.log)"; }
mkdir -p "$WORK/out/bin"
for b in kube-apiserver kube-controller-manager kube-scheduler kubelet; do
    f="$TREE/_output/local/bin/linux/amd64/$b"
    [ -x "$f" ] || die "make built no $b (log: $LOGS/make.log)"
    cp "$f" "$WORK/out/bin/$b"
done
cp "$ETCD" "$WORK/out/bin/etcd"
gcc -Os -static -o "$WORK/out/bin/pause" "$TREE/build/pause/linux/pause.c" -DVERSION=distlib >&2
{
    printf 'source=%s\n' "$(basename "$dsc")"
    printf 'version=%s\n' "$version"
    printf 'go=%s\n' "$("$GOROOT/bin/go" version | cut -d' ' -f3)"
    printf 'etcd=%s\n' "$(basename "$(ls "$WORK"/debs/etcd-server_*.deb)")"
    printf 'patches='; for p in "$HERE"/kube/*.patch; do printf '%s ' "$(basename "$p")"; done; printf '\n'
    printf 'seconds=%s\n' "$((SECONDS - started))"
} >"$WORK/out/build.env.tmp"
rm -rf "$OUT_DIR"
mv "$WORK/out" "$OUT_DIR"
mv "$OUT_DIR/build.env.tmp" "$OUT_DIR/build.env"
# older builds (another patch) go
find "$CACHE" -mindepth 1 -maxdepth 1 -name 'build-*' ! -path "$OUT_DIR" -exec rm -rf {} +
log "built in $((SECONDS - started)) s: $OUT_DIR"
printf '%s\n' "$OUT_DIR"
