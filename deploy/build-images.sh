#!/usr/bin/env bash
# Build the container images with no network inside the builds (`make containers` runs this):
#   1. the base image, cardiofl/base:bookworm, from Debian's packages (make-base-image.sh; kept
#      between runs: skipped when it exists),
#   2. the wheelhouse, .wheelhouse/<variant>, on this host (make-wheelhouse.sh; skipped when current),
#   3. cardiofl/coordinator and cardiofl/site-agent:cpu (also tagged :latest) from deploy/*.Dockerfile,
#      which install only from the wheelhouse,
#   4. deploy/.debs on this host: the Debian packages `apt-get install postgresql` adds to the base
#      image (resolved by this host's apt against the base image's installed packages and package
#      sources; skipped when current), and cardiofl/postgres from deploy/postgres.Dockerfile, which
#      installs those files alone (deploy/compose.coordinator.yaml runs it).
#
#   deploy/build-images.sh          # the CPU images
#   deploy/build-images.sh cuda     # also cardiofl/site-agent:cuda (PyPI's torch with its CUDA wheels)
#
# Prints how long each step took and the images' sizes. Needs Docker, root (debootstrap) for the
# base image, Debian's mirror and pip's index for the first two steps, and apt and Debian's mirror for
# the packages. BASE_IMAGE, POSTGRES_PACKAGES (default postgresql) and PYTHON (the Python that runs
# pip; the Makefile passes the tested virtual environment's) pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

export BASE_IMAGE="${BASE_IMAGE:-cardiofl/base:bookworm}"
POSTGRES_PACKAGES="${POSTGRES_PACKAGES:-postgresql}"
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

# The packages of `apt-get install $POSTGRES_PACKAGES` that BASE_IMAGE lacks, as its own package
# sources have them now, into deploy/.debs (the context of deploy/postgres.Dockerfile's build). This
# host's apt resolves and downloads them, with the base image's dpkg status and sources.list in place
# of its own; keyed by the base image's id, so a rebuilt base image downloads them again. (`timed`
# runs it as a condition, where `set -e` does not apply: each step says when it failed.)
postgres_debs() {
    local out=deploy/.debs key work file
    key="$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE") $POSTGRES_PACKAGES" || return 1
    if [ -f "$out/.key" ] && [ "$(cat "$out/.key")" = "$key" ] && ls "$out"/*.deb >/dev/null 2>&1; then
        echo "$out is up to date ($(ls "$out"/*.deb | wc -l) packages, $(du -sh "$out" | cut -f1))"
        return 0
    fi
    work="$(mktemp -d)" || return 1
    mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/parts" "$work/cache"
    local apt=(apt-get -q -o Debug::NoLocking=1 -o APT::Sandbox::User=root -o Dir::State="$work"
        -o Dir::State::status="$work/status" -o Dir::State::Lists="$work/lists"
        -o Dir::Etc::SourceList="$work/sources.list" -o Dir::Etc::SourceParts="$work/parts"
        -o Dir::Etc::Preferences="$work/preferences" -o Dir::Etc::PreferencesParts="$work/parts"
        -o Dir::Cache="$work/cache" -o Dir::Cache::archives="$work/archives" -o APT::Install-Recommends=false)
    for file in /var/lib/dpkg/status /etc/apt/sources.list; do
        docker run --rm --network none --entrypoint cat "$BASE_IMAGE" "$file" >"$work/$(basename "$file")" \
            || { rm -rf "$work"; return 1; }
    done
    # shellcheck disable=SC2086  # a list of package names
    if ! "${apt[@]}" update >/dev/null || ! "${apt[@]}" install -y --download-only $POSTGRES_PACKAGES >/dev/null; then
        rm -rf "$work"
        return 1
    fi
    rm -rf "$out" && mkdir -p "$out" && mv "$work"/archives/*.deb "$out"/ || { rm -rf "$work"; return 1; }
    printf '# made by deploy/build-images.sh\n*\n' >"$out/.gitignore"  # downloaded, never versioned
    echo "$key" >"$out/.key"
    rm -rf "$work"
    echo "$out: $(ls "$out"/*.deb | wc -l) packages, $(du -sh "$out" | cut -f1)"
}

postgres_image() {  # the context is deploy/ (deploy/.dockerignore: the packages and the entrypoint)
    docker build -q -f deploy/postgres.Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t cardiofl/postgres deploy
}

built=("$BASE_IMAGE" cardiofl/coordinator cardiofl/site-agent:cpu cardiofl/postgres)
timed "base image $BASE_IMAGE" deploy/make-base-image.sh
timed "wheelhouse .wheelhouse/cpu" deploy/make-wheelhouse.sh cpu
timed "image cardiofl/coordinator" image deploy/coordinator.Dockerfile .wheelhouse/cpu cardiofl/coordinator
timed "image cardiofl/site-agent:cpu" image deploy/site-agent.Dockerfile .wheelhouse/cpu \
    cardiofl/site-agent:cpu cardiofl/site-agent:latest
timed "packages deploy/.debs ($POSTGRES_PACKAGES)" postgres_debs
timed "image cardiofl/postgres" postgres_image
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
