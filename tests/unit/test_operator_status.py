"""Status computation (pure) and the reconcile's decisions, with an in-memory API."""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from kvpool_operator import index as redis_index
from kvpool_operator.errors import IndexUnavailableError, KubernetesApiError, TemporaryApiError
from kvpool_operator.index import IndexSnapshot
from kvpool_operator.kube import resource_path
from kvpool_operator.preflight import REDIS_HOSTS_ANNOTATION
from kvpool_operator.reconcile import purge_index, reconcile
from kvpool_operator.settings import OperatorSettings
from kvpool_operator.status import (
    Observation,
    PoolFigures,
    TierFigures,
    build_status,
    conditions,
    merge_patch,
    node_tiers,
    pool_figures,
    ready_status,
)
from tests.unit.operator_support import FakeKube, pool_body

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
GiB = 1 << 30


def node(dram: tuple[int, int, int], disk: tuple[int, int, int] | None = None, hits: int = 0,
         misses: int = 0) -> dict[str, str]:
    tiers = {"dram": dict(zip(("capacity_bytes", "used_bytes", "blocks"), dram))}
    if disk:
        tiers["disk"] = dict(zip(("capacity_bytes", "used_bytes", "blocks"), disk))
    return {"address": "10.0.0.1:7470", "heartbeat": "1.5", "tiers": json.dumps(tiers), "hits": str(hits),
            "misses": str(misses), "gpus": "[]", "version": "0.1.0"}


def by_type(conds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conds}


# -- figures ------------------------------------------------------------------------------


def test_pool_figures_sum_live_nodes() -> None:
    figures = pool_figures({"a": node((GiB, 100, 2), (10 * GiB, 300, 3), hits=6, misses=2),
                            "b": node((GiB, 50, 1), hits=2, misses=0)})
    assert figures.live == 2
    assert figures.tiers == {"dram": TierFigures(2 * GiB, 150, 3), "disk": TierFigures(10 * GiB, 300, 3)}
    assert (figures.capacity_bytes, figures.used_bytes, figures.blocks) == (12 * GiB, 450, 6)
    assert figures.hit_ratio == 0.8


def test_figures_a_writer_to_redis_makes_huge_stay_within_int64() -> None:
    """The API server refuses a whole status patch with an integer past int64: a forged
    heartbeat with ``hits`` of 200 digits or a tier of 2**80 bytes had frozen the status."""
    forged = {**node((2**80, 2**70, 2**65), hits=0), "hits": "9" * 200, "misses": str(2**64)}
    # figures just under the bound that add up past it: three tiers of one node, two nodes' hits
    big = {**node((2**63 - 1, 2**63 - 1, 2**63 - 1), (2**63 - 1, 0, 0), hits=2**62), "tiers": json.dumps(
        {t: {"capacity_bytes": 2**63 - 1, "used_bytes": 2**63 - 1, "blocks": 2**63 - 1}
         for t in ("gpu", "dram", "disk")})}
    figures = pool_figures({"a": node((GiB, 100, 2), hits=6, misses=2), "evil": forged, "big": big,
                            "big2": {**big, "hits": str(2**62)}})
    status = build_status(obs(figures=figures), None, NOW)

    def ints(value: object) -> list[int]:
        if isinstance(value, dict):
            return [i for v in value.values() for i in ints(v)]
        if isinstance(value, list):
            return [i for v in value for i in ints(v)]
        return [value] if isinstance(value, int) and not isinstance(value, bool) else []

    found = ints(status)
    assert found and max(found) < 2**63


