"""Smoke tests for the real control plane harness (tests/cluster)."""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from tests.cluster.fixtures import ApiServer

pytestmark = pytest.mark.apiserver

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.smoke.kvpool.io"},
    "spec": {
        "group": "smoke.kvpool.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [{
            "name": "v1",
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {"spec": {
                    "type": "object",
                    "properties": {"size": {"type": "integer"}},
                }},
            }},
        }],
    },
}


def kubectl(
    server: ApiServer, *args: str, stdin: str | None = None, check: bool = True, kubeconfig: str | None = None,
) -> subprocess.CompletedProcess[str]:
    argv = [server.kubectl, "--kubeconfig", kubeconfig or str(server.kubeconfig), *args]
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        pytest.fail("{} failed ({}):\n{}{}".format(" ".join(args), result.returncode, result.stdout, result.stderr))
    return result


def test_get_namespaces(apiserver: ApiServer) -> None:  # noqa: F811
    out = kubectl(apiserver, "get", "ns", "-o", "name").stdout.split()
    assert "namespace/default" in out
    assert "namespace/kube-system" in out


def test_crd_established_and_served(apiserver: ApiServer) -> None:  # noqa: F811
    kubectl(apiserver, "apply", "-f", "-", stdin=json.dumps(CRD))
    try:
        apiserver.wait_established("widgets.smoke.kvpool.io")
        widget = {
            "apiVersion": "smoke.kvpool.io/v1",
            "kind": "Widget",
            "metadata": {"name": "w1", "namespace": "default"},
            "spec": {"size": 3},
        }
        # Discovery can lag a moment behind Established.
        deadline = time.monotonic() + 30
        while True:
            result = kubectl(apiserver, "apply", "-f", "-", stdin=json.dumps(widget), check=False)
            if result.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert result.returncode == 0, result.stderr
        got = json.loads(kubectl(apiserver, "get", "widgets.smoke.kvpool.io", "w1", "-o", "json").stdout)
        assert got["spec"] == {"size": 3}
    finally:
        kubectl(apiserver, "delete", "crd", "widgets.smoke.kvpool.io", "--ignore-not-found", "--wait=false")


def test_auth_can_i(apiserver: ApiServer) -> None:  # noqa: F811
    assert kubectl(apiserver, "auth", "can-i", "*", "*").stdout.strip() == "yes"
    assert kubectl(apiserver, "auth", "can-i", "create", "customresourcedefinitions").stdout.strip() == "yes"
    # RBAC is really on: a user without bindings is denied (exit code 1, "no").
    denied = kubectl(apiserver, "auth", "can-i", "create", "configmaps", check=False,
                     kubeconfig=str(apiserver.user_kubeconfig))
    assert denied.returncode == 1, denied.stderr
    assert denied.stdout.strip() == "no"
    whoami = json.loads(kubectl(apiserver, "auth", "whoami", "-o", "json").stdout)
    assert "system:masters" in whoami["status"]["userInfo"]["groups"]


def test_python_client(apiserver: ApiServer) -> None:  # noqa: F811
    kubernetes = pytest.importorskip("kubernetes")
    client = kubernetes.config.new_client_from_config(config_file=str(apiserver.kubeconfig))
    try:
        names = [ns.metadata.name for ns in kubernetes.client.CoreV1Api(client).list_namespace().items]
    finally:
        client.close()
    assert "default" in names


def test_garbage_collection(apiserver: ApiServer) -> None:  # noqa: F811
    if not apiserver.control_plane.with_controller_manager:
        pytest.skip("kube-controller-manager is not running")
    suffix = uuid.uuid4().hex[:8]
    owner = json.loads(kubectl(apiserver, "create", "configmap", "owner-" + suffix, "-o", "json").stdout)
    dependent = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "dependent-" + suffix,
            "namespace": "default",
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "ConfigMap",
                "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            }],
        },
    }
    kubectl(apiserver, "apply", "-f", "-", stdin=json.dumps(dependent))
    kubectl(apiserver, "delete", "configmap", "owner-" + suffix)
    kubectl(apiserver, "wait", "--for=delete", "--timeout=60s", "configmap/dependent-" + suffix)
