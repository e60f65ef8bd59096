"""A pool started from what the operator rendered, on a real node: the images of ``make
images`` imported into containerd, a kubelet registered with the test API server, the
operator's DaemonSet scheduled there (kube-scheduler) and run by the kubelet (init container
and sidecar, probes, Secret and ConfigMap volumes, the host socket directory), a serving pod
that puts and gets through the socket it is given, and the pool's status showing the node
Ready with its capacity and use. See tests/cluster/node.py for what the node needs.

``make test`` builds the images and prepares the host (``scripts/podman_host.sh``) and sets
``KVPOOL_REQUIRE_PODMAN=1``, so there a missing prerequisite fails instead of skipping.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.fixtures import ApiServer
from tests.cluster.harness import free_port
from tests.cluster.node import GATEWAY, KubeletNode, image_present, node_usable
from tests.e2e.conftest import (
    OPERATOR_NAMESPACE,
    K8s,
    OperatorProcess,
    create_pool,
    running_operator,
    wait_condition,
    wait_for,
)

pytestmark = [pytest.mark.apiserver, pytest.mark.podman]

IMAGE = os.environ.get("KVPOOL_TEST_IMAGE", "localhost/kvpool:dev")
PAUSE = IMAGE.replace("/kvpool:", "/kvpool-pause:")
OPERATOR_IMAGE = IMAGE.replace("/kvpool:", "/kvpool-operator:")
SIDECAR_GID = 10001
MiB = 1 << 20

#: The serving pod's process: what an engine does through the pool's client. Its verdict goes
#: to the termination message (the kubelet's HTTPS server, and so ``kubectl logs``, is off).
SERVING = """
import json, os, sys
from kvpool_client.blockinfo import EngineBlock
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
fp = ModelFingerprint(model="e2e", revision="1", dtype="bfloat16", kv_layout="test", block_tokens=16)
keys = block_keys(fp, list(range(16 * 8)))
blocks = [os.urandom(64 << 10) for _ in keys]
# the engine's own identity of each block (vLLM's hash): what the pool's KV events announce
engine = [EngineBlock(hash=i + 1, token_ids=list(range(16 * i, 16 * (i + 1))), block_size=16, parent=i or None)
          for i in range(len(keys))]
with PoolClient(sys.argv[1]) as pool:
    put = [s.name for s in pool.put(keys, blocks, chain=True, engine=engine)]
    got = pool.get(keys)
    same = all(g is not None and bytes(g) == b for g, b in zip(got, blocks))
    out = {"put": put, "same": same, "prefix": pool.lookup(keys).prefix, "uid": os.getuid()}
with open("/dev/termination-log", "w") as f:
    json.dump(out, f)
sys.exit(0 if same else 3)
"""


def _require(why: str | None) -> None:
    if why:
        if os.environ.get("KVPOOL_REQUIRE_PODMAN") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def kvpool_operator(apiserver: ApiServer, kvpool_crd: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator, its own sidecar image the one imported into the node: the init container
    that runs as root runs the operator's image, never the pool's."""
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    with running_operator({"KUBECONFIG": str(apiserver.kubeconfig), "KVPOOL_OPERATOR_POD_NAMESPACE": OPERATOR_NAMESPACE,
                           "KVPOOL_OPERATOR_IMAGE": IMAGE}, log_path) as operator:
        yield operator


@pytest.fixture
def node(apiserver: ApiServer) -> Iterator[KubeletNode]:
    _require(node_usable() or next(("image {} is missing (make images)".format(i) for i in (IMAGE, PAUSE)
                                    if not image_present(i)), None))
    n = KubeletNode(apiserver.bin_dir, apiserver.kubeconfig)
    try:
        n.start([IMAGE], PAUSE)
        yield n
    finally:
        n.stop()


