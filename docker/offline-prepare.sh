#!/usr/bin/env bash
# The offline half of the image build: everything `docker build` would fetch from a registry
# or an index, prepared on the host, so that the build itself runs with --network=none.
# docker/build-image.sh (`make image`) runs it, then builds docker/Dockerfile with the context it
# makes; with a registry and pip's index, `docker build -f docker/Dockerfile .` needs none of it.
#
#   docker/offline-prepare.sh          (prints nothing on stdout; logs on stderr)
#
# Steps:
#   1. pick the base image: $BASE_IMAGE when given; else python:3.11-slim-bookworm when it is
#      present locally or a `docker pull` of it succeeds (bounded by PULL_TIMEOUT); else
#      distlib-base:bookworm-<hash>, built here once with debootstrap (as root, ~70 s) and
#      reused after (<hash>: of the Debian package list, so a changed list is a new tag);
#   2. build a wheelhouse on the host (pip reaches PyPI; the image build does not): the distlib
#      wheel from the working tree, and the wheels of its runtime dependencies and of the
#      extras in IMAGE_EXTRAS (as the wheel's metadata, i.e. pyproject.toml, lists them) for
#      the base image's Python and platform; for TARGET=cuda also the wheels of the [gpu]
#      extra (kept in .build/gpu-wheels);
#   3. fetch .deb files for what the base lacks (ip, ps, ssh, sshd) with the host's apt;
#   4. lay out the build context in .build/image-context, shaped like the repository (the
#      sources, and docker/offline/{wheels,debs} filled, and gpu-wheels for TARGET=cuda), and write the build's arguments to
#      .build/image-build.env (BASE_IMAGE, DISTLIB_VERSION, BUILD_NETWORK, REPLACED_BASE_ID).
# Every step is skipped when its inputs did not change, so a second run takes seconds.
#
# Environment:
#   BASE_IMAGE       base image to build on (default: see step 1); the debootstrap base
#                    (--print-debootstrap-base names it) is built when named and missing
#   IMAGE_EXTRAS     extras of distlib-c10d whose wheels go into the image, comma-separated
#                    (default mpi: mpi4py and Open MPI for the mpi backend and MODE=mpi)
#   PULL_TIMEOUT     seconds allowed for pulling the default base (default 60)
#   DISTLIB_NO_PULL  1: never try `docker pull`
#   REBUILD_BASE     1: rebuild the debootstrap base even if it exists
#   REFRESH_WHEELS   1: rebuild the wheelhouse even if nothing changed
#   TARGET           the Dockerfile target the context is for: cpu (default) or cuda (+ the
#                    [gpu] wheels, ~580 MB to download once)
#   DEBIAN_MIRROR    Debian mirror for debootstrap (default: taken from the host's apt sources)
#   PYTHON           host Python whose pip builds the wheelhouse (default python3)
#   APT_ETC, OS_RELEASE  where the host's apt sources and os-release are (default /etc/apt,
#                    /etc/os-release; for tests)
#
# Arguments: none to prepare; --print-debian-mirror prints the mirror debootstrap would use;
# --print-debootstrap-base prints the debootstrap base's tag.
set -euo pipefail

