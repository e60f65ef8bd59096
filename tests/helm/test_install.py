"""The chart on the real API server: install, RBAC proven by use, upgrade, uninstall.

No kubelet runs here, so the operator's Deployment never gets a pod. Instead the test
runs the operator the way that pod would: ``python -m kvpool_operator`` with the env of
the installed Deployment and the token of the chart's ServiceAccount (TokenRequest). If
the chart's Roles miss a permission the operator needs, a pool is not reconciled (or the
log shows 403s) and the test fails; ``kubectl auth can-i`` with the same token proves
what it must not be able to do.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.harness import free_port
from tests.e2e.conftest import EXAMPLES, K8s, OperatorProcess, RedisServer, running_operator, wait_for
from tests.e2e.conftest import k8s, redis_server  # noqa: F401 - fixtures
from tests.helm.conftest import CHART, Helm, HelmError

pytestmark = [pytest.mark.helm, pytest.mark.apiserver]

#: What kopf logs when it may not watch CRDs (rbac.scanCluster=false): retries, then a warning.
CRD_SCAN_DENIED = ("/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                   "Not enough permissions to watch for resources")
#: Things the operator's identity must never be able to do, in any namespace.
NEVER = [
    ("list", "secrets"), ("watch", "secrets"), ("create", "pods"), ("get", "pods"), ("create", "pods/exec"),
    ("create", "pods/attach"), ("create", "pods/portforward"), ("create", "serviceaccounts/token"),
    ("impersonate", "serviceaccounts"), ("create", "rolebindings"), ("escalate", "roles"), ("bind", "roles"),
    ("update", "deployments"), ("create", "deployments"), ("create", "kvcachepools"), ("delete", "kvcachepools"),
    ("update", "configmaps"), ("list", "configmaps"), ("deletecollection", "configmaps"), ("*", "*"),
]
#: A namespace named in a request path (``.../namespaces/NAME/...``).
NAMESPACE_IN_PATH = re.compile(r"/namespaces/([a-z0-9]([-a-z0-9]*[a-z0-9])?)/")
NEVER_CLUSTER = [("list", "secrets"), ("get", "nodes"), ("create", "customresourcedefinitions"),
                 ("delete", "namespaces"), ("create", "clusterrolebindings"), ("get", "kvcachepools")]
#: Children of a minimal pool (managed Redis) named P.
CHILDREN = [("v1", "ConfigMap", "{}-config"), ("v1", "Secret", "{}-auth"), ("apps/v1", "DaemonSet", "{}-sidecar"),
            ("v1", "Service", "{}-sidecar"), ("networking.k8s.io/v1", "NetworkPolicy", "{}-sidecar"),
            ("apps/v1", "StatefulSet", "{}-redis"), ("v1", "Service", "{}-redis"), ("v1", "Secret", "{}-redis"),
            ("networking.k8s.io/v1", "NetworkPolicy", "{}-redis")]
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor",
                       "listKind": "ServiceMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}


# ---------------------------------------------------------------------------- helpers


@dataclass
class Release:
    name: str
    namespace: str
    helm: Helm
    k8s: K8s

    @property
    def fullname(self) -> str:
        return "{}-kvpool".format(self.name)

    def install(self, *args: str) -> str:
        return self.helm.run("install", self.name, str(CHART), "--namespace", self.namespace, *args).stdout

    def upgrade(self, *args: str) -> str:
        return self.helm.run("upgrade", self.name, str(CHART), "--namespace", self.namespace, *args).stdout

    def uninstall(self) -> str:
        return self.helm.run("uninstall", self.name, "--namespace", self.namespace).stdout

    def exists(self, kind: str, name: str, namespace: str | None = None) -> bool:
        args = ["get", kind, name] + (["-n", namespace] if namespace else [])
        return self.k8s.kubectl(*args, check=False).returncode == 0

    def deployment_env(self) -> dict[str, str]:
        deploy = json.loads(self.k8s.kubectl("get", "deployment", self.fullname, "-n", self.namespace,
                                             "-o", "json").stdout)
        (container,) = deploy["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["python", "-m", "kvpool_operator"]
        return {e["name"]: e.get("value", "") for e in container["env"]}


def create_namespace(k8s: K8s, prefix: str) -> str:  # noqa: F811
    name = "{}-{}".format(prefix, uuid.uuid4().hex[:6])
    k8s.kubectl("create", "namespace", name)
    return name


def delete_namespace(k8s: K8s, name: str) -> None:  # noqa: F811
    # Pools the chart kept (or a stopped operator left) would hold the namespace: drop their finalizers.
    out = k8s.kubectl("get", "kvcachepools", "-n", name, "-o", "name", check=False).stdout.split()
    for pool in out:
        k8s.kubectl("patch", pool, "-n", name, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
    k8s.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def service_account_kubeconfig(k8s: K8s, namespace: str, sa: str, path: Path) -> Path:  # noqa: F811
    """A kubeconfig holding a fresh token of the ServiceAccount (TokenRequest API)."""
    token = k8s.kubectl("create", "token", sa, "-n", namespace, "--duration=1h").stdout.strip()
    assert token.count(".") == 2, "not a JWT: {!r}".format(token[:40])
    server = k8s.server
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server.url, "certificate-authority": str(server.ca_file)}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": sa, "namespace": namespace}}],
        "current-context": "sa",
    }))
    return path


def can_i(k8s: K8s, kubeconfig: Path, verb: str, resource: str, *where: str) -> bool:  # noqa: F811
    """``kubectl auth can-i`` as the identity in ``kubeconfig`` (a SelfSubjectAccessReview)."""
    result = subprocess.run([k8s.server.kubectl, "--kubeconfig", str(kubeconfig), "auth", "can-i", verb, resource,
                             *where], capture_output=True, text=True, timeout=60, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), "kubectl auth can-i {} {}: {}{}".format(verb, resource, answer, result.stderr)
    return answer == "yes"


@contextmanager
def operator_as(kubeconfig: Path, env: dict[str, str], log_path: Path) -> Iterator[tuple[OperatorProcess, int]]:
    """The operator with the Deployment's env, short timers and the ServiceAccount's kubeconfig."""
    port = free_port()
    full_env = {**env, "KUBECONFIG": str(kubeconfig),
                "KVPOOL_OPERATOR_LIVENESS": "http://127.0.0.1:{}/healthz".format(port),
                "KVPOOL_OPERATOR_TIMER_INTERVAL": "2", "KVPOOL_OPERATOR_BACKOFF_MAX": "1",
                "KVPOOL_OPERATOR_PURGE_RETRIES": "2"}
    with running_operator(full_env, log_path, "--verbose") as operator:
        yield operator, port


def forbidden_lines(operator: OperatorProcess, allowed: tuple[str, ...] = ()) -> list[str]:
    """Log lines about refused requests, but for those the configuration means to refuse."""
    lines = operator.log_path.read_text(errors="replace").splitlines()
    return [ln for ln in lines if ("forbidden" in ln.lower() or " 403" in ln or "permission" in ln.lower())
            and not any(a in ln for a in allowed)]


def torn_down_namespaces(k8s: K8s, operator: OperatorProcess, ours: tuple[str, ...]) -> tuple[str, ...]:  # noqa: F811
    """``/namespaces/NAME/`` of every other namespace named by a refused request in the log
    that is being deleted (Terminating, or gone already).

    A cluster-wide operator also reconciles pools other tests left in namespaces they are
    deleting; the API server refuses to create children there (NamespaceLifecycle, a 403).
    With ``--verbose`` urllib3 logs each such request as ``"PATCH /apis/.../namespaces/NAME/
    ...?fieldManager=..." 403``, without the API's message. A namespace never goes back to
    Active once it is Terminating, and refusals in any namespace that is Active still count.
    """
    named = {m.group(1) for line in forbidden_lines(operator) for m in NAMESPACE_IN_PATH.finditer(line)}
    gone = []
    for name in sorted(named - set(ours)):
        phase = k8s.kubectl("get", "namespace", name, "-o", "jsonpath={.status.phase}", check=False)
        if phase.returncode != 0 or phase.stdout.strip() != "Active":
            gone.append("/namespaces/{}/".format(name))
    return tuple(gone)


def pool_reconciled(k8s: K8s, operator: OperatorProcess, namespace: str,  # noqa: F811
                    name: str) -> Callable[[], dict[str, Any] | None]:
    """Probe: the pool's status was written for its current generation."""
    def probe() -> dict[str, Any] | None:
        if operator.process.poll() is not None:
            pytest.fail("the operator died:\n" + operator.log_tail())
        pool = k8s.pool(namespace, name) or {}
        conditions = {c["type"]: c for c in (pool.get("status") or {}).get("conditions") or ()}
        ready = conditions.get("Ready")
        if ready and ready.get("observedGeneration") == pool["metadata"]["generation"]:
            return pool
        return None
    return probe


