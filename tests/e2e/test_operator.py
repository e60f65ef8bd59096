"""The operator (``python -m kvpool_operator``) against a real API server and a real Redis.

No kubelet runs, so no sidecar does: where a test needs live sidecars it writes their
heartbeat hashes into Redis itself, exactly as docs/redis-schema.md specifies.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import yaml

from kvpool_operator.manifests import (
    CONFIG_HASH_ANNOTATION,
    OPERATOR_POD_LABELS,
    REDIS_AUTH_HASH_ANNOTATION,
    config_hash,
)
from kvpool_operator.settings import DEFAULT_SIDECAR_IMAGE
from tests.e2e.conftest import (
    OPERATOR_NAMESPACE,
    TIMER_INTERVAL_S,
    K8s,
    OperatorProcess,
    RedisServer,
    create_pool,
    wait_child,
    wait_condition,
    wait_for,
)

pytestmark = pytest.mark.apiserver

GiB = 1 << 30


def heartbeat(redis_server: RedisServer, pool_id: str, node: str, *, dram: tuple[int, int, int],
              disk: tuple[int, int, int] | None = None, hits: int = 0, misses: int = 0, ttl: int = 30) -> None:
    """Stand in for a sidecar: register the node and write its heartbeat hash (redis-schema.md)."""
    tiers = {"dram": dict(zip(("capacity_bytes", "used_bytes", "blocks"), dram))}
    if disk is not None:
        tiers["disk"] = dict(zip(("capacity_bytes", "used_bytes", "blocks"), disk))
    r = redis_server.client()
    pipe = r.pipeline()
    pipe.sadd("kvp:{}:nodes".format(pool_id), node)
    key = "kvp:{}:node:{}".format(pool_id, node)
    pipe.hset(key, mapping={"address": "10.0.0.1:7470", "heartbeat": str(time.time()), "tiers": json.dumps(tiers),
                            "hits": str(hits), "misses": str(misses), "gpus": "[]", "version": "0.1.0"})
    pipe.expire(key, ttl)
    pipe.execute()


def owned_by(obj: dict[str, Any], pool: dict[str, Any]) -> bool:
    return any(ref["uid"] == pool["metadata"]["uid"] and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences", []))


def test_children_are_created_with_the_expected_content(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    pool = create_pool(k8s, namespace, "tiered", {
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "tiers": {"dram": {"size": "2Gi"},
                  "disk": {"path": "/mnt/{}.tiered".format(namespace), "size": "100Gi", "compression": "zstd"}},
        "tenants": [{"name": "prod", "priority": 10, "quota": "1Gi"}, {"name": "batch"}],
        "redis": {"external": {"url": redis_server.url}},
        "resources": {"limits": {"memory": "3Gi"}},
        "image": "registry.example/pool-own:2",
        "kvEvents": {"enabled": True, "replayPort": 5558, "tenants": ["prod"],
                     "routers": {"podSelector": {"matchLabels": {"app": "router"}},
                                 "namespaceSelector": {"matchExpressions": [
                                     {"key": "team", "operator": "In", "values": ["routing"]}]}}},
    })
    ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "tiered-sidecar")
    cm = k8s.child("v1", "ConfigMap", namespace, "tiered-config")
    secret = k8s.child("v1", "Secret", namespace, "tiered-auth")
    svc = k8s.child("v1", "Service", namespace, "tiered-sidecar")
    netpol = k8s.child("networking.k8s.io/v1", "NetworkPolicy", namespace, "tiered-sidecar")
    assert cm and secret and svc and netpol
    for child in (ds, cm, secret, svc, netpol):
        assert owned_by(child, pool), child["metadata"]
    # External Redis: no managed one.
    assert k8s.child("apps/v1", "StatefulSet", namespace, "tiered-redis") is None

    config = yaml.safe_load(cm["data"]["sidecar.yaml"])
    assert config["pool"] == "{}.tiered".format(namespace)
    assert config["dram"]["size_bytes"] == 2 * GiB
    assert config["disk"] == {"path": "/mnt/{}.tiered".format(namespace), "size_bytes": 100 * GiB, "fsync": "never",
                              "compression": "zstd", "layout": "segments"}
    assert config["index"] == {"backend": "redis", "url": redis_server.url}
    assert config["tenants"] == [{"name": "prod", "priority": 10, "quota_bytes": GiB},
                                 {"name": "batch", "priority": 0}]
    assert config["peer"] == {"enabled": True, "host": "0.0.0.0", "port": 9467, "transport": "tcp",
                              "token_file": "/etc/kvpool/auth/token"}
    # KV events: the API server kept every field (defaults filled in), and only the routers reach them
    assert config["kv_events"] == {"enabled": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                   "topic": "", "encoding": "tagged", "tenants": ["prod"]}
    kv_rule = netpol["spec"]["ingress"][-1]
    assert kv_rule["ports"] == [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]
    assert kv_rule["from"] == [{"podSelector": {"matchLabels": {"app": "router"}}, "namespaceSelector": {
        "matchExpressions": [{"key": "team", "operator": "In", "values": ["routing"]}]}}]

    assert len(base64.b64decode(secret["data"]["token"])) >= 32

    pod = ds["spec"]["template"]
    assert pod["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == config_hash(cm)
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert not spec.get("hostIPC") and not spec.get("hostNetwork") and not spec.get("hostPID")
    container = spec["containers"][0]
    assert container["securityContext"]["privileged"] is False
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"/run/kvpool/{}.tiered".format(namespace), "/mnt/{}.tiered".format(namespace)}
    assert container["resources"]["limits"]["memory"] == "3Gi"
    # the pool's image runs as the sidecar's user; the one step as root runs the operator's image
    assert container["image"] == "registry.example/pool-own:2"
    assert [c["image"] for c in spec["initContainers"]] == [DEFAULT_SIDECAR_IMAGE]

    assert svc["spec"]["clusterIP"] == "None"
    peer_rule = netpol["spec"]["ingress"][0]
    assert peer_rule["ports"] == [{"protocol": "TCP", "port": 9467}]
    assert peer_rule["from"] == [{"podSelector": {"matchLabels": ds["spec"]["selector"]["matchLabels"]}}]

    # Observed: the index is reachable, no sidecar yet.
    wait_condition(k8s, namespace, "tiered", "IndexReachable", "True")
    ready = wait_condition(k8s, namespace, "tiered", "Ready", "False", reason="NoLiveSidecars")
    assert ready["observedGeneration"] == pool["metadata"]["generation"]
    # where serving pods find the socket (the directory is the DaemonSet's hostPath)
    stored = k8s.pool(namespace, "tiered") or {}
    assert stored["status"]["socketPath"] == "/run/kvpool/{}.tiered/kvpool.sock".format(namespace)


def test_managed_redis_children(k8s: K8s, kvpool_operator: OperatorProcess, namespace: str) -> None:
    pool = create_pool(k8s, namespace, "managed", {})
    sts = wait_child(k8s, kvpool_operator, "apps/v1", "StatefulSet", namespace, "managed-redis")
    svc = wait_child(k8s, kvpool_operator, "v1", "Service", namespace, "managed-redis")
    netpol = wait_child(k8s, kvpool_operator, "networking.k8s.io/v1", "NetworkPolicy", namespace, "managed-redis")
    assert owned_by(sts, pool) and owned_by(svc, pool) and owned_by(netpol, pool)
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"].startswith("redis:")
    cm = wait_child(k8s, kvpool_operator, "v1", "ConfigMap", namespace, "managed-config")
    url = yaml.safe_load(cm["data"]["sidecar.yaml"])["index"]["url"]
    assert url == "redis://managed-redis.{}.svc:6379/0".format(namespace)
    # No cluster DNS here: the operator reports the index unreachable, with the URL.
    cond = wait_condition(k8s, namespace, "managed", "IndexReachable", "False")
    assert "managed-redis" in cond["message"]
    wait_condition(k8s, namespace, "managed", "Degraded", "True", reason="IndexUnreachable")


def _secret_text(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def _auth_hashes(k8s: K8s, namespace: str, pool: str) -> list[str | None]:
    """The Redis password digest on the pod templates of Redis and of the sidecars."""
    found: list[str | None] = []
    for api_version, kind, name in (("apps/v1", "StatefulSet", pool + "-redis"),
                                    ("apps/v1", "DaemonSet", pool + "-sidecar")):
        template = ((k8s.child(api_version, kind, namespace, name) or {}).get("spec") or {}).get("template") or {}
        found.append((template.get("metadata", {}).get("annotations") or {}).get(REDIS_AUTH_HASH_ANNOTATION))
    return found


def test_managed_redis_password_is_generated_once_and_redis_admits_its_pool_only(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str) -> None:
    pool = create_pool(k8s, namespace, "guarded", {})
    create_pool(k8s, namespace, "neighbour", {})
    secret = wait_child(k8s, kvpool_operator, "v1", "Secret", namespace, "guarded-redis")
    sts = wait_child(k8s, kvpool_operator, "apps/v1", "StatefulSet", namespace, "guarded-redis")
    ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "guarded-sidecar")
    netpol = wait_child(k8s, kvpool_operator, "networking.k8s.io/v1", "NetworkPolicy", namespace, "guarded-redis")
    cm = wait_child(k8s, kvpool_operator, "v1", "ConfigMap", namespace, "guarded-config")
    assert owned_by(secret, pool) and owned_by(netpol, pool)
    password = _secret_text(secret, "password")
    assert len(password) >= 32
    assert _secret_text(secret, "redis.conf") == "requirepass {}\n".format(password)

    # Redis starts with the Secret's redis.conf; the sidecars read the Secret's password key.
    redis_pod = sts["spec"]["template"]["spec"]
    conf_volume = next(v for v in redis_pod["volumes"] if v["name"] == "config")
    assert conf_volume["secret"]["secretName"] == "guarded-redis"
    assert redis_pod["containers"][0]["args"][0].endswith("/redis.conf")
    assert password not in json.dumps(sts) + json.dumps(ds) + json.dumps(cm)
    sidecar_volume = next(v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == "redis-password")
    assert sidecar_volume["secret"]["secretName"] == "guarded-redis"
    assert yaml.safe_load(cm["data"]["sidecar.yaml"])["index"]["password_file"] == "/etc/kvpool/redis/password"
    hashes = _auth_hashes(k8s, namespace, "guarded")
    assert hashes[0] and hashes[0] == hashes[1]

    # The Redis pods admit this pool's sidecars and the operator's pods of its namespace, on 6379.
    assert netpol["spec"]["podSelector"] == sts["spec"]["selector"]
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = netpol["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    sidecars, operator = rule["from"]
    assert sidecars == {"podSelector": ds["spec"]["selector"]}  # this namespace, this pool
    assert operator == {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}}}
    neighbour = wait_child(k8s, kvpool_operator, "networking.k8s.io/v1", "NetworkPolicy", namespace,
                           "neighbour-redis")
    neighbour_ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "neighbour-sidecar")
    assert neighbour["spec"]["ingress"][0]["from"][0] == {"podSelector": neighbour_ds["spec"]["selector"]}
    assert neighbour_ds["spec"]["selector"] != ds["spec"]["selector"]
    neighbour_secret = wait_child(k8s, kvpool_operator, "v1", "Secret", namespace, "neighbour-redis")
    assert _secret_text(neighbour_secret, "password") != password  # one password per pool

    # A spec change is reconciled (the ConfigMap follows it): the password and its Secret stay.
    k8s.patch_pool(namespace, "guarded", {"spec": {"tiers": {"dram": {"size": "3Gi"}}}})
    wait_for("the ConfigMap to follow the spec", lambda: yaml.safe_load(
        (k8s.child("v1", "ConfigMap", namespace, "guarded-config") or {}).get("data", {}).get("sidecar.yaml", "{}")
    ).get("dram", {}).get("size_bytes") == 3 * GiB)
    again = k8s.child("v1", "Secret", namespace, "guarded-redis") or {}
    assert again["data"] == secret["data"]
    assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    assert _auth_hashes(k8s, namespace, "guarded") == hashes

    # Deleted by someone: a new password, and both pod templates change with it (they restart).
    k8s.kubectl("delete", "secret", "guarded-redis", "-n", namespace)
    fresh = wait_for("a new Secret", lambda: (lambda s: s if s and s["metadata"]["uid"] != secret["metadata"]["uid"]
                                              else None)(k8s.child("v1", "Secret", namespace, "guarded-redis")))
    assert owned_by(fresh, pool) and _secret_text(fresh, "password") != password
    new_hashes = wait_for("the pod templates to follow the new password", lambda: (
        lambda h: h if h != hashes and h[0] == h[1] else None)(_auth_hashes(k8s, namespace, "guarded")))
    assert new_hashes[0]


def test_spec_change_updates_children(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    create_pool(k8s, namespace, "change", {"redis": {"external": {"url": redis_server.url}}})
    ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "change-sidecar")
    cm = k8s.child("v1", "ConfigMap", namespace, "change-config")
    secret = k8s.child("v1", "Secret", namespace, "change-auth")
    assert cm and secret
    old_hash = ds["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    # Level-based and idempotent: timer runs change nothing.
    time.sleep(2.5 * TIMER_INTERVAL_S)
    assert (k8s.child("v1", "ConfigMap", namespace, "change-config") or {})["metadata"]["resourceVersion"] == \
        cm["metadata"]["resourceVersion"]
    assert (k8s.child("apps/v1", "DaemonSet", namespace, "change-sidecar") or {})["metadata"]["generation"] == \
        ds["metadata"]["generation"]

    k8s.patch_pool(namespace, "change", {"spec": {"tiers": {"dram": {"size": "3Gi"}}, "logLevel": "DEBUG",
                                                  "nodeSelector": {"pool": "kv"}}})

    def updated() -> dict[str, Any] | None:
        current = k8s.child("v1", "ConfigMap", namespace, "change-config") or {}
        config = yaml.safe_load(current.get("data", {}).get("sidecar.yaml", "{}"))
        return current if config.get("dram", {}).get("size_bytes") == 3 * GiB else None

    new_cm = wait_for("the ConfigMap to follow the spec", updated, timeout=60)
    assert yaml.safe_load(new_cm["data"]["sidecar.yaml"])["log_level"] == "DEBUG"
    new_ds = wait_for(
        "the DaemonSet's config hash to change",
        lambda: (lambda d: d if d and d["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
                 != old_hash else None)(k8s.child("apps/v1", "DaemonSet", namespace, "change-sidecar")))
    assert new_ds["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] == config_hash(new_cm)
    assert new_ds["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "kv"}
    # The generated token survives (no needless rotation).
    assert (k8s.child("v1", "Secret", namespace, "change-auth") or {})["data"] == secret["data"]

    # Switching to managed Redis adds it; back to external removes it again.
    k8s.patch_pool(namespace, "change", {"spec": {"redis": {"external": None, "managed": {}}}})
    wait_child(k8s, kvpool_operator, "apps/v1", "StatefulSet", namespace, "change-redis")
    k8s.patch_pool(namespace, "change", {"spec": {"redis": {"managed": None, "external": {"url": redis_server.url}}}})
    wait_for("the managed Redis to go",
             lambda: k8s.child("apps/v1", "StatefulSet", namespace, "change-redis") is None)


def test_ready_follows_heartbeats(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    create_pool(k8s, namespace, "live", {"redis": {"external": {"url": redis_server.url}},
                                         "tiers": {"disk": {"path": "/mnt/{}.live".format(namespace), "size": "10Gi"}}})
    pool_id = "{}.live".format(namespace)
    wait_condition(k8s, namespace, "live", "Ready", "False", reason="NoLiveSidecars")

    heartbeat(redis_server, pool_id, "node-a", dram=(GiB, GiB // 2, 100), disk=(10 * GiB, GiB, 50),
              hits=30, misses=10)
    heartbeat(redis_server, pool_id, "node-b", dram=(GiB, GiB // 2, 100), hits=10, misses=0)
    ready = wait_condition(k8s, namespace, "live", "Ready", "True", timeout=30)
    assert ready["reason"] == "PoolReady"

    def both() -> dict[str, Any] | None:  # (a reconcile between the heartbeats is Ready with one)
        st: dict[str, Any] = (k8s.pool(namespace, "live") or {}).get("status") or {}
        return st if (st.get("nodes") or {}).get("ready") == 2 else None

    status = wait_for("both sidecars in the status", both, timeout=30)
    assert status["tiers"]["dram"] == {"capacityBytes": 2 * GiB, "usedBytes": GiB, "blocks": 200}
    assert status["tiers"]["disk"] == {"capacityBytes": 10 * GiB, "usedBytes": GiB, "blocks": 50}
    assert status["capacityBytes"] == 12 * GiB and status["blocks"] == 250
    assert status["hitRatio"] == 0.8
    assert status["index"]["pool"] == pool_id
    row = k8s.kubectl("get", "kvp", "live", "-n", namespace, "--no-headers").stdout.split()
    assert row[:6] == ["live", "True", "2/0", "12Gi", "2Gi", "80.0%"], row

    # A sidecar whose heartbeat expires no longer counts; with none left the pool is not Ready.
    r = redis_server.client()
    r.delete("kvp:{}:node:node-a".format(pool_id), "kvp:{}:node:node-b".format(pool_id))
    wait_condition(k8s, namespace, "live", "Ready", "False", reason="NoLiveSidecars", timeout=30)

    # Redis gone: IndexReachable turns False (a stopped server, not a mock).
    k8s.patch_pool(namespace, "live", {"spec": {"redis": {"external": {"url": "redis://127.0.0.1:1/0"}}}})
    cond = wait_condition(k8s, namespace, "live", "IndexReachable", "False", timeout=30)
    assert cond["reason"] == "Unreachable"
    assert cond["observedGeneration"] == (k8s.pool(namespace, "live") or {})["metadata"]["generation"]


def test_unworkable_spec_sets_a_condition(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    # Things the schema cannot know: a missing Secret, a name taken by someone else's object,
    # a memory limit below the DRAM arena.
    k8s.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "odd-config", "namespace": namespace},
               "data": {"mine": "yes"}})
    create_pool(k8s, namespace, "odd", {
        "redis": {"external": {"url": redis_server.url}},
        "auth": {"secretRef": {"name": "no-such-secret"}},
        "resources": {"limits": {"memory": "512Mi"}},
        "kvEvents": {"enabled": True},
    })
    cond = wait_condition(k8s, namespace, "odd", "Ready", "False", reason="InvalidSpec")
    assert "spec.kvEvents.routers.podSelector is required" in cond["message"]
    assert "spec.auth.secretRef" in cond["message"] and "no-such-secret" in cond["message"]
    assert "ConfigMap 'odd-config' already exists" in cond["message"]
    assert "spec.resources.limits.memory" in cond["message"]
    wait_condition(k8s, namespace, "odd", "Degraded", "True", reason="InvalidSpec")
    # Someone else's ConfigMap is left alone.
    assert (k8s.child("v1", "ConfigMap", namespace, "odd-config") or {})["data"] == {"mine": "yes"}

    # Fix all four: the message clears.
    k8s.kubectl("delete", "configmap", "odd-config", "-n", namespace)
    k8s.kubectl("create", "secret", "generic", "no-such-secret", "-n", namespace, "--from-literal=token=" + "k" * 32)
    k8s.kubectl("annotate", "secret", "no-such-secret", "-n", namespace, "kvpool.io/pools=odd")  # the pool may use it
    k8s.patch_pool(namespace, "odd", {"spec": {"resources": {"limits": {"memory": "2Gi"}},
                                              "kvEvents": {"connectTo": "tcp://router.infra:5557"}}})
    wait_condition(k8s, namespace, "odd", "Ready", "False", reason="NoLiveSidecars")
    wait_condition(k8s, namespace, "odd", "Degraded", "False")
    # The user's Secret is used; no generated one.
    assert k8s.child("v1", "Secret", namespace, "odd-auth") is None


def test_delete_runs_the_finalizer(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    pool = create_pool(k8s, namespace, "doomed", {"redis": {"external": {"url": redis_server.url}}})
    wait_for("the finalizer", lambda: "kvpool.io/index-cleanup" in
             ((k8s.pool(namespace, "doomed") or {}).get("metadata", {}).get("finalizers") or []))
    wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "doomed-sidecar")
    pool_id = "{}.doomed".format(namespace)
    heartbeat(redis_server, pool_id, "node-a", dram=(GiB, 0, 0))
    r = redis_server.client()
    block = "ab" * 48
    r.sadd("kvp:{}:blk:{}".format(pool_id, block), "node-a@dram")
    r.sadd("kvp:{}:inv:node-a".format(pool_id), block)
    bystander = "kvp:{}.doomed-too:nodes".format(namespace)  # another pool's key, same prefix start
    r.sadd(bystander, "node-z")
    assert len(list(r.scan_iter(match="kvp:{}:*".format(pool_id)))) == 4

    k8s.kubectl("delete", "kvcachepool", "doomed", "-n", namespace, "--wait=true", "--timeout=60s")
    assert k8s.pool(namespace, "doomed") is None
    assert list(r.scan_iter(match="kvp:{}:*".format(pool_id))) == []
    assert r.exists(bystander) == 1
    # The children go by garbage collection (owner references).
    wait_for("the DaemonSet to be garbage-collected",
             lambda: k8s.child("apps/v1", "DaemonSet", namespace, "doomed-sidecar") is None, timeout=60)
    assert pool["metadata"]["uid"]


def _children_versions(k8s: K8s, namespace: str, pool: str) -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for api_version, kind, name in (("v1", "ConfigMap", "-config"), ("v1", "Secret", "-auth"),
                                    ("v1", "Service", "-sidecar"), ("networking.k8s.io/v1", "NetworkPolicy", "-sidecar"),
                                    ("apps/v1", "DaemonSet", "-sidecar")):
        obj = k8s.child(api_version, kind, namespace, pool + name)
        found[kind + "/" + pool + name] = obj["metadata"]["resourceVersion"] if obj else None
    return found


def _events(k8s: K8s, namespace: str, pool: str, reason: str) -> list[dict[str, Any]]:
    out = k8s.kubectl("get", "events", "-n", namespace, "-o", "json", "--field-selector",
                      "involvedObject.kind=KVCachePool,involvedObject.name={},reason={}".format(pool, reason)).stdout
    return list(json.loads(out).get("items") or [])


def test_invalid_spec_changes_no_child_and_is_an_event(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    create_pool(k8s, namespace, "steady", {"redis": {"external": {"url": redis_server.url}}})
    wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "steady-sidecar")
    wait_condition(k8s, namespace, "steady", "Ready", "False", reason="NoLiveSidecars")
    before = _children_versions(k8s, namespace, "steady")
    assert all(before.values()), before

    # A memory limit below the DRAM arena, with a change that would roll the DaemonSet.
    k8s.patch_pool(namespace, "steady", {"spec": {"logLevel": "DEBUG", "tiers": {"dram": {"size": "2Gi"}},
                                                  "resources": {"limits": {"memory": "1Gi"}}}})
    generation = (k8s.pool(namespace, "steady") or {})["metadata"]["generation"]
    ready = wait_for("Ready=False InvalidSpec for generation {}".format(generation), lambda: (
        lambda c: c if c and c.get("reason") == "InvalidSpec" and c.get("observedGeneration") == generation
        else None)(k8s.condition(namespace, "steady", "Ready")))
    assert "spec.resources.limits.memory" in ready["message"]
    (event,) = wait_for("an InvalidSpec Event", lambda: _events(k8s, namespace, "steady", "InvalidSpec"))
    assert event["type"] == "Warning" and event["involvedObject"]["kind"] == "KVCachePool"
    assert "spec.resources.limits.memory" in event["message"] and "not applied" in event["message"]
    # Several timer runs later: every child exactly as it was, and still one Event.
    wait_for("two more reconciles of the refused spec", lambda: sum(
        "/steady: not applying an invalid spec" in line for line in kvpool_operator.log_tail(2000).splitlines()) >= 3,
        timeout=30)
    assert _children_versions(k8s, namespace, "steady") == before
    assert len(_events(k8s, namespace, "steady", "InvalidSpec")) == 1

    # Fixed: applied, the Ready reason moves on.
    k8s.patch_pool(namespace, "steady", {"spec": {"resources": {"limits": {"memory": "3Gi"}}}})
    wait_condition(k8s, namespace, "steady", "Ready", "False", reason="NoLiveSidecars")
    after = _children_versions(k8s, namespace, "steady")
    assert after["DaemonSet/steady-sidecar"] != before["DaemonSet/steady-sidecar"]


def test_a_pool_never_takes_over_a_host_directory_outside_the_roots(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    """The sidecars' init container chowns the pool's host directories as root: a pool that
    names /etc gets InvalidSpec and no DaemonSet at all."""
    create_pool(k8s, namespace, "grab", {"redis": {"external": {"url": redis_server.url}},
                                         "tiers": {"disk": {"path": "/etc", "size": "1Gi"}}})
    ready = wait_condition(k8s, namespace, "grab", "Ready", "False", reason="InvalidSpec")
    assert "spec.tiers.disk.path (/etc) must be the pool's own directory under one of /run/kvpool, /var/lib/kvpool, /mnt" in ready["message"]
    wait_for("an InvalidSpec Event", lambda: _events(k8s, namespace, "grab", "InvalidSpec"))
    assert k8s.child("apps/v1", "DaemonSet", namespace, "grab-sidecar") is None


def _mounted_secrets(ds: dict[str, Any]) -> set[str]:
    return {v["secret"]["secretName"] for v in ds["spec"]["template"]["spec"]["volumes"] if "secret" in v}


def test_a_pool_mounts_only_secrets_that_let_it_and_keeps_its_labels_to_itself(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    """Someone who may create pools had had another pool's generated token and any Secret of the
    namespace mounted into sidecars of an image of their choice; and a pool's labels (one a
    Secret replicator acts on, say) had been copied onto every child, its Secrets included."""
    external = {"redis": {"external": {"url": redis_server.url}}}
    k8s.apply({"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool",
               "metadata": {"name": "victim", "namespace": namespace,
                            "labels": {"replicator.example.com/sync-to": "all-namespaces"}},
               "spec": external})
    wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "victim-sidecar")
    for api_version, kind, name in (("v1", "Secret", "victim-auth"), ("v1", "ConfigMap", "victim-config"),
                                    ("apps/v1", "DaemonSet", "victim-sidecar")):
        labels = (k8s.child(api_version, kind, namespace, name) or {})["metadata"]["labels"]
        assert "replicator.example.com/sync-to" not in labels and labels["kvpool.io/pool"] == "victim", labels

    k8s.kubectl("create", "secret", "generic", "db-creds", "-n", namespace, "--from-literal=token=" + "d" * 32)
    create_pool(k8s, namespace, "intruder", {
        **external, "image": "evil.example.com/x:1", "auth": {"secretRef": {"name": "db-creds"}},
        "tenants": [{"name": "a", "tokenSecret": {"name": "victim-auth"}}]})
    ready = wait_condition(k8s, namespace, "intruder", "Ready", "False", reason="InvalidSpec")
    assert "Secret 'db-creds' does not let this pool use it" in ready["message"]
    assert "kvpool.io/pools=intruder" in ready["message"]
    assert "Secret 'victim-auth' belongs to KVCachePool 'victim'" in ready["message"]
    assert k8s.child("apps/v1", "DaemonSet", namespace, "intruder-sidecar") is None

    # The Secret's owner lets the pool use it, and the pool drops the other pool's: applied.
    k8s.kubectl("annotate", "secret", "db-creds", "-n", namespace, "kvpool.io/pools=intruder")
    k8s.patch_pool(namespace, "intruder", {"spec": {"tenants": None}})
    ds = wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "intruder-sidecar")
    assert "db-creds" in _mounted_secrets(ds) and "victim-auth" not in _mounted_secrets(ds)


def test_a_pool_gets_no_more_on_the_nodes_than_the_operator_allows(
        k8s: K8s, kvpool_operator: OperatorProcess, namespace: str, redis_server: RedisServer) -> None:
    """A critical priority class, tolerating every taint, and every GPU for an image of the pool
    creator's choice: refused, and the pool's children stay as they were."""
    create_pool(k8s, namespace, "modest", {"redis": {"external": {"url": redis_server.url}}})
    wait_child(k8s, kvpool_operator, "apps/v1", "DaemonSet", namespace, "modest-sidecar")
    wait_condition(k8s, namespace, "modest", "Ready", "False", reason="NoLiveSidecars")
    before = _children_versions(k8s, namespace, "modest")
    k8s.patch_pool(namespace, "modest", {"spec": {
        "priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}],
        "image": "evil.example.com/x:1", "tiers": {"gpu": {"enabled": True}}}})
    generation = (k8s.pool(namespace, "modest") or {})["metadata"]["generation"]
    ready = wait_for("Ready=False InvalidSpec for generation {}".format(generation), lambda: (
        lambda c: c if c and c.get("reason") == "InvalidSpec" and c.get("observedGeneration") == generation
        else None)(k8s.condition(namespace, "modest", "Ready")))
    for said in ("spec.priorityClassName: 'system-node-critical' is not allowed",
                 "spec.tolerations[0]: a toleration without a key", "spec.tiers.gpu: the GPU tier"):
        assert said in ready["message"], ready["message"]
    assert _children_versions(k8s, namespace, "modest") == before
