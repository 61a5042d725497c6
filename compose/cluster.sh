#!/usr/bin/env bash
# The Compose cluster: what `make cluster-up`, `make cluster-down` and `make cluster-logs` run.
#
#   compose/cluster.sh up      build the image if needed, start the cluster, run the job to the
#                              end, print its report; exit status = the job's (0: success)
#   compose/cluster.sh down    remove every container, network and volume the cluster created
#   compose/cluster.sh logs    follow the logs of the last run (Ctrl-C stops following)
#   compose/cluster.sh ps      the last run's containers
#   compose/cluster.sh report  print the last run's report again
#   compose/cluster.sh config  print the merged Compose file `up` would use
#
# Environment:
#   MODE          tcp (default) | rank0 | file | nfs   the rendezvous mode (docs/cluster.md)
#   NODES         worker containers (default 4), each its own host
#   NPROC_PER_NODE  processes per worker container (default 1)
#   IMAGE         image to run (default distlib:cpu); built/updated by docker/build-image.sh
#   SKIP_BUILD    1: use IMAGE as it is (do not run docker/build-image.sh)
#   JOB_ARGS      extra arguments of the job, e.g. "--epochs 3 --bench-sizes 4KiB,1MiB,16MiB"
#   JOB_MODULE    the job (default distlib.jobs.train_dp)
#   NFS_SERVER, NFS_PATH  MODE=file: the shared volume is this NFS export (also NFS_VERSION,
#                 default 4.1, and NFS_OPTIONS, e.g. ",port=2049")
#   COMPOSE       the Compose command (default: `docker compose` if present, else docker-compose)
#   CLUSTER_TIMEOUT  seconds the job may run before it is stopped (default 900)
#   CLUSTER_STATE_DIR  where runs are recorded (default .build/cluster)
#   QUIET         1: do not stream the workers' logs while the job runs
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMPOSE_DIR="$ROOT/compose"
IMAGE="${IMAGE:-distlib:cpu}"
NODES="${NODES:-4}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
MODE="${MODE:-tcp}"
CLUSTER_TIMEOUT="${CLUSTER_TIMEOUT:-900}"
STATE_DIR="${CLUSTER_STATE_DIR:-$ROOT/.build/cluster}"
LABEL=org.distlib.cluster
GIVEN_RUN_ID="${RUN_ID:-}" # a run id from the caller; otherwise every `up` makes a new one

