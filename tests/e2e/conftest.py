"""Fixtures for the KVCachePool tests against the real API server.

- ``apiserver``: the control plane (tests/cluster/fixtures.py), once per session.
- ``kvpool_crd``: the KVCachePool CRD applied and served.
- ``namespace``: a fresh namespace per test, deleted afterwards.
- ``redis_server``: a real redis-server on a free 127.0.0.1 port in a temp dir.
- ``kvpool_operator``: ``python -m kvpool_operator`` as a subprocess with short timers.
- ``k8s``: small helpers (kubectl, typed reads of pools and children, waiting).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.cluster.fixtures import ApiServer
from tests.cluster.harness import free_port

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "kvcachepools.kvpool.io.yaml"
EXAMPLES = REPO / "examples"
GROUP, VERSION, PLURAL = "kvpool.io", "v1alpha1", "kvcachepools"
#: Seconds between the operator's periodic reconciles in these tests.
TIMER_INTERVAL_S = 2.0
#: Where the operator says it runs (KVPOOL_OPERATOR_POD_NAMESPACE, as the chart sets it).
OPERATOR_NAMESPACE = "kvpool-system"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    pytest.fail("timed out after {:.0f}s waiting for {} (last: {!r})".format(timeout, what, last))


@dataclass
class K8s:
    """What the tests need from the cluster, with the kubeconfig applied."""

    server: ApiServer
    api: Any  # kubernetes.client.ApiClient

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.server.kubectl_argv(*args), input=stdin, capture_output=True, text=True,
                                timeout=120, check=False)
        if check and result.returncode != 0:
            pytest.fail("kubectl {} failed ({}):\n{}{}".format(" ".join(args), result.returncode, result.stdout,
                                                               result.stderr))
        return result

    def apply(self, obj: dict[str, Any] | str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        text = obj if isinstance(obj, str) else json.dumps(obj)
        return self.kubectl("apply", "-f", "-", *extra, stdin=text, check=check)

    def pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            obj: dict[str, Any] = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return obj

    def patch_pool(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.kubectl("patch", "-n", namespace, "kvcachepool", name, "--type=merge", "-p", json.dumps(patch))

    def child(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kvpool_operator.kube import Kube

        return Kube(self.api, field_manager="kvpool-tests", timeout_s=30).get(api_version, kind, namespace, name)

    def condition(self, namespace: str, name: str, kind: str) -> dict[str, Any] | None:
        pool = self.pool(namespace, name) or {}
        for c in (pool.get("status") or {}).get("conditions") or ():
            if c.get("type") == kind:
                return dict(c)
        return None


def create_pool(k8s: K8s, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    k8s.apply({"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
               "metadata": {"name": name, "namespace": namespace}, "spec": spec})
    created = k8s.pool(namespace, name)
    assert created is not None
    return created


def wait_child(k8s: K8s, operator: OperatorProcess, api_version: str, kind: str, namespace: str,
               name: str, timeout: float = 60) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        if operator.process.poll() is not None:
            pytest.fail("the operator died:\n" + operator.log_tail())
        return k8s.child(api_version, kind, namespace, name)

    return wait_for("{} {}/{}".format(kind, namespace, name), probe, timeout=timeout)


def wait_condition(k8s: K8s, namespace: str, name: str, kind: str, status: str, timeout: float = 60,
                   reason: str | None = None) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        c = k8s.condition(namespace, name, kind)
        if c and c["status"] == status and (reason is None or c.get("reason") == reason):
            return c
        return None

    return wait_for("{} {}={} on {}/{}".format(kind, status, reason or "", namespace, name), probe, timeout=timeout)


@pytest.fixture(scope="session")
def k8s(apiserver: ApiServer) -> Iterator[K8s]:  # noqa: F811
    kubernetes = pytest.importorskip("kubernetes")
    api = kubernetes.config.new_client_from_config(config_file=str(apiserver.kubeconfig))
    try:
        yield K8s(apiserver, api)
    finally:
        api.close()


@pytest.fixture(scope="session")
def kvpool_crd(k8s: K8s) -> str:
    """Apply the CRD and wait until pools can be created (Established and discovered)."""
    k8s.kubectl("apply", "-f", str(CRD_PATH))
    k8s.server.wait_established("kvcachepools.kvpool.io")
    wait_for("kvcachepools in discovery",
             lambda: "kvcachepools" in k8s.kubectl("api-resources", "--api-group=kvpool.io", "-o", "name",
                                                  check=False).stdout, timeout=30)
    return "kvcachepools.kvpool.io"


@pytest.fixture
def namespace(k8s: K8s) -> Iterator[str]:
    name = "kvp-test-" + uuid.uuid4().hex[:8]
    k8s.kubectl("create", "namespace", name)
    wait_for("default ServiceAccount in " + name,
             lambda: k8s.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             timeout=30)
    yield name
    k8s.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@dataclass(frozen=True)
class RedisServer:
    port: int
    url: str
    process: subprocess.Popen[bytes]

    def client(self) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.access(binary, os.X_OK):
        pytest.skip("redis-server is not installed")
    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir), "--save", "",
         "--appendonly", "no"],
        stdout=open(workdir / "redis.log", "wb"), stderr=subprocess.STDOUT,
    )
    server = RedisServer(port=port, url="redis://127.0.0.1:{}/0".format(port), process=proc)
    try:
        wait_for("redis-server on port {}".format(port), lambda: _redis_pings(server), timeout=20, interval=0.1)
        yield server
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _redis_pings(server: RedisServer) -> bool:
    import redis

    try:
        return bool(server.client().ping())
    except redis.RedisError:
        return False


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def running_operator(env: dict[str, str], log_path: Path, *args: str) -> Iterator[OperatorProcess]:
    """``python -m kvpool_operator`` with ``env`` (plus short timers unless given), as Helm
    would run it; waits until it watches and stops it with SIGTERM at the end."""
    full_env = {
        **os.environ,
        "KVPOOL_OPERATOR_TIMER_INTERVAL": str(TIMER_INTERVAL_S),
        "KVPOOL_OPERATOR_TIMER_DELAY": "0.5",
        "KVPOOL_OPERATOR_BACKOFF_MAX": "2",
        "KVPOOL_OPERATOR_PURGE_RETRIES": "3",
        "KVPOOL_OPERATOR_REDIS_TIMEOUT": "1",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    full_env.pop("KUBERNETES_SERVICE_HOST", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvpool_operator", *args], env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=str(REPO))
    operator = OperatorProcess(proc, log_path)
    try:
        wait_for("the operator to start watching",
                 lambda: proc.poll() is not None or "Initial authentication has finished" in log_path.read_text(),
                 timeout=60)
        if proc.poll() is not None:
            pytest.fail("the operator exited with {}:\n{}".format(proc.returncode, operator.log_tail()))
        yield operator
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def kvpool_operator(apiserver: ApiServer, kvpool_crd: str,  # noqa: F811
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator as Helm would run it (``python -m kvpool_operator``), cluster-wide."""
    log_path = tmp_path_factory.mktemp("operator") / "operator.log"
    with running_operator({"KUBECONFIG": str(apiserver.kubeconfig),
                           "KVPOOL_OPERATOR_POD_NAMESPACE": OPERATOR_NAMESPACE}, log_path) as operator:
        yield operator
