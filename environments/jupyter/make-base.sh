#!/bin/sh
# Make a Debian base image without any container registry: debootstrap a minimal Debian into a folder and
# `docker import` it. The runtime image is then built on it with --build-arg BASE_IMAGE=<tag>.
#
#   sudo environments/jupyter/make-base.sh [TAG] [SUITE] [MIRROR]
#
# Needs root, debootstrap (apt-get install debootstrap) and a reachable Debian mirror (or a local one).
set -eu
TAG="${1:-nbexec-base:bookworm}"
SUITE="${2:-bookworm}"
MIRROR="${3:-http://deb.debian.org/debian}"
command -v debootstrap >/dev/null || { echo "debootstrap is not installed: apt-get install debootstrap" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "debootstrap needs root" >&2; exit 2; }
ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/nbexec-rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap $SUITE from $MIRROR into $ROOTFS" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" >&2
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
echo "deb $MIRROR $SUITE main" > "$ROOTFS/etc/apt/sources.list"
tar -C "$ROOTFS" -c . | docker import --change 'CMD ["/bin/bash"]' - "$TAG" >&2
echo "$TAG"