say() { printf 'cluster: %s\n' "$*" >&2; }
die() { say "$*"; exit "${2:-1}"; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

# --- Docker and Compose ------------------------------------------------------------------------

need_docker() {
    command -v docker >/dev/null 2>&1 ||
        die "Docker is not installed (the cluster runs in Docker containers); \`make demo\` runs a master service and 4 local processes without Docker"
    local err
    if ! err="$(timeout -k 5 20 docker version --format '{{.Server.Version}}' 2>&1 >/dev/null)"; then
        err="$(printf '%s' "$err" | grep -v '^[[:space:]]*$' | tail -n 1 | tr -s '[:space:]' ' ')"
        die "the Docker engine is not reachable (${err:-no answer}); start it, or run \`make demo\` for a master service and 4 local processes without Docker"
    fi
}

COMPOSE_CMD=()
find_compose() {
    if [ -n "${COMPOSE:-}" ]; then
        read -r -a COMPOSE_CMD <<<"$COMPOSE"
    elif [ -n "${COMPOSE_OF_RUN:-}" ]; then # the one that started the recorded run
        read -r -a COMPOSE_CMD <<<"$COMPOSE_OF_RUN"
    elif docker compose version >/dev/null 2>&1; then
        COMPOSE_CMD=(docker compose)
    elif command -v docker-compose >/dev/null 2>&1; then
        COMPOSE_CMD=(docker-compose)
    else
        die "neither \`docker compose\` (Compose v2) nor \`docker-compose\` is installed; install one (e.g. apt-get install docker-compose), or run \`make demo\` without containers"
    fi
    COMPOSE_VERSION="$("${COMPOSE_CMD[@]}" version --short 2>/dev/null || "${COMPOSE_CMD[@]}" version 2>/dev/null | sed -n 1p)"
}

# The owner label: resources of runs recorded in this state directory (so that `down` never
# touches clusters started from another checkout, or by the tests).
owner_id() { printf '%s' "$STATE_DIR" | sha256sum | cut -c1-12; }

compose_files() { # $1: mode → the -f arguments
    local mode="$1" files=()
    files=(-f "$COMPOSE_DIR/docker-compose.yml" -f "$COMPOSE_DIR/mode-$mode.yml")
    if [ "$mode" = file ] && [ -n "${NFS_SERVER:-}" ]; then
        files+=(-f "$COMPOSE_DIR/nfs-volume.yml")
    fi
    printf '%s\n' "${files[@]}"
}

compose() { # runs Compose for the recorded/current project: needs PROJECT and FILES set
    "${COMPOSE_CMD[@]}" -p "$PROJECT" "${FILES[@]}" "$@"
}

# --- the state of the last run ----------------------------------------------------------------

load_state() { # sets PROJECT, RUN_ID, MODE_OF_RUN, FILES from $STATE_DIR/current; 1 if none
    [ -s "$STATE_DIR/current" ] || return 1
    PROJECT="" RUN_ID="" MODE_OF_RUN="" NODES_OF_RUN="" IMAGE_OF_RUN="" NFS_ENV="" COMPOSE_OF_RUN="" FILES_TEXT=""
    # shellcheck source=/dev/null
    . "$STATE_DIR/current"
    [ -n "$PROJECT" ] || return 1
    local paths p
    IFS=: read -r -a paths <<<"$FILES_TEXT"
    FILES=()
    for p in "${paths[@]}"; do FILES+=(-f "$p"); done
    return 0
}

save_state() {
    mkdir -p "$STATE_DIR/$PROJECT"
    local files_text
    files_text="$(printf '%s\n' "${FILES[@]}" | grep -v '^-f$' | paste -sd: -)"
    {
        printf 'PROJECT=%q\nRUN_ID=%q\nMODE_OF_RUN=%q\nNODES_OF_RUN=%q\nIMAGE_OF_RUN=%q\nFILES_TEXT=%q\n' \
            "$PROJECT" "$RUN_ID" "$MODE" "$NODES" "$IMAGE" "$files_text"
        printf 'NFS_ENV=%q\n' "NFS_SERVER=${NFS_SERVER:-} NFS_PATH=${NFS_PATH:-}"
        printf 'COMPOSE_OF_RUN=%q\n' "${COMPOSE_CMD[*]}"
    } >"$STATE_DIR/current.tmp"
    mv "$STATE_DIR/current.tmp" "$STATE_DIR/current"
}

export_run_env() { # what the Compose files interpolate
    export RUN_ID IMAGE NODES NPROC_PER_NODE CLUSTER_OWNER
    export JOB_ARGS="${JOB_ARGS:-}" JOB_MODULE="${JOB_MODULE:-distlib.jobs.train_dp}"
}

# --- removing ---------------------------------------------------------------------------------

remove_by_label() { # $1: label filter; containers, then networks, then volumes. 1 if any stayed
    local ids=() id err left=0
    mapfile -t ids < <(docker ps -aq --filter "label=$1")
    [ "${#ids[@]}" = 0 ] || docker rm -f -v "${ids[@]}" >/dev/null 2>&1 || true
    for id in $(docker network ls -q --filter "label=$1"); do
        if ! err="$(docker network rm "$id" 2>&1 >/dev/null)"; then
            left=1
            err="${err%%$'\n'*}"
            say "could not remove network $(docker network inspect -f '{{.Name}}' "$id" 2>/dev/null || echo "$id"): ${err#Error response from daemon: }"
            case "$err" in *"active endpoints"*)
                say "  (no container uses it: a network endpoint leaked inside the Docker engine; restarting the engine clears it)" ;;
            esac
        fi
    done
    for id in $(docker volume ls -q --filter "label=$1"); do
        if ! err="$(docker volume rm -f "$id" 2>&1 >/dev/null)"; then
            left=1
            err="${err%%$'\n'*}"
            say "could not remove volume $id: ${err#Error response from daemon: }"
        fi
    done
    return "$left"
}

