"""The KVCachePool CRD on a real API server: examples apply, defaults, invalid pools rejected."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from kvpool_operator.spec import DEFAULTS
from tests.e2e.conftest import EXAMPLES, K8s

pytestmark = pytest.mark.apiserver


def pool(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kvpool.io/v1alpha1", "kind": "KVCachePool", "metadata": {"name": name}, "spec": spec}


def test_crd_is_served_with_names_and_columns(k8s: K8s, kvpool_crd: str) -> None:
    crd = json.loads(k8s.kubectl("get", "crd", kvpool_crd, "-o", "json").stdout)
    names = crd["spec"]["names"]
    assert names["kind"] == "KVCachePool" and names["plural"] == "kvcachepools"
    assert names["shortNames"] == ["kvp"] and "kvpool" in names["categories"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Ready", "Nodes", "Capacity", "Used", "Hit rate", "Age"]
    # The short name and the category resolve.
    assert k8s.kubectl("get", "kvp", "-A").returncode == 0
    assert k8s.kubectl("get", "kvpool", "-A").returncode == 0


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_applies(k8s: K8s, kvpool_crd: str, namespace: str, example: str) -> None:
    path = EXAMPLES / example
    k8s.kubectl("apply", "-n", namespace, "-f", str(path))
    pools = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "KVCachePool"]
    assert pools, "{} has no KVCachePool".format(example)
    for doc in pools:
        stored = k8s.pool(namespace, doc["metadata"]["name"])
        assert stored is not None
        # Defaults are filled in by the API server.
        assert stored["spec"]["tiers"]["dram"]["pageSize"]
        assert stored["spec"]["transport"]["port"] == doc["spec"].get("transport", {}).get(
            "port", DEFAULTS["transport.port"])
    k8s.kubectl("delete", "-n", namespace, "-f", str(path), "--wait=false")


def test_minimal_pool_gets_defaults(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    k8s.apply(pool("defaults", {}), "-n", namespace)
    spec = (k8s.pool(namespace, "defaults") or {})["spec"]
    assert spec["redis"] == {"managed": {}}
    assert spec["tiers"]["dram"] == {"size": "1Gi", "pageSize": "64Ki", "populate": True, "cleanShare": 0.1,
                                     "putWaitsForDisk": False}
    assert spec["maxBlockSize"] == "256Mi"
    # no socketDir: the operator gives each pool /run/kvpool/<namespace>.<name>
    assert spec["api"] == {"httpPort": 9466}
    assert spec["transport"] == {"type": "tcp", "port": 9467}
    assert spec["eviction"] == {"policy": "prefix", "demote": True}
    assert "disk" not in spec["tiers"] and "auth" not in spec


INVALID: list[tuple[str, dict[str, Any], list[str]]] = [
    ("disk-without-path", {"tiers": {"disk": {"size": "10Gi"}}}, ["spec.tiers.disk.path", "required"]),
    ("clean-share-whole", {"tiers": {"dram": {"cleanShare": 1}}}, ["spec.tiers.dram.cleanShare"]),
    ("clean-share-negative", {"tiers": {"dram": {"cleanShare": -0.5}}}, ["spec.tiers.dram.cleanShare"]),
    ("waits-not-boolean", {"tiers": {"dram": {"putWaitsForDisk": "yes"}}}, ["spec.tiers.dram.putWaitsForDisk"]),
    ("disk-without-size", {"tiers": {"disk": {"path": "/mnt/kv"}}}, ["spec.tiers.disk.size", "required"]),
    ("disk-relative-path", {"tiers": {"disk": {"path": "mnt/kv", "size": "1Gi"}}}, ["spec.tiers.disk.path"]),
    ("disk-in-socket-dir", {"tiers": {"disk": {"path": "/run/kvpool/blocks", "size": "1Gi"}}},
     ["spec.tiers.disk.path", "socketDir"]),
    ("disk-in-own-socket-dir",
     {"api": {"socketDir": "/srv/kv"}, "tiers": {"disk": {"path": "/srv/kv/b", "size": "1Gi"}}},
     ["spec.tiers.disk.path", "socketDir"]),
    ("socket-dir-too-long", {"api": {"socketDir": "/" + "s" * 95}}, ["spec.api.socketDir"]),
    ("level-without-zstd", {"tiers": {"disk": {"path": "/mnt/kv", "size": "1Gi", "compressionLevel": 5}}},
     ["spec.tiers.disk.compressionLevel"]),
    ("both-redis", {"redis": {"managed": {}, "external": {"url": "redis://r:6379"}}},
     ["spec.redis", "exactly one of spec.redis.managed and spec.redis.external"]),
    ("no-redis", {"redis": {}}, ["spec.redis", "exactly one"]),
    ("redis-url-scheme", {"redis": {"external": {"url": "http://r:6379"}}}, ["spec.redis.external.url"]),
    ("redis-url-credentials", {"redis": {"external": {"url": "redis://:secret@r:6379"}}},
     ["spec.redis.external.url", "passwordSecretRef"]),
    ("zero-dram", {"tiers": {"dram": {"size": "0"}}}, ["spec.tiers.dram.size"]),
    ("negative-dram", {"tiers": {"dram": {"size": -5}}}, ["spec.tiers.dram.size"]),
    ("not-a-quantity", {"tiers": {"dram": {"size": "lots"}}}, ["spec.tiers.dram.size"]),
    ("block-bigger-than-dram", {"maxBlockSize": "2Gi", "tiers": {"dram": {"size": "1Gi"}}},
     ["spec.maxBlockSize", "must not exceed spec.tiers.dram.size"]),
    ("bad-page-size", {"tiers": {"dram": {"pageSize": "3Ki"}}}, ["spec.tiers.dram.pageSize"]),
    ("gpu-size-and-fraction", {"tiers": {"gpu": {"enabled": True, "size": "8Gi", "fraction": 0.2}}},
     ["spec.tiers.gpu.fraction", "not both"]),
    ("gpu-fraction-range", {"tiers": {"gpu": {"enabled": True, "fraction": 0.95}}}, ["spec.tiers.gpu.fraction"]),
    ("same-ports", {"transport": {"port": 9466}}, ["spec.transport.port", "must differ"]),
    ("bad-transport", {"transport": {"type": "udp"}}, ["spec.transport.type"]),
    ("bad-policy", {"eviction": {"policy": "random"}}, ["spec.eviction.policy"]),
    ("duplicate-tenant", {"tenants": [{"name": "a"}, {"name": "a"}]}, ["spec.tenants[1]", "Duplicate"]),
    ("zero-quota", {"tenants": [{"name": "a", "quota": 0}]}, ["spec.tenants[0].quota"]),
    ("zero-share", {"tenants": [{"name": "a", "quota": "0%"}]}, ["spec.tenants[0].quota"]),
    ("share-over-100", {"tenants": [{"name": "a", "quota": "101%"}]}, ["spec.tenants[0].quota"]),
    ("bad-key-space", {"tenants": [{"name": "a", "keySpace": "Not Valid"}]}, ["spec.tenants[0].keySpace"]),
    ("priority-range", {"tenants": [{"name": "a", "priority": 5000}]}, ["spec.tenants[0].priority"]),
    ("auth-without-secret", {"auth": {}}, ["spec.auth.secretRef", "Required"]),
    ("toleration-exists-value", {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
     ["spec.tolerations[0].value"]),
    ("unknown-field", {"tiers": {"nvme": {"size": "1Gi"}}}, ["spec.tiers.nvme"]),
    ("dram-too-large", {"tiers": {"dram": {"size": "1000000Ei"}}}, ["spec.tiers.dram.size must be at most 64Ti"]),
    ("dram-too-large-int", {"tiers": {"dram": {"size": 2**46 + 1}}}, ["spec.tiers.dram.size must be at most 64Ti"]),
    ("disk-too-large", {"tiers": {"disk": {"path": "/mnt/kv", "size": "2Pi"}}},
     ["spec.tiers.disk.size must be at most 1Pi"]),
    ("gpu-too-large", {"tiers": {"gpu": {"enabled": True, "size": "5Ti"}}}, ["spec.tiers.gpu.size must be at most 4Ti"]),
    ("block-too-large", {"maxBlockSize": "99999999999999999999"}, ["spec.maxBlockSize must be at most 64Ti"]),
    ("storage-too-large", {"redis": {"managed": {"storage": "1000000Ei"}}},
     ["spec.redis.managed.storage must be at most 1Pi"]),
]


@pytest.mark.parametrize("spec,expected", [(s, e) for _, s, e in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_pool_is_rejected(k8s: K8s, kvpool_crd: str, spec: dict[str, Any], expected: list[str]) -> None:
    result = k8s.apply(pool("invalid", spec), "-n", "default", "--dry-run=server", check=False)
    assert result.returncode != 0, "accepted: {}".format(spec)
    for text in expected:
        assert text in result.stderr, "{!r} not in:\n{}".format(text, result.stderr)


@pytest.mark.parametrize("name", ["1pool", "a" * 41, "Upper"])
def test_invalid_pool_name_is_rejected(k8s: K8s, kvpool_crd: str, name: str) -> None:
    result = k8s.apply(pool(name, {}), "-n", "default", "--dry-run=server", check=False)
    assert result.returncode != 0
    assert "metadata.name" in result.stderr or "RFC 1123" in result.stderr, result.stderr


def test_valid_edge_cases_are_accepted(k8s: K8s, kvpool_crd: str) -> None:
    spec = {
        "maxBlockSize": 1048576,  # integer bytes
        "tiers": {"dram": {"size": 1073741824}, "disk": {"enabled": False},  # switched off: no path needed
                  "gpu": {"enabled": True, "fraction": 0.5}},
        "tenants": [{"name": "a", "quota": "512Mi", "priority": -10}, {"name": "b", "quota": "0.5%"},
                    {"name": "c", "quota": "100%", "keySpace": "shared"}],
        "redis": {"external": {"url": "rediss://redis.infra:6380/2", "passwordSecretRef": {"name": "r"}}},
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
    }
    result = k8s.apply(pool("edge", spec), "-n", "default", "--dry-run=server", "-o", "json")
    stored = json.loads(result.stdout)
    assert stored["spec"]["redis"]["external"]["passwordSecretRef"]["key"] == "password"  # defaulted
    assert stored["spec"]["affinity"] == spec["affinity"]  # passed through unpruned


def test_status_is_a_subresource(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    doc = pool("sub", {})
    doc["status"] = {"observedGeneration": 7}
    k8s.apply(doc, "-n", namespace)
    assert "status" not in (k8s.pool(namespace, "sub") or {}) or \
        (k8s.pool(namespace, "sub") or {}).get("status", {}).get("observedGeneration") != 7


def test_sizes_up_to_their_maximum_are_accepted(k8s: K8s, kvpool_crd: str) -> None:
    spec = {"maxBlockSize": "64Ti",
            "tiers": {"dram": {"size": 2**46}, "disk": {"path": "/mnt/kv", "size": "1Pi"},
                      "gpu": {"enabled": True, "size": "4Ti"}},
            "tenants": [{"name": "a", "quota": "1Pi"}, {"name": "b", "quota": "25%"}, {"name": "c", "quota": 1024}],
            "redis": {"managed": {"storage": "1Pi"}}}
    k8s.apply(pool("at-max", spec), "-n", "default", "--dry-run=server")


def _apply_text(k8s: K8s, namespace: str, name: str, spec_yaml: str, check: bool = True) -> Any:
    """``kubectl apply -f`` of a pool written as a user writes it (YAML, nulls included)."""
    text = "apiVersion: kvpool.io/v1alpha1\nkind: KVCachePool\nmetadata: {{name: {}, namespace: {}}}\nspec:\n{}".format(
        name, namespace, spec_yaml)
    return k8s.apply(text, check=check)


def test_managed_redis_storage_cannot_change(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    _apply_text(k8s, namespace, "vol", "  redis: {managed: {storage: 1Gi, storageClassName: fast}}\n")
    for changed, field in (("{storage: 2Gi, storageClassName: fast}", "spec.redis.managed.storage"),
                           ("{storageClassName: fast}", "spec.redis.managed.storage"),
                           ("{storage: 1Gi, storageClassName: slow}", "spec.redis.managed.storageClassName")):
        result = _apply_text(k8s, namespace, "vol", "  redis: {{managed: {}}}\n".format(changed), check=False)
        assert result.returncode != 0, changed
        assert "{} cannot be changed".format(field) in result.stderr, result.stderr
        assert "re-create the pool" in result.stderr
    # Everything else may change.
    _apply_text(k8s, namespace, "vol", "  logLevel: DEBUG\n  redis: {managed: {storage: 1Gi, storageClassName: fast}}\n")
    assert (k8s.pool(namespace, "vol") or {})["spec"]["redis"]["managed"]["storage"] == "1Gi"
    # A pool created without storage cannot gain it either (the StatefulSet's volumes are fixed).
    _apply_text(k8s, namespace, "novol", "  redis: {managed: {}}\n")
    result = _apply_text(k8s, namespace, "novol", "  redis: {managed: {storage: 1Gi}}\n", check=False)
    assert result.returncode != 0 and "spec.redis.managed.storage cannot be changed" in result.stderr


def test_switching_redis_modes_with_kubectl_apply(k8s: K8s, kvpool_crd: str, namespace: str) -> None:
    _apply_text(k8s, namespace, "sw", "  logLevel: INFO\n")  # managed Redis by default
    assert (k8s.pool(namespace, "sw") or {})["spec"]["redis"] == {"managed": {}}
    # The defaulted managed: {} stays under a plain apply: refused, with the way to do it.
    result = _apply_text(k8s, namespace, "sw", "  redis:\n    external: {url: 'redis://r:6379/0'}\n", check=False)
    assert result.returncode != 0
    assert "exactly one of spec.redis.managed and spec.redis.external" in result.stderr
    assert "managed: null" in result.stderr, result.stderr
    # As the message says.
    _apply_text(k8s, namespace, "sw", "  redis:\n    managed: null\n    external: {url: 'redis://r:6379/0'}\n")
    assert (k8s.pool(namespace, "sw") or {})["spec"]["redis"] == {
        "external": {"url": "redis://r:6379/0", "cluster": False}}
    # And back: apply removes what the last apply set.
    _apply_text(k8s, namespace, "sw", "  redis:\n    managed: {}\n")
    assert (k8s.pool(namespace, "sw") or {})["spec"]["redis"] == {"managed": {}}
