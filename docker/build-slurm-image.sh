#!/usr/bin/env bash
# Build distlib's Slurm image (docker/slurm/Dockerfile) without a registry: what `MODE=slurm
# make cluster-up` and the Slurm container tests run.
#
#   IMAGE=distlib:slurm DISTLIB_IMAGE=distlib:cpu docker/build-slurm-image.sh
#
# Steps:
#   1. distlib's image DISTLIB_IMAGE with docker/build-image.sh (seconds when it is up to date;
#      SKIP_DISTLIB_IMAGE=1 uses it as it is);
#   2. the .deb files of Slurm and munge (slurmctld slurmd slurm-client munge) that image lacks,
#      fetched with the host's apt against the image's own dpkg status, kept in
#      ~/.cache/distlib/slurm-debs/<key> (key: that status and the package list), so that a
#      later build needs no network; when the host runs another Debian release than the image,
#      or has no apt, none are fetched and the build installs them with apt-get (needs network);
#   3. docker build --network=none of docker/slurm/Dockerfile FROM DISTLIB_IMAGE with them.
# A second run with nothing changed takes seconds.
#
# Environment:
#   IMAGE               tag to build (default distlib:slurm)
#   DISTLIB_IMAGE       distlib's image to build on (default distlib:cpu)
#   SKIP_DISTLIB_IMAGE  1: do not (re)build DISTLIB_IMAGE
#   SLURM_DEB_CACHE     where the .deb files are kept (default ~/.cache/distlib/slurm-debs)
#   DOCKER_BUILDKIT     default 0 (the classic builder uses the local base image without pulling)
#
# Arguments: none; --help.
set -euo pipefail

log() { printf 'build-slurm-image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-distlib:slurm}"
DISTLIB_IMAGE="${DISTLIB_IMAGE:-distlib:cpu}"
PACKAGES=(slurmctld slurmd slurm-client munge)
CACHE="${SLURM_DEB_CACHE:-${HOME:-/root}/.cache/distlib/slurm-debs}"
BUILD_DIR="$ROOT/.build"
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"
SECONDS=0

case "${1:-}" in
"") ;;
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown argument: $1 (see --help)" ;;
esac
[ "$IMAGE" != "$DISTLIB_IMAGE" ] || die "IMAGE and DISTLIB_IMAGE are both $IMAGE: the Slurm image is built on distlib's"

mkdir -p "$BUILD_DIR"
WORK="$(mktemp -d "$BUILD_DIR/slurm-image.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- 1. distlib's image ----------------------------------------------------------------------------
if [ "${SKIP_DISTLIB_IMAGE:-0}" = 1 ]; then
    docker image inspect "$DISTLIB_IMAGE" >/dev/null 2>&1 ||
        die "SKIP_DISTLIB_IMAGE=1 but $DISTLIB_IMAGE does not exist (make image builds it)"
else
    log "distlib's image $DISTLIB_IMAGE: docker/build-image.sh"
    IMAGE="$DISTLIB_IMAGE" TARGET=cpu "$BASH" "$ROOT/docker/build-image.sh" || die "building $DISTLIB_IMAGE failed"
fi

# --- 2. the .deb files -----------------------------------------------------------------------------
docker run --rm --network none --user 0 --entrypoint cat "$DISTLIB_IMAGE" /var/lib/dpkg/status >"$WORK/status" ||
    die "could not read the dpkg status of $DISTLIB_IMAGE"
image_codename="$(docker run --rm --network none --entrypoint /bin/sh "$DISTLIB_IMAGE" -c \
    '. /etc/os-release && echo "${VERSION_CODENAME:-}"')" || image_codename=""
# shellcheck source=/dev/null
host_codename="$( (. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}") || true)"
key="$(printf '%s\n' "${PACKAGES[@]}" | cat - "$WORK/status" | sha256sum | cut -c1-16)"
mkdir -p "$WORK/context/debs"
cp "$ROOT/docker/slurm/Dockerfile" "$WORK/context/"
network=none
if [ -f "$CACHE/$key/.complete" ]; then
    log "the .deb files of ${PACKAGES[*]}: cached in $CACHE/$key"
elif command -v apt-get >/dev/null 2>&1 && [ -n "$host_codename" ] && [ "$host_codename" = "$image_codename" ]; then
    log "fetching the .deb files of ${PACKAGES[*]} with the host's apt (resolved against $DISTLIB_IMAGE's dpkg status)"
    mkdir -p "$WORK/archives/partial"
    fetch() {
        apt-get install --download-only --yes --no-install-recommends \
            -o Dir::State::status="$WORK/status" -o Dir::Cache::archives="$WORK/archives/" \
            -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= \
            -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)" "${PACKAGES[@]}"
    }
    if ! fetch >"$BUILD_DIR/slurm-apt-download.log" 2>&1; then
        # the host's package lists may be missing or stale: refresh them once (root only)
        if ! { [ "$(id -u)" = 0 ] && apt-get update -qq >>"$BUILD_DIR/slurm-apt-download.log" 2>&1 &&
               fetch >>"$BUILD_DIR/slurm-apt-download.log" 2>&1; }; then
            die "apt could not fetch ${PACKAGES[*]} (log: $BUILD_DIR/slurm-apt-download.log)"
        fi
    fi
    rm -rf "${CACHE:?}/$key"
    mkdir -p "$CACHE/$key"
    mv "$WORK"/archives/*.deb "$CACHE/$key/"
    touch "$CACHE/$key/.complete"
else
    log "the host (${host_codename:-no Debian release}) cannot fetch .deb files for $DISTLIB_IMAGE (${image_codename:-?}):" \
        "the build installs ${PACKAGES[*]} with apt-get (needs network)"
    network=default
fi
if [ "$network" = none ]; then
    cp -l "$CACHE/$key"/*.deb "$WORK/context/debs/" 2>/dev/null || cp "$CACHE/$key"/*.deb "$WORK/context/debs/"
fi

# --- 3. the image ----------------------------------------------------------------------------------
old_id="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "docker build --network=$network -t $IMAGE (on $DISTLIB_IMAGE, $(find "$WORK/context/debs" -name '*.deb' | wc -l) .deb files)"
docker build --network="$network" --build-arg DISTLIB_IMAGE="$DISTLIB_IMAGE" -t "$IMAGE" "$WORK/context" \
    >"$BUILD_DIR/slurm-docker-build.log" 2>&1 ||
    { tail -n 25 "$BUILD_DIR/slurm-docker-build.log" >&2; die "docker build failed (log: $BUILD_DIR/slurm-docker-build.log)"; }
new_id="$(docker image inspect -f '{{.Id}}' "$IMAGE")"
# The image this tag pointed to before is now untagged: drop it unless something still uses it.
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ] &&
    [ "$(docker image inspect -f '{{len .RepoTags}}' "$old_id" 2>/dev/null)" = 0 ]; then
    docker image rm "$old_id" >/dev/null 2>&1 || true
fi
size="$(docker image inspect -f '{{.Size}}' "$IMAGE")"
log "built $IMAGE: $(awk -v b="$size" 'BEGIN { printf "%.0f MB", b / 1000000 }') in ${SECONDS}s"
