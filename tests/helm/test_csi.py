"""The chart's CSI driver (csi.enabled): the CSIDriver object, the privileged node plugin
DaemonSet with node-driver-registrar, and the plugin's read-only access to pools, rendered
and validated without a cluster (kubernetes-validate, strict, for every supported version).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpool_csi import DRIVER_NAME
from tests.e2e.conftest import K8s
from tests.e2e.conftest import k8s  # noqa: F401 - fixture
from tests.helm.conftest import CHART, Helm, Manifest, by_kind, one
from tests.helm.test_chart import K8S_VERSIONS, STANDARD_LABELS, assert_no_dangerous_grants, validate_k8s
from tests.helm.test_install import can_i, create_namespace, delete_namespace, service_account_kubeconfig
from tests.integration.csi_support import Pod, mount_refused, node_host, running_plugin

pytestmark = pytest.mark.helm

ON = "csi.enabled=true"


def containers(docs: Sequence[Manifest]) -> dict[str, Manifest]:
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def host_paths(docs: Sequence[Manifest]) -> dict[str, str]:
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}


def test_off_by_default(helm: Helm) -> None:
    docs = helm.template()
    assert not by_kind(docs, "CSIDriver") and not by_kind(docs, "DaemonSet")
    assert not by_kind(docs, "ClusterRole")


@pytest.mark.parametrize("extra", [[], ["csi.lookupPools=false"], ["csi.kubeletDir=/data/kubelet",
                                                                    "csi.priorityClassName=system-node-critical",
                                                                    "csi.verbose=true"]])
def test_rendered_objects_are_valid(helm: Helm, extra: list[str]) -> None:
    docs = helm.template(ON, *extra)
    helm.run("lint", "--strict", str(CHART), "--set", ",".join([ON, *extra]))
    for doc in docs:
        assert all(label in doc["metadata"].get("labels", {}) for label in STANDARD_LABELS), doc["metadata"]
        for version in K8S_VERSIONS:
            validate_k8s(doc, version)


def test_csi_driver_object(helm: Helm) -> None:
    driver = one(helm.template(ON), "CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME  # what the plugin answers in GetPluginInfo
    assert driver["spec"] == {"attachRequired": False, "podInfoOnMount": True, "volumeLifecycleModes": ["Ephemeral"],
                              "fsGroupPolicy": "None", "requiresRepublish": False, "storageCapacity": False}


def test_node_plugin_daemonset(helm: Helm) -> None:
    docs = helm.template(ON)
    ds = one(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert ds["metadata"]["namespace"] == "kvpool-system"
    assert ds["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "csi-node"
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert pod["tolerations"] == [{"operator": "Exists"}]  # on every node, tainted GPU nodes too
    c = containers(docs)
    assert set(c) == {"node-plugin", "node-driver-registrar"}

    plugin = c["node-plugin"]
    assert plugin["image"] == "ghcr.io/kvpool/kvpool-operator:0.1.0"  # the operator image holds kvpool_csi
    assert plugin["command"] == ["python", "-m", "kvpool_csi"]
    assert plugin["args"] == ["--endpoint=unix:///csi/csi.sock", "--socket-root=/run/kvpool",
                              "--kubelet-dir=/var/lib/kubelet", "--pool-lookup=api"]
    assert plugin["env"] == [{"name": "KVPOOL_NODE_NAME",
                              "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    assert plugin["securityContext"]["privileged"] is True and plugin["securityContext"]["readOnlyRootFilesystem"]
    mounts = {m["name"]: m for m in plugin["volumeMounts"]}
    assert mounts["kubelet-dir"] == {"name": "kubelet-dir", "mountPath": "/var/lib/kubelet",
                                     "mountPropagation": "Bidirectional"}
    assert mounts["socket-root"]["mountPath"] == "/run/kvpool" and mounts["socket-root"]["readOnly"] is True
    assert mounts["plugin-dir"]["mountPath"] == "/csi"

    registrar = c["node-driver-registrar"]
    assert re.match(r"^registry\.k8s\.io/sig-storage/csi-node-driver-registrar:v[0-9]+\.[0-9]+\.[0-9]+$",
                    registrar["image"]), registrar["image"]
    assert registrar["args"][:2] == ["--csi-address=/csi/csi.sock",
                                     "--kubelet-registration-path=/var/lib/kubelet/plugins/csi.kvpool.io/csi.sock"]
    sc = registrar["securityContext"]
    assert not sc.get("privileged") and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {m["mountPath"] for m in registrar["volumeMounts"]} == {"/csi", "/registration"}
    assert host_paths(docs) == {"plugin-dir": "/var/lib/kubelet/plugins/csi.kvpool.io",
                                "registration-dir": "/var/lib/kubelet/plugins_registry",
                                "kubelet-dir": "/var/lib/kubelet", "socket-root": "/run/kvpool"}


def test_another_kubelet_dir_moves_every_path(helm: Helm) -> None:
    docs = helm.template(ON, "csi.kubeletDir=/data/kubelet")
    assert set(host_paths(docs).values()) == {"/data/kubelet/plugins/csi.kvpool.io", "/data/kubelet/plugins_registry",
                                              "/data/kubelet", "/run/kvpool"}
    c = containers(docs)
    assert "--kubelet-dir=/data/kubelet" in c["node-plugin"]["args"]
    assert "--kubelet-registration-path=/data/kubelet/plugins/csi.kvpool.io/csi.sock" in \
        c["node-driver-registrar"]["args"]
    assert {m["mountPath"] for m in c["node-plugin"]["volumeMounts"]} >= {"/data/kubelet"}
    for bad in ("csi.kubeletDir=var/lib/kubelet", "csi.kubeletDir=/var/lib/kubelet/", "csi.registrarImage.tag=latest",
                "csi.unknown=1"):
        assert "schema" in helm.template_error(ON, bad).lower(), bad


def test_the_plugin_reads_pools_and_nothing_else(helm: Helm) -> None:
    docs = helm.template(ON)
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": ["kvpool.io"], "resources": ["kvcachepools"], "verbs": ["get"]}]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    sa = [s for s in by_kind(docs, "ServiceAccount") if s["metadata"]["name"].endswith("-csi-node")][0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": "kvpool-system"}]
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and pod["automountServiceAccountToken"] is True
    assert_no_dangerous_grants(docs)

    # Without pool lookups: no API access at all, pods mount their own namespace's pools only.
    docs = helm.template(ON, "csi.lookupPools=false")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert one(docs, "DaemonSet")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "--pool-lookup=none" in containers(docs)["node-plugin"]["args"]
    # rbac.create=false: the administrator grants get on kvcachepools to the ServiceAccount.
    assert not by_kind(helm.template(ON, "rbac.create=false"), "ClusterRole")


@pytest.mark.apiserver
def test_installed_on_the_api_server_the_plugin_reads_pools_with_its_own_identity(
        helm: Helm, k8s: K8s, tmp_path: Path) -> None:
    """helm install with csi.enabled: the API server takes the CSIDriver and the DaemonSet, and
    the node plugin's ServiceAccount may get pools and nothing else. Where mounts work, the
    plugin runs with that ServiceAccount's token and serves a pod of a namespace the pool lists."""
    namespace = create_namespace(k8s, "kvp-csi-helm")
    pool_ns, serving_ns = create_namespace(k8s, "kvp-pool"), create_namespace(k8s, "kvp-serve")
    release = "csi{}".format(uuid.uuid4().hex[:4])
    h = helm.with_kubeconfig(k8s.server.kubeconfig)
    try:
        h.run("install", release, str(CHART), "--namespace", namespace, "--set", ON, "--wait=false")
        driver = json.loads(k8s.kubectl("get", "csidriver", DRIVER_NAME, "-o", "json").stdout)
        assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"] and driver["spec"]["podInfoOnMount"] is True
        sa = "{}-kvpool-csi-node".format(release)
        k8s.kubectl("get", "daemonset", sa, "-n", namespace)
        kubeconfig = service_account_kubeconfig(k8s, namespace, sa, tmp_path / "kubeconfig")
        assert can_i(k8s, kubeconfig, "get", "kvcachepools.kvpool.io", "-n", pool_ns)
        for verb, resource in (("list", "kvcachepools.kvpool.io"), ("watch", "kvcachepools.kvpool.io"),
                               ("patch", "kvcachepools.kvpool.io"), ("get", "secrets"), ("get", "pods"),
                               ("get", "nodes"), ("create", "pods")):
            assert not can_i(k8s, kubeconfig, verb, resource, "-n", pool_ns), (verb, resource)

        if mount_refused() is not None:
            return
        grpc = pytest.importorskip("grpc", reason="the csi extra (grpcio) is not installed")
        token = tmp_path / "token"
        token.write_text(json.loads(kubeconfig.read_text())["users"][0]["user"]["token"])
        k8s.apply({"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
                   "metadata": {"name": "cache", "namespace": pool_ns},
                   "spec": {"api": {"allowedNamespaces": [serving_ns]}}})
        with node_host() as host:
            host.pool_dir(pool_ns, "cache")
            with running_plugin(host, "--pool-lookup", "api", "--api-server", k8s.server.url, "--api-token-file",
                                str(token), "--api-ca-file", str(k8s.server.ca_file)) as kubelet:
                assert kubelet.publish(Pod(serving_ns), "{}.cache".format(pool_ns)).is_dir()
                with pytest.raises(grpc.RpcError) as refused:
                    kubelet.publish(Pod(namespace), "{}.cache".format(pool_ns))
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        h.run("uninstall", release, "--namespace", namespace, check=False)
        for ns in (namespace, pool_ns, serving_ns):
            delete_namespace(k8s, ns)
