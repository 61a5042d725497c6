#!/usr/bin/env bash
# Build the distlib image without a container registry: what `make image` runs.
#
#   IMAGE=distlib:cpu docker/build-image.sh
#   IMAGE=distlib:cuda TARGET=cuda docker/build-image.sh     (make image-gpu)
#
# Two steps: docker/offline-prepare.sh (a base image, the wheelhouse and .deb files made on the
# host, laid out as a build context in .build/image-context), then the same multi-stage build of
# docker/Dockerfile that a user with a registry runs (`docker build -f docker/Dockerfile .`),
# here with that context and --network=none. Then the build cache of superseded builds is
# dropped and the size printed. A second run with nothing changed takes seconds.
#
# Environment (offline-prepare.sh reads more: BASE_IMAGE, PULL_TIMEOUT, REBUILD_BASE, ...):
#   IMAGE            tag to build (default distlib:cpu)
#   TARGET           Dockerfile target: cpu (default) or cuda (the GPU image: cupy, NVRTC, NCCL)
#   DOCKER_BUILDKIT  default 0 (the classic builder uses local base images without pulling)
#
# Arguments: none; --help.
set -euo pipefail

log() { printf 'build-image: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-distlib:cpu}"
TARGET="${TARGET:-cpu}"
export TARGET # offline-prepare.sh prepares the GPU wheels for the cuda target
BUILD_DIR="$ROOT/.build"
CONTEXT="$BUILD_DIR/image-context"
BUILD_ENV="$BUILD_DIR/image-build.env"
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"
SECONDS=0

case "$TARGET" in
cpu | cuda) ;;
*) die "TARGET=$TARGET: the Dockerfile's targets are cpu and cuda" ;;
esac

case "${1:-}" in
"") ;;
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown argument: $1 (see --help)" ;;
esac

mkdir -p "$BUILD_DIR"
# One build at a time in this tree (two test sessions may start one together).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$BUILD_DIR/build-image.lock"
    if ! flock -n 9; then
        log "waiting for another build-image.sh run in this tree to finish"
        flock -w 1800 9 || die "gave up waiting for $BUILD_DIR/build-image.lock"
    fi
fi

"$BASH" "$ROOT/docker/offline-prepare.sh" # says what went wrong itself

setting() { sed -n "s/^$1=//p" "$BUILD_ENV" | sed -n 1p; }
base="$(setting BASE_IMAGE)"
version="$(setting DISTLIB_VERSION)"
network="$(setting BUILD_NETWORK)"
replaced_base="$(setting REPLACED_BASE_ID)"
if [ -z "$base" ] || [ -z "$version" ] || [ -z "$network" ]; then
    die "$BUILD_ENV is incomplete (run docker/offline-prepare.sh)"
fi

image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null; }
megabytes() { awk -v b="$1" 'BEGIN { printf "%.0f MB", b / 1000000 }'; }

old_id="$(image_id "$IMAGE" || true)"
log "docker build --network=$network --target $TARGET -t $IMAGE (base $base, distlib $version)"
docker build --network="$network" --target "$TARGET" \
    --build-arg BASE_IMAGE="$base" --build-arg DISTLIB_VERSION="$version" \
    -t "$IMAGE" -f "$ROOT/docker/Dockerfile" "$CONTEXT" ||
    die "docker build failed"
new_id="$(image_id "$IMAGE")"

# The wheelhouse and venv stages (and the cuda target's two) stay behind as untagged images (the build cache of the next
# run). Keep the ones this build used; drop older ones built on the same base.
stages=(wheelhouse venv)
[ "$TARGET" != cuda ] || stages+=(gpu-wheelhouse cuda-venv)
for stage in "${stages[@]}"; do
    keep="$(docker build -q --network=none --target "$stage" --build-arg BASE_IMAGE="$base" \
        -f "$ROOT/docker/Dockerfile" "$CONTEXT" 2>/dev/null)" || continue
    for id in $(docker images -q --no-trunc --filter dangling=true --filter "label=distlib.stage=$stage" \
        --filter "label=distlib.base-image=$base"); do
        [ "$id" = "$keep" ] || docker image rm "$id" >/dev/null 2>&1 || true
    done
done
# The image this tag pointed to before is now untagged: drop it unless something still uses it.
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ] &&
    [ "$(docker image inspect -f '{{len .RepoTags}}' "$old_id" 2>/dev/null)" = 0 ]; then
    docker image rm "$old_id" >/dev/null 2>&1 || true
fi
# A base image that REBUILD_BASE=1 replaced is removed once nothing uses it any more.
if [ -n "$replaced_base" ] && [ "$(docker image inspect -f '{{len .RepoTags}}' "$replaced_base" 2>/dev/null)" = 0 ]; then
    docker image rm "$replaced_base" >/dev/null 2>&1 || log "kept the replaced base $replaced_base (still in use)"
fi

size="$(docker image inspect -f '{{.Size}}' "$IMAGE")"
base_size="$(docker image inspect -f '{{.Size}}' "$base")"
log "built $IMAGE: $(megabytes "$size") (base $base: $(megabytes "$base_size")) in ${SECONDS}s"
docker image ls --filter "reference=$IMAGE"
