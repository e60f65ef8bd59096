"""The CSI driver against the real API server: the example serving pod (examples/serving/)
is admitted in a namespace that enforces Pod Security "restricted", and the same pod with a
hostPath is refused; the node plugin, reading pools with ``--pool-lookup api``, lets a pod
mount a pool of another namespace only when the pool lists the pod's namespace in
``spec.api.allowedNamespaces``, and says so with the CSI spec's codes.

The mounts need root (see tests/integration/test_csi_node.py); the admission test does not.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.harness import TEST_USER
from tests.e2e.conftest import EXAMPLES, K8s
from tests.helm.test_install import create_namespace, delete_namespace
from tests.integration.csi_support import Pod, mount_refused, node_host, running_plugin

pytestmark = pytest.mark.apiserver
_REFUSED = mount_refused()

SERVING = EXAMPLES / "serving"


def example(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((SERVING / name).read_text()) if d]


@contextmanager
def namespaces(k8s: K8s, *prefixes: str) -> Iterator[list[str]]:
    """Fresh namespaces, deleted afterwards."""
    names = [create_namespace(k8s, p) for p in prefixes]
    try:
        yield names
    finally:
        for n in names:
            delete_namespace(k8s, n)


def serving_docs(serving_ns: str, pool_ns: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's Namespace and Pod, moved to ``serving_ns`` and naming the pool in ``pool_ns``."""
    docs = example("vllm-restricted.yaml")
    (ns,) = [d for d in docs if d["kind"] == "Namespace"]
    (pod,) = [d for d in docs if d["kind"] == "Pod"]
    ns["metadata"]["name"] = serving_ns
    pod["metadata"]["namespace"] = serving_ns
    (volume,) = [v for v in pod["spec"]["volumes"] if "csi" in v]
    attrs = volume["csi"]["volumeAttributes"]
    attrs["pool"] = "{}.{}".format(pool_ns, attrs["pool"].split(".")[1])
    return ns, pod


def pool_doc(pool_ns: str, allowed: list[str]) -> dict[str, Any]:
    (pool,) = example("pool.yaml")
    pool["metadata"]["namespace"] = pool_ns
    pool["spec"]["api"]["allowedNamespaces"] = allowed
    return dict(pool)


def test_the_example_serving_pod_passes_pod_security_restricted(k8s: K8s, kvpool_crd: str) -> None:
    with namespaces(k8s, "kvp-pool", "kvp-serve") as (pool_ns, serving_ns):
        ns, pod = serving_docs(serving_ns, pool_ns)
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
        k8s.apply(ns)  # the example's labels on the fresh namespace
        k8s.apply(pool_doc(pool_ns, [serving_ns]))
        stored = k8s.pool(pool_ns, "cache")
        assert stored is not None and stored["spec"]["api"]["allowedNamespaces"] == [serving_ns]

        admitted = k8s.apply(pod, check=False)
        assert admitted.returncode == 0, admitted.stderr
        assert "violate" not in admitted.stderr  # no PodSecurity warning either
        got = json.loads(k8s.kubectl("get", "pod", "-n", serving_ns, pod["metadata"]["name"], "-o", "json").stdout)
        (volume,) = [v for v in got["spec"]["volumes"] if v["name"] == "kvpool"]
        assert volume["csi"]["driver"] == "csi.kvpool.io" and volume["csi"]["readOnly"] is True

        # The same pod with the socket from a hostPath, as before the driver: refused.
        host_path = copy.deepcopy(pod)
        host_path["metadata"]["name"] = "vllm-hostpath"
        host_path["spec"]["volumes"] = [{"name": "kvpool", "hostPath": {
            "path": "/run/kvpool/{}.cache".format(pool_ns), "type": "Directory"}}]
        refused = k8s.apply(host_path, check=False)
        assert refused.returncode != 0
        assert "violates PodSecurity" in refused.stderr and "hostPath" in refused.stderr, refused.stderr


