#!/usr/bin/env bash
# Build the sidecar and operator images from Debian packages, without a container registry:
#   scripts/build_images.sh [TAG]          (make images)
#
# What docker/*.Dockerfile describe, built with Debian's tools instead of `FROM python:...`:
#   1. mmdebstrap: a Debian bookworm root filesystem with python3, python3-venv and libstdc++6
#      (variant essential: no compiler, no apt caches);
#   2. the project's wheel and its pinned dependencies (requirements/image-*.txt, binary
#      wheels only) downloaded here, installed into /opt/kvpool inside the root filesystem
#      (chroot, --no-index), then pip, setuptools and python3-venv removed again;
#   3. user and group kvpool (10001), the image's user;
#   4. `podman import` with the Dockerfile's ENTRYPOINT, CMD, USER, ENV and EXPOSE.
# The Debian packages are bookworm's current ones (recorded in /usr/share/kvpool/packages.txt
# of each image); the Python packages are pinned. Needs root, mmdebstrap and podman.
# Images: localhost/kvpool:TAG, localhost/kvpool-operator:TAG and (with Go) localhost/kvpool-pause:TAG,
# the test node's pod sandbox.
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=${1:-${KVPOOL_IMAGE_TAG:-dev}}
PY=${PY:-.venv/bin/python}
SUITE=${DEBIAN_SUITE:-bookworm}
WORK=$(mktemp -d /var/tmp/kvpool-images.XXXXXX)
trap 'rm -rf "$WORK"' EXIT

for tool in mmdebstrap podman; do
  command -v "$tool" >/dev/null || { echo "build_images: $tool is missing (apt-get install $tool)" >&2; exit 2; }
done

# Images already built from these very sources are kept (label kvpool.source).
SOURCE=$( { git ls-files -z client sidecar operator docker/pause pyproject.toml README.md requirements/image-sidecar.txt \
            requirements/image-operator.txt scripts/build_images.sh | xargs -0 cat; } | sha256sum | cut -c1-16)
if [ -z "${KVPOOL_IMAGES_REBUILD:-}" ] && [ -z "$(git status --porcelain client sidecar operator pyproject.toml)" ]; then
  fresh=1
  for name in kvpool kvpool-operator kvpool-pause; do
    label=$(podman image inspect --format '{{index .Labels "kvpool.source"}}' "localhost/$name:$TAG" 2>/dev/null || true)
    [ "$label" = "$SOURCE" ] || fresh=0
  done
  if [ "$fresh" = 1 ]; then
    echo "build_images: localhost/kvpool:$TAG and localhost/kvpool-operator:$TAG are built from these sources"
    exit 0
  fi
fi

# one base root filesystem for both images
echo "build_images: root filesystem ($SUITE)"
mmdebstrap --quiet --variant=essential --include=python3,python3-venv,libstdc++6 \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' "$SUITE" "$WORK/base.tar"

"$PY" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/wheels" .
KVPOOL_WHEEL=$(basename "$(ls "$WORK"/wheels/kvpool-*.whl)")

in_root() {  # run a command in the root filesystem $root, with none of this host's environment
  chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 "$@"
}

build() {  # build NAME EXTRA REQUIREMENTS [--change ...] "MODULES THAT MUST IMPORT"
  local name=$1 extra=$2 reqs=$3
  shift 3
  local root="$WORK/$name"
  mkdir -p "$root"
  tar -C "$root" -xf "$WORK/base.tar"
  echo "build_images: $name: Python packages ($reqs)"
  mkdir -p "$root/tmp/wheels"
  cp "$WORK/wheels/$KVPOOL_WHEEL" "$root/tmp/wheels/"
  "$PY" -m pip download --quiet --only-binary=:all: --no-deps --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --python-version 3.11 \
    --implementation cp --dest "$root/tmp/wheels" -r "$reqs"
  in_root python3 -m venv /opt/kvpool
  grep -v '^#' "$reqs" > "$root/tmp/wheels/requirements.txt"
  in_root /opt/kvpool/bin/pip install --quiet --no-index --no-deps --find-links /tmp/wheels \
    -r /tmp/wheels/requirements.txt "/tmp/wheels/$KVPOOL_WHEEL[$extra]"
  in_root /opt/kvpool/bin/pip check
  # what the image runs imports (a missing shared library shows here)
  in_root /opt/kvpool/bin/python -c 'import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)' ${@: -1} >/dev/null
  set -- "${@:1:$#-1}"
  in_root /opt/kvpool/bin/pip uninstall --quiet --yes pip setuptools 2>/dev/null || \
    in_root /opt/kvpool/bin/pip uninstall --quiet --yes pip
  in_root dpkg --purge python3-venv python3.11-venv python3-pip-whl python3-setuptools-whl >/dev/null
  rm -rf "$root/tmp/wheels" "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/*
  find "$root/opt/kvpool" -name __pycache__ -prune -exec rm -rf {} +
  echo 'kvpool:x:10001:' >> "$root/etc/group"
  echo 'kvpool:x:10001:10001:kvpool:/nonexistent:/usr/sbin/nologin' >> "$root/etc/passwd"
  mkdir -p "$root/usr/share/kvpool"
  in_root dpkg-query -W -f '${Package}=${Version}\n' > "$root/usr/share/kvpool/packages.txt"
  in_root /opt/kvpool/bin/python -m pip --version >/dev/null 2>&1 && {
    echo "build_images: pip is still in $name" >&2; exit 1; }
  echo "build_images: $name: importing as localhost/$name:$TAG"
  tar -C "$root" -c . | podman import --quiet \
    --change 'ENV PATH=/opt/kvpool/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PYTHONDONTWRITEBYTECODE=1' --change 'ENV PYTHONUNBUFFERED=1' \
    --change 'USER 10001:10001' --change "LABEL org.opencontainers.image.version=$TAG" \
    --change "LABEL kvpool.source=$SOURCE" \
    "$@" - "localhost/$name:$TAG" >/dev/null
  rm -rf "$root"
}

build kvpool sidecar requirements/image-sidecar.txt \
  --change 'ENTRYPOINT ["kvpool"]' --change 'CMD ["sidecar", "--config", "/etc/kvpool/config/sidecar.yaml"]' \
  --change 'EXPOSE 9467' --change 'EXPOSE 9466' \
  --change 'LABEL org.opencontainers.image.title=kvpool' "kvpool_sidecar.__main__ kvpool_sidecar.cli zmq msgspec uvloop"
build kvpool-operator operator,csi requirements/image-operator.txt \
  --change 'ENTRYPOINT ["python", "-m", "kvpool_operator"]' \
  --change 'ENV KVPOOL_OPERATOR_LIVENESS=http://0.0.0.0:8080/healthz' --change 'EXPOSE 8080' \
  --change 'LABEL org.opencontainers.image.title=kvpool-operator' \
  "kvpool_operator.handlers kvpool_operator.__main__ kvpool_csi.service kvpool_csi.__main__"
# The pod sandbox image for the test node's containerd (tests/cluster/node.py): one static
# binary that sleeps, as Kubernetes' pause image does (that one lives in a registry).
if command -v go >/dev/null; then
  mkdir -p "$WORK/pause"
  (cd docker/pause && CGO_ENABLED=0 GOWORK=off go build -trimpath -ldflags "-s -w" -o "$WORK/pause/pause" .)
  tar -C "$WORK/pause" -c pause | podman import --quiet --change 'ENTRYPOINT ["/pause"]' \
    --change "LABEL kvpool.source=$SOURCE" - "localhost/kvpool-pause:$TAG" >/dev/null
fi
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "localhost/kvpool(-operator|-pause)?:$TAG "