@pytest.fixture
def pod_redis(node: KubeletNode, tmp_path: Path) -> Iterator[str]:
    """A redis-server that pods reach (on the pod network's gateway) and the host too."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", GATEWAY, "127.0.0.1",
                             "--protected-mode", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for("redis on the pod network", lambda: subprocess.run(
            ["redis-cli", "-h", GATEWAY, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip()
            == "PONG", timeout=20, interval=0.1)
        yield "redis://{}:{}/0".format(GATEWAY, port)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


#: A KV-aware router's first step: replay the sidecar's KV events from sequence 0 (vLLM's
#: protocol, a DEALER to the replay socket) and report the block hashes stored in DRAM.
ROUTER = """
import json, sys, msgpack, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect("tcp://{}:5558".format(sys.argv[1]))
sock.send_multipart([b"", (0).to_bytes(8, "big")])
stored = []
while sock.poll(30000):
    _, topic, seq, batch = sock.recv_multipart()
    if int.from_bytes(seq, "big", signed=True) < 0:
        break
    for event in msgpack.unpackb(batch)[1]:
        if event["type"] == "BlockStored" and event["medium"] == "CPU":
            stored += event["block_hashes"]
with open("/dev/termination-log", "w") as f:
    f.write(json.dumps({"stored": stored}))
