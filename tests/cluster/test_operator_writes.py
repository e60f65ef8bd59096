"""Against the real API server: a reconcile writes no child that has not changed since it applied it.

The operator's records (:mod:`kvpool_operator.applied`) trust the API server's own versions:
that a DaemonSet's or StatefulSet's generation moves with its spec and not with the status its
controller writes (the controller manager runs here), and that any edit of another kind moves
its resourceVersion. The reconcile runs in this process, its Redis index stubbed, with the
operator's API client counting its requests.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvpool_operator import index as redis_index
from kvpool_operator.applied import AppliedChildren
from kvpool_operator.index import IndexSnapshot
from kvpool_operator.kube import Kube
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import OperatorSettings
from tests.cluster.fixtures import ApiServer

pytestmark = pytest.mark.apiserver

CRD = Path(__file__).resolve().parents[2] / "crds" / "kvcachepools.kvpool.io.yaml"
SETTINGS = OperatorSettings()


class CountingKube(Kube):
    """The operator's API client, recording each request: (method, plural/name, dry run), and
    the answer to the last real write of each object."""

    def __init__(self, api: Any) -> None:
        super().__init__(api, field_manager=SETTINGS.reconcile.field_manager, timeout_s=30)
        self.requests: list[tuple[str, str, bool]] = []
        self.answers: dict[str, dict[str, Any]] = {}

    def _request(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
                 content_type: str = "application/json") -> dict[str, Any] | None:
        what, dry_run = "/".join(path.split("/")[-2:]), ("dryRun", "All") in (query or [])
        self.requests.append((method, what, dry_run))
        answer = super()._request(method, path, body=body, query=query, content_type=content_type)
        if method == "PATCH" and not dry_run and answer is not None:
            self.answers[what] = answer
        return answer

    def writes(self) -> list[tuple[str, str, bool]]:
        return [r for r in self.requests if r[0] != "GET"]


def kubectl(server: ApiServer, *args: str, stdin: str | None = None) -> str:
    result = subprocess.run(server.kubectl_argv(*args), input=stdin, capture_output=True, text=True, timeout=120,
                            check=False)
    if result.returncode != 0:
        pytest.fail("kubectl {} failed: {}{}".format(" ".join(args), result.stdout, result.stderr))
    return result.stdout


@pytest.fixture
def pool(apiserver: ApiServer) -> Iterator[tuple[Any, dict[str, Any]]]:
    """(API client, the body of a new KVCachePool with a managed Redis in a fresh namespace)."""
    kubernetes = pytest.importorskip("kubernetes")
    kubectl(apiserver, "apply", "-f", str(CRD))
    apiserver.wait_established("kvcachepools.kvpool.io")
    namespace = "kvp-writes-" + uuid.uuid4().hex[:8]
    kubectl(apiserver, "create", "namespace", namespace)
    api = kubernetes.config.new_client_from_config(config_file=str(apiserver.kubeconfig))
    try:
        body = {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
                "metadata": {"name": "p", "namespace": namespace}, "spec": {}}
        yield api, json.loads(kubectl(apiserver, "create", "-o", "json", "-f", "-", stdin=json.dumps(body)))
    finally:
        api.close()
        kubectl(apiserver, "delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def wait_status_observed(api: Any, kind: str, namespace: str, name: str) -> dict[str, Any]:
    """Wait (on the watch's events) until the controller of a DaemonSet or StatefulSet has
    written its status for its current generation; returns it as stored then."""
    from kubernetes import client, watch

    apps = client.AppsV1Api(api)
    lister = apps.list_namespaced_daemon_set if kind == "DaemonSet" else apps.list_namespaced_stateful_set
    w = watch.Watch()
    for event in w.stream(lister, namespace, field_selector="metadata.name=" + name, timeout_seconds=60):
        obj = api.sanitize_for_serialization(event["object"])
        if (obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"]:
            w.stop()
            return dict(obj)
    pytest.fail("the {} controller wrote no status for {}/{} within 60 s".format(kind, namespace, name))


@contextmanager
def _no_index() -> Iterator[object]:
    yield object()


def test_a_reconcile_writes_only_the_children_that_changed(pool: tuple[Any, dict[str, Any]],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          apiserver: ApiServer) -> None:
    monkeypatch.setattr(redis_index, "connect", lambda *a, **kw: _no_index())
    monkeypatch.setattr(redis_index, "read_snapshot", lambda client, pool_id, url="": IndexSnapshot())
    api, body = pool
    ns = body["metadata"]["namespace"]
    kube, applied = CountingKube(api), AppliedChildren(SETTINGS.reconcile.resync_s)

    def run() -> None:
        kube.requests.clear()
        status = reconcile(body, kube=kube, settings=SETTINGS, applied=applied)
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        assert ready["reason"] not in ("InvalidSpec", "ApiRefused"), ready

    run()
    dry_runs = [r for r in kube.writes() if r[2]]
    assert len(dry_runs) == 9 and len(kube.writes()) == 18  # 7 applies and 2 creates (the Secrets), each dry-run
    # Their controllers write the DaemonSet's and the StatefulSet's status: new resourceVersions.
    observed = wait_status_observed(api, "DaemonSet", ns, "p-sidecar")
    for kind, name, answer in (("DaemonSet", "p-sidecar", "daemonsets/p-sidecar"),
                               ("StatefulSet", "p-redis", "statefulsets/p-redis")):
        status_written = wait_status_observed(api, kind, ns, name)["metadata"]
        assert status_written["resourceVersion"] != kube.answers[answer]["metadata"]["resourceVersion"]
        assert status_written["generation"] == kube.answers[answer]["metadata"]["generation"]

    run()
    assert kube.writes() == []
    assert [r[0] for r in kube.requests] == ["GET"] * 9  # each child read once

    # Someone edits: a label off the DaemonSet (no new generation), the ConfigMap's data; a Service goes.
    kubectl(apiserver, "label", "-n", ns, "daemonset", "p-sidecar", "app.kubernetes.io/managed-by-")
    assert kube.get("apps/v1", "DaemonSet", ns, "p-sidecar")["metadata"]["generation"] == (  # type: ignore[index]
        observed["metadata"]["generation"])
    kubectl(apiserver, "patch", "-n", ns, "configmap", "p-config", "--type=merge", "-p",
            json.dumps({"data": {"sidecar.yaml": "log_level: TRACE\n"}}))
    kubectl(apiserver, "delete", "-n", ns, "service", "p-sidecar")
    run()
    written = ["configmaps/p-config", "services/p-sidecar", "daemonsets/p-sidecar"]
    assert kube.writes() == [("PATCH", w, True) for w in written] + [("PATCH", w, False) for w in written]
    daemonset = kube.get("apps/v1", "DaemonSet", ns, "p-sidecar") or {}
    assert daemonset["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kvpool-operator"
    assert "TRACE" not in (kube.get("v1", "ConfigMap", ns, "p-config") or {})["data"]["sidecar.yaml"]
    assert kube.get("v1", "Service", ns, "p-sidecar") is not None

    run()
    assert kube.writes() == []