cmd_down() {
    need_docker
    CLUSTER_OWNER="$(owner_id)"
    local found=0
    if load_state; then
        found=1
        find_compose
        RUN_ID="${RUN_ID:-none}"
        NODES="${NODES_OF_RUN:-$NODES}" IMAGE="${IMAGE_OF_RUN:-$IMAGE}"
        export_run_env
        # shellcheck disable=SC2086
        env $NFS_ENV "${COMPOSE_CMD[@]}" -p "$PROJECT" "${FILES[@]}" down -v --remove-orphans -t 5 \
            >"$STATE_DIR/$PROJECT/compose-down.log" 2>&1 ||
            say "compose down reported a problem (see $STATE_DIR/$PROJECT/compose-down.log); removing by label"
        if remove_by_label "com.docker.compose.project=$PROJECT"; then
            say "removed $PROJECT (containers, network, volumes)"
        fi
        rm -f "$STATE_DIR/current"
    fi
    # Anything else this state directory's runs left (a crashed cluster.sh, a lost state file).
    local left
    left="$(docker ps -aq --filter "label=$LABEL.owner=$CLUSTER_OWNER"; docker network ls -q --filter "label=$LABEL.owner=$CLUSTER_OWNER"; docker volume ls -q --filter "label=$LABEL.owner=$CLUSTER_OWNER")"
    if [ -n "$left" ]; then
        found=1
        if remove_by_label "$LABEL.owner=$CLUSTER_OWNER"; then say "removed leftovers of earlier runs"; fi
    fi
    [ "$found" = 1 ] || say "nothing to remove: no cluster was started from here"
}

# --- up ---------------------------------------------------------------------------------------

new_run_id() { printf 'r%s-%s' "$(date +%Y%m%d-%H%M%S)" "$(head -c 3 /dev/urandom | od -An -tx1 | tr -d ' \n')"; }

LOGS_PID=""
stop_logs() {
    if [ -n "$LOGS_PID" ]; then
        kill "$LOGS_PID" 2>/dev/null || true
        wait "$LOGS_PID" 2>/dev/null || true
        LOGS_PID=""
    fi
}

volume_of() { # $1: volume name in the Compose file → its Docker name for this project
    docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.volume=$1" | sed -n 1p
}

read_report() { # copy report.txt and report.json out of the reports volume into the run's state dir
    local vol
    vol="$(volume_of reports)"
    [ -n "$vol" ] || return 1
    rm -f "$STATE_DIR/$PROJECT/report.txt" "$STATE_DIR/$PROJECT/report.json"
    docker run --rm --network none -v "$vol:/r:ro" --entrypoint sh "$IMAGE" -c \
        'cd /r && tar -cf - $(ls report.txt report.json 2>/dev/null)' 2>/dev/null |
        tar -C "$STATE_DIR/$PROJECT" -xf - 2>/dev/null || return 1
    [ -s "$STATE_DIR/$PROJECT/report.txt" ]
}

# A Docker FinishedAt time (RFC 3339, its fraction of a second trimmed of trailing zeros)
# with a 9-digit fraction, so that times sort as strings: "…:05.5Z" < "…:05.12Z" otherwise.
sortable_time() {
    local t="${1%Z}" frac=""
    case "$t" in *.*) frac="${t##*.}" t="${t%.*}" ;; esac
    frac="${frac}000000000"
    printf '%s.%sZ' "$t" "${frac:0:9}"
}

# The containers among $@ (ids) that exited with a non-zero status, one "id status" line each,
# the root cause first. A worker whose ranks failed because a peer died ("... died, was killed, or
# destroyed its process group", "(reported by rank K ...)") often exits before the one that
# died, so those followers go last; then by exit time.
failed_root_cause_first() {
    local id code logs follower
    for id in "$@"; do
        code="$(docker inspect -f '{{.State.ExitCode}}' "$id" 2>/dev/null || echo 1)"
        [ "$code" != 0 ] || continue
        # The whole log is read before grep looks at it: in `docker logs | grep -q` grep stops
        # at the first match, docker logs may die of SIGPIPE, and pipefail then calls the
        # follower a root cause.
        logs="$(docker logs "$id" 2>&1 || true)"
        follower=0
        if grep -qE 'died, was killed, or destroyed its process group|\(reported by rank [0-9]+' <<<"$logs"; then
            follower=1
        fi
        printf '%s %s %s %s\n' "$follower" "$(sortable_time "$(docker inspect -f '{{.State.FinishedAt}}' "$id" 2>/dev/null || true)")" "$id" "$code"
    done | LC_ALL=C sort | cut -d' ' -f3,4
}