def test_gpus_of_live_nodes_are_counted_by_model_and_health() -> None:
    h200 = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1", "total_bytes": 1, "free_bytes": 1,
            "health": {"ok": True, "ecc_uncorrected": 0}}
    sick = {**h200, "index": 1, "health": {"ok": False, "retire_pending": True}}
    a, b = node((GiB, 0, 0)), node((GiB, 0, 0))
    a["gpus"], b["gpus"] = json.dumps([h200, sick]), json.dumps([{**h200, "name": "NVIDIA L4"}, "junk", {"x": 1}])
    figures = pool_figures({"a": a, "b": b, "c": {**node((GiB, 0, 0)), "gpus": "not json"}})
    assert figures.gpu_models == {"NVIDIA H200": 2, "NVIDIA L4": 1} and figures.gpus_unhealthy == 1
    status = build_status(obs(figures=figures, desired=3), None, NOW)
    assert status["gpus"] == {"count": 3, "unhealthy": 1, "models": {"NVIDIA H200": 2, "NVIDIA L4": 1}}
    assert "gpus" not in build_status(obs(figures=pool_figures({"a": node((GiB, 0, 0))})), None, NOW)


@pytest.mark.parametrize("tiers", ["not json", "[1, 2]", '{"dram": "full"}', '{"nvme": {"blocks": 3}}'])
def test_malformed_heartbeats_count_as_zero(tiers: str) -> None:
    assert node_tiers({"tiers": tiers}) == {}
    figures = pool_figures({"a": {"tiers": tiers, "hits": "x", "misses": "-4"}})
    assert (figures.live, figures.capacity_bytes, figures.hits, figures.misses) == (1, 0, 0, 0)
    assert figures.hit_ratio is None


# -- conditions ---------------------------------------------------------------------------


def obs(**kw: Any) -> Observation:
    base: dict[str, Any] = {"generation": 3, "pool_id": "ns.p", "index_url": "redis://r:6379/0"}
    base.update(kw)
    return Observation(**base)


def test_ready_with_live_sidecars() -> None:
    c = by_type(conditions(obs(figures=PoolFigures(live=2), desired=2)))
    assert c["Ready"]["status"] == "True" and c["Ready"]["reason"] == "PoolReady"
    assert c["IndexReachable"]["status"] == "True"
    assert c["Degraded"]["status"] == "False"


def test_not_ready_without_sidecars() -> None:
    c = by_type(conditions(obs(figures=PoolFigures(live=0), desired=3)))
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "NoLiveSidecars")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "SidecarsMissing")


def test_partial_pool_is_ready_but_degraded() -> None:
    c = by_type(conditions(obs(figures=PoolFigures(live=2), desired=3)))
    assert c["Ready"]["status"] == "True"
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "SidecarsMissing")
    assert "2 sidecar(s) live, 3 node(s)" in c["Degraded"]["message"]


def test_unreachable_index() -> None:
    c = by_type(conditions(obs(index_error="cannot reach Redis at redis://r:6379/0", index_reason="Unreachable",
                               figures=PoolFigures(live=0))))
    assert (c["IndexReachable"]["status"], c["IndexReachable"]["reason"]) == ("False", "Unreachable")
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "IndexUnreachable")
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "IndexUnreachable")


def test_problems_win() -> None:
    c = by_type(conditions(obs(problems=["spec.auth.secretRef: Secret 'x' not found"], figures=PoolFigures(live=4),
                               desired=4)))
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert "spec.auth.secretRef" in c["Ready"]["message"]
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "InvalidSpec")


