#!/bin/sh
# A Debian base image for compose/Dockerfile where no registry image can be pulled
# (docker import of a debootstrap tree: about a minute). Usage: base-image.sh [TAG]
# Needs root, debootstrap (installed with apt-get if missing) and Debian's mirror.
set -eu
tag=${1:-yuebing-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null \
  || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# python3 and venv for the image's virtual environment; ca-certificates for pip.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
tar -C "$root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "built $tag"
