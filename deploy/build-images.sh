#!/usr/bin/env bash
# Build the container images with no network inside the builds (`make containers` runs this):
#   1. the base image, cardiofl/base:bookworm, from Debian's packages (make-base-image.sh; kept
#      between runs: skipped when it exists),
#   2. the wheelhouse, .wheelhouse/<variant>, on this host (make-wheelhouse.sh; skipped when current),
#   3. cardiofl/coordinator and cardiofl/site-agent:cpu (also tagged :latest) from deploy/*.Dockerfile,
#      which install only from the wheelhouse.
#
#   deploy/build-images.sh          # the CPU images
#   deploy/build-images.sh cuda     # also cardiofl/site-agent:cuda (PyPI's torch with its CUDA wheels)
#
# Prints how long each step took and the images' sizes. Needs Docker, root (debootstrap) for the
# base image, and Debian's mirror and pip's index for the first two steps. BASE_IMAGE and PYTHON
# (the Python that runs pip; the Makefile passes the tested virtual environment's) pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

export BASE_IMAGE="${BASE_IMAGE:-cardiofl/base:bookworm}"
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
total_start=$SECONDS

say() { echo "[build-images] $*"; }

timed() {  # timed LABEL COMMAND...: run it, its output to a log shown on failure
    local label="$1" start=$SECONDS log
    shift
    log="$logs/$(echo "$label" | tr -c 'a-z0-9' '-').log"
    if ! "$@" >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        say "$label: FAILED after $((SECONDS - start)) s"
        exit 1
    fi
    grep -vE 'legacy builder is deprecated|buildx|docs.docker.com|BuildKit is currently disabled|environment-variable|^ *$' "$log" \
        | grep -vE '^sha256:' | sed 's/^/    /' || true
    say "$label: $((SECONDS - start)) s"
}

image() {  # image DOCKERFILE WHEELHOUSE TAG...
    local dockerfile="$1" wheelhouse="$2" tags=()
    shift 2
    for tag in "$@"; do tags+=(-t "$tag"); done
    docker build -q -f "$dockerfile" --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELHOUSE="$wheelhouse" \
        "${tags[@]}" .
}

built=("$BASE_IMAGE" cardiofl/coordinator cardiofl/site-agent:cpu)
timed "base image $BASE_IMAGE" deploy/make-base-image.sh
timed "wheelhouse .wheelhouse/cpu" deploy/make-wheelhouse.sh cpu
timed "image cardiofl/coordinator" image deploy/coordinator.Dockerfile .wheelhouse/cpu cardiofl/coordinator
timed "image cardiofl/site-agent:cpu" image deploy/site-agent.Dockerfile .wheelhouse/cpu \
    cardiofl/site-agent:cpu cardiofl/site-agent:latest
for variant in "$@"; do
    case "$variant" in
        cpu) ;;
        cuda)
            timed "wheelhouse .wheelhouse/cuda" deploy/make-wheelhouse.sh cuda
            timed "image cardiofl/site-agent:cuda" image deploy/site-agent.Dockerfile .wheelhouse/cuda \
                cardiofl/site-agent:cuda
            built+=(cardiofl/site-agent:cuda)
            ;;
        *) echo "unknown variant $variant (cpu, cuda)" >&2; exit 2 ;;
    esac
done

say "built in $((SECONDS - total_start)) s:"
for tag in "${built[@]}"; do
    docker image inspect -f '{{.Size}}' "$tag" | awk -v tag="$tag" '{ printf "    %-28s %6.2f GB\n", tag, $1 / 1e9 }'
done
