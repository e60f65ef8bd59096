"""What a pool's creator may get through the operator: Secrets that let the pool use them,
the operator's allow-lists (priority and runtime classes, tolerations, GPU images), no
label of theirs on the children, and nothing learnt about the network from the status."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis

from kvpool_operator import index as redis_index
from kvpool_operator.admission import policy_problems
from kvpool_operator.errors import IndexUnavailableError, KubernetesApiError, SettingsError
from kvpool_operator.kube import resource_path
from kvpool_operator.manifests import POOL_LABEL
from kvpool_operator.preflight import POOLS_ANNOTATION, REDIS_HOSTS_ANNOTATION
from kvpool_operator.reconcile import purge_index, reconcile
from kvpool_operator.settings import DEFAULT_SIDECAR_IMAGE, OperatorSettings, PoolPolicySettings
from kvpool_operator.spec import parse_spec
from tests.unit.operator_support import FakeKube, pool_body

SETTINGS = OperatorSettings()
EXTERNAL = {"redis": {"external": {"url": "redis://r:1/0"}}}
VICTIM_OWNER = [{"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool", "name": "victim", "uid": "victim-uid",
                 "controller": True, "blockOwnerDeletion": True}]


@pytest.fixture(autouse=True)
def index_state(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Stand-in Redis: an empty index, or ``error`` raised when read."""
    state: dict[str, Any] = {"error": None}

    @contextmanager
    def connect(url: str, password: str | None, **_: Any) -> Iterator[object]:
        yield object()

    def read_snapshot(client: object, pool_id: str, url: str = "") -> redis_index.IndexSnapshot:
        if state["error"] is not None:
            raise state["error"]
        return redis_index.IndexSnapshot()

    monkeypatch.setattr(redis_index, "connect", connect)
    monkeypatch.setattr(redis_index, "read_snapshot", read_snapshot)
    return state


def condition(status: dict[str, Any], kind: str = "Ready") -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def written(kube: FakeKube) -> str:
    """Every object the reconcile stored, as one text to search."""
    return json.dumps(kube.objects, sort_keys=True)


# -- 1. Secrets the pool names ------------------------------------------------------------------


