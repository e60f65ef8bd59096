#!/usr/bin/env bash
# Prepare this host to run the pool's pods (tests/e2e/test_pods.py), as root: podman and
# mmdebstrap build the images; containerd, runc and the CNI plugins run them under a real
# kubelet (tests/cluster/node.py).
#
# crun refuses a hybrid cgroup layout whose v2 hierarchy holds controllers ("cgroups in
# hybrid mode not supported, drop all controllers from cgroupv2"); some VMs put hugetlb
# there. Each such controller is mounted as a v1 hierarchy instead, which empties the v2 one.
# Idempotent; changes nothing on a host that needs nothing.
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
  echo "podman_host: not root: nothing done (the podman tests will skip)" >&2
  exit 0
fi
missing=""
for pkg in podman:podman mmdebstrap:mmdebstrap containerd:containerd runc:runc; do
  command -v "${pkg%%:*}" >/dev/null || missing="$missing ${pkg#*:}"
done
[ -x /usr/lib/cni/bridge ] || missing="$missing containernetworking-plugins"
if [ -n "$missing" ]; then
  echo "podman_host: installing$missing"
  apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >/dev/null
fi
v2=/sys/fs/cgroup/unified/cgroup.controllers
if [ -f "$v2" ]; then
  for c in $(cat "$v2"); do
    mkdir -p "/sys/fs/cgroup/$c"
    mountpoint -q "/sys/fs/cgroup/$c" || mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
    echo "podman_host: cgroup controller $c moved to a v1 hierarchy"
  done
fi