log() { printf 'offline-prepare: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PULL_TIMEOUT="${PULL_TIMEOUT:-60}"
PYTHON="${PYTHON:-python3}"
DEFAULT_BASE="python:3.11-slim-bookworm"
SUITE="bookworm"
# What the debootstrap base holds besides minbase: python3 (3.11 in bookworm) with venv, CA
# certificates, ip and ps for debugging, /etc/services and /etc/protocols (netbase) and time
# zones (tzdata), as python:3.11-slim has; the SSH server and client that MODE=mpi's mpirun
# launches ranks through (sshd runs only in that mode).
BASE_PACKAGES="python3,python3-venv,ca-certificates,iproute2,procps,netbase,tzdata,openssh-server,openssh-client"
# The tag names the package list (a short hash of it): a machine holding a base made from
# another list (the first one was plain distlib-base:bookworm) never reuses it by mistake.
debootstrap_base() { printf 'distlib-base:%s-%s\n' "$SUITE" "$(printf '%s\n' "$SUITE" "$BASE_PACKAGES" | sha256sum | cut -c1-8)"; }
DEBOOTSTRAP_BASE="" # set once the tools are known to be there (debootstrap_base)
IMAGE_EXTRAS="${IMAGE_EXTRAS-mpi}"
BUILD_DIR="$ROOT/.build"
APT_ETC="${APT_ETC:-/etc/apt}"           # where the host's apt sources are (tests point it elsewhere)
OS_RELEASE="${OS_RELEASE:-/etc/os-release}"
CONTEXT="$BUILD_DIR/image-context"
OFFLINE="$CONTEXT/docker/offline"   # where the Dockerfile looks for the prepared wheels and .debs
BUILD_ENV="$BUILD_DIR/image-build.env"
TARGET="${TARGET:-cpu}"             # the Dockerfile target the context is for (cuda: + the GPU wheels)
GPU_WHEELS="$BUILD_DIR/gpu-wheels"  # the [gpu] wheels, kept between builds
export PATH="$PATH:/usr/sbin:/sbin"
SECONDS=0

mkdir -p "$BUILD_DIR"

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }
image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null; }
megabytes() { awk -v b="$1" 'BEGIN { printf "%.0f MB", b / 1000000 }'; }

# --- temporary directories, removed on any exit --------------------------------------------------
TEMP_DIRS=()
ROOTFS=""
REPLACED_BASE_ID="" # a debootstrap base that REBUILD_BASE=1 replaced

unmount_under() { # unmount everything mounted at or below $1, deepest first
    local dir="$1" m
    awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts |
        sort -r | while read -r m; do
            m="$(printf '%b' "$m")"
            umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "could not unmount $m"
        done
}

