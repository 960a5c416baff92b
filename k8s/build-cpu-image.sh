#!/usr/bin/env bash
# Builds the CPU image with podman where no image registry can be reached: the base is a
# Debian bookworm root made here with debootstrap (its own python3, 3.11) and imported as
# a local image, then the Dockerfile is built on it with `podman build --isolation chroot`.
# Needs root, podman and debootstrap (apt-get install podman debootstrap), and network to
# a Debian mirror and to PyPI. tests/test_image.py builds the image through this script.
#
#   k8s/build-cpu-image.sh [TAG]          TAG defaults to localhost/pagedserve:cpu
#
# Environment:
#   BASE_IMAGE      the imported base (default localhost/pagedserve-base:bookworm); made
#                   only when missing, or always with REBUILD_BASE=1
#   DEBIAN_MIRROR   debootstrap's mirror (default http://deb.debian.org/debian)
#   TORCH_WHEELS    a folder holding a torch CPU wheel for Python 3.11; mounted into the
#                   build and searched by pip first. Without it pip takes PyPI's torch,
#                   a CUDA build of several GB, unless TORCH_PIP_ARGS names a CPU index.
#   TORCH_PIP_ARGS  extra pip arguments for the torch install (the Dockerfile's build arg)
#   CA_BUNDLE       a PEM file the build's pip trusts instead of its own CAs (a proxy's),
#                   mounted for the build only; defaults to $PIP_CERT, the host pip's
set -euo pipefail
cd "$(dirname "$0")/.."

tag=${1:-localhost/pagedserve:cpu}
base=${BASE_IMAGE:-localhost/pagedserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "${REBUILD_BASE:-0}" = 1 ] || ! podman image exists "$base"; then
    root=$(mktemp -d "${TMPDIR:-/var/tmp}/pagedserve-base.XXXXXX")
    trap 'rm -rf "$root"' EXIT
    # minbase is Debian's required set (useradd included) and apt: no Python, no CAs.
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$root" "$mirror"
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
    # An imported root carries no config; the Dockerfile's PATH=/opt/venv/bin:$PATH needs one.
    tar -C "$root" -c . | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$base"
    rm -rf "$root"
    trap - EXIT
fi

# --force-rm: a failed build leaves no working container behind.
build=(--isolation chroot --force-rm --build-arg VARIANT=cpu --build-arg PYTHON_IMAGE="$base"
       --build-arg CPU_PYTHON=/usr/bin/python3)
# What the build's pip reads from the host goes into one folder mounted over the base's
# empty /mnt: a mount on a path the image lacks would leave an empty file or folder there.
ca=${CA_BUNDLE:-${PIP_CERT:-}}
if [ -n "${TORCH_WHEELS:-}" ] || [ -n "$ca" ]; then
    extra=$(mktemp -d "${TMPDIR:-/var/tmp}/pagedserve-build.XXXXXX")
    trap 'rm -rf "$extra"' EXIT
    build+=(--volume "$extra":/mnt:ro)
fi
if [ -n "${TORCH_WHEELS:-}" ]; then
    mkdir "$extra/wheels"
    cp -l "$TORCH_WHEELS"/*.whl "$extra/wheels/" 2>/dev/null || cp "$TORCH_WHEELS"/*.whl "$extra/wheels/"
    build+=(--build-arg TORCH_PIP_ARGS="--find-links /mnt/wheels ${TORCH_PIP_ARGS:-}")
elif [ -n "${TORCH_PIP_ARGS:-}" ]; then
    build+=(--build-arg TORCH_PIP_ARGS="$TORCH_PIP_ARGS")
fi
if [ -n "$ca" ]; then
    cp "$ca" "$extra/ca.pem"
    build+=(--build-arg PIP_CERT=/mnt/ca.pem)
fi
podman build "${build[@]}" -t "$tag" .
