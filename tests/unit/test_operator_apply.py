"""The reconcile never half-applies: every refusal before the first write, Events for each."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kopf
import pytest

from kvpool_operator import handlers
from kvpool_operator import index as redis_index
from kvpool_operator.index import IndexSnapshot
from kvpool_operator.kube import resource_path
from kvpool_operator.reconcile import reconcile
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.status import invalid_spec_event
from tests.unit.operator_support import FakeKube, pool_body

SETTINGS = OperatorSettings()
EXTERNAL = {"redis": {"external": {"url": "redis://r:1/0"}}}


@pytest.fixture(autouse=True)
def empty_index(monkeypatch: pytest.MonkeyPatch) -> None:
    @contextmanager
    def connect(url: str, password: str | None, **_: Any) -> Iterator[object]:
        yield object()

    monkeypatch.setattr(redis_index, "connect", connect)
    monkeypatch.setattr(redis_index, "read_snapshot", lambda client, pool_id, url="": IndexSnapshot())


def ready(status: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == "Ready")


def applied_pool(spec: dict[str, Any]) -> FakeKube:
    """A pool whose children a valid spec has created."""
    kube = FakeKube()
    status = reconcile(pool_body(spec), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert ready(status)["reason"] != "InvalidSpec"
    kube.calls.clear()
    return kube


def test_the_status_says_where_serving_pods_find_the_socket() -> None:
    """status.socketPath: the pool's own socket (kubectl get kvp -o jsonpath='{.status.socketPath}')."""
    status = reconcile(pool_body(EXTERNAL), kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
    assert status["socketPath"] == "/run/kvpool/ns.p/kvpool.sock"
    custom = reconcile(pool_body({**EXTERNAL, "api": {"socketDir": "/var/run/kv"}}), kube=FakeKube(),
                       settings=SETTINGS)  # type: ignore[arg-type]
    assert custom["socketPath"] == "/var/run/kv/kvpool.sock"


def _foreign_configmap(kube: FakeKube) -> None:
    kube.objects[resource_path("v1", "ConfigMap", "ns", "p-config")] = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-config", "namespace": "ns"}, "data": {}}


INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("memory-below-dram", {**EXTERNAL, "tiers": {"dram": {"size": "4Gi"}}, "resources": {"limits": {"memory": "1Gi"}}},
     "spec.resources.limits.memory"),
    ("missing-auth-secret", {**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}, "spec.auth.secretRef"),
    ("missing-tenant-token", {**EXTERNAL, "tenants": [{"name": "a", "tokenSecret": {"name": "gone"}}]},
     "spec.tenants[0].tokenSecret"),
    ("missing-redis-password", {"redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "gone"}}}},
     "spec.redis.external.passwordSecretRef"),
    ("size-too-large", {**EXTERNAL, "tiers": {"dram": {"size": "1000000Ei"}}}, "spec.tiers.dram.size"),
]


@pytest.mark.parametrize("spec,field", [(s, f) for _, s, f in INVALID], ids=[i for i, _, _ in INVALID])
def test_an_invalid_spec_changes_no_child(spec: dict[str, Any], field: str) -> None:
    kube = applied_pool(EXTERNAL)
    before = copy.deepcopy(kube.objects)
    status = reconcile(pool_body(spec, generation=2), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert (ready(status)["reason"], ready(status)["status"]) == ("InvalidSpec", "False")
    assert field in ready(status)["message"]
    assert kube.writes() == [] and kube.objects == before  # not even the DaemonSet


def test_a_foreign_object_under_a_childs_name_stops_every_write() -> None:
    kube = FakeKube()
    _foreign_configmap(kube)
    status = reconcile(pool_body(EXTERNAL), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert "ConfigMap 'p-config' already exists and does not belong to this pool" in ready(status)["message"]
    assert kube.writes() == []
    assert list(kube.objects) == [resource_path("v1", "ConfigMap", "ns", "p-config")]


def test_a_child_refused_in_the_dry_run_changes_nothing() -> None:
    kube = applied_pool({})
    before = copy.deepcopy(kube.objects)
    kube.reject_kind = "StatefulSet"  # e.g. 422: a field of the StatefulSet that cannot change
    status = reconcile(pool_body({"logLevel": "DEBUG"}, generation=2), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    assert ready(status)["reason"] == "InvalidSpec"
    assert "StatefulSet 'p-redis' was rejected by the API server" in ready(status)["message"]
    assert "no child was changed" in ready(status)["message"]
    assert kube.writes() == [] and kube.objects == before


def test_a_child_refused_for_real_stops_before_the_rest() -> None:
    kube = applied_pool({})
    daemonset = copy.deepcopy(kube.objects[resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")])
    kube.reject_kind, kube.reject_only_for_real = "StatefulSet", True  # passed the dry run, then refused
    status = reconcile(pool_body({"logLevel": "DEBUG"}, generation=2), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    message = ready(status)["message"]
    assert ready(status)["reason"] == "InvalidSpec" and ready(status)["status"] == "False"
    assert "StatefulSet 'p-redis' was rejected" in message
    assert "not applied after it: NetworkPolicy 'p-sidecar', Service 'p-sidecar', DaemonSet 'p-sidecar'" in message
    applied = [(kind, name) for verb, kind, name in kube.writes() if verb == "apply"]
    assert applied[-1] == ("StatefulSet", "p-redis")  # the refused one was the last attempted
    assert ("DaemonSet", "p-sidecar") not in applied
    assert kube.objects[resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")] == daemonset  # old spec kept
    assert not [c for c in kube.writes() if c[0] == "delete"]  # no stale-child clean-up either


def test_children_are_applied_after_what_they_depend_on() -> None:
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    dry = [(k, n) for verb, k, n in kube.calls if verb == "dry-run"]
    real = [(k, n) for verb, k, n in kube.calls if verb in ("apply", "create")]
    assert dry == real and len(real) == 9
    assert kube.calls.index(("apply", "ConfigMap", "p-config")) > kube.calls.index(("dry-run", "DaemonSet",
                                                                                    "p-sidecar"))  # all checked first
    order = [k + "/" + n for k, n in real]
    assert order[0] == "ConfigMap/p-config" and order[-1] == "DaemonSet/p-sidecar"
    assert order.index("Secret/p-redis") < order.index("StatefulSet/p-redis")
    assert order.index("NetworkPolicy/p-redis") < order.index("StatefulSet/p-redis")
    assert order.index("NetworkPolicy/p-sidecar") < order.index("DaemonSet/p-sidecar")
    assert order.index("Secret/p-auth") < order.index("DaemonSet/p-sidecar")


# -- Events ---------------------------------------------------------------------------------


def _status(reason: str, message: str, generation: int = 1) -> dict[str, Any]:
    return {"conditions": [{"type": "Ready", "status": "False", "reason": reason, "message": message,
                            "observedGeneration": generation}]}


def test_invalid_spec_event_once_per_distinct_refusal() -> None:
    new = _status("InvalidSpec", "spec.auth.secretRef: Secret 'x' not found")
    message = invalid_spec_event(None, new)
    assert message is not None and "spec.auth.secretRef: Secret 'x' not found" in message
    assert "not applied" in message
    assert invalid_spec_event(new, new) is None  # the timer's re-run: told already
    assert invalid_spec_event(new, _status("InvalidSpec", "other")) is not None
    assert invalid_spec_event(new, _status("InvalidSpec", new["conditions"][0]["message"], 2)) is not None
    assert invalid_spec_event(None, _status("NoLiveSidecars", "none yet")) is None


def test_the_handler_posts_a_warning_event_for_an_invalid_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[dict[str, Any]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, **kw: posted.append(kw))
    monkeypatch.setattr(handlers, "Kube", FakeKube)
    memo = kopf.Memo()
    memo[handlers._KUBE] = FakeKube()  # noqa: SLF001
    body = kopf.Body(pool_body({**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}))
    patch = kopf.Patch()
    handlers._run(body, patch, memo, 0)  # noqa: SLF001
    assert [p["reason"] for p in posted] == ["InvalidSpec"]
    assert "spec.auth.secretRef: Secret 'gone' not found" in posted[0]["message"]
    # The same refusal again, with the status written: no second Event.
    again = kopf.Body({**pool_body({**EXTERNAL, "auth": {"secretRef": {"name": "gone"}}}),
                       "status": dict(patch["status"])})
    handlers._run(again, kopf.Patch(), memo, 0)  # noqa: SLF001
    assert len(posted) == 1