cleanup() {
    local d
    if [ -n "$ROOTFS" ] && [ -d "$ROOTFS" ]; then
        unmount_under "$ROOTFS"
        rm -rf --one-file-system "$ROOTFS" || log "could not remove $ROOTFS"
    fi
    for d in "${TEMP_DIRS[@]+"${TEMP_DIRS[@]}"}"; do rm -rf "$d"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

new_temp_dir() { # $1: name prefix; sets TEMP_DIR to a new directory under .build, removed on exit
    TEMP_DIR="$(mktemp -d "$BUILD_DIR/$1.XXXXXX")"
    TEMP_DIRS+=("$TEMP_DIR")
}

# --- step 1: the base image ----------------------------------------------------------------------
try_pull() {
    if [ "${DISTLIB_NO_PULL:-0}" = 1 ]; then return 1; fi
    log "$1 is not present locally; trying docker pull (at most ${PULL_TIMEOUT}s)"
    if timeout -k 5 "$PULL_TIMEOUT" docker pull -q "$1" >"$BUILD_DIR/pull.log" 2>&1; then
        return 0
    fi
    log "pull failed: $(tail -n 1 "$BUILD_DIR/pull.log")"
    return 1
}

# The Debian mirror the host's apt uses: the first "deb" source for $SUITE, else the first one for
# any release suite (no "-security"/"-updates" suffix). Nothing in the repository names a host.
debian_mirror() {
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        printf '%s\n' "$DEBIAN_MIRROR"
        return
    fi
    local id=""
    # shellcheck source=/dev/null
    id="$(. "$OS_RELEASE" 2>/dev/null && printf '%s' "${ID:-}")" || true
    [ "$id" = debian ] ||
        die "this host is not Debian ($id): set DEBIAN_MIRROR to a Debian mirror URL to build $DEBOOTSTRAP_BASE"
    local found
    found="$(
        {
            for f in "$APT_ETC"/sources.list.d/*.sources; do
                [ -r "$f" ] || continue
                # deb822 paragraphs: Types / URIs / Suites / Enabled
                awk -v want="$SUITE" '
                    function flush(   n, i, s, u) {
                        if (types ~ /(^| )deb( |$)/ && enabled != "no" && uris != "") {
                            split(uris, u, " ")
                            n = split(suites, s, " ")
                            for (i = 1; i <= n; i++) {
                                if (s[i] == want) print "1 " u[1]
                                else if (s[i] !~ /-/) print "2 " u[1]
                            }
                        }
                        types = uris = suites = enabled = ""
                    }
                    /^[ \t]*#/ { next }
                    /^[ \t]*$/ { flush(); next }
                    { key = tolower($1); $1 = ""; sub(/^[ \t]+/, "") }
                    key == "types:" { types = $0 }
                    key == "uris:" { uris = $0 }
                    key == "suites:" { suites = $0 }
                    key == "enabled:" { enabled = tolower($0) }
                    END { flush() }
                ' "$f"
            done
            for f in "$APT_ETC"/sources.list "$APT_ETC"/sources.list.d/*.list; do
                [ -r "$f" ] || continue
                # one-line format: deb [options] URI suite components...
                awk -v want="$SUITE" '
                    $1 != "deb" { next }
                    {
                        i = 2
                        if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                        uri = $i; suite = $(i + 1)
                        if (suite == want) print "1 " uri
                        else if (suite !~ /-/) print "2 " uri
                    }
                ' "$f"
            done
        } | { grep -E '^[12] (https?|file|ftp)://' || true; } | sort -s -k1,1 | sed -n 1p | cut -d' ' -f2
    )"
    [ -n "$found" ] ||
        die "found no Debian mirror in $APT_ETC/sources.list(.d): set DEBIAN_MIRROR to build $DEBOOTSTRAP_BASE"
    printf '%s\n' "$found"
}

ensure_debootstrap() {
    command -v debootstrap >/dev/null 2>&1 && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "installing debootstrap with apt-get"
        if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }; } \
            >"$BUILD_DIR/apt-debootstrap.log" 2>&1; then
            die "could not install debootstrap (see $BUILD_DIR/apt-debootstrap.log); install it with: apt-get install debootstrap"
        fi
        command -v debootstrap >/dev/null 2>&1 || die "debootstrap still missing after apt-get install"
    else
        die "debootstrap is not installed; install it with: sudo apt-get install debootstrap (or set BASE_IMAGE to an image you have)"
    fi
}

write_file() { # $1: path inside the rootfs, $2: content (printf format); never writes through a link
    local p="$ROOTFS/$1"
    rm -f "$p"
    # shellcheck disable=SC2059
    printf "$2" >"$p"
}

clear_dir() { # $1: directory inside the rootfs; remove its entries except those named in $2..
    local p="$ROOTFS/$1" keep=() name
    [ -d "$p" ] && [ ! -L "$p" ] || return 0
    shift
    for name in "$@"; do keep+=(! -name "$name"); done
    find "$p" -mindepth 1 -maxdepth 1 "${keep[@]+"${keep[@]}"}" -exec rm -rf --one-file-system {} +
}

build_debootstrap_base() {
    [ "$(id -u)" = 0 ] ||
        die "building $DEBOOTSTRAP_BASE needs root (debootstrap): run it once as root (sudo make image), or set BASE_IMAGE to an image you have"
    ensure_debootstrap
    local mirror started=$SECONDS
    mirror="$(debian_mirror)"
    ROOTFS="$(mktemp -d "$BUILD_DIR/rootfs.XXXXXX")"
    chmod 0755 "$ROOTFS" # becomes / in the image: mktemp made it 0700
    log "building $DEBOOTSTRAP_BASE: debootstrap --variant=minbase $SUITE from $mirror (about 70 s; log in .build/debootstrap.log)"
    if ! DEBIAN_FRONTEND=noninteractive debootstrap --variant=minbase --components=main \
        --include="$BASE_PACKAGES" "$SUITE" "$ROOTFS" "$mirror" >"$BUILD_DIR/debootstrap.log" 2>&1; then
        tail -n 15 "$BUILD_DIR/debootstrap.log" >&2
        die "debootstrap failed (full log: $BUILD_DIR/debootstrap.log)"
    fi
    unmount_under "$ROOTFS"

    # Slim it: package lists and caches, logs, documentation (copyright files stay), manuals,
    # translations. Paths are cleared only when they are real directories inside the tree
    # (var/run, for one, is a link to the host's /run while the tree sits here).
    clear_dir var/lib/apt/lists
    clear_dir var/cache/apt
    clear_dir var/log
    clear_dir usr/share/man
    clear_dir usr/share/info
    clear_dir usr/share/lintian
    clear_dir usr/share/locale locale.alias
    clear_dir dev
    if [ -d "$ROOTFS/usr/share/doc" ] && [ ! -L "$ROOTFS/usr/share/doc" ]; then
        find "$ROOTFS/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
        find "$ROOTFS/usr/share/doc" -mindepth 1 -type d -empty -delete
    fi
    rm -f "$ROOTFS"/var/cache/debconf/*-old "$ROOTFS"/var/lib/dpkg/*-old
    # openssh-server's postinst made host keys: every container of the image would share them.
    # MODE=mpi makes a worker's host key when the container starts.
    rm -f "$ROOTFS"/etc/ssh/ssh_host_*
    mkdir -p "$ROOTFS/var/lib/apt/lists/partial" "$ROOTFS/var/cache/apt/archives/partial"

    # What a container image needs: no host identity, an mtab, quiet and slim apt/dpkg.
    write_file etc/resolv.conf ''
    write_file etc/hostname 'distlib\n'
    write_file etc/hosts '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
    [ ! -e "$ROOTFS/etc/machine-id" ] || write_file etc/machine-id ''
    rm -f "$ROOTFS/etc/mtab"
    ln -s ../proc/self/mounts "$ROOTFS/etc/mtab"
    write_file usr/sbin/policy-rc.d '#!/bin/sh\n# no services start inside image builds\nexit 101\n'
    chmod 0755 "$ROOTFS/usr/sbin/policy-rc.d"
    write_file etc/dpkg/dpkg.cfg.d/distlib-slim 'path-exclude=/usr/share/doc/*\npath-include=/usr/share/doc/*/copyright\npath-exclude=/usr/share/man/*\npath-exclude=/usr/share/info/*\npath-exclude=/usr/share/lintian/*\npath-exclude=/usr/share/locale/*\npath-include=/usr/share/locale/locale.alias\n'
    write_file etc/apt/apt.conf.d/distlib-slim 'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\nAcquire::Languages "none";\nDir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n'

    log "importing the tree as $DEBOOTSTRAP_BASE"
    REPLACED_BASE_ID="$(image_id "$DEBOOTSTRAP_BASE" || true)"
    tar --numeric-owner --one-file-system -C "$ROOTFS" -cf - . |
        docker import \
            -m "debootstrap --variant=minbase $SUITE + $BASE_PACKAGES" \
            -c 'ENV LANG=C.UTF-8' \
            -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            -c 'CMD ["/bin/bash"]' \
            - "$DEBOOTSTRAP_BASE" >/dev/null
    rm -rf --one-file-system "$ROOTFS"
    ROOTFS=""
    log "built $DEBOOTSTRAP_BASE ($(megabytes "$(docker image inspect -f '{{.Size}}' "$DEBOOTSTRAP_BASE")")) in $((SECONDS - started))s"
}

ensure_debootstrap_base() {
    if image_exists "$DEBOOTSTRAP_BASE" && [ "${REBUILD_BASE:-0}" != 1 ]; then
        log "reusing $DEBOOTSTRAP_BASE (REBUILD_BASE=1 rebuilds it)"
    else
        build_debootstrap_base
    fi
}

# --- main ----------------------------------------------------------------------------------------
case "${1:-}" in
"") ;;
--print-debian-mirror) # what debootstrap would use, then exit (no Docker needed)
    debian_mirror
    exit 0
    ;;
--print-debootstrap-base) # the debootstrap base's tag, then exit (no Docker needed)
    debootstrap_base
    exit 0
    ;;
-h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit 0
    ;;
*) die "unknown argument: $1 (see --help)" ;;
esac

# --- the Docker engine ---------------------------------------------------------------------------
command -v docker >/dev/null 2>&1 ||
    die "docker is not installed (need the docker CLI and a running engine)"
if ! server_version="$(timeout -k 5 30 docker version --format '{{.Server.Version}}' 2>"$BUILD_DIR/docker-version.err")" ||
    [ -z "$server_version" ]; then
    reason="$(grep -v '^[[:space:]]*$' "$BUILD_DIR/docker-version.err" | tail -n 1 | tr -s '[:space:]' ' ' | sed 's/ $//')"
    die "cannot reach the Docker engine: ${reason:-no answer from ${DOCKER_HOST:-unix:///var/run/docker.sock} (is dockerd running?)}"
fi

DEBOOTSTRAP_BASE="$(debootstrap_base)"
if [ -n "${BASE_IMAGE:-}" ]; then
    base="$BASE_IMAGE"
    if [ "$base" = "$DEBOOTSTRAP_BASE" ]; then
        ensure_debootstrap_base
    elif ! image_exists "$base" && ! try_pull "$base"; then
        die "base image $base is not present locally and could not be pulled; leave BASE_IMAGE unset to build $DEBOOTSTRAP_BASE offline"
    fi
elif image_exists "$DEFAULT_BASE" || try_pull "$DEFAULT_BASE"; then
    base="$DEFAULT_BASE"
else
    base="$DEBOOTSTRAP_BASE"
    log "no registry: using the offline base $DEBOOTSTRAP_BASE"
    ensure_debootstrap_base
fi
log "base image: $base"

# What the base offers: Python version, platform, libc, Debian release, ip/ps/ssh/sshd.
# Cached per image id and probe version (a container start costs a second).
base_id="$(image_id "$base")"
probe_file="$BUILD_DIR/probe/${base_id#sha256:}.v2.txt"
if [ ! -s "$probe_file" ]; then
    mkdir -p "$BUILD_DIR/probe"
    # shellcheck disable=SC2016
    probe_script='
        command -v python3 >/dev/null 2>&1 || { echo "error=no python3 on PATH"; exit 0; }
        python3 -c "import sys, platform; lib, ver = platform.libc_ver()
print(\"python=%d.%d\" % sys.version_info[:2]); print(\"machine=\" + platform.machine())
print(\"libc=\" + lib); print(\"libc_version=\" + ver)"
        codename=""; [ -r /etc/os-release ] && codename="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
        echo "codename=$codename"
        if command -v ip >/dev/null 2>&1; then echo has_ip=1; else echo has_ip=0; fi
        if command -v ps >/dev/null 2>&1; then echo has_ps=1; else echo has_ps=0; fi
        if command -v ssh >/dev/null 2>&1; then echo has_ssh=1; else echo has_ssh=0; fi
        if [ -x /usr/sbin/sshd ]; then echo has_sshd=1; else echo has_sshd=0; fi'
    docker run --rm --network none --user 0 --entrypoint /bin/sh "$base" -c "$probe_script" \
        >"$probe_file.tmp" 2>&1 || { cat "$probe_file.tmp" >&2; rm -f "$probe_file.tmp"; die "could not run a shell in $base"; }
    mv "$probe_file.tmp" "$probe_file"
fi
probe() { sed -n "s/^$1=//p" "$probe_file" | sed -n 1p; }
probe_error="$(probe error)"
[ -z "$probe_error" ] || { rm -f "$probe_file"; die "base image $base is unusable: $probe_error"; }
py_version="$(probe python)"
machine="$(probe machine)"
libc_version="$(probe libc_version)"
if [ "$(probe libc)" != glibc ] || [ -z "$libc_version" ]; then
    rm -f "$probe_file"
    die "base image $base is not glibc-based: manylinux wheels need glibc"
fi
log "base has Python $py_version, $machine, glibc $libc_version"

# --- step 2: the wheelhouse ----------------------------------------------------------------------
# The sources that make the wheel: tracked and untracked-but-not-ignored files, so that the
# image holds exactly the working tree (not stale build/ or egg-info leftovers).
SOURCE_PATHS=(pyproject.toml setup.py setup.cfg MANIFEST.in README.md README.rst LICENSE LICENSE.txt distlib deploy)
list_sources() { # NUL-separated, relative to $ROOT, sorted
    if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        git -C "$ROOT" ls-files -z --cached --others --exclude-standard -- "${SOURCE_PATHS[@]}"
    else
        (cd "$ROOT" && { find "${SOURCE_PATHS[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.py[co]' -print0 2>/dev/null || true; })
    fi | (cd "$ROOT" && while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done) | sort -zu
}
sources_hash="$(list_sources | (cd "$ROOT" && xargs -0 -r sha256sum) | sha256sum | cut -d' ' -f1)"

mkdir -p "$OFFLINE/wheels" "$OFFLINE/debs"
app_dir="$OFFLINE/wheels/app"
deps_dir="$OFFLINE/wheels/deps"

if [ "${REFRESH_WHEELS:-0}" = 1 ] || [ "$(cat "$app_dir/.stamp" 2>/dev/null)" != "$sources_hash" ]; then
    "$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip (set PYTHON to a Python 3 with pip)"
    new_temp_dir wheel
    work="$TEMP_DIR"
    mkdir -p "$work/src" "$work/app"
    list_sources | tar -C "$ROOT" --null -T - -cf - | tar -C "$work/src" -xf -
    # Two wheels: the library (distlib-c10d) and the deployment (distlib-c10d-deploy: the jobs
    # the image runs, and the cluster driver's code without its docker SDK).
    log "building the distlib and distlib-deploy wheels from the working tree"
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$work/app" "$work/src" "$work/src/deploy" \
        >"$BUILD_DIR/pip-wheel.log" 2>&1 ||
        { tail -n 20 "$BUILD_DIR/pip-wheel.log" >&2; die "pip wheel failed (log: $BUILD_DIR/pip-wheel.log)"; }
    wheels=("$work"/app/*.whl)
    if [ "${#wheels[@]}" != 2 ] || [ ! -f "${wheels[0]}" ]; then
        die "expected two wheels from pip wheel (distlib-c10d, distlib-c10d-deploy), got: ${wheels[*]}"
    fi
    for wheel in "${wheels[@]}"; do
        whl_name="$(basename "$wheel")"
        printf '%s==%s\n' "${whl_name%%-*}" "$(cut -d- -f2 <<<"$whl_name")"
    done >"$work/app/requirements.txt"
    printf '%s\n' "$sources_hash" >"$work/app/.stamp"
    rm -rf "$app_dir"
    mv "$work/app" "$app_dir"
fi
app_wheel="$(ls "$app_dir"/distlib_c10d-*.whl)"
version="$(basename "$app_wheel" | cut -d- -f2)"

# Requires-Dist lines of the wheel: those of the extras named in $1 (comma-separated, their
# markers dropped) and, when $2 is 1, those without an extra (pyproject's [project]
# dependencies). An extra the wheel does not declare is an error.
wheel_requirements() { # $1: extras, $2: 1 to include the base dependencies
    "$PYTHON" - "$app_wheel" "$1" "$2" <<'EOF'
import re, sys, zipfile
from email.parser import Parser

with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode("utf-8"))
declared = meta.get_all("Provides-Extra") or []
wanted = {e.strip() for e in sys.argv[2].split(",") if e.strip()}
if wanted - set(declared):
    sys.exit(f"the extras {', '.join(sorted(wanted - set(declared)))} are not declared by the wheel "
             f"(it has: {', '.join(declared) or 'none'})")
for req in meta.get_all("Requires-Dist") or []:
    extra = re.search(r"""\bextra\s*==\s*["']([^"']+)["']""", req)
    if extra is None:
        if sys.argv[3] == "1":
            print(req.strip())
    elif extra.group(1) in wanted:
        print(req.split(";", 1)[0].strip())
EOF
}

# Runtime dependencies and those of IMAGE_EXTRAS, for the base's CPython and glibc.
requirements="$(wheel_requirements "$IMAGE_EXTRAS" 1)" || die "IMAGE_EXTRAS=$IMAGE_EXTRAS: reading the wheel's requirements failed"
# Wheel platforms the base can run: manylinux2014 and manylinux_2_17 up to its glibc.
platforms=(--platform "manylinux2014_$machine")
glibc_minor="${libc_version#*.}"
glibc_minor="${glibc_minor%%.*}"
for ((m = 17; m <= glibc_minor; m++)); do platforms+=(--platform "manylinux_2_${m}_$machine"); done
download_wheels() { # $1: destination, $2: requirements file, $3: log name under .build
    "$PYTHON" -m pip download --quiet --dest "$1" --only-binary=:all: \
        --implementation cp --python-version "$py_version" \
        --abi "cp${py_version/./}" --abi abi3 --abi none "${platforms[@]}" \
        -r "$2" >"$BUILD_DIR/$3" 2>&1 ||
        { tail -n 20 "$BUILD_DIR/$3" >&2; die "pip download failed (log: $BUILD_DIR/$3)"; }
}
deps_key="$(printf '%s\n' "$requirements" "python=$py_version" "machine=$machine" "glibc=$libc_version" | sha256sum | cut -d' ' -f1)"
if [ "${REFRESH_WHEELS:-0}" = 1 ] || [ "$(cat "$deps_dir/.stamp" 2>/dev/null)" != "$deps_key" ]; then
    new_temp_dir deps
    work="$TEMP_DIR"
    mkdir -p "$work/deps"
    if [ -n "$requirements" ]; then
        log "downloading wheels for: $(tr '\n' ' ' <<<"$requirements")(cp${py_version/./}, $machine, glibc $libc_version)"
        printf '%s\n' "$requirements" >"$work/requested.txt"
        download_wheels "$work/deps" "$work/requested.txt" pip-download.log
    fi
    : >"$work/deps/requirements.txt"
    for w in "$work"/deps/*.whl; do
        [ -f "$w" ] || continue
        w="$(basename "$w")"
        printf '%s==%s\n' "${w%%-*}" "$(cut -d- -f2 <<<"$w")" >>"$work/deps/requirements.txt"
    done
    printf '%s\n' "$deps_key" >"$work/deps/.stamp"
    rm -rf "$deps_dir"
    mv "$work/deps" "$deps_dir"
fi

# The [gpu] extra's wheels (cupy, NVRTC, the CUDA headers, NCCL: ~580 MB), for TARGET=cuda only.
# Resolved together with the runtime dependencies, so that both agree (numpy); what deps/ holds
# already is left out. They are kept in .build/gpu-wheels, and the context gets hard links to
# them only for a cuda build: a cpu build does not send them to the engine.
rm -rf "$OFFLINE/gpu-wheels"
mkdir -p "$OFFLINE/gpu-wheels"
if [ "$TARGET" = cuda ]; then
    gpu_requirements="$(wheel_requirements gpu 0)"
    [ -n "$gpu_requirements" ] || die "the distlib wheel has no [gpu] extra (pyproject.toml): nothing for the cuda image"
    gpu_key="$(printf '%s\n' "$deps_key" "$gpu_requirements" | sha256sum | cut -d' ' -f1)"
    if [ "${REFRESH_WHEELS:-0}" = 1 ] || [ "$(cat "$GPU_WHEELS/.stamp" 2>/dev/null)" != "$gpu_key" ]; then
        new_temp_dir gpu
        work="$TEMP_DIR"
        mkdir -p "$work/all" "$work/gpu"
        log "downloading the [gpu] wheels: $(tr '\n' ' ' <<<"$gpu_requirements")(cp${py_version/./}, $machine, glibc $libc_version)"
        printf '%s\n' "$requirements" "$gpu_requirements" >"$work/requested.txt"
        download_wheels "$work/all" "$work/requested.txt" pip-download-gpu.log
        : >"$work/gpu/requirements.txt"
        for w in "$work"/all/*.whl; do
            [ -f "$w" ] || continue
            w="$(basename "$w")"
            [ -e "$deps_dir/$w" ] && continue
            mv "$work/all/$w" "$work/gpu/"
            printf '%s==%s\n' "${w%%-*}" "$(cut -d- -f2 <<<"$w")" >>"$work/gpu/requirements.txt"
        done
        printf '%s\n' "$gpu_key" >"$work/gpu/.stamp"
        rm -rf "$GPU_WHEELS"
        mv "$work/gpu" "$GPU_WHEELS"
    fi
    cp -al "$GPU_WHEELS/." "$OFFLINE/gpu-wheels/" 2>/dev/null || cp -a "$GPU_WHEELS/." "$OFFLINE/gpu-wheels/"
fi

# .deb files for ip/ps/ssh/sshd when the base lacks them (python:3.11-slim does): when the host runs the
# same Debian release, the host's apt resolves them against the base's own dpkg status and
# downloads exactly what is missing; else the build falls back to apt-get inside the build,
# which needs a network.
download_debs() { # $@: packages; fills $OFFLINE/debs; returns non-zero when it could not
    local host_codename work
    # shellcheck source=/dev/null
    host_codename="$(. "$OS_RELEASE" 2>/dev/null && echo "${VERSION_CODENAME:-}")" || true
    command -v apt-get >/dev/null 2>&1 && [ -n "$host_codename" ] && [ "$host_codename" = "$(probe codename)" ] ||
        return 1
    log "base lacks $*: fetching the .deb files with the host's apt (resolved against the base's dpkg status)"
    new_temp_dir debs
    work="$TEMP_DIR"
    mkdir -p "$work/archives/partial"
    docker run --rm --network none --user 0 --entrypoint cat "$base" /var/lib/dpkg/status >"$work/status" ||
        return 1
    apt_download() {
        apt-get install --download-only --yes --no-install-recommends \
            -o Dir::State::status="$work/status" -o Dir::Cache::archives="$work/archives/" \
            -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache= \
            -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)" "$@"
    }
    if ! apt_download "$@" >"$BUILD_DIR/apt-download.log" 2>&1; then
        # The host's package lists may be missing or stale: refresh them once (root only).
        if [ "$(id -u)" != 0 ] || ! apt-get update -qq >>"$BUILD_DIR/apt-download.log" 2>&1 ||
            ! apt_download "$@" >>"$BUILD_DIR/apt-download.log" 2>&1; then
            log "apt could not fetch $* (log: $BUILD_DIR/apt-download.log)"
            return 1
        fi
    fi
    mv "$work"/archives/*.deb "$OFFLINE/debs/"
}

build_network=none
missing=()
[ "$(probe has_ip)" = 1 ] || missing+=(iproute2)
[ "$(probe has_ps)" = 1 ] || missing+=(procps)
[ "$(probe has_ssh)" = 1 ] || missing+=(openssh-client)
[ "$(probe has_sshd)" = 1 ] || missing+=(openssh-server)
debs_key="$(printf '%s\n' "$base_id" "${missing[@]+"${missing[@]}"}" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$OFFLINE/debs/.stamp" 2>/dev/null)" != "$debs_key" ]; then
    rm -rf "$OFFLINE/debs"
    mkdir -p "$OFFLINE/debs"
    if [ "${#missing[@]}" = 0 ] || download_debs "${missing[@]}"; then
        printf '%s\n' "$debs_key" >"$OFFLINE/debs/.stamp"
    fi
fi
if [ "${#missing[@]}" -gt 0 ] && ! ls "$OFFLINE"/debs/*.deb >/dev/null 2>&1; then
    log "base lacks ${missing[*]} and no .deb files could be had: the build installs them with apt-get (needs network)"
    build_network=default
fi

# --- step 4: the context and the build's arguments ----------------------------------------------
# The sources again, beside the wheelhouse: the Dockerfile's wheelhouse stage copies them in
# either mode (a plain build makes its wheel from them; here the prepared wheel is used).
rm -rf "$CONTEXT/distlib" "$CONTEXT/deploy" "$CONTEXT/wheels" "$CONTEXT/debs" # (the last two: an older layout)
for f in pyproject.toml setup.py setup.cfg MANIFEST.in README.md README.rst LICENSE LICENSE.txt; do
    rm -f "${CONTEXT:?}/$f"
done
list_sources | tar -C "$ROOT" --null -T - -cf - | tar -C "$CONTEXT" -xf -
{
    printf 'BASE_IMAGE=%s\n' "$base"
    printf 'DISTLIB_VERSION=%s\n' "$version"
    printf 'BUILD_NETWORK=%s\n' "$build_network"
    printf 'REPLACED_BASE_ID=%s\n' "$REPLACED_BASE_ID"
} >"$BUILD_ENV.tmp"
mv "$BUILD_ENV.tmp" "$BUILD_ENV"
log "prepared $CONTEXT (base $base, distlib $version, wheels for Python $py_version) in ${SECONDS}s"