def test_build_status_fields_and_transition_times() -> None:
    figures = pool_figures({"a": node((GiB, GiB // 2, 8), hits=3, misses=1)})
    first = build_status(obs(figures=figures, desired=1, pods_ready=1), None, NOW)
    assert first["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 and c["lastTransitionTime"] == "2026-01-02T03:04:05Z"
               for c in first["conditions"])
    assert first["nodes"] == {"desired": 1, "ready": 1, "podsReady": 1}
    assert first["tiers"] == {"dram": {"capacityBytes": GiB, "usedBytes": GiB // 2, "blocks": 8}}
    assert first["summary"] == {"nodes": "1/1", "capacity": "1Gi", "used": "512Mi", "hitRate": "75.0%"}
    assert first["hitRatio"] == 0.75 and first["index"] == {"pool": "ns.p", "url": "redis://r:6379/0"}
    assert "socketPath" not in first  # not known: not said
    assert build_status(obs(socket_path="/run/kvpool/ns.p/kvpool.sock"), None, NOW)["socketPath"] == \
        "/run/kvpool/ns.p/kvpool.sock"
    assert ready_status(first) == "True"

    # Same state later, new generation: times stay, generations move.
    later = NOW + timedelta(minutes=5)
    second = build_status(obs(figures=figures, desired=1, generation=4), first, later)
    assert [c["lastTransitionTime"] for c in second["conditions"]] == [c["lastTransitionTime"]
                                                                      for c in first["conditions"]]
    assert all(c["observedGeneration"] == 4 for c in second["conditions"])
    # The index goes away: IndexReachable and Ready move, figures disappear.
    third = build_status(obs(index_error="gone", index_reason="Unreachable"), second, later)
    moved = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert moved["IndexReachable"] == moved["Ready"] == "2026-01-02T03:09:05Z"
    assert "tiers" not in third and "hitRatio" not in third and third["summary"] == {"nodes": "0/0"}
    patch = merge_patch(second, third)
    assert patch["tiers"] is None and patch["hitRatio"] is None and patch["summary"]["capacity"] is None


def test_merge_patch() -> None:
    old = {"a": 1, "b": {"c": 2, "d": 3}, "e": [1], "gone": True}
    new = {"a": 1, "b": {"c": 2, "d": 4}, "e": [2], "f": {}}
    assert merge_patch(old, new) == {"b": {"d": 4}, "e": [2], "f": {}, "gone": None}
    assert merge_patch(new, new) == {}
    assert merge_patch(None, {"x": 1}) == {"x": 1}


# -- reconcile with an in-memory API ------------------------------------------------------------


@pytest.fixture
def live_index(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-in Redis: the reconcile reads this snapshot (or raises ``error``)."""
    state: dict[str, Any] = {"live": {"n1": node((GiB, 0, 0))}, "error": None, "password": "unset"}

    @contextmanager
    def connect(url: str, password: str | None, **_: Any) -> Iterator[object]:
        state["password"] = password
        yield object()

    def read_snapshot(client: object, pool_id: str, url: str = "") -> IndexSnapshot:
        if state["error"] is not None:
            raise state["error"]
        return IndexSnapshot(live=state["live"], registered=frozenset(state["live"]))

    monkeypatch.setattr(redis_index, "connect", connect)
    monkeypatch.setattr(redis_index, "read_snapshot", read_snapshot)
    return state


SETTINGS = OperatorSettings()


def test_reconcile_creates_children_and_is_idempotent(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    status = reconcile(pool_body(), kube=kube, settings=SETTINGS, now=NOW)  # type: ignore[arg-type]
    assert ready_status(status) == "True"
    assert status["nodes"] == {"desired": 3, "ready": 1, "podsReady": 2}
    assert by_type(status["conditions"])["Degraded"]["reason"] == "SidecarsMissing"
    assert len(kube.objects) == 9
    for obj in kube.objects.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == "pool-uid" and ref["controller"] is True and ref["kind"] == "KVCachePool"
    before = copy.deepcopy(kube.objects)
    again = reconcile(pool_body(), kube=kube, settings=SETTINGS, now=NOW)  # type: ignore[arg-type]
    assert kube.objects == before  # same token, same objects
    assert merge_patch(status, again) == {}


def test_reconcile_removes_children_no_longer_wanted(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    kube.add_secret("mine", pools="p", token="x" * 32)
    reconcile(pool_body({"redis": {"external": {"url": "redis://r:1/0"}}, "auth": {"secretRef": {"name": "mine"}}},
                        generation=2), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in kube.objects.values())
    assert kinds == [("ConfigMap", "p-config"), ("DaemonSet", "p-sidecar"), ("NetworkPolicy", "p-sidecar"),
                     ("Secret", "mine"), ("Service", "p-sidecar")]


def test_reconcile_reports_what_the_schema_cannot(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    # Someone else's ConfigMap under the child's name; a short token; a missing Redis password.
    kube.objects[resource_path("v1", "ConfigMap", "ns", "p-config")] = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-config", "namespace": "ns"}, "data": {}}
    kube.add_secret("short", pools="p", token="abc")
    status = reconcile(pool_body({"auth": {"secretRef": {"name": "short"}},
                                  "redis": {"external": {"url": "redis://r:1/0",
                                                         "passwordSecretRef": {"name": "nope"}}}}),
                       kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    ready = by_type(status["conditions"])["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "ConfigMap 'p-config' already exists" in ready["message"]
    assert "spec.auth.secretRef" in ready["message"] and "at least 16 bytes" in ready["message"]
    assert "spec.redis.external.passwordSecretRef" in ready["message"]
    assert by_type(status["conditions"])["IndexReachable"]["reason"] == "MissingSecret"
    assert kube.objects[resource_path("v1", "ConfigMap", "ns", "p-config")]["data"] == {}  # left alone


def test_reconcile_passes_the_redis_password(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.add_secret("rp", annotations={REDIS_HOSTS_ANNOTATION: "other:6379, R:1"}, pools="p", password="hunter22")
    reconcile(pool_body({"redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "rp"}}}}),
              kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert live_index["password"] == "hunter22"


@pytest.mark.parametrize(("url", "annotations"), [
    ("redis://r:1/0", None), ("redis://r:1/0", {REDIS_HOSTS_ANNOTATION: "r:6379"}),
    ("redis://r:1/0", {REDIS_HOSTS_ANNOTATION: "redis.infra:1"}), ("redis://r:1/0", {REDIS_HOSTS_ANNOTATION: ""}),
    # redis-py takes ?port= where the URL names none: the password had gone to another port
    ("redis://r/0?port=1", {REDIS_HOSTS_ANNOTATION: "r:6379"}),
    ("rediss://r:1/0?ssl_cert_reqs=none", {REDIS_HOSTS_ANNOTATION: "r:1"}),  # TLS checks off
])
def test_a_password_secret_goes_only_to_the_hosts_it_names(live_index: dict[str, Any], url: str,
                                                           annotations: dict[str, str] | None) -> None:
    """Anyone who may create a pool but not read a Secret had named any Secret of the
    namespace as the password of a Redis of their own, and read it in the ``AUTH`` the
    operator and every sidecar sent there. A Secret now names the hosts its value may go to,
    and the URL carries no option but ``db``."""
    kube = FakeKube()
    kube.add_secret("db", annotations=annotations, pools="p", password="victim-db-password")  # the pool may use it
    live_index["password"] = "never connected"
    status = reconcile(pool_body({"redis": {"external": {"url": url, "passwordSecretRef": {"name": "db"}}}}),
                       kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    ready = by_type(status["conditions"])["Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert REDIS_HOSTS_ANNOTATION in ready["message"] or "no options in the URL but db" in ready["message"]
    assert live_index["password"] == "never connected"  # the operator never sent it
    assert not [c for c in kube.writes() if c[1] == "DaemonSet"]  # nor any sidecar


def _redis_secret(kube: FakeKube) -> dict[str, Any]:
    return kube.objects[resource_path("v1", "Secret", "ns", "p-redis")]


def _redis_password(kube: FakeKube) -> str:
    return base64.b64decode(_redis_secret(kube)["data"]["password"]).decode()


def _auth_annotations(kube: FakeKube) -> list[str]:
    """The Redis password digest on the pod templates of Redis and of the sidecars."""
    return [kube.objects[resource_path("apps/v1", kind, "ns", name)]["spec"]["template"]["metadata"]
            ["annotations"]["kvpool.io/redis-auth-hash"]
            for kind, name in (("StatefulSet", "p-redis"), ("DaemonSet", "p-sidecar"))]


def test_reconcile_generates_the_managed_redis_password_once(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    password = _redis_password(kube)
    assert len(password) >= 32
    assert live_index["password"] == password  # the operator reads the index with it
    (ref,) = _redis_secret(kube)["metadata"]["ownerReferences"]
    assert ref["uid"] == "pool-uid"
    secret, annotations = copy.deepcopy(_redis_secret(kube)), _auth_annotations(kube)
    # Re-reconciled, and after a spec change: the same password, the same Secret.
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    reconcile(pool_body({"tiers": {"dram": {"size": "2Gi"}}, "logLevel": "DEBUG"}, generation=2),
              kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert _redis_secret(kube) == secret and _auth_annotations(kube) == annotations
    assert live_index["password"] == password
    # Deleted by someone: a new password, and Redis and the sidecars restart with it.
    del kube.objects[resource_path("v1", "Secret", "ns", "p-redis")]
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert _redis_password(kube) != password and live_index["password"] == _redis_password(kube)
    new_annotations = _auth_annotations(kube)
    assert new_annotations[0] == new_annotations[1] and new_annotations != annotations


@pytest.mark.parametrize("secret", ["p-redis", "p-auth"])
def test_a_reconcile_racing_another_never_overwrites_the_generated_secret(
        live_index: dict[str, Any], secret: str) -> None:
    """Two reconciles of a new pool (the timer's and the create handler's, or two operator
    replicas) both find no Secret and each make up a value: the first to write keeps
    it, the second's write is refused (409) and it retries with the stored one."""
    kube = FakeKube()
    path = resource_path("v1", "Secret", "ns", secret)
    raced: list[dict[str, Any]] = []

    def other_reconcile_first(kind: str, name: str) -> None:
        if (kind, name) == ("Secret", secret) and not raced:
            kube.before_write = None
            reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
            raced.append(copy.deepcopy(kube.objects[path]))
            kube.before_write = other_reconcile_first

    kube.before_write = other_reconcile_first
    with pytest.raises(TemporaryApiError, match="409"):
        reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert raced and kube.objects[path] == raced[0]  # the first one's value stands
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]  # the retry
    assert kube.objects[path] == raced[0]
    if secret != "p-redis":
        return
    assert live_index["password"] == _redis_password(kube)
    # A Secret whose value cannot be used is replaced, but only at the version read.
    _redis_secret(kube)["data"]["password"] = base64.b64encode(b"bad\npassword-of-20-chars").decode()
    raced.clear()
    with pytest.raises(TemporaryApiError, match="409"):
        reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert kube.objects[path] == raced[0] and "\n" not in _redis_password(kube)


def test_reconcile_keeps_a_secret_it_does_not_own_and_replaces_an_unusable_password(
        live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.add_secret("p-redis", password="someone-elses-password")
    status = reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert "Secret 'p-redis' already exists and does not belong to this pool" in \
        by_type(status["conditions"])["Ready"]["message"]
    assert _redis_password(kube) == "someone-elses-password"  # left alone
    # ... and no password made up on every run: Redis and the sidecars are not restarted each time.
    before = copy.deepcopy(kube.objects)
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert kube.objects == before

    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    bad = "x" * 20 + "\nrename-command CONFIG y"  # would add a line to redis.conf
    _redis_secret(kube)["data"]["password"] = base64.b64encode(bad.encode()).decode()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert _redis_password(kube) != bad and "\n" not in _redis_password(kube)


def test_reconcile_puts_the_operators_namespace_in_the_redis_policy(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    settings = OperatorSettings.from_env({"KVPOOL_OPERATOR_POD_NAMESPACE": "kvpool-system"})
    reconcile(pool_body(), kube=kube, settings=settings)  # type: ignore[arg-type]
    policy = kube.objects[resource_path("networking.k8s.io/v1", "NetworkPolicy", "ns", "p-redis")]
    operator = policy["spec"]["ingress"][0]["from"][1]
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kvpool-system"}}


def test_purge_uses_the_managed_redis_password(live_index: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    live_index["password"] = "unset"
    monkeypatch.setattr(redis_index, "purge", lambda client, pool_id, url="": 3)
    assert purge_index(pool_body(), kube=kube, settings=SETTINGS) == 3  # type: ignore[arg-type]
    assert live_index["password"] == _redis_password(kube)


@pytest.mark.parametrize("pools", [None, "p"])
def test_a_purge_sends_no_password_of_a_secret_the_pool_does_not_own(live_index: dict[str, Any],
                                                                      pools: str | None) -> None:
    """A Secret ``p-redis`` of someone else's refuses the pool; its deletion's purge had still
    sent that Secret's password to whatever answered at the Service ``p-redis`` (an
    ExternalName of the pool creator's choosing, say)."""
    kube = FakeKube()
    kube.add_secret("p-redis", pools=pools, password="s3cr3t-of-another-app")
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    live_index["password"] = "unset"
    assert purge_index(pool_body(), kube=kube, settings=SETTINGS) == 0  # type: ignore[arg-type]
    assert live_index["password"] == "unset"  # never connected


def test_a_condition_message_fits_the_crds_bound(live_index: dict[str, Any]) -> None:
    """32 tolerations of 300-character keys made an InvalidSpec message of 14,538 characters:
    the API server refused the status patch and the pool stayed Ready while refused."""
    spec = {"tolerations": [{"key": "example.com/" + "k" * 300 + str(i), "operator": "Exists"} for i in range(32)]}
    status = reconcile(pool_body(spec), kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and ready["message"].startswith("spec.tolerations")
    assert all(len(c["message"]) <= 4096 for c in status["conditions"])
    assert ready["message"].endswith("characters in all)")


def test_reconcile_rejected_child_becomes_a_condition(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.reject_kind = "DaemonSet"
    status = reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    ready = by_type(status["conditions"])["Ready"]
    assert ready["reason"] == "InvalidSpec" and "DaemonSet 'p-sidecar' was rejected" in ready["message"]


def test_reconcile_raises_temporary_api_errors(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.fail_with = TemporaryApiError("PATCH: 503", 503)
    with pytest.raises(TemporaryApiError):
        reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]


def test_reconcile_turns_a_refusal_for_good_into_conditions(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.fail_with = KubernetesApiError("PATCH daemonsets: 403 forbidden: RBAC", 403, "Forbidden")
    status = reconcile(pool_body(), kube=kube, settings=SETTINGS, now=NOW)  # type: ignore[arg-type]
    c = by_type(status["conditions"])
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "ApiRefused")
    assert "403 forbidden" in c["Ready"]["message"]
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ApiRefused")
    assert c["IndexReachable"]["status"] == "False"
    kube.fail_with = None  # RBAC fixed: the next run (the timer's) recovers
    status = reconcile(pool_body(), kube=kube, settings=SETTINGS, now=NOW)  # type: ignore[arg-type]
    assert by_type(status["conditions"])["Ready"]["reason"] != "ApiRefused"


def test_reconcile_index_errors_are_status(live_index: dict[str, Any]) -> None:
    live_index["error"] = IndexUnavailableError("cannot reach Redis at redis://x", "Unreachable")
    status = reconcile(pool_body(), kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
    c = by_type(status["conditions"])
    assert (c["IndexReachable"]["status"], c["IndexReachable"]["reason"]) == ("False", "Unreachable")
    assert c["Ready"]["reason"] == "IndexUnreachable"


def test_reconcile_unparseable_spec(live_index: dict[str, Any]) -> None:
    kube = FakeKube()
    status = reconcile(pool_body({"tiers": {"dram": {"size": "lots"}}}), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    assert "spec.tiers.dram.size" in by_type(status["conditions"])["Ready"]["message"]
    assert kube.objects == {}  # nothing applied from a spec that cannot be read


def test_real_connect_to_a_closed_port_is_unreachable() -> None:
    with redis_index.connect("redis://127.0.0.1:1/0", None, timeout_s=0.5) as client:
        with pytest.raises(IndexUnavailableError) as info:
            redis_index.read_snapshot(client, "ns.p", "redis://127.0.0.1:1/0")
    assert info.value.reason == "Unreachable"


def test_messages_never_show_url_credentials() -> None:
    with redis_index.connect("redis://user:pw@127.0.0.1:1/0", None, timeout_s=0.5) as client:
        with pytest.raises(IndexUnavailableError) as info:
            redis_index.ping(client, "redis://user:pw@127.0.0.1:1/0")
    assert "pw" not in str(info.value) and "127.0.0.1:1/0" in str(info.value)


class _FakeRedis:
    """A RESP server on loopback that answers the handshake, ``SCARD`` with ``scard``, and
    anything else with a bulk string it sends a byte every 50 ms (never finished): the Redis
    a pool's owner may point the operator at. ``mode`` ``slots``: ``CLUSTER SLOTS`` answered
    with one range of 3 million slots; ``flood``: ``SMEMBERS`` answered at
    once with two million names; ``ok``: every command answered ``+OK`` (no Redis at all)."""

    def __init__(self, scard: int, mode: str = "drip") -> None:
        import socket
        import threading

        self.scard = scard
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = "redis://127.0.0.1:{}/0".format(self.sock.getsockname()[1])
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import threading

        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: Any) -> None:
        import time

        with conn:
            try:
                while not self.stop.is_set():
                    data = conn.recv(65536)
                    if not data:
                        return
                    if self.mode == "ok":
                        conn.sendall(b"+OK\r\n")
                    elif self.mode == "flood" and b"SMEMBERS" in data.upper():
                        conn.sendall(b"*2000000\r\n" + b"$4\r\nnode\r\n" * 2_000_000)
                    elif self.mode == "slots" and b"SLOTS" in data.upper():  # one range of 3 million slots
                        port = self.sock.getsockname()[1]
                        conn.sendall(b"*1\r\n*3\r\n:0\r\n:3000000\r\n*2\r\n$9\r\n127.0.0.1\r\n:%d\r\n" % port)
                    elif self.mode == "lie" and b"SMEMBERS" in data.upper():  # past SCARD's count
                        conn.sendall(b"*5000\r\n" + b"".join(b"$5\r\n%05d\r\n" % i for i in range(5000)))
                    elif b"HELLO" in data.upper():  # the handshake (RESP3): a map
                        conn.sendall(b"%2\r\n+server\r\n+redis\r\n+proto\r\n:3\r\n")
                    elif b"SCARD" in data.upper():
                        conn.sendall(b":%d\r\n" % self.scard)
                    elif b"CLIENT" in data.upper():  # the handshake: each command answered OK
                        conn.sendall(b"+OK\r\n" * data.upper().count(b"CLIENT"))
                    else:
                        conn.sendall(b"$100000000\r\n")
                        while not self.stop.is_set():
                            conn.sendall(b"x")
                            time.sleep(0.05)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("scard", [3, 100_000])
def test_a_redis_that_drips_or_overflows_cannot_hold_a_reconcile(scard: int) -> None:
    """A server that answers a byte at a time never trips the per-read timeout: the whole
    read has a deadline (4 timeouts), and a node registry past 4096 names is not read."""
    import threading
    import time

    server = _FakeRedis(scard)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            with redis_index.connect(server.url, None, timeout_s=0.3) as client:
                redis_index.read_snapshot(client, "ns.p", server.url)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    t0 = time.monotonic()
    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)
    server.close()
    assert outcome, "the read still hangs after 10 s"
    assert isinstance(outcome[0], IndexUnavailableError), outcome
    assert outcome[0].reason == ("TooManyNodes" if scard > 4096 else "Unreachable"), outcome[0]
    assert time.monotonic() - t0 < 4.0


def _read_with(server: _FakeRedis, cluster: bool = False, seconds: float = 10.0) -> BaseException | None:
    """What one reconcile's read of ``server`` ends with (None: it read), in a thread."""
    import threading

    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            with redis_index.connect(server.url, None, timeout_s=0.3, cluster=cluster) as client:
                redis_index.read_snapshot(client, "ns.p", server.url)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome.append(e)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(seconds)
    server.close()
    assert outcome, "the read still hangs after {} s".format(seconds)
    return outcome[0]


def test_a_redis_that_sends_more_than_a_reconcile_may_read_is_cut() -> None:
    """Replies of any size (here 2 million names behind a SCARD of 1) had grown the operator,
    which reconciles every pool, until it was killed, and again at each restart."""
    error = _read_with(_FakeRedis(1, "flood"))
    assert isinstance(error, IndexUnavailableError) and error.reason == "ReplyTooLarge", error


def test_a_cluster_client_is_held_to_the_deadline_while_it_reads_the_slot_map() -> None:
    """A cluster client reads the slot map as it is made, before the reconcile's deadline
    was armed: a server dripping a byte at a time held the thread for good."""
    import time

    t0 = time.monotonic()
    error = _read_with(_FakeRedis(3), cluster=True)
    assert isinstance(error, IndexUnavailableError), error
    assert time.monotonic() - t0 < 4.0


def test_a_slot_map_no_redis_cluster_sends_is_refused_before_it_is_read() -> None:
    """redis-py makes an entry for each slot a CLUSTER SLOTS answer names: one range of 0 to
    10**8 (60 bytes) had taken the operator, every pool's, past its memory limit at every
    restart. Ranges past slot 16383 are refused before redis-py reads them."""
    import tracemalloc

    tracemalloc.start()
    try:
        error = _read_with(_FakeRedis(3, "slots"), cluster=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(error, IndexUnavailableError), error
    assert peak < 32 << 20, peak  # (3 million slots' entries took 300 MB)


@pytest.mark.parametrize("reply", [[[0, 16384, [b"h", 1]]], [[5, 4, [b"h", 1]]], [[-1, 3, [b"h", 1]]],
                                   [[0, 16383, [b"h", 1]], [0, 10, [b"h", 1]]], [[0, b"9", [b"h", 1]]], [[0, 9]],
                                   b"x", [[0, 1, [b"h", 1]]] * 16385])
def test_slot_maps_out_of_range_are_refused(reply: Any) -> None:
    with pytest.raises(redis_index.REDIS_ERRORS):
        redis_index.check_slot_map(reply)
    redis_index.check_slot_map([[0, 8191, [b"h", 1]], [8192, 16383, [b"h", 2], [b"r", 3]]])


@pytest.mark.parametrize("args", [("UNLINK", b"kvp:p:\xff"), (b"\xfe\xff", b"SLOTS"), ("GET", "x")])
def test_only_cluster_slots_is_taken_for_a_slot_map_request(args: tuple[Any, ...]) -> None:
    """Any command's first two arguments are read, as Latin-1: a purge's UNLINK of a key that
    is not UTF-8 (one a writer to Redis chose) had failed as the server not speaking Redis."""
    assert not redis_index._asks_slots(args)  # noqa: SLF001
    assert redis_index._asks_slots(("CLUSTER SLOTS",)) and redis_index._asks_slots((b"cluster", b"slots"))  # noqa: SLF001


def test_a_server_that_does_not_speak_redis_makes_the_index_unavailable() -> None:
    """``+OK`` to everything made redis-py raise AttributeError, past the handlers' Redis
    errors: the pool's status froze and its deletion never ended."""
    error = _read_with(_FakeRedis(0, "ok"))
    assert isinstance(error, IndexUnavailableError), error


def test_gpu_models_a_writer_to_redis_makes_up_are_counted_under_one_name_past_64() -> None:
    live = {"n%d" % n: {"gpus": json.dumps([{"name": "model-%d-%d" % (n, g)} for g in range(64)])}
            for n in range(100)}
    models = pool_figures(live).gpu_models
    assert len(models) == 65 and models["(other)"] == 100 * 64 - 64 and sum(models.values()) == 6400


def test_a_registry_larger_than_scard_said_is_not_read() -> None:
    """SCARD's count is the server's word: 1, then 5,000 names (1.6 million, each under the
    cap, had the operator send a heartbeat read for each and grow by a gigabyte)."""
    error = _read_with(_FakeRedis(1, "lie"))
    assert isinstance(error, IndexUnavailableError) and error.reason == "TooManyNodes", error