"""


def _pod_phase(k8s: K8s, namespace: str, name: str) -> str | None:
    phase = k8s.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}",
                        check=False).stdout
    return phase if phase in ("Succeeded", "Failed") else None


def test_a_pool_runs_on_a_kubelet_from_what_the_operator_rendered(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, node: KubeletNode, pod_redis: str) -> None:
    create_pool(k8s, namespace, "real", {
        "image": IMAGE, "imagePullPolicy": "Never", "redis": {"external": {"url": pod_redis}},
        "tiers": {"dram": {"size": "64Mi", "populate": False}}, "maxBlockSize": "4Mi",
        "kvEvents": {"enabled": True, "replayPort": 5558, "routers": {"podSelector": {"matchLabels": {"app": "router"}}}},
    })
    host_dir = Path("/run/kvpool/{}.real".format(namespace))
    try:
        def ready() -> dict[str, Any] | None:
            c = k8s.condition(namespace, "real", "Ready")
            return c if c and c["status"] == "True" else None

        try:
            wait_for("the pool Ready from its sidecar's heartbeat", ready, timeout=150)
        except BaseException:
            pods = k8s.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
            raise AssertionError("not Ready:\n{}\n{}\n{}".format(pods, k8s.condition(namespace, "real", "Ready"),
                                                                node.log_tail("kubelet", 40)))
        def sidecar_ready() -> dict[str, Any] | None:
            pods = json.loads(k8s.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
            found = [p for p in pods if p["metadata"]["name"].startswith("real-sidecar-")]
            statuses = found[0]["status"].get("containerStatuses") or [] if len(found) == 1 else []
            return found[0] if statuses and all(c["ready"] for c in statuses) else None

        # the kubelet's readiness probe (GET /healthz on the pod's IP) passes
        sidecar = wait_for("the sidecar pod Ready", sidecar_ready, timeout=60)
        assert sidecar["spec"]["nodeName"] == node.name and sidecar["status"]["phase"] == "Running"
        assert [c["name"] for c in sidecar["status"]["initContainerStatuses"]] == ["prepare-dirs"]
        assert host_dir.joinpath("kvpool.sock").is_socket()
        assert (host_dir.stat().st_uid, host_dir.stat().st_gid, host_dir.stat().st_mode & 0o7777) \
            == (10001, SIDECAR_GID, 0o750)  # prepare-dirs ran: its group reaches the socket, cannot swap it

        status = (k8s.pool(namespace, "real") or {})["status"]
        k8s.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "serving", "namespace": namespace},
                   "spec": {
                       "restartPolicy": "Never",
                       "securityContext": {"runAsNonRoot": True, "runAsUser": 10002, "runAsGroup": 10002,
                                           "supplementalGroups": [SIDECAR_GID],
                                           "seccompProfile": {"type": "RuntimeDefault"}},
                       "containers": [{
                           "name": "engine", "image": IMAGE, "imagePullPolicy": "Never",
                           "command": ["python3", "-c", SERVING, status["socketPath"].replace(str(host_dir),
                                                                                              "/run/kvpool")],
                           "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                               "capabilities": {"drop": ["ALL"]}},
                           "volumeMounts": [{"name": "kvpool", "mountPath": "/run/kvpool", "readOnly": True}]}],
                       "volumes": [{"name": "kvpool", "hostPath": {"path": str(host_dir), "type": "Directory"}}]}})
        phase = wait_for("the serving pod to finish", lambda: _pod_phase(k8s, namespace, "serving"), timeout=120)
        serving = json.loads(k8s.kubectl("get", "pod", "serving", "-n", namespace, "-o", "json").stdout)
        (state,) = [c["state"] for c in serving["status"]["containerStatuses"]]
        assert phase == "Succeeded", state
        assert json.loads(state["terminated"]["message"]) == {"put": ["STORED"] * 8, "same": True, "prefix": 8,
                                                              "uid": 10002}

        # a router pod reaches the sidecar's KV events on the pod network, as the operator rendered them
        k8s.apply({"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": "router", "namespace": namespace, "labels": {"app": "router"}},
                   "spec": {
                       "restartPolicy": "Never",
                       "securityContext": {"runAsNonRoot": True, "runAsUser": 10003,
                                           "seccompProfile": {"type": "RuntimeDefault"}},
                       "containers": [{
                           "name": "router", "image": IMAGE, "imagePullPolicy": "Never",
                           "command": ["python3", "-c", ROUTER, sidecar["status"]["podIP"]],
                           "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                               "capabilities": {"drop": ["ALL"]}}}]}})
        phase = wait_for("the router pod to finish", lambda: _pod_phase(k8s, namespace, "router"), timeout=120)
        router = json.loads(k8s.kubectl("get", "pod", "router", "-n", namespace, "-o", "json").stdout)
        (state,) = [c["state"] for c in router["status"]["containerStatuses"]]
        assert phase == "Succeeded", state
        assert json.loads(state["terminated"]["message"]) == {"stored": list(range(1, 9))}

        def used() -> dict[str, Any] | None:
            st = (k8s.pool(namespace, "real") or {}).get("status") or {}
            return st if ((st.get("tiers") or {}).get("dram") or {}).get("blocks", 0) >= 8 else None

        st = wait_for("the pool's status to count the serving pod's blocks", used, timeout=60)
        assert st["nodes"]["ready"] == 1
        assert st["tiers"]["dram"]["capacityBytes"] == 64 * MiB
        assert st["tiers"]["dram"]["usedBytes"] >= 8 * (64 << 10)
        # deleting the pool drains its sidecar from the node before the index is purged
        k8s.kubectl("delete", "kvcachepool", "real", "-n", namespace, "--timeout=120s")
        assert not [p for p in json.loads(k8s.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
                    if p["metadata"]["name"].startswith("real-sidecar-")]
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def test_the_operator_image_runs_the_operator() -> None:
    _require(None if image_present(OPERATOR_IMAGE) else "image {} is missing (make images)".format(OPERATOR_IMAGE))
    done = subprocess.run(["podman", "run", "--rm", "--pull", "never", "--network", "none", "--read-only",
                           "--cap-drop", "ALL", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
                           OPERATOR_IMAGE, "--help"], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "python -m kvpool_operator" in done.stdout, done.stdout + done.stderr
    entry = subprocess.run(["podman", "image", "inspect", "--format", "{{json .Config.Entrypoint}} {{.Config.User}}",
                            OPERATOR_IMAGE], capture_output=True, text=True, timeout=30, check=True)
    assert entry.stdout.split() == ['["python","-m","kvpool_operator"]', "10001:10001"]