def wait_children(k8s: K8s, operator: OperatorProcess, namespace: str, pool: str) -> None:  # noqa: F811
    for api_version, kind, pattern in CHILDREN:
        name = pattern.format(pool)

        def probe(api_version: str = api_version, kind: str = kind, name: str = name) -> dict[str, Any] | None:
            if operator.process.poll() is not None:
                pytest.fail("the operator died:\n" + operator.log_tail())
            return k8s.child(api_version, kind, namespace, name)

        child = wait_for("{} {}/{} (log:\n{})".format(kind, namespace, name, operator.log_tail(20)), probe,
                         timeout=60)
        owners = child["metadata"].get("ownerReferences") or []
        assert [o["name"] for o in owners] == [pool] and owners[0]["kind"] == "KVCachePool"


def apply_example(k8s: K8s, namespace: str, example: str) -> str:  # noqa: F811
    doc = yaml.safe_load((EXAMPLES / example).read_text())
    k8s.kubectl("apply", "-n", namespace, "-f", str(EXAMPLES / example))
    return str(doc["metadata"]["name"])


def assert_never(k8s: K8s, kubeconfig: Path, *namespaces: str) -> None:  # noqa: F811
    for ns in namespaces:
        for verb, resource in NEVER:
            assert not can_i(k8s, kubeconfig, verb, resource, "-n", ns), "may {} {} in {}".format(verb, resource, ns)
    for verb, resource in NEVER_CLUSTER:
        assert not can_i(k8s, kubeconfig, verb, resource, "--all-namespaces"), "may {} {} cluster-wide".format(
            verb, resource)