def test_a_pool_cannot_mount_secrets_that_do_not_let_it() -> None:
    """The review's reproduction: a pool of someone who may only create pools named a Secret of
    the namespace, another pool's generated peer token and its Redis password, for sidecars of
    an image of their choice. Refused, and nothing written (no DaemonSet mounts any of them)."""
    kube = FakeKube()
    kube.add_secret("db-creds", token="d" * 32)
    kube.add_secret("victim-auth", owners=VICTIM_OWNER, token="v" * 32)
    kube.add_secret("victim-redis", {REDIS_HOSTS_ANNOTATION: "r:1"}, owners=VICTIM_OWNER, pools="*",
                    password="victim-redis-password")
    spec = {"image": "evil.example.com/x:1", "auth": {"secretRef": {"name": "db-creds"}},
            "tenants": [{"name": "a", "tokenSecret": {"name": "victim-auth"}}],
            "redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "victim-redis"}}}}
    status = reconcile(pool_body(spec, name="evil", uid="evil-uid"), kube=kube,  # type: ignore[arg-type]
                       settings=SETTINGS)
    ready = condition(status)
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    message = ready["message"]
    assert "spec.auth.secretRef: Secret 'db-creds' does not let this pool use it" in message
    assert "annotate the Secret {}=evil".format(POOLS_ANNOTATION) in message
    assert "spec.tenants[0].tokenSecret: Secret 'victim-auth' belongs to KVCachePool 'victim'" in message
    # another pool's Secret is refused whatever its annotations say
    assert "spec.redis.external.passwordSecretRef: Secret 'victim-redis' belongs to KVCachePool 'victim'" in message
    assert kube.writes() == []


@pytest.mark.parametrize("ref", [{"name": "../../team-b/secrets/db-creds"}, {"name": "x/../../team-b/secrets/db"},
                                 {"name": "Db"}, {"name": "db?x=1"}, {"name": "db", "key": "../x"},
                                 {"name": "db", "key": "a/b"}, {"name": "a" * 254}])
@pytest.mark.parametrize("where", ["auth", "tenant", "redis"])
def test_a_secret_reference_that_is_no_secrets_name_is_refused_before_any_read(ref: dict[str, str],
                                                                               where: str) -> None:
    """A name is a path segment of the API's: ``../../team-b/secrets/db-creds`` had the
    operator read team-b's Secret for a pool of team-a, and say in its status whether it
    existed and which pool it belonged to."""
    kube = FakeKube()
    spec: dict[str, Any] = {"auth": {"secretRef": ref}} if where == "auth" else \
        {"tenants": [{"name": "a", "tokenSecret": ref}]} if where == "tenant" else \
        {"redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": ref}}}
    status = reconcile(pool_body(spec), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert (condition(status)["status"], condition(status)["reason"]) == ("False", "InvalidSpec")
    assert not [read for read in kube.reads if read[0] == "Secret"], kube.reads
    assert kube.writes() == []


@pytest.mark.parametrize("name", ["../../team-b/secrets/x", "a/b", "A", "", "a" * 254, "a..b", "-a"])
def test_paths_are_made_of_names_the_api_allows_only(name: str) -> None:
    with pytest.raises(KubernetesApiError):
        resource_path("v1", "Secret", "ns", name)
    with pytest.raises(KubernetesApiError):
        resource_path("v1", "Secret", name or "..", "s")
    assert resource_path("v1", "Secret", "ns", "a.b-c") == "/api/v1/namespaces/ns/secrets/a.b-c"


@pytest.mark.parametrize("pools", ["p", "other, p", "*"])
def test_a_secret_that_names_the_pool_is_mounted(pools: str) -> None:
    kube = FakeKube()
    kube.add_secret("peer", pools=pools, token="t" * 32)
    kube.add_secret("tenant", pools=pools, token="u" * 32)
    kube.add_secret("db", {REDIS_HOSTS_ANNOTATION: "r:1"}, pools=pools, password="db-password")
    spec = {"auth": {"secretRef": {"name": "peer"}}, "tenants": [{"name": "a", "tokenSecret": {"name": "tenant"}}],
            "redis": {"external": {"url": "redis://r:1/0", "passwordSecretRef": {"name": "db"}}}}
    status = reconcile(pool_body(spec), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert condition(status)["reason"] != "InvalidSpec", condition(status)
    ds = kube.objects[resource_path("apps/v1", "DaemonSet", "ns", "p-sidecar")]
    mounted = {v["secret"]["secretName"] for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert mounted == {"peer", "tenant", "db"}


@pytest.mark.parametrize("pools", [None, "", "other", "p-2", "pp"])
def test_a_secret_that_does_not_name_the_pool_is_refused_and_the_last_good_children_stay(pools: str | None) -> None:
    kube = FakeKube()
    reconcile(pool_body(EXTERNAL), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    kube.calls.clear()
    kube.add_secret("tenant", pools=pools, token="u" * 32)
    before = copy.deepcopy(kube.objects)
    spec = {**EXTERNAL, "tenants": [{"name": "a", "tokenSecret": {"name": "tenant"}}]}
    status = reconcile(pool_body(spec, generation=2), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert condition(status)["reason"] == "InvalidSpec"
    assert POOLS_ANNOTATION in condition(status)["message"]
    assert kube.writes() == [] and kube.objects == before


def test_the_pools_own_generated_secrets_need_no_annotation() -> None:
    """Its peer token and managed Redis password, and a Secret it owns that its spec names."""
    kube = FakeKube()
    first = reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert condition(first)["reason"] != "InvalidSpec", condition(first)
    own = [{"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool", "name": "p", "uid": "pool-uid"}]
    kube.add_secret("mine", owners=own, token="m" * 32)
    status = reconcile(pool_body({"tenants": [{"name": "a", "tokenSecret": {"name": "mine"}}]}, generation=2),
                       kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert condition(status)["reason"] != "InvalidSpec", condition(status)


# -- 2. What the pool's creator may ask for on the nodes ---------------------------------------------


def test_pool_policy_settings_from_env() -> None:
    default = OperatorSettings.from_env({}).pool_policy
    assert default == PoolPolicySettings(("*",), ("nvidia",), ("nvidia.com/gpu",), ())
    policy = OperatorSettings.from_env({
        "KVPOOL_OPERATOR_PRIORITY_CLASSES": "kv-high, system-node-critical", "KVPOOL_OPERATOR_RUNTIME_CLASSES": "",
        "KVPOOL_OPERATOR_TOLERATION_KEYS": "nvidia.com/gpu,example.com/*", "KVPOOL_OPERATOR_GPU_IMAGES": "reg/kv-gpu:*",
    }).pool_policy
    assert policy == PoolPolicySettings(("kv-high", "system-node-critical"), (), ("nvidia.com/gpu", "example.com/*"),
                                        ("reg/kv-gpu:*",))
    with pytest.raises(SettingsError, match="KVPOOL_OPERATOR_GPU_IMAGES"):
        OperatorSettings.from_env({"KVPOOL_OPERATOR_GPU_IMAGES": "reg/*/kv"})


def _problems(raw: dict[str, Any], policy: PoolPolicySettings | None = None) -> list[str]:
    return policy_problems(parse_spec("p", "ns", raw), policy or PoolPolicySettings(), DEFAULT_SIDECAR_IMAGE)


GPU = {"tiers": {"gpu": {"enabled": True}}}


@pytest.mark.parametrize(("raw", "wanted"), [
    ({"priorityClassName": "kv-high"}, []),
    ({"priorityClassName": "system-node-critical"}, ["spec.priorityClassName: 'system-node-critical' is not allowed"]),
    ({"priorityClassName": "system-cluster-critical"}, ["KVPOOL_OPERATOR_PRIORITY_CLASSES"]),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}, []),
    ({"tolerations": [{"operator": "Exists"}]}, ["spec.tolerations[0]: a toleration without a key"]),
    ({"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"},
                      {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
     ["spec.tolerations[1]: tolerating the taint key 'node-role.kubernetes.io/control-plane' is not allowed"]),
    ({"tolerations": [{"key": "node-role.kubernetes.io/master", "operator": "Equal", "value": "",
                       "effect": "NoSchedule"}]}, ["KVPOOL_OPERATOR_TOLERATION_KEYS: nvidia.com/gpu"]),
    (GPU, []),  # the operator's own image, the nvidia runtime class
    ({"tiers": {"gpu": {"enabled": True, "runtimeClassName": ""}}}, []),
    ({"tiers": {"gpu": {"enabled": True, "runtimeClassName": "kata"}}},
     ["spec.tiers.gpu.runtimeClassName: 'kata' is not allowed"]),
    ({**GPU, "image": "evil.example.com/x:1"}, ["spec.tiers.gpu: the GPU tier shows every GPU of the node"]),
    ({"image": "evil.example.com/x:1"}, []),  # no GPU tier: no GPU
    ({**GPU, "image": DEFAULT_SIDECAR_IMAGE}, []),
])
def test_the_default_policy(raw: dict[str, Any], wanted: list[str]) -> None:
    found = _problems(raw)
    assert len(found) == len(wanted) and all(w in f for w, f in zip(wanted, found)), found


def test_an_operator_may_allow_more() -> None:
    policy = PoolPolicySettings(priority_classes=("*", "system-node-critical"), runtime_classes=("*",),
                                toleration_keys=("*",), gpu_images=("registry.example/kv-gpu:*",))
    assert _problems({"priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}],
                      "tiers": {"gpu": {"enabled": True, "runtimeClassName": "kata"}},
                      "image": "registry.example/kv-gpu:2"}, policy) == []
    # a pattern never matches a system- class; an image outside the list still gets no GPU
    found = _problems({"priorityClassName": "system-cluster-critical", **GPU, "image": "registry.example/kv:2"},
                      policy)
    assert len(found) == 2 and "system-cluster-critical" in found[0] and "registry.example/kv:2" in found[1]
    nothing = PoolPolicySettings(priority_classes=(), toleration_keys=())
    assert len(_problems({"priorityClassName": "kv-high", "tolerations": [{"key": "nvidia.com/gpu"}]}, nothing)) == 2


def test_a_refused_update_writes_nothing() -> None:
    """A pool that asks for what the policy refuses keeps its last good children."""
    kube = FakeKube()
    reconcile(pool_body(EXTERNAL), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    kube.calls.clear()
    before = copy.deepcopy(kube.objects)
    spec = {**EXTERNAL, "priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}],
            "tiers": {"gpu": {"enabled": True}}, "image": "evil.example.com/x:1"}
    status = reconcile(pool_body(spec, generation=2), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    ready = condition(status)
    assert ready["reason"] == "InvalidSpec"
    for field in ("spec.priorityClassName", "spec.tolerations[0]", "spec.tiers.gpu"):
        assert field in ready["message"]
    assert kube.writes() == [] and kube.objects == before


# -- 4. The pool's labels stay on the pool --------------------------------------------------------------


def test_children_get_owner_references_and_the_operators_labels_but_not_the_pools() -> None:
    kube = FakeKube()
    body = pool_body(labels={"replicator.example.com/sync-to": "all-namespaces", "team": "a"})
    reconcile(body, kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert len(kube.objects) == 9
    for obj in kube.objects.values():
        meta = obj["metadata"]
        assert "replicator.example.com/sync-to" not in meta["labels"] and "team" not in meta["labels"], meta
        assert meta["labels"][POOL_LABEL] == "p"
        (ref,) = meta["ownerReferences"]
        assert (ref["uid"], ref["kind"], ref["controller"], ref["blockOwnerDeletion"]) == (
            "pool-uid", "KVCachePool", True, True)


# -- 5. An external Redis's errors --------------------------------------------------------------------


def _translated(error: Exception) -> IndexUnavailableError:
    return redis_index._translate(error, "redis://10.0.0.7:22/0")  # noqa: SLF001 - as read_snapshot raises it


FAILURES = {
    "closed": _translated(redis.ConnectionError("Error 111 connecting to 10.0.0.7:22. Connection refused.")),
    "dns": _translated(redis.ConnectionError("Error -2 connecting to db.internal:6379. Name or service not known.")),
    "silent": _translated(redis.TimeoutError("Timeout connecting to server")),
    "not-redis": redis_index._not_redis(AttributeError("'str' object has no attribute 'get'"),  # noqa: SLF001
                                        "redis://10.0.0.7:22/0"),
    "auth": _translated(redis.AuthenticationError("invalid username-password pair")),
}


def test_an_external_redis_failure_reads_the_same_whatever_it_was(index_state: dict[str, Any],
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """The URL is the pool creator's: the status had told a closed port from an open one from
    a name that does not resolve, a port scanner from the operator's place in the network."""
    shown = set()
    for what, error in FAILURES.items():
        index_state["error"] = error
        with caplog.at_level(logging.WARNING, logger="kvpool_operator"):
            status = reconcile(pool_body({"redis": {"external": {"url": "redis://10.0.0.7:22/0"}}}),
                               kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
        index = condition(status, "IndexReachable")
        shown.add((index["status"], index["reason"], index["message"], condition(status)["message"]))
        assert str(error) in caplog.text, what  # the details: in the operator's log only
    assert len(shown) == 1, shown
    ((_, reason, message, _),) = shown
    assert reason == "Unreachable" and "cannot use the Redis at redis://10.0.0.7:22/0" in message


def test_the_managed_redis_errors_keep_their_details(index_state: dict[str, Any]) -> None:
    index_state["error"] = FAILURES["auth"]
    status = reconcile(pool_body(), kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
    assert condition(status, "IndexReachable")["reason"] == "AuthenticationFailed"


def test_a_purge_of_an_external_redis_fails_with_the_generic_message(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finalizer's IndexNotPurged Event shows the error: the same for every failure."""
    messages = set()
    for error in FAILURES.values():
        def purge(client: object, pool_id: str, url: str = "", error: Exception = error) -> int:
            raise error

        monkeypatch.setattr(redis_index, "purge", purge)
        with pytest.raises(IndexUnavailableError) as caught:
            purge_index(pool_body({"redis": {"external": {"url": "redis://10.0.0.7:22/0"}}}),
                        kube=FakeKube(), settings=SETTINGS)  # type: ignore[arg-type]
        messages.add((caught.value.reason, str(caught.value)))
    assert len(messages) == 1, messages


def test_a_generated_secret_with_labels_an_older_operator_copied_is_not_applied_every_time() -> None:
    """Labels copied from the pool onto its generated Secrets (by ``kopf.adopt``) stay after
    an upgrade, the applies never removing them: compared whole, they had made every
    reconcile apply those Secrets again."""
    kube = FakeKube()
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    for obj in kube.objects.values():
        if obj["kind"] == "Secret":
            obj["metadata"]["labels"]["team"] = "a"
            obj["metadata"]["ownerReferences"].append({"apiVersion": "v1", "kind": "ConfigMap", "name": "other",
                                                       "uid": "other-uid"})  # (another controller's)
    writes: list[tuple[str, str]] = []
    kube.before_write = lambda kind, name: writes.append((kind, name))
    reconcile(pool_body(), kube=kube, settings=SETTINGS)  # type: ignore[arg-type]
    assert not [w for w in writes if w[0] == "Secret"]