cmd_up() {
    case "$MODE" in tcp | rank0 | file | nfs) ;; *) die "MODE=$MODE: choose tcp, rank0, file or nfs (docs/cluster.md)" 2 ;; esac
    [[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "NODES=$NODES: a positive number of worker containers" 2
    [[ "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE=$NPROC_PER_NODE: a positive number" 2
    if [ "$MODE" = file ] && { [ -n "${NFS_SERVER:-}" ] || [ -n "${NFS_PATH:-}" ]; } &&
        { [ -z "${NFS_SERVER:-}" ] || [ -z "${NFS_PATH:-}" ]; }; then
        die "set both NFS_SERVER and NFS_PATH (the NFS export for the shared volume), or neither" 2
    fi
    need_docker
    find_compose
    mkdir -p "$STATE_DIR"
    CLUSTER_OWNER="$(owner_id)"

    if load_state; then
        say "removing the previous run $PROJECT first (make cluster-down does this too)"
        (cmd_down) || true
    fi

    if [ "${SKIP_BUILD:-0}" = 1 ]; then
        docker image inspect "$IMAGE" >/dev/null 2>&1 || die "SKIP_BUILD=1 but image $IMAGE does not exist (make image builds it)"
    else
        if docker image inspect "$IMAGE" >/dev/null 2>&1; then
            say "checking that $IMAGE holds this working tree (docker/build-image.sh; seconds when it does)"
        else
            say "image $IMAGE not found: building it with docker/build-image.sh (offline; minutes the first time)"
        fi
        mkdir -p "$ROOT/.build"
        IMAGE="$IMAGE" "$ROOT/docker/build-image.sh" >"$STATE_DIR/build-image.log" 2>&1 || {
            tail -n 20 "$STATE_DIR/build-image.log" >&2
            die "building $IMAGE failed (log: $STATE_DIR/build-image.log)"
        }
    fi
    if [ "$MODE" = nfs ]; then
        "$COMPOSE_DIR/nfs/build-nfs-image.sh" >"$STATE_DIR/build-nfs-image.log" 2>&1 || {
            tail -n 20 "$STATE_DIR/build-nfs-image.log" >&2
            die "building the NFS server image failed (log: $STATE_DIR/build-nfs-image.log)"
        }
    fi

    RUN_ID="${GIVEN_RUN_ID:-$(new_run_id)}"
    [[ "$RUN_ID" =~ ^[a-z0-9][a-z0-9-]*$ ]] || die "RUN_ID=$RUN_ID: lower-case letters, digits and '-' only (it names the Compose project)" 2
    PROJECT="distlib-$RUN_ID"
    mapfile -t FILES < <(compose_files "$MODE")
    save_state
    export_run_env
    local run_dir="$STATE_DIR/$PROJECT"
    say "run $RUN_ID: $NODES worker container(s) x $NPROC_PER_NODE process(es), mode $MODE, image $IMAGE, ${COMPOSE_CMD[*]} $COMPOSE_VERSION (project $PROJECT)"

    local started=$SECONDS
    if ! compose up -d --no-build --scale "worker=$NODES" >"$run_dir/compose-up.log" 2>&1; then
        grep -v '^\s*$' "$run_dir/compose-up.log" | tail -n 15 | sed 's/^/cluster:   | /' >&2
        compose logs --no-color --tail 20 >"$run_dir/logs-on-failure.txt" 2>&1 || true
        if grep -q 'failed to mount local volume.*no such device' "$run_dir/compose-up.log"; then
            die "the Docker host's kernel cannot mount NFS (mount(2) of the NFS volume failed with ENODEV, \"no such device\": no nfs/nfs4 file system in this kernel; load it with \`modprobe nfs\` where the kernel has the module). Use MODE=file for a local shared volume; make cluster-down removes what was created"
        fi
        die "starting the cluster failed (${COMPOSE_CMD[*]} up; log: $run_dir/compose-up.log); make cluster-down removes what was created"
    fi
    local ids
    mapfile -t ids < <(compose ps -q worker)
    if [ "${#ids[@]}" -ne "$NODES" ]; then
        die "expected $NODES worker containers, Compose started ${#ids[@]} (see $run_dir/compose-up.log)"
    fi
    say "$NODES workers started in $((SECONDS - started)) s; the job is running (logs: make cluster-logs)"

    if [ "${QUIET:-0}" != 1 ]; then
        # rank 0's report is printed once, at the end: not here
        compose logs -f --no-color worker 2>/dev/null |
            awk '/distlib train_dp report/ { if (!hid) print "  (the report follows below)"; hid = 1 }
                 hid && !/exited with code/ { next }
                 { print "  " $0; fflush() }' >&2 &
        LOGS_PID=$!
    fi
    trap 'stop_logs; say "interrupted: the cluster is left as it is (make cluster-logs, make cluster-down)"; exit 130' INT TERM

    local status=0 timed_out=0
    if ! timeout "$CLUSTER_TIMEOUT" docker wait "${ids[@]}" >/dev/null; then
        timed_out=1
    fi
    sleep 0.5 # the last log lines
    stop_logs
    trap - INT TERM
    if [ "$timed_out" = 1 ]; then
        say "the job ran past CLUSTER_TIMEOUT=${CLUSTER_TIMEOUT}s: stopping the workers"
        docker stop -t 5 "${ids[@]}" >/dev/null 2>&1 || true
        status=124
    fi
    if [ "$MODE" = tcp ] || [ "$MODE" = nfs ]; then
        compose stop -t 5 >/dev/null 2>&1 || true # the master service / the NFS server
    fi

    # Which containers failed, the root cause first. The job's exit status is the root cause's.
    local id name code failed=() failed_ids=()
    while read -r id code; do
        failed_ids+=("$id")
        name="$(docker inspect -f '{{.Name}}' "$id" 2>/dev/null | sed 's,^/,,')"
        if [ "$status" = 0 ]; then
            status="$code"
            failed+=("$name exited with $code (the first failure)")
        else
            failed+=("$name exited with $code")
        fi
    done < <(failed_root_cause_first "${ids[@]}")
    [[ "$status" =~ ^[0-9]+$ ]] || status=1

    if read_report; then
        echo
        cat "$run_dir/report.txt"
        echo
    else
        say "no report was written (rank 0 did not get that far)"
    fi
    if [ "${#failed[@]}" -gt 0 ]; then
        for name in "${failed[@]}"; do say "FAILED: $name"; done
        for id in "${failed_ids[@]}"; do
            name="$(docker inspect -f '{{.Name}}' "$id" 2>/dev/null | sed 's,^/,,')"
            say "$name:"
            # the lines that say what happened (the job's FAILED line, the launcher's verdict),
            # else the last lines
            docker logs "$id" 2>&1 | grep -E 'FAILED|worker failed|Error: |error: ' | grep -v '^distlib-run:   |' |
                cut -c1-400 | tail -n 4 | sed 's/^/cluster:   | /' >&2 ||
                docker logs --tail 6 "$id" 2>&1 | sed 's/^/cluster:   | /' >&2
        done
        say "job FAILED in $((SECONDS - started)) s (exit status $status); all logs: make cluster-logs; remove: make cluster-down"
        exit "$status"
    fi
    say "job succeeded in $((SECONDS - started)) s; report: $run_dir/report.txt and report.json; remove: make cluster-down"
}

# --- logs, ps, report, config -----------------------------------------------------------------

with_last_run() {
    load_state || die "no cluster run recorded in $STATE_DIR (make cluster-up starts one)"
    need_docker
    find_compose
    RUN_ID="${RUN_ID:-none}"
    NODES="${NODES_OF_RUN:-$NODES}" IMAGE="${IMAGE_OF_RUN:-$IMAGE}"
    CLUSTER_OWNER="$(owner_id)"
    export_run_env
}

# Sourced (the tests do, to call its functions): define them, run nothing.
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

case "${1:-}" in
up) cmd_up ;;
down) cmd_down ;;
logs)
    with_last_run
    say "following the logs of $PROJECT (mode ${MODE_OF_RUN:-?}; Ctrl-C stops following, the cluster is not touched)"
    # shellcheck disable=SC2086
    exec env $NFS_ENV "${COMPOSE_CMD[@]}" -p "$PROJECT" "${FILES[@]}" logs -f --no-color
    ;;
ps)
    with_last_run
    # shellcheck disable=SC2086
    exec env $NFS_ENV "${COMPOSE_CMD[@]}" -p "$PROJECT" "${FILES[@]}" ps
    ;;
report)
    load_state || die "no cluster run recorded in $STATE_DIR (make cluster-up starts one)"
    [ -s "$STATE_DIR/$PROJECT/report.txt" ] || die "run $RUN_ID wrote no report"
    cat "$STATE_DIR/$PROJECT/report.txt"
    ;;
config)
    find_compose
    RUN_ID="${RUN_ID:-config}"
    CLUSTER_OWNER="$(owner_id)"
    export_run_env
    mapfile -t FILES < <(compose_files "$MODE")
    exec "${COMPOSE_CMD[@]}" -p "distlib-config" "${FILES[@]}" config
    ;;
-h | --help | help) usage ;;
*)
    usage >&2
    exit 2
    ;;
esac
