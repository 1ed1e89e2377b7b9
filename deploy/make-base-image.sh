#!/usr/bin/env bash
# Make the images' base, cardiofl/base:bookworm, from Debian's packages alone (no image registry):
# debootstrap a minimal bookworm with Python 3.11, venv, CA certificates and tini, bring it up to date
# with bookworm-updates and bookworm-security, and `docker import` it.
#
#   deploy/make-base-image.sh            # skips the work when the image already exists
#   deploy/make-base-image.sh --force    # rebuild it (e.g. monthly, for security updates)
#
# Needs root (debootstrap), Docker, and Debian's package mirror: the one this host's apt uses, or
# MIRROR / SECURITY_MIRROR. Installs debootstrap with apt-get when it is missing. Takes about a
# minute. BASE_IMAGE names the image (the Dockerfiles' build argument of the same name).
set -euo pipefail

BASE_IMAGE="${BASE_IMAGE:-cardiofl/base:bookworm}"
SUITE="${SUITE:-bookworm}"
PACKAGES="${PACKAGES:-python3,python3-venv,ca-certificates,tini}"
force=false
[ "${1:-}" = "--force" ] && force=true

if ! $force && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "base image $BASE_IMAGE exists (--force rebuilds it)"
    exit 0
fi

# The mirror this host's apt already uses for a suite (deb822 .sources or one-line .list), else Debian's.
apt_mirror() {
    local suite="$1" fallback="$2" found=""
    found=$(awk -v suite="$suite" '
        /^[[:space:]]*$/ { if (uri != "" && has) { print uri; exit } uri = ""; has = 0; next }
        /^URIs:/ { uri = $2 }
        /^Suites:/ { for (i = 2; i <= NF; i++) if ($i == suite) has = 1 }
        END { if (uri != "" && has) print uri }
    ' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)
    if [ -z "$found" ]; then
        found=$(awk -v suite="$suite" '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { if ($(i+1) == suite) print $i; break } }' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1)
    fi
    echo "${found:-$fallback}"
}
MIRROR="${MIRROR:-$(apt_mirror "$SUITE" http://deb.debian.org/debian)}"
SECURITY_MIRROR="${SECURITY_MIRROR:-$(apt_mirror "$SUITE-security" http://deb.debian.org/debian-security)}"

if ! command -v debootstrap >/dev/null; then
    apt-get install -y -q debootstrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
fi

rootfs="$(mktemp -d "${TMPDIR:-/tmp}/cardiofl-rootfs.XXXXXX")"
cleanup() {
    umount "$rootfs/proc" 2>/dev/null || true
    if mountpoint -q "$rootfs/proc" 2>/dev/null; then
        echo "left $rootfs: $rootfs/proc is still mounted" >&2
    else
        rm -rf "$rootfs" "$rootfs.log"
    fi
}
trap cleanup EXIT

echo "debootstrap $SUITE from $MIRROR (security: $SECURITY_MIRROR)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
    || { tail -n 30 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"

cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY_MIRROR $SUITE-security main
EOF
mount -t proc proc "$rootfs/proc" 2>/dev/null || true
in_root() { DEBIAN_FRONTEND=noninteractive chroot "$rootfs" "$@" >>"$rootfs.log" 2>&1 || { tail -n 30 "$rootfs.log" >&2; exit 1; }; }
in_root apt-get -q -o APT::Sandbox::User=root update
in_root apt-get -y -q -o APT::Sandbox::User=root -o Dpkg::Options::=--force-confold upgrade
in_root apt-get clean
rm -f "$rootfs.log"
umount "$rootfs/proc" 2>/dev/null || true

# What a container never needs: package lists and caches (`apt-get update` brings the lists back),
# documentation, manual pages and translations.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/* "$rootfs"/tmp/* "$rootfs"/dev/*

tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE $MIRROR" \
    - "$BASE_IMAGE" >/dev/null
echo "made $BASE_IMAGE ($(docker image inspect -f '{{.Size}}' "$BASE_IMAGE" | awk '{printf "%.0f MB", $1 / 1e6}'))"
