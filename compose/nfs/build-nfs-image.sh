#!/usr/bin/env bash
# Build the NFS server image of the Compose cluster's nfs mode (nfs-ganesha), offline.
#
#   NFS_IMAGE=distlib-nfs:bookworm compose/nfs/build-nfs-image.sh
#
# The base is the base of $IMAGE (its distlib.base-image label; default distlib-base:bookworm,
# which docker/offline-prepare.sh makes). nfs-ganesha, its VFS backend and libnfs-utils (nfs-ls for
# the healthcheck) are downloaded as .deb files by the host's apt, resolved against the base's
# own dpkg status (a Debian bookworm host), then installed by `docker build --network=none`.
# Skipped when the image exists and nothing changed.
set -euo pipefail

log() { printf 'build-nfs-image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
NFS_IMAGE="${NFS_IMAGE:-distlib-nfs:bookworm}"
IMAGE="${IMAGE:-distlib:cpu}"
CONTEXT="$ROOT/.build/nfs-context"
PACKAGES=(nfs-ganesha nfs-ganesha-vfs libnfs-utils)
export DOCKER_BUILDKIT=0

base="$(docker image inspect -f '{{index .Config.Labels "distlib.base-image"}}' "$IMAGE" 2>/dev/null || true)"
base="${base:-distlib-base:bookworm}"
docker image inspect "$base" >/dev/null 2>&1 || die "base image $base not found: run make image first"
base_id="$(docker image inspect -f '{{.Id}}' "$base")"
key="$(cat "$HERE/Dockerfile" "$HERE/ganesha.conf" | sha256sum | cut -c1-16)-${base_id#sha256:}"
if [ "$(docker image inspect -f '{{index .Config.Labels "distlib.nfs.key"}}' "$NFS_IMAGE" 2>/dev/null || true)" = "$key" ]; then
    log "$NFS_IMAGE is up to date"
    exit 0
fi

mkdir -p "$CONTEXT"
if [ "$(cat "$CONTEXT/debs/.stamp" 2>/dev/null)" != "$base_id" ]; then
    command -v apt-get >/dev/null 2>&1 || die "building $NFS_IMAGE needs apt-get on the host (a Debian bookworm host)"
    work="$(mktemp -d "$ROOT/.build/nfs-debs.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/archives/partial"
    docker run --rm --network none --user 0 --entrypoint cat "$base" /var/lib/dpkg/status >"$work/status"
    log "downloading ${PACKAGES[*]} with the host's apt (resolved against $base's dpkg status)"
    apt_download() {
        apt-get install --download-only --yes --no-install-recommends \
            -o Dir::State::status="$work/status" -o Dir::Cache::archives="$work/archives/" \
            -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= -o Debug::NoLocking=1 \
            -o APT::Sandbox::User="$(id -un)" "${PACKAGES[@]}"
    }
    if ! apt_download >"$ROOT/.build/nfs-apt.log" 2>&1; then
        { [ "$(id -u)" = 0 ] && apt-get update -qq >>"$ROOT/.build/nfs-apt.log" 2>&1 && apt_download >>"$ROOT/.build/nfs-apt.log" 2>&1; } ||
            die "apt could not download ${PACKAGES[*]} (log: $ROOT/.build/nfs-apt.log)"
    fi
    rm -rf "$CONTEXT/debs"
    mkdir -p "$CONTEXT/debs"
    mv "$work"/archives/*.deb "$CONTEXT/debs/"
    printf '%s\n' "$base_id" >"$CONTEXT/debs/.stamp"
fi
cp "$HERE/Dockerfile" "$HERE/ganesha.conf" "$CONTEXT/"
log "docker build -t $NFS_IMAGE (base $base)"
docker build --network=none --build-arg BASE_IMAGE="$base" --label "distlib.nfs.key=$key" \
    -t "$NFS_IMAGE" "$CONTEXT" >"$ROOT/.build/nfs-build.log" 2>&1 ||
    { tail -n 20 "$ROOT/.build/nfs-build.log" >&2; die "docker build failed (log: $ROOT/.build/nfs-build.log)"; }
log "built $NFS_IMAGE ($(docker image inspect -f '{{.Size}}' "$NFS_IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
