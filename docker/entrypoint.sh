#!/bin/sh
# Container entrypoint: check the model repository, then hand the process over to the server.
#
#   entrypoint.sh [serve options]          -> python -m service serve [options]
#   entrypoint.sh serve|optimize|zoo ...   -> python -m service <command> ...
#   entrypoint.sh <any other command>      -> that command (e.g. sh, for debugging)
#
# `exec` replaces this shell, so the server is PID 1's direct process and receives SIGTERM from
# `docker stop` itself (a shell left in between would swallow it and the server would be SIGKILLed
# after the grace period, dropping in-flight requests).
#
# SERVICE_ADMIN_TOKEN_FILE: read the admin token from a file (a Docker/Compose secret) instead of
# passing it in the environment, where `docker inspect` would show it.
set -eu

fail() {
    echo "entrypoint: error: $*" >&2
    exit 64
}

# The model repository: --model-dir DIR or --model-dir=DIR on the command line, else SERVICE_MODEL_DIR.
model_dir_from_args() {
    dir=${SERVICE_MODEL_DIR:-models}
    while [ "$#" -gt 0 ]; do
        case $1 in
            --model-dir=*) dir=${1#--model-dir=} ;;
            --model-dir) [ "$#" -ge 2 ] || fail "--model-dir needs a value"; dir=$2; shift ;;
        esac
        shift
    done
    printf '%s\n' "$dir"
}

# The service writes new model versions and its optimization cache here: fail early and clearly
# rather than with a stack trace on the first upload.
check_model_dir() {
    dir=$1
    if [ -e "$dir" ] && [ ! -d "$dir" ]; then
        fail "model directory '$dir' exists but is not a directory"
    fi
    if [ ! -d "$dir" ] && ! mkdir -p "$dir" 2>/dev/null; then
        fail "cannot create model directory '$dir' as uid $(id -u); mount a volume there that this user can write"
    fi
    probe="$dir/.entrypoint-write-test.$$"
    if ! (: >"$probe") 2>/dev/null; then
        fail "model directory '$dir' is not writable by uid $(id -u) gid $(id -g);" \
            "fix the owner of the mounted volume (e.g. chown -R $(id -u):$(id -g) on the host)" \
            "or mount it read-write"
    fi
    rm -f "$probe"
}

load_token_file() {
    if [ -n "${SERVICE_ADMIN_TOKEN_FILE:-}" ]; then
        [ -r "$SERVICE_ADMIN_TOKEN_FILE" ] || fail "SERVICE_ADMIN_TOKEN_FILE '$SERVICE_ADMIN_TOKEN_FILE' is not readable"
        SERVICE_ADMIN_TOKEN=$(cat "$SERVICE_ADMIN_TOKEN_FILE")
        export SERVICE_ADMIN_TOKEN
        unset SERVICE_ADMIN_TOKEN_FILE
    fi
}

if [ "$#" -gt 0 ]; then
    case $1 in
        -*) ;;
        serve) shift ;;
        optimize | zoo) exec python -m service "$@" ;;
        *) exec "$@" ;;
    esac
fi

model_dir=$(model_dir_from_args "$@")
check_model_dir "$model_dir"
load_token_file
exec python -m service serve "$@"
