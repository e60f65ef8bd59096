"""A pool started from what the operator rendered: the images of ``make images``, the
DaemonSet's pod run as a kubelet would (under podman, see tests/cluster/podman.py), a
serving pod's process putting and getting through the socket it is given, and the pool's
status showing the node Ready with its capacity and use.

``make test`` builds the images and prepares the host (``scripts/podman_host.sh``) and sets
``KVPOOL_REQUIRE_PODMAN=1``, so there a missing prerequisite fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.harness import free_port
from tests.cluster.podman import PodmanNode, image_present, podman_usable
from tests.e2e.conftest import K8s, OperatorProcess, RedisServer, create_pool, wait_child, wait_condition, wait_for

pytestmark = [pytest.mark.apiserver, pytest.mark.podman]

IMAGE = os.environ.get("KVPOOL_TEST_IMAGE", "localhost/kvpool:dev")
SIDECAR_GID = 10001
MiB = 1 << 20

#: The serving pod's process: what an engine does through the pool's client, in the image.
SERVING = """
import json, os, sys
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
fp = ModelFingerprint(model="e2e", revision="1", dtype="bfloat16", kv_layout="test", block_tokens=16)
keys = block_keys(fp, list(range(16 * 8)))
blocks = [os.urandom(64 << 10) for _ in keys]
with PoolClient(sys.argv[1]) as pool:
    put = [s.name for s in pool.put(keys, blocks, chain=True)]
    got = pool.get(keys)
    same = all(g is not None and bytes(g) == b for g, b in zip(got, blocks))
    print(json.dumps({"put": put, "same": same, "prefix": pool.lookup(keys).prefix, "uid": os.getuid()}))
"""


@pytest.fixture
def node(tmp_path: Path, k8s: K8s) -> Iterator[PodmanNode]:
    why = podman_usable() or (None if image_present(IMAGE) else "image {} is missing (make images)".format(IMAGE))
    if why:
        if os.environ.get("KVPOOL_REQUIRE_PODMAN") == "1":
            pytest.fail(why)
        pytest.skip(why)

    def read(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return k8s.child("v1", kind, namespace, name)

    n = PodmanNode(tmp_path / "node-a", "node-a", read)
    yield n
    n.stop()


def test_a_pool_runs_from_what_the_operator_rendered(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer,
        node: PodmanNode) -> None:
    create_pool(k8s, namespace, "real", {
        "image": IMAGE, "imagePullPolicy": "Never",
        "redis": {"external": {"url": redis_server.url}},
        "tiers": {"dram": {"size": "64Mi", "populate": False}}, "maxBlockSize": "4Mi",
        "transport": {"port": free_port()}, "api": {"httpPort": free_port()},
    })
    ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "real-sidecar")
    pod_spec = ds["spec"]["template"]["spec"]
    [sidecar] = node.run_pod(namespace, pod_spec, name="real-sidecar-node-a")

    # Ready: the operator read the node's heartbeat from Redis
    wait_condition(k8s, namespace, "real", "Ready", "True", timeout=90)
    status = (k8s.pool(namespace, "real") or {})["status"]
    socket_path = status["socketPath"]
    host_socket = node.host_path(socket_path)
    assert host_socket.is_socket(), "the sidecar's socket is not where the status says"
    # the sidecar runs as its own user, on a read-only root, with what the pod spec gave it
    who = subprocess.run(["podman", "exec", sidecar, "id", "-u"], capture_output=True, text=True, timeout=30)
    assert who.stdout.strip() == "10001", node.logs(sidecar)

    # a serving pod: another user, in the sidecar's group, with the socket's directory mounted
    done = node.run_once(IMAGE, ["python3", "-c", SERVING, socket_path], user="10002:10002",
                         groups=[SIDECAR_GID], mounts={host_socket.parent: str(Path(socket_path).parent)})
    assert done.returncode == 0, done.stderr + node.logs(sidecar)
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served == {"put": ["STORED"] * 8, "same": True, "prefix": 8, "uid": 10002}

    # the pool's status shows the node, its capacity and what the serving pod stored
    def used() -> dict[str, Any] | None:
        st = (k8s.pool(namespace, "real") or {}).get("status") or {}
        dram = (st.get("tiers") or {}).get("dram") or {}
        return st if dram.get("blocks", 0) >= 8 else None

    st = wait_for("the pool's status to count the serving pod's blocks", used, timeout=60)
    assert st["nodes"]["ready"] == 1
    assert st["tiers"]["dram"]["capacityBytes"] == 64 * MiB
    assert st["tiers"]["dram"]["usedBytes"] >= 8 * (64 << 10)
    assert node.running(sidecar), node.logs(sidecar)


def test_the_operator_image_runs_the_operator(node: PodmanNode) -> None:
    image = IMAGE.replace("/kvpool:", "/kvpool-operator:")
    done = node.run_once(image, ["python", "-m", "kvpool_operator", "--help"], user="10001:10001")
    assert done.returncode == 0 and "python -m kvpool_operator" in done.stdout, done.stdout + done.stderr
    entry = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config.Entrypoint}}", image],
                           capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(entry.stdout) == ["python", "-m", "kvpool_operator"]
