#!/usr/bin/env bash
# A base image from Debian's packages, for machines that reach no image registry:
#   deploy/compose/base-image.sh [TAG]        (default millstream-base:bookworm)
# debootstrap a minimal Debian 12 (its python3 is 3.11) with venv support, redis-server and
# CA certificates, then `docker import` it. prepare.sh runs it when no registry answers and
# records the tag as BASE_IMAGE in .env; every image here is built FROM it then.
# Needs root, debootstrap and a Debian mirror (MIRROR, default deb.debian.org).
set -euo pipefail
TAG="${1:-millstream-base:bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "[base-image] $TAG exists"; exit 0
fi
ROOTFS="$(mktemp -d /tmp/millstream-rootfs.XXXXXX)"
trap 'rm -rf "$ROOTFS"' EXIT
echo "[base-image] debootstrap bookworm into $ROOTFS (a few minutes)"
debootstrap --variant=minbase \
  --include=python3,python3-venv,python3-pip,redis-server,redis-tools,ca-certificates,curl \
  bookworm "$ROOTFS" "$MIRROR" >/dev/null
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
echo "[base-image] docker import -> $TAG"
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "[base-image] ready: $TAG"
