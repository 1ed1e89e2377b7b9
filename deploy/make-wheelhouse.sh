#!/usr/bin/env bash
# Download every Python package the images install into a local wheelhouse, on the build host, so
# that `docker build` itself never needs the network: the Dockerfiles install from it with
# `pip install --no-index --find-links`.
#
#   deploy/make-wheelhouse.sh          # .wheelhouse/cpu:  torch's CPU build (coordinator, CPU agents)
#   deploy/make-wheelhouse.sh cuda     # .wheelhouse/cuda: PyPI's torch, whose CUDA runtime comes as
#                                      #   nvidia-* wheels (the host gives only the driver)
#
# The wheels are for the base image's Python (Debian bookworm: CPython 3.11, glibc 2.36, x86-64),
# whatever Python runs this script. PYTHON (default python3) runs pip, with pip's own configuration
# (index, find-links, certificates); when PYTHON is a virtual environment's, the versions it has
# installed (the ones the tests ran with) pin the image's. TORCH_SPEC overrides the torch
# requirement; the CPU build `torch==X+cpu` comes from pip's find-links or from
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu. Skips the download when nothing changed.
# Writes requirements.txt (every wheel, pinned) beside the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT="${1:-${VARIANT:-cpu}}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
case "$VARIANT" in
    cpu) TORCH_SPEC="${TORCH_SPEC:-torch==$TORCH_VERSION+cpu}" ;;
    # `===`: exactly PyPI's build, never a local `+cpu` one that `==` would also accept.
    cuda) TORCH_SPEC="${TORCH_SPEC:-torch===$TORCH_VERSION}" ;;
    *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
WHEELHOUSE="${WHEELHOUSE:-.wheelhouse/$VARIANT}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The project's dependencies, read from pyproject.toml (torch comes from TORCH_SPEC).
"$PYTHON" - pyproject.toml >"$work/requirements.in" <<'EOF'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].strip().lower() != "torch"))
EOF
echo "$TORCH_SPEC" >>"$work/requirements.in"
# Build tools for the project's own wheel (pyproject's build-system), and a current pip.
echo "pip" >>"$work/requirements.in"
"$PYTHON" - pyproject.toml >>"$work/requirements.in" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["build-system"]["requires"]))
EOF

# Pin to what the test environment runs, when PYTHON is a virtual environment's.
: >"$work/constraints.txt"
if "$PYTHON" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
    "$PYTHON" -m pip freeze --exclude-editable 2>/dev/null \
        | grep -E '^[A-Za-z0-9._-]+==[^ ;@]+$' | grep -viE '^(torch|cardiofl|pip|setuptools)==' \
        >"$work/constraints.txt" || true
fi

platforms=()
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
target=(--only-binary=:all: "${platforms[@]}" --python-version 3.11 --implementation cp
    --abi cp311 --abi abi3 --abi none)

key="$(cat "$work/requirements.in" "$work/constraints.txt" <(echo "${target[*]}") | sha256sum | cut -d' ' -f1)"
if [ -f "$WHEELHOUSE/.key" ] && [ "$(cat "$WHEELHOUSE/.key")" = "$key" ] && [ -f "$WHEELHOUSE/requirements.txt" ]; then
    echo "wheelhouse $WHEELHOUSE is up to date ($(du -sh "$WHEELHOUSE" | cut -f1))"
    exit 0
fi

rm -rf "$WHEELHOUSE.new"
mkdir -p "$WHEELHOUSE.new"
case "$WHEELHOUSE" in  # downloaded, never versioned
    .wheelhouse/*) [ -f .wheelhouse/.gitignore ] || printf '# made by deploy/make-wheelhouse.sh\n*\n' >.wheelhouse/.gitignore ;;
esac
"$PYTHON" -m pip download -q --disable-pip-version-check --progress-bar off "${target[@]}" \
    -c "$work/constraints.txt" -r "$work/requirements.in" -d "$WHEELHOUSE.new" 2> >(grep -v 'is ignored: it is neither' >&2)

# Every wheel, pinned, but the tools (pip, and the build requirements installed by pip when it
# builds the project's wheel).
(cd "$WHEELHOUSE.new" && ls -1 ./*.whl) | sed 's|^\./||' | awk -F- '{ print $1 "==" $2 }' \
    | grep -viE '^(pip|setuptools|wheel)==' | sort -f >"$WHEELHOUSE.new/requirements.txt"
echo "$key" >"$WHEELHOUSE.new/.key"
rm -rf "$WHEELHOUSE"
mv "$WHEELHOUSE.new" "$WHEELHOUSE"
echo "wheelhouse $WHEELHOUSE: $(wc -l <"$WHEELHOUSE/requirements.txt") packages, $(du -sh "$WHEELHOUSE" | cut -f1)"