# ---------------------------------------------------------------------------- tests


@pytest.fixture
def admin_helm(helm: Helm, apiserver: Any) -> Helm:  # noqa: F811
    return helm.with_kubeconfig(apiserver.kubeconfig)


def test_install_namespaced_reconcile_upgrade_uninstall(
        admin_helm: Helm, k8s: K8s, redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    ns = create_namespace(k8s, "kvp-helm")
    other = create_namespace(k8s, "kvp-helm-other")
    release = Release("kvp", ns, admin_helm, k8s)
    try:
        # -- install (no --wait: no pod runs here) ------------------------------------------
        out = release.install()
        assert "STATUS: deployed" in out
        notes = out[out.index("NOTES:"):]
        assert "in: {}.".format(ns) in notes and "kind: KVCachePool" in notes
        assert "rollout status deployment/kvp-kvpool" in notes
        assert k8s.kubectl("get", "crd", "kvcachepools.kvpool.io").returncode == 0
        for kind in ("deployment", "serviceaccount", "role", "rolebinding"):
            assert release.exists(kind, release.fullname, ns), kind
        assert not release.exists("clusterrole", "{}-kvp-kvpool-scan".format(ns))  # nothing cluster-scoped
        assert not release.exists("role", release.fullname, other)
        env = release.deployment_env()
        assert env["KVPOOL_OPERATOR_NAMESPACES"] == ns

        # -- the operator, as the chart's ServiceAccount, reconciles pools --------------------
        kubeconfig = service_account_kubeconfig(k8s, ns, release.fullname, tmp_path / "sa.kubeconfig")
        with operator_as(kubeconfig, env, tmp_path / "operator.log") as (operator, health_port):
            with urllib.request.urlopen("http://127.0.0.1:{}/healthz".format(health_port), timeout=10) as r:
                assert r.status == 200  # what the chart's probes ask for

            minimal = apply_example(k8s, ns, "minimal.yaml")
            k8s.apply({"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
                       "metadata": {"name": "external", "namespace": ns},
                       "spec": {"redis": {"external": {"url": redis_server.url}}}})
            wait_children(k8s, operator, ns, minimal)
            pool = wait_for("pool {} status".format(minimal), pool_reconciled(k8s, operator, ns, minimal))
            conditions = {c["type"]: c for c in pool["status"]["conditions"]}
            assert conditions["IndexReachable"]["status"] == "False"  # no cluster DNS for the managed Redis
            assert "finalizers" in pool["metadata"] and pool["metadata"]["finalizers"]
            external = wait_for("external pool indexed", lambda: (lambda p: p if p and any(
                c["type"] == "IndexReachable" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions", [])) else None)(k8s.pool(ns, "external")))
            for c in external["status"]["conditions"]:
                assert "forbidden" not in c.get("message", "").lower(), c

            # Switching the index to an external Redis makes the operator delete the managed one.
            k8s.patch_pool(ns, minimal, {"spec": {"redis": {"managed": None, "external": {"url": redis_server.url}}}})
            for api_version, kind in (("apps/v1", "StatefulSet"), ("v1", "Service"), ("v1", "Secret"),
                                      ("networking.k8s.io/v1", "NetworkPolicy")):
                wait_for("{} {}-redis to be deleted".format(kind, minimal),
                         lambda api_version=api_version, kind=kind: k8s.child(
                             api_version, kind, ns, "{}-redis".format(minimal)) is None)
            k8s.patch_pool(ns, minimal, {"spec": {"redis": {"external": None, "managed": {}}}})
            wait_for("the managed Redis back", lambda: k8s.child("apps/v1", "StatefulSet", ns, minimal + "-redis"))

            # -- what it must not do ------------------------------------------------------------
            assert can_i(k8s, kubeconfig, "patch", "kvcachepools/status", "-n", ns)
            assert can_i(k8s, kubeconfig, "get", "secrets", "-n", ns)
            assert not can_i(k8s, kubeconfig, "get", "secrets", "-n", other)
            assert not can_i(k8s, kubeconfig, "create", "configmaps", "-n", other)
            assert not can_i(k8s, kubeconfig, "list", "kvcachepools", "-n", other)
            assert not can_i(k8s, kubeconfig, "get", "secrets", "--all-namespaces")
            assert_never(k8s, kubeconfig, ns, other, "kube-system")

            # -- deleting: the finalizer runs (purge) or gives up with a Warning event -----------
            k8s.kubectl("delete", "kvcachepool", "external", "-n", ns, "--wait=false")
            k8s.kubectl("delete", "kvcachepool", minimal, "-n", ns, "--wait=false")
            # the external pool's Redis is unreachable: its finalizer retries before it gives up,
            # which on a loaded 2-core machine has taken over a minute
            wait_for("the pools to go", lambda: k8s.pool(ns, minimal) is None and k8s.pool(ns, "external") is None,
                     timeout=180)
            events = json.loads(k8s.kubectl("get", "events", "-n", ns, "-o", "json").stdout)["items"]
            assert any(e.get("reason") == "IndexNotPurged" for e in events), [e.get("reason") for e in events]

            # -- upgrade: a second namespace, a pool from values, dashboard, ServiceMonitor ------
            k8s.apply(SERVICE_MONITOR_CRD)
            k8s.server.wait_established("servicemonitors.monitoring.coreos.com")
            out = release.upgrade("--set", "watch.namespaces={{{},{}}}".format(ns, other),
                                  "--set", "pools[0].name=fromvalues", "--set", "pools[0].spec.logLevel=DEBUG",
                                  "--set", "grafanaDashboard.enabled=true", "--set", "serviceMonitor.enabled=true")
            assert "REVISION: 2" in out
            assert release.deployment_env()["KVPOOL_OPERATOR_NAMESPACES"] == "{},{}".format(ns, other)
            assert release.exists("role", release.fullname, other)
            assert release.exists("configmap", "kvp-kvpool-dashboard", ns)
            assert release.exists("servicemonitor", "kvp-kvpool-sidecars", ns)
            assert can_i(k8s, kubeconfig, "create", "configmaps", "-n", other)
            # The running operator (still serving ns) picks up the pool Helm created.
            wait_children(k8s, operator, ns, "fromvalues")
            wait_for("pool fromvalues status", pool_reconciled(k8s, operator, ns, "fromvalues"))
            assert forbidden_lines(operator) == []

        # -- uninstall ------------------------------------------------------------------------
        assert "uninstalled" in release.uninstall()
        for kind, name, where in (("deployment", release.fullname, ns), ("serviceaccount", release.fullname, ns),
                                  ("role", release.fullname, ns), ("role", release.fullname, other),
                                  ("rolebinding", release.fullname, other),
                                  ("configmap", "kvp-kvpool-dashboard", ns)):
            assert not release.exists(kind, name, where), "{} {} survived helm uninstall".format(kind, name)
        assert k8s.kubectl("get", "crd", "kvcachepools.kvpool.io").returncode == 0  # Helm keeps CRDs
        assert k8s.pool(ns, "fromvalues") is not None  # helm.sh/resource-policy: keep
        # The ServiceAccount is gone, and its token with it (once the authenticator's cache sees it).
        def token_refused() -> bool:
            denied = subprocess.run([k8s.server.kubectl, "--kubeconfig", str(kubeconfig), "get", "kvcachepools"],
                                    capture_output=True, text=True, timeout=60, check=False)
            return denied.returncode != 0 and "Unauthorized" in denied.stderr

        wait_for("the ServiceAccount's token to be refused", token_refused, timeout=30)
        assert "not found" in admin_helm.run("status", "kvp", "-n", ns, check=False).stderr
    finally:
        try:
            release.uninstall()
        except HelmError:
            pass
        delete_namespace(k8s, ns)
        delete_namespace(k8s, other)


def test_install_cluster_wide(admin_helm: Helm, k8s: K8s, tmp_path: Path) -> None:  # noqa: F811
    ns = create_namespace(k8s, "kvp-helm-cw")
    pools = create_namespace(k8s, "kvp-helm-pools")
    release = Release("cw", ns, admin_helm, k8s)
    cluster_role = "{}-cw-kvpool".format(ns)
    try:
        out = release.install("--set", "watch.clusterWide=true", "--set", "rbac.scanCluster=false")
        assert "in every namespace" in out
        assert release.exists("clusterrole", cluster_role) and release.exists("clusterrolebinding", cluster_role)
        assert not release.exists("clusterrole", cluster_role + "-scan")
        env = release.deployment_env()
        assert env["KVPOOL_OPERATOR_NAMESPACES"] == ""

        kubeconfig = service_account_kubeconfig(k8s, ns, release.fullname, tmp_path / "sa.kubeconfig")
        # Pools in another namespace than the operator's.
        assert can_i(k8s, kubeconfig, "get", "secrets", "-n", pools)
        assert can_i(k8s, kubeconfig, "watch", "kvcachepools", "--all-namespaces")
        assert_never(k8s, kubeconfig, ns, pools)
        with operator_as(kubeconfig, env, tmp_path / "operator.log") as (operator, _):
            name = apply_example(k8s, pools, "minimal.yaml")
            wait_children(k8s, operator, pools, name)
            wait_for("pool status", pool_reconciled(k8s, operator, pools, name))
            k8s.kubectl("delete", "kvcachepool", name, "-n", pools, "--wait=false")
            wait_for("the pool to go", lambda: k8s.pool(pools, name) is None, timeout=60)
            # a cluster-wide operator also sees other tests' pools (e.g. the kept pool of the
            # namespaced test above): its events and children in their namespaces being deleted
            # are refused by the API server, not by RBAC
            allowed = CRD_SCAN_DENIED + ("is being terminated",) + torn_down_namespaces(k8s, operator, (ns, pools))
            assert forbidden_lines(operator, allowed) == []

        release.upgrade("--reuse-values", "--set", "operator.verbose=true")
        assert "REVISION: 2" in admin_helm.run("status", "cw", "-n", ns).stdout
        release.uninstall()
        assert not release.exists("clusterrole", cluster_role)
        assert not release.exists("clusterrolebinding", cluster_role)
    finally:
        try:
            release.uninstall()
        except HelmError:
            pass
        delete_namespace(k8s, ns)
        delete_namespace(k8s, pools)