def test_a_pool_in_the_crd_refuses_bad_namespace_names(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    bad = k8s.apply(pool_doc(namespace, ["Team_A"]) | {"metadata": {"name": "bad", "namespace": namespace}},
                    check=False)
    assert bad.returncode != 0 and "allowedNamespaces" in bad.stderr, bad.stderr


@pytest.mark.skipif(_REFUSED is not None, reason=_REFUSED or "")
def test_the_plugin_serves_other_namespaces_only_where_the_pool_allows(
        k8s: K8s, kvpool_crd: str, tmp_path: Path) -> None:
    grpc = pytest.importorskip("grpc", reason="the csi extra (grpcio) is not installed")
    plane = k8s.server.control_plane
    token = tmp_path / "token"
    token.write_text(plane.user_token)  # kvpool-test-user: no grants until the ClusterRole below
    role = "kvp-csi-{}".format(uuid.uuid4().hex[:6])

    def code_of(call: Callable[[], object]) -> Any:
        try:
            call()
        except grpc.RpcError as e:
            return e.code()
        return None

    with namespaces(k8s, "kvp-pool", "kvp-serve", "kvp-other") as (pool_ns, serving_ns, other_ns), \
            node_host() as host:
        k8s.apply(pool_doc(pool_ns, [serving_ns]))
        k8s.apply({"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
                   "metadata": {"name": "own-dir", "namespace": pool_ns},
                   "spec": {"api": {"socketDir": "/run/kvpool/elsewhere"}}})
        for name in ("cache", "own-dir", "gone"):
            (host.pool_dir(pool_ns, name) / "kvpool.sock").write_text("")
        _, example_pod = serving_docs(serving_ns, pool_ns)
        (volume,) = [v for v in example_pod["spec"]["volumes"] if "csi" in v]
        pool = volume["csi"]["volumeAttributes"]["pool"]

        with running_plugin(host, "--pool-lookup", "api", "--api-server", k8s.server.url,
                            "--api-token-file", str(token), "--api-ca-file", str(k8s.server.ca_file),
                            "--api-timeout", "10") as kubelet:
            pod = Pod(serving_ns)
            # The plugin may not read pools yet: a clear refusal, nothing mounted.
            assert code_of(lambda: kubelet.publish(pod, pool)) == grpc.StatusCode.FAILED_PRECONDITION
            assert not kubelet.target(pod).exists()
            k8s.kubectl("create", "clusterrole", role, "--verb=get", "--resource=kvcachepools.kvpool.io")
            k8s.kubectl("create", "clusterrolebinding", role, "--clusterrole=" + role, "--user=" + TEST_USER)
            try:
                # Listed in spec.api.allowedNamespaces: the example pod's volume is served.
                target = kubelet.publish(pod, pool)
                assert sorted(p.name for p in target.iterdir()) == ["kvpool.sock"]
                kubelet.unpublish(target)
                # Not listed, or no such pool: the same refusal (no pool names leak).
                for ref in (pool, "{}.gone".format(pool_ns)):
                    assert code_of(lambda: kubelet.publish(Pod(other_ns), ref)) == grpc.StatusCode.PERMISSION_DENIED
                # The pool's own namespace needs no listing; a pool that is not there is NOT_FOUND.
                assert kubelet.publish(Pod(pool_ns), "cache").exists()
                assert code_of(lambda: kubelet.publish(Pod(pool_ns), "gone")) == grpc.StatusCode.NOT_FOUND
                # A pool with its own socketDir is not served (its directory could be any pool's).
                assert code_of(lambda: kubelet.publish(Pod(pool_ns), "own-dir")) \
                    == grpc.StatusCode.FAILED_PRECONDITION
                # Taking a namespace off the list stops new mounts from it.
                k8s.patch_pool(pool_ns, "cache", {"spec": {"api": {"allowedNamespaces": []}}})
                assert code_of(lambda: kubelet.publish(Pod(serving_ns), pool)) == grpc.StatusCode.PERMISSION_DENIED
            finally:
                k8s.kubectl("delete", "clusterrolebinding", role, "--ignore-not-found", check=False)
                k8s.kubectl("delete", "clusterrole", role, "--ignore-not-found", check=False)


def test_the_gpu_serving_example_is_restricted_and_names_the_connector(k8s: K8s, kvpool_crd: str) -> None:
    """examples/serving/vllm.yaml: the API server admits it in a namespace enforcing (and
    warning on) "restricted", with no warning; its GPU comes from the device plugin, its
    socket from the CSI driver; its kv-transfer-config names a connector class that exists."""
    (deployment,) = example("vllm.yaml")
    pod = deployment["spec"]["template"]["spec"]
    (vllm,) = pod["containers"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not any("hostPath" in v for v in pod["volumes"])
    config = json.loads(vllm["args"][vllm["args"].index("--kv-transfer-config") + 1])
    module = __import__(config["kv_connector_module_path"], fromlist=[config["kv_connector"]])
    assert isinstance(getattr(module, config["kv_connector"]), type)
    assert config["kv_connector_extra_config"]["socket_path"].startswith(
        next(m["mountPath"] for m in vllm["volumeMounts"] if m["name"] == "kvpool"))
    with namespaces(k8s, "kvp-gpu") as (ns,):
        k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
        deployment["metadata"]["namespace"] = ns
        out = k8s.apply(deployment, check=False)
        assert out.returncode == 0 and "violate" not in out.stderr, out.stderr
        # the pod it stands for, checked as a pod (a Deployment only warns)
        probe = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": ns},
                 "spec": copy.deepcopy(pod)}
        admitted = k8s.apply(probe, "--dry-run=server", check=False)
        assert admitted.returncode == 0 and "violate" not in admitted.stderr, admitted.stderr


def test_the_sidecar_pods_need_a_namespace_that_allows_hostpath(k8s: K8s, kvpool_crd: str) -> None:
    """What README says of the pool's own namespace: its sidecar pods keep hostPath volumes,
    so Pod Security "baseline" refuses them and "privileged" admits them."""
    from kvpool_operator.manifests import build_daemonset
    from kvpool_operator.spec import parse_spec

    template = build_daemonset(parse_spec("cache", "x", {"tiers": {"disk": {"path": "/mnt/kv", "size": "1Gi"}}}),
                               default_image="localhost/kvpool:dev", configuration_hash="h")["spec"]["template"]
    with namespaces(k8s, "kvp-base", "kvp-priv") as (base, priv):
        for ns, level in ((base, "baseline"), (priv, "privileged")):
            k8s.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=" + level)
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sidecar"}, "spec": template["spec"]}
        refused = k8s.apply({**pod, "metadata": {"name": "sidecar", "namespace": base}}, "--dry-run=server",
                            check=False)
        assert refused.returncode != 0 and "hostPath" in refused.stderr, refused.stderr
        admitted = k8s.apply({**pod, "metadata": {"name": "sidecar", "namespace": priv}}, "--dry-run=server",
                             check=False)
        assert admitted.returncode == 0, admitted.stderr
