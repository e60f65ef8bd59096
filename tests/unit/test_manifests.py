"""The CRD file and the operator's pure manifest builders (no cluster needed)."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import secrets
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_operator.errors import InvalidSpecError, SettingsError
from kvpool_operator.manifests import (
    CONFIG_HASH_ANNOTATION,
    NAMESPACE_NAME_LABEL,
    OPERATOR_POD_LABELS,
    REDIS_AUTH_HASH_ANNOTATION,
    REDIS_CONFIG_KEY,
    REDIS_PASSWORD_KEY,
    REDIS_SECRET_DIR,
    build_children,
    build_configmap,
    build_daemonset,
    build_network_policy,
    build_redis_secret,
    build_redis_statefulset,
    build_service,
    build_sidecar_config,
    config_hash,
    names,
    possible_children,
    redis_auth_hash,
    redis_url,
    usable_redis_password,
)
from kvpool_operator.quantity import format_bytes, parse_bytes
from kvpool_operator.settings import DEFAULT_HOST_PATH_ROOTS, OperatorSettings
from kvpool_operator.spec import (
    DEFAULTS,
    MAX_SIZES,
    MAX_SOCKET_DIR,
    MAX_SOCKET_PATH,
    SOCKET_ROOT,
    PoolSpec,
    host_path_problems,
    parse_spec,
    spec_problems,
)
from tests.unit.operator_support import walk_schema

REPO = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((REPO / "crds" / "kvcachepools.kvpool.io.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
GiB = 1 << 30


def spec(raw: dict[str, Any] | None = None, name: str = "pool") -> PoolSpec:
    return parse_spec(name, "ns", raw or {})


REDIS_PASSWORD = "r" * 43


def children(raw: dict[str, Any] | None = None, token: str | None = "t" * 43, name: str = "pool",
             redis_password: str = REDIS_PASSWORD,
             operator_namespace: str | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    s = spec(raw, name)
    built = build_children(s, token=token if s.auth is None else None, sidecar_image="img:1", redis_image="redis:7",
                           redis_password=redis_password if s.managed_redis is not None else None,
                           operator_namespace=operator_namespace)
    return {(c["kind"], c["metadata"]["name"]): c for c in built}


# -- the CRD -----------------------------------------------------------------------------


def test_crd_names_and_version() -> None:
    assert CRD["metadata"]["name"] == "kvcachepools.kvpool.io"
    assert CRD["spec"]["group"] == "kvpool.io" and CRD["spec"]["scope"] == "Namespaced"
    n = CRD["spec"]["names"]
    assert (n["kind"], n["plural"], n["shortNames"], n["categories"]) == (
        "KVCachePool", "kvcachepools", ["kvp"], ["kvpool"])
    version = CRD["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


def test_every_field_is_described_and_typed() -> None:
    missing = [p for p, node in walk_schema(SCHEMA, "") if p != ".metadata" and not node.get("description")]
    assert missing == []
    untyped = [p for p, node in walk_schema(SCHEMA, "")
               if "type" not in node and not node.get("x-kubernetes-int-or-string")]
    assert untyped == []


def test_conditions_are_a_list_map_and_columns_are_printed() -> None:
    conditions = SCHEMA["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "observedGeneration" in conditions["items"]["properties"]
    columns = {c["name"]: c["jsonPath"] for c in CRD["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert list(columns) == ["Ready", "Nodes", "Capacity", "Used", "Hit rate", "Age"]


def test_crd_has_cel_rules_for_cross_field_checks() -> None:
    rules = [r["rule"] for _, node in walk_schema(SCHEMA, "") for r in node.get("x-kubernetes-validations", ())]
    assert "has(self.managed) != has(self.external)" in rules
    assert any("has(self.path)" in r for r in rules)
    assert any("maxBlockSize" in r for r in rules)


def test_crd_bounds_every_size_as_the_operator_does() -> None:
    nodes = {path.lstrip("."): node for path, node in walk_schema(SCHEMA["properties"]["spec"], "")}
    # A tenant's quota has no CEL bound: the API server refuses a quantity() rule inside the
    # tenants list (64 items) as over its cost budget; the operator and the sidecar bound it.
    in_crd = {key: limit for key, limit in MAX_SIZES.items() if key != "tenants[].quota"}
    for key, limit in in_crd.items():
        rules = [r["rule"] for r in nodes[key].get("x-kubernetes-validations", ())]
        assert any("quantity('{}')".format(limit) in r and "compareTo" in r for r in rules), (key, rules)
    sizes = {path for path, node in nodes.items() if node.get("x-kubernetes-int-or-string") and "{}" not in path}
    assert sizes == set(MAX_SIZES)  # no quantity field left unbounded (by the CRD or the operator)


def test_crd_marks_the_managed_redis_volume_immutable() -> None:
    managed = SCHEMA["properties"]["spec"]["properties"]["redis"]["properties"]["managed"]
    rules = {r.get("fieldPath"): r for r in managed["x-kubernetes-validations"] if "oldSelf" in r["rule"]}
    assert set(rules) == {".storage", ".storageClassName"}
    for field, rule in rules.items():
        assert "self{0} == oldSelf{0}".format(field) in rule["rule"].replace("\n", " ")
        assert "cannot be changed" in rule["message"] and "re-create the pool" in rule["message"]
    redis_rule = SCHEMA["properties"]["spec"]["properties"]["redis"]["x-kubernetes-validations"][0]
    assert "managed: null" in redis_rule["message"]  # how to switch with kubectl apply


def _crd_defaults() -> dict[str, Any]:
    found: dict[str, Any] = {}
    for path, node in walk_schema(SCHEMA["properties"]["spec"], ""):
        if "default" in node and not isinstance(node["default"], dict):
            found[path.lstrip(".").replace("[]", "[]")] = node["default"]
    return found


def test_operator_defaults_match_the_crd() -> None:
    assert _crd_defaults() == dict(DEFAULTS)


def test_empty_spec_parses_to_the_defaults() -> None:
    s = spec({})
    assert s.dram.size_bytes == parse_bytes(DEFAULTS["tiers.dram.size"], "x")
    assert s.dram.page_bytes == parse_bytes(DEFAULTS["tiers.dram.pageSize"], "x")
    assert s.max_block_bytes == parse_bytes(DEFAULTS["maxBlockSize"], "x")
    assert (s.socket_dir, s.http_port) == ("/run/kvpool/ns.pool", DEFAULTS["api.httpPort"])
    assert (s.transport, s.peer_port) == (DEFAULTS["transport.type"], DEFAULTS["transport.port"])
    assert (s.eviction_policy, s.demote, s.log_level) == ("prefix", True, "INFO")
    assert s.managed_redis is not None and s.external_redis is None
    assert s.disk is None and s.gpu is None and s.auth is None and s.tenants == ()
    assert s.network_policy is True


# -- spec parsing and quantities -------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("1Gi", GiB), ("1.5Gi", 3 * GiB // 2), ("512Mi", 512 << 20), ("10G", 10**10), ("4k", 4000), (1234, 1234),
    ("64Ki", 65536), ("2Ti", 2 << 40),
])
def test_parse_bytes(text: object, expected: int) -> None:
    assert parse_bytes(text, "f") == expected


@pytest.mark.parametrize("bad", ["0", 0, -1, "1X", "", "Gi", True, 1.5, None])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(InvalidSpecError) as info:
        parse_bytes(bad, "spec.tiers.dram.size")
    assert info.value.field == "spec.tiers.dram.size"


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 512, 1536, GiB, 12 * GiB, 3 * (1 << 40) // 2)] == \
        ["0", "512", "1.5Ki", "1Gi", "12Gi", "1.5Ti"]


@pytest.mark.parametrize("raw,field", [
    ({"tiers": {"disk": {"size": "1Gi"}}}, "spec.tiers.disk.path"),
    ({"tiers": {"disk": {"path": "/x"}}}, "spec.tiers.disk.size"),
    ({"tiers": {"dram": {"size": "none"}}}, "spec.tiers.dram.size"),
    ({"redis": {"managed": {}, "external": {"url": "redis://x"}}}, "spec.redis"),
    ({"redis": {"external": {"url": "http://x"}}}, "spec.redis.external.url"),
    ({"tenants": [{"priority": 1}]}, "spec.tenants[0].name"),
    ({"tenants": [{"name": "a", "uids": [-1]}]}, "spec.tenants[0].uids"),
    ({"tenants": [{"name": "a", "gids": ["x"]}]}, "spec.tenants[0].gids"),
    ({"tenants": [{"name": "a", "tokenSecret": {"key": "t"}}]}, "spec.tenants[0].tokenSecret.name"),
    ({"tenants": [{"name": "a", "quota": "0%"}]}, "spec.tenants[0].quota"),
    ({"tenants": [{"name": "a", "quota": "120%"}]}, "spec.tenants[0].quota"),
    ({"tenants": [{"name": "a", "quota": "x%"}]}, "spec.tenants[0].quota"),
    ({"tenants": [{"name": "a", "keySpace": 5}]}, "spec.tenants[0].keySpace"),
    ({"tiers": "big"}, "spec.tiers"),
    ({"auth": {"secretRef": {}}}, "spec.auth.secretRef.name"),
    ({"transport": {"port": "7470"}}, "spec.transport.port"),
    ({"tiers": {"dram": {"cleanShare": 1}}}, "spec.tiers.dram.cleanShare"),
    ({"tiers": {"dram": {"cleanShare": -0.1}}}, "spec.tiers.dram.cleanShare"),
    ({"tiers": {"dram": {"cleanShare": float("nan")}}}, "spec.tiers.dram.cleanShare"),
    ({"tiers": {"dram": {"cleanShare": "10%"}}}, "spec.tiers.dram.cleanShare"),
    ({"tiers": {"dram": {"putWaitsForDisk": "yes"}}}, "spec.tiers.dram.putWaitsForDisk"),
])
def test_parse_spec_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        spec(raw)
    assert info.value.field == field


def test_disk_switched_off_is_no_tier() -> None:
    assert spec({"tiers": {"disk": {"enabled": False}}}).disk is None


def test_spec_problems() -> None:
    assert spec_problems(spec({})) == []
    low = spec_problems(spec({"resources": {"limits": {"memory": "1Gi"}}}))
    assert len(low) == 1 and "spec.resources.limits.memory" in low[0]
    assert spec_problems(spec({"resources": {"limits": {"memory": "2Gi", "cpu": "500m"}}})) == []
    small_disk = spec_problems(spec({"tiers": {"disk": {"path": "/d", "size": "1Mi"}}}))
    assert len(small_disk) == 1 and "spec.tiers.disk.size" in small_disk[0]


ROUTERS = {"podSelector": {"matchLabels": {"app": "router"}}, "namespaceSelector": {"matchLabels": {"team": "r"}}}


def test_kv_events_need_the_routers_that_may_connect_and_ports_of_their_own() -> None:
    assert spec_problems(spec({"kvEvents": {"enabled": False}})) == []
    unfenced = spec_problems(spec({"kvEvents": {"enabled": True}}))
    assert len(unfenced) == 1 and "spec.kvEvents.routers.podSelector is required" in unfenced[0]
    assert spec_problems(spec({"kvEvents": {"enabled": True, "routers": ROUTERS}})) == []
    # a sidecar that connects to a listening router binds nothing, unless it replays
    assert spec_problems(spec({"kvEvents": {"enabled": True, "connectTo": "tcp://router:5557"}})) == []
    replay = spec_problems(spec({"kvEvents": {"enabled": True, "connectTo": "tcp://router:5557", "replayPort": 5558}}))
    assert len(replay) == 1 and "routers.podSelector" in replay[0]
    clash = spec_problems(spec({"kvEvents": {"enabled": True, "routers": ROUTERS, "port": 9467, "replayPort": 9466}}))
    assert [p.split(" must")[0] for p in clash] == ["spec.transport.port and spec.kvEvents.port",
                                                    "spec.api.httpPort and spec.kvEvents.replayPort"]
    unknown = spec_problems(spec({"kvEvents": {"enabled": True, "routers": ROUTERS, "tenants": ["a"]},
                                  "tenants": [{"name": "b"}]}))
    assert len(unknown) == 1 and "'a'" in unknown[0]
    with pytest.raises(InvalidSpecError, match="spec.kvEvents.connectTo"):
        spec({"kvEvents": {"enabled": True, "connectTo": "router:5557"}})


def test_kv_events_are_published_on_ports_only_the_routers_reach() -> None:
    built = children({"kvEvents": {"enabled": True, "port": 5557, "replayPort": 5558, "routers": ROUTERS}})
    config = yaml.safe_load(built[("ConfigMap", "pool-config")]["data"]["sidecar.yaml"])
    assert config["kv_events"] == {"enabled": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                                   "topic": "", "encoding": "tagged", "tenants": []}
    [container] = built[("DaemonSet", "pool-sidecar")]["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "peer": 9467, "http": 9466, "kv-events": 5557, "kv-replay": 5558}
    assert {p["name"]: p["port"] for p in built[("Service", "pool-sidecar")]["spec"]["ports"]}["kv-replay"] == 5558
    rules = built[("NetworkPolicy", "pool-sidecar")]["spec"]["ingress"]
    assert rules[-1] == {"from": [ROUTERS], "ports": [{"protocol": "TCP", "port": 5557}, {"protocol": "TCP", "port": 5558}]}
    assert all(r.get("from") for r in rules if any(p["port"] in (5557, 5558) for p in r["ports"]))
    # connected to a router that listens: no port, no rule
    out = children({"kvEvents": {"enabled": True, "connectTo": "tcp://router.infra:5557", "topic": "kv"}})
    config = yaml.safe_load(out[("ConfigMap", "pool-config")]["data"]["sidecar.yaml"])
    assert config["kv_events"]["endpoint"] == "tcp://router.infra:5557" and config["kv_events"]["connect"] is True
    assert len(out[("NetworkPolicy", "pool-sidecar")]["spec"]["ingress"]) == 2
    assert "kv_events" not in yaml.safe_load(children()[("ConfigMap", "pool-config")]["data"]["sidecar.yaml"])


# -- builders -------------------------------------------------------------------------------


def test_children_of_a_default_pool() -> None:
    built = children()
    assert set(built) == {
        ("ConfigMap", "pool-config"), ("Secret", "pool-auth"), ("Secret", "pool-redis"), ("Service", "pool-redis"),
        ("StatefulSet", "pool-redis"), ("NetworkPolicy", "pool-redis"), ("Service", "pool-sidecar"),
        ("NetworkPolicy", "pool-sidecar"), ("DaemonSet", "pool-sidecar"),
    }
    assert all(c["metadata"]["namespace"] == "ns" for c in built.values())
    assert all(c["metadata"]["labels"]["app.kubernetes.io/instance"] == "pool" for c in built.values())
    possible = {(kind, name) for _, kind, name in possible_children("pool")}
    assert set(built) <= possible
    # The DaemonSet goes last: its config hash is of the ConfigMap applied before it.
    assert build_children(spec(), token="x" * 20, sidecar_image="i", redis_image="r",
                          redis_password=REDIS_PASSWORD)[-1]["kind"] == "DaemonSet"


def test_external_redis_and_own_token_and_no_netpol() -> None:
    built = children({"redis": {"external": {"url": "redis://r:6379/1", "passwordSecretRef": {"name": "rp"}}},
                      "auth": {"secretRef": {"name": "tok"}}, "networkPolicy": {"enabled": False}})
    assert set(built) == {("ConfigMap", "pool-config"), ("Service", "pool-sidecar"), ("DaemonSet", "pool-sidecar")}
    pod = built[("DaemonSet", "pool-sidecar")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["auth"]["secret"]["secretName"] == "tok"
    assert volumes["redis-password"]["secret"] == {"secretName": "rp", "defaultMode": 0o400,
                                                   "items": [{"key": "password", "path": "password"}]}


def test_generated_secret_holds_the_token() -> None:
    secret = children(token="abc" * 15)[("Secret", "pool-auth")]
    assert base64.b64decode(secret["data"]["token"]).decode() == "abc" * 15
    with pytest.raises(ValueError):
        build_children(spec(), token=None, sidecar_image="i", redis_image="r", redis_password=REDIS_PASSWORD)


def test_daemonset_is_pss_baseline_with_probes_and_host_paths() -> None:
    ds = build_daemonset(spec({"tiers": {"disk": {"path": "/mnt/nvme", "size": "1Ti"}}}),
                         default_image="img:1", configuration_hash="h")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostIPC"] is False and pod["hostPID"] is False and pod["hostNetwork"] is False
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert "hostPort" not in str(container["ports"])
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    host = {v["name"]: v["hostPath"] for v in pod["volumes"] if "hostPath" in v}
    assert host == {"socket": {"path": "/run/kvpool/ns.pool", "type": "DirectoryOrCreate"},
                    "disk": {"path": "/mnt/nvme", "type": "DirectoryOrCreate"}}
    assert container["image"] == "img:1"
    assert ds["spec"]["template"]["metadata"]["annotations"] == {CONFIG_HASH_ANNOTATION: "h"}
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


def test_daemonset_node_selection_passes_through() -> None:
    affinity: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    ds = build_daemonset(spec({"nodeSelector": {"gpu": "yes"}, "affinity": affinity, "tolerations": tolerations,
                               "priorityClassName": "system-node-critical", "image": "mine:2",
                               "imagePullSecrets": [{"name": "regcred"}],
                               "resources": {"limits": {"memory": "4Gi"}}}),
                         default_image="img:1", configuration_hash="h")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "yes"} and pod["affinity"] == affinity
    assert pod["tolerations"] == tolerations and pod["priorityClassName"] == "system-node-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["containers"][0]["image"] == "mine:2"
    assert pod["containers"][0]["resources"] == {"limits": {"memory": "4Gi"}}


def test_config_hash_follows_the_config_only() -> None:
    a, b = build_configmap(spec({})), build_configmap(spec({}))
    assert config_hash(a) == config_hash(b)
    c = build_configmap(spec({"tiers": {"dram": {"size": "2Gi"}}}))
    assert config_hash(c) != config_hash(a)
    # Node selection is not config: it rolls the pods by itself, not through the hash.
    assert config_hash(build_configmap(spec({"nodeSelector": {"x": "y"}}))) == config_hash(a)


def test_sidecar_config_content() -> None:
    s = spec({"tiers": {"dram": {"size": "2Gi"}, "disk": {"path": "/d", "size": "1Ti", "compressionLevel": 7,
                                                           "compression": "zstd"},
                        "gpu": {"enabled": True, "fraction": 0.3}},
              "tenants": [{"name": "a", "quota": "1Gi", "priority": 3},
                          {"name": "b", "quota": "25%", "keySpace": "team"}],
              "transport": {"type": "rdma"}})
    config = build_sidecar_config(s)
    assert config["pool"] == "ns.pool"
    assert config["dram"] == {"size_bytes": 2 * GiB, "page_bytes": 65536, "populate": True, "clean_share": 0.1,
                              "put_waits_for_disk": False}
    assert config["disk"] == {"path": "/d", "size_bytes": 1 << 40, "fsync": "never", "compression": "zstd",
                              "compression_level": 7, "layout": "segments"}
    assert config["gpu"] == {"enabled": True, "device": 0, "fraction": 0.3}
    assert config["tenants"] == [{"name": "a", "priority": 3, "quota_bytes": GiB},
                                 {"name": "b", "priority": 0, "quota_share": 0.25, "key_space": "team"}]
    assert config["peer"]["transport"] == "rdma"  # the CRD's name is the sidecar's
    assert config["max_block_bytes"] == 256 << 20
    assert "node_name" not in config  # from KVPOOL_NODE_NAME
    assert yaml.safe_load(build_configmap(s)["data"]["sidecar.yaml"]) == config


def _socket_of(raw: dict[str, Any], name: str, namespace: str) -> tuple[str, str, list[str]]:
    """(hostPath of the socket volume, the rendered api.socket_path, the dirs prepare-dirs hands
    to the sidecar's user) of a pool."""
    s = parse_spec(name, namespace, raw)
    pod = build_daemonset(s, default_image="img:1", configuration_hash="h")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "socket"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "socket"]
    assert mount["mountPath"] == volume["hostPath"]["path"]  # the same path on the host and in the sidecar
    (prepare,) = pod["initContainers"]
    return volume["hostPath"]["path"], build_sidecar_config(s)["api"]["socket_path"], prepare["command"]


def test_each_pool_has_a_socket_directory_of_its_own() -> None:
    """Two pools on one node never share a socket: the default directory is per namespace and
    name, so the second sidecar does not find the first one's socket and exit."""
    pools = [("cache", "team-a"), ("cache", "team-b"), ("other", "team-a")]
    rendered = {pool: _socket_of({}, *pool) for pool in pools}
    assert rendered[("cache", "team-a")][:2] == ("/run/kvpool/team-a.cache", "/run/kvpool/team-a.cache/kvpool.sock")
    host_paths = {r[0] for r in rendered.values()}
    sockets = {r[1] for r in rendered.values()}
    assert len(host_paths) == len(sockets) == len(pools)
    for host_path, socket_path, prepare in rendered.values():
        assert socket_path == host_path + "/kvpool.sock"
        assert host_path in prepare  # handed to the sidecar's user before it binds there
    # none is inside another's (a serving pod mounting one sees no other pool's socket)
    assert not any(a != b and b.startswith(a + "/") for a in host_paths for b in host_paths)
    # spec.api.socketDir still wins
    assert _socket_of({"api": {"socketDir": "/var/run/kv"}}, "cache", "team-a")[:2] == \
        ("/var/run/kv", "/var/run/kv/kvpool.sock")


def test_long_pool_names_keep_a_bindable_and_unique_socket_path() -> None:
    namespace = "n" * 63
    long_a, long_b = parse_spec("a" * 40, namespace, {}), parse_spec("a" * 39 + "b", namespace, {})
    for s in (long_a, long_b):
        assert len(s.socket_path.encode()) <= MAX_SOCKET_PATH and s.socket_dir.startswith(SOCKET_ROOT + "/")
    assert long_a.socket_dir != long_b.socket_dir
    assert parse_spec("a" * 40, namespace, {}).socket_dir == long_a.socket_dir  # the same every time
    # 64 bits of digest (32 could be searched, offline, for a name whose cut form is another pool's)
    cut, digest = long_a.socket_dir.rsplit("/", 1)[1].rsplit("_", 1)
    whole = "{}.{}".format(namespace, "a" * 40)
    assert digest == hashlib.sha256(whole.encode()).hexdigest()[:16] and whole.startswith(cut)
    assert len(long_a.socket_path.encode()) == MAX_SOCKET_PATH  # the room is used, not passed
    too_long = "/" + "d" * MAX_SOCKET_DIR
    with pytest.raises(InvalidSpecError, match="spec.api.socketDir"):
        parse_spec("p", "ns", {"api": {"socketDir": too_long}})
    socket_dir = SCHEMA["properties"]["spec"]["properties"]["api"]["properties"]["socketDir"]
    assert socket_dir["maxLength"] == MAX_SOCKET_DIR and "default" not in socket_dir


def test_redis_url() -> None:
    assert redis_url(spec({})) == "redis://pool-redis.ns.svc:6379/0"
    assert redis_url(spec({"redis": {"external": {"url": "rediss://r:1/2"}}})) == "rediss://r:1/2"


def test_service_is_headless_and_network_policy_fences_the_peer_port() -> None:
    s = spec({"transport": {"port": 7000}, "api": {"httpPort": 9000}})
    svc = build_service(s)
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"peer": 7000, "http": 9000}
    np = build_network_policy(s)
    peer, http = np["spec"]["ingress"]
    assert peer["ports"] == [{"protocol": "TCP", "port": 7000}]
    assert peer["from"] == [{"podSelector": {"matchLabels": np["spec"]["podSelector"]["matchLabels"]}}]
    assert http == {"ports": [{"protocol": "TCP", "port": 9000}]}
    assert np["spec"]["policyTypes"] == ["Ingress"]


def test_managed_redis_storage() -> None:
    ephemeral = build_redis_statefulset(spec({}), default_image="redis:7")
    assert ephemeral["spec"]["template"]["spec"]["volumes"][0] == {"name": "data", "emptyDir": {}}
    assert "volumeClaimTemplates" not in ephemeral["spec"]
    assert "--save" in ephemeral["spec"]["template"]["spec"]["containers"][0]["args"]
    # an image the pool's creator names gets no GPU, whatever its own environment asks
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in ephemeral["spec"]["template"]["spec"]["containers"][0]["env"]
    persistent = build_redis_statefulset(
        spec({"redis": {"managed": {"storage": "8Gi", "storageClassName": "fast", "image": "valkey:8"}}}),
        default_image="redis:7")
    (claim,) = persistent["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    assert persistent["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    assert persistent["spec"]["template"]["spec"]["containers"][0]["image"] == "valkey:8"
    with pytest.raises(ValueError):
        build_redis_statefulset(spec({"redis": {"external": {"url": "redis://x"}}}), default_image="r")


def test_names_are_short_enough() -> None:
    longest = "a" * 40  # the CRD's limit
    for name in vars(names(longest)).values():
        assert len(name) <= 63 - len("-0") - 11  # StatefulSet pod + controller-revision-hash label


# -- operator settings ---------------------------------------------------------------------


def test_settings_from_env() -> None:
    s = OperatorSettings.from_env({"KVPOOL_OPERATOR_NAMESPACES": "a, b,", "KVPOOL_OPERATOR_TIMER_INTERVAL": "2.5",
                                   "KVPOOL_OPERATOR_IMAGE": "x:1", "KVPOOL_OPERATOR_PURGE_RETRIES": "4"})
    assert s.watch.namespaces == ("a", "b")
    assert s.reconcile.timer_interval_s == 2.5 and s.reconcile.purge_retries == 4
    assert s.images.sidecar == "x:1" and s.images.redis == "redis:7.4"
    assert OperatorSettings.from_env({}).watch.namespaces == ()
    assert [s.backoff(r) for r in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]


def test_the_operator_says_which_namespaces_it_serves(caplog: pytest.LogCaptureFixture) -> None:
    """A pool elsewhere is never reconciled (the operator cannot see it): not silently."""
    from kvpool_operator.__main__ import log_watch_scope

    with caplog.at_level(logging.INFO, logger="kvpool_operator"):
        log_watch_scope(OperatorSettings.from_env({"KVPOOL_OPERATOR_NAMESPACES": "a,b"}).watch.namespaces)
        log_watch_scope(())
    first, second = [r.getMessage() for r in caplog.records]
    assert "namespace(s) a, b only" in first and "never reconciled" in first and "watch.namespaces" in first
    assert second == "serving KVCachePools in every namespace"


@pytest.mark.parametrize("env", [{"KVPOOL_OPERATOR_TIMER_INTERVAL": "soon"}, {"KVPOOL_OPERATOR_TIMER_INTERVAL": "0"},
                                 {"KVPOOL_OPERATOR_PURGE_RETRIES": "-1"}])
def test_settings_errors_name_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match=next(iter(env))):
        OperatorSettings.from_env(env)


def test_sidecar_runs_as_its_own_user_and_only_the_dir_setup_runs_as_root() -> None:
    ds = build_daemonset(spec({"tiers": {"disk": {"path": "/var/lib/kvpool", "size": "10Gi"}}}),
                         default_image="img:1", configuration_hash="h")
    pod = ds["spec"]["template"]["spec"]
    [main] = pod["containers"]
    assert main["securityContext"]["runAsNonRoot"] is True
    assert main["securityContext"]["runAsUser"] == 10001
    [init] = pod["initContainers"]
    sc = init["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    host_paths = {v["name"] for v in pod["volumes"] if "hostPath" in v}
    assert {m["name"] for m in init["volumeMounts"]} == host_paths == {"socket", "disk"}
    assert init["command"][-2:] == [m["mountPath"] for m in init["volumeMounts"]]


def test_the_root_step_runs_the_operators_image_whatever_image_the_pool_names() -> None:
    """Whoever may create a pool chooses the sidecar's image, which runs as uid 10001 without
    capabilities; the init container that runs as root runs the operator's own image."""
    own = build_daemonset(spec({"image": "registry.example/anything:evil"}), default_image="img:1",
                          configuration_hash="h")["spec"]["template"]["spec"]
    assert own["containers"][0]["image"] == "registry.example/anything:evil"
    assert [c["image"] for c in own["initContainers"]] == ["img:1"]
    plain = build_daemonset(spec({}), default_image="img:1", configuration_hash="h")["spec"]["template"]["spec"]
    assert plain["containers"][0]["image"] == plain["initContainers"][0]["image"] == "img:1"


# -- the managed Redis's password and NetworkPolicy -------------------------------------------


def _secret_text(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


def test_managed_redis_requires_the_pools_generated_password() -> None:
    built = children()
    secret = built[("Secret", "pool-redis")]
    assert secret["type"] == "Opaque" and secret["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    assert _secret_text(secret, REDIS_PASSWORD_KEY) == REDIS_PASSWORD
    assert _secret_text(secret, REDIS_CONFIG_KEY) == "requirepass {}\n".format(REDIS_PASSWORD)

    # Redis reads its redis.conf (requirepass) from that Secret: first argument, mounted read-only.
    sts = built[("StatefulSet", "pool-redis")]
    pod = sts["spec"]["template"]["spec"]
    (redis,) = pod["containers"]
    assert redis["command"] == ["redis-server"]
    conf_mount = next(m for m in redis["volumeMounts"] if m["name"] == "config")
    assert conf_mount["readOnly"] is True
    assert redis["args"][0] == "{}/{}".format(conf_mount["mountPath"], REDIS_CONFIG_KEY)
    conf_volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert conf_volume["secret"] == {"secretName": "pool-redis", "defaultMode": 0o400,
                                     "items": [{"key": REDIS_CONFIG_KEY, "path": REDIS_CONFIG_KEY}]}
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]  # 0400 -> 0440, its group
    # ... and the password itself is nowhere in the StatefulSet (no argv, no env).
    assert REDIS_PASSWORD not in json.dumps(sts) and redis["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]

    # The sidecars read the same Secret's password key from a file (index.password_file).
    ds = built[("DaemonSet", "pool-sidecar")]
    ds_pod = ds["spec"]["template"]["spec"]
    (sidecar,) = ds_pod["containers"]
    index = yaml.safe_load(built[("ConfigMap", "pool-config")]["data"]["sidecar.yaml"])["index"]
    assert index == {"backend": "redis", "url": "redis://pool-redis.ns.svc:6379/0",
                     "password_file": "{}/{}".format(REDIS_SECRET_DIR, REDIS_PASSWORD_KEY)}
    pw_mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "redis-password")
    assert pw_mount == {"name": "redis-password", "mountPath": REDIS_SECRET_DIR, "readOnly": True}
    pw_volume = next(v for v in ds_pod["volumes"] if v["name"] == "redis-password")
    assert pw_volume["secret"] == {"secretName": "pool-redis", "defaultMode": 0o400,
                                   "items": [{"key": REDIS_PASSWORD_KEY, "path": REDIS_PASSWORD_KEY}]}
    # The sidecar's user reads the 0400 Secret files through its fsGroup (the kubelet makes them 0440).
    assert ds_pod["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"]
    assert REDIS_PASSWORD not in json.dumps(ds) + json.dumps(built[("ConfigMap", "pool-config")])


def test_a_new_redis_password_restarts_redis_and_the_sidecars_but_not_the_config() -> None:
    before, after = children(), children(redis_password="s" * 43)
    for key in (("StatefulSet", "pool-redis"), ("DaemonSet", "pool-sidecar")):
        old = before[key]["spec"]["template"]["metadata"]["annotations"][REDIS_AUTH_HASH_ANNOTATION]
        new = after[key]["spec"]["template"]["metadata"]["annotations"][REDIS_AUTH_HASH_ANNOTATION]
        assert old == redis_auth_hash(REDIS_PASSWORD) and new == redis_auth_hash("s" * 43) and old != new
        assert REDIS_PASSWORD not in old
    assert before[("ConfigMap", "pool-config")] == after[("ConfigMap", "pool-config")]
    # An external Redis: none of it.
    external = children({"redis": {"external": {"url": "redis://r:6379/1"}}})
    assert ("Secret", "pool-redis") not in external
    annotations = external[("DaemonSet", "pool-sidecar")]["spec"]["template"]["metadata"]["annotations"]
    assert REDIS_AUTH_HASH_ANNOTATION not in annotations


@pytest.mark.parametrize("password", ["short", "a" * 20 + " b" * 4, "a" * 20 + "\nrename-command CONFIG x",
                                      "a" * 20 + '"', "a" * 513])
def test_redis_secret_refuses_a_password_redis_conf_would_misread(password: str) -> None:
    assert not usable_redis_password(password)
    with pytest.raises(ValueError):
        build_redis_secret(spec(), password)


def test_managed_redis_whose_secret_is_not_the_pools() -> None:
    # The name is taken by a Secret the pool does not own: nothing to write, no digest to roll by.
    built = {(c["kind"], c["metadata"]["name"]): c
             for c in build_children(spec(), token="t" * 43, sidecar_image="i", redis_image="r",
                                     redis_password=None)}
    assert ("Secret", "pool-redis") not in built and ("StatefulSet", "pool-redis") in built
    for key in (("StatefulSet", "pool-redis"), ("DaemonSet", "pool-sidecar")):
        annotations = built[key]["spec"]["template"]["metadata"].get("annotations") or {}
        assert REDIS_AUTH_HASH_ANNOTATION not in annotations
    assert usable_redis_password(secrets.token_urlsafe(32))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector of matchLabels only ({} selects everything)."""
    unknown = set(selector) - {"matchLabels"}
    if unknown:
        pytest.fail("selector fields this helper does not evaluate: {}".format(sorted(unknown)))
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(policy: dict[str, Any], *, to: dict[str, str], source_namespace: str, source: dict[str, str],
           port: int) -> bool:
    """Whether a NetworkPolicy lets a pod (``source``'s labels, in ``source_namespace``) reach
    ``port`` of a pod with labels ``to`` in the policy's namespace (Kubernetes semantics; a
    pod no policy selects is open, which this answers as True)."""
    spec_ = policy["spec"]
    if not _selects(spec_["podSelector"], to):
        return True
    own_namespace = policy["metadata"]["namespace"]
    namespace_labels = {NAMESPACE_NAME_LABEL: source_namespace}
    for rule in spec_.get("ingress") or ():
        if rule.get("ports") and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP"
                                         for p in rule["ports"]):
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                in_namespace = _selects(peer["namespaceSelector"], namespace_labels)
            else:
                in_namespace = source_namespace == own_namespace
            if in_namespace and _selects(peer.get("podSelector") or {}, source):
                return True
    return False


def _pod_labels(manifest: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = manifest["spec"]["template"]["metadata"]["labels"]
    return labels


def test_redis_network_policy_admits_this_pools_sidecars_and_the_operator_only() -> None:
    a = children(name="a", operator_namespace="kvpool-system")
    b = children(name="b", operator_namespace="kvpool-system")
    policy = a[("NetworkPolicy", "a-redis")]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    redis_a, redis_b = _pod_labels(a[("StatefulSet", "a-redis")]), _pod_labels(b[("StatefulSet", "b-redis")])
    sidecar_a, sidecar_b = _pod_labels(a[("DaemonSet", "a-sidecar")]), _pod_labels(b[("DaemonSet", "b-sidecar")])
    operator = {"app.kubernetes.io/name": "kvpool", "app.kubernetes.io/instance": "kvpool",
                "app.kubernetes.io/part-of": "kvpool", "app.kubernetes.io/component": "operator"}
    assert OPERATOR_POD_LABELS.items() <= operator.items()  # what the chart's pods carry (tests/helm)

    def reaches(source_ns: str, source: dict[str, str], *, to: dict[str, str] = redis_a, port: int = 6379) -> bool:
        return admits(policy, to=to, source_namespace=source_ns, source=source, port=port)

    assert _selects(policy["spec"]["podSelector"], redis_a) and not _selects(policy["spec"]["podSelector"], redis_b)
    assert reaches("ns", sidecar_a)
    assert not reaches("ns", sidecar_a, port=6380)  # the Redis port only
    assert not reaches("ns", sidecar_b)  # another pool of the same namespace
    assert not reaches("other", sidecar_a)  # a pool named "a" in another namespace
    assert not reaches("ns", {})  # any other pod
    assert not reaches("ns", redis_b)
    assert reaches("kvpool-system", operator)
    assert not reaches("ns", operator) and not reaches("tenant", operator)  # its labels, elsewhere
    assert not reaches("kvpool-system", {"app.kubernetes.io/name": "kvpool"})  # another pod of its namespace
    # Pool b's own policy admits b's sidecars and not a's.
    policy_b = b[("NetworkPolicy", "b-redis")]
    assert admits(policy_b, to=redis_b, source_namespace="ns", source=sidecar_b, port=6379)
    assert not admits(policy_b, to=redis_b, source_namespace="ns", source=sidecar_a, port=6379)
    # Where the operator runs is unknown: its labels, from any namespace.
    unknown = children(name="a")[("NetworkPolicy", "a-redis")]
    assert admits(unknown, to=redis_a, source_namespace="tenant", source=operator, port=6379)
    assert not admits(unknown, to=redis_a, source_namespace="ns", source=sidecar_b, port=6379)
    # Switched off with the pool's other policies.
    assert ("NetworkPolicy", "a-redis") not in children({"networkPolicy": {"enabled": False}}, name="a")


def test_settings_read_the_operators_namespace() -> None:
    assert OperatorSettings.from_env({"KVPOOL_OPERATOR_POD_NAMESPACE": "kvpool-system"}).index.operator_namespace \
        == "kvpool-system"
    assert OperatorSettings.from_env({}).index.operator_namespace == ""


def test_the_gpu_tier_sees_the_nodes_gpus_through_the_runtime_class() -> None:
    """GPU tier on: the NVIDIA runtime's class and its environment, never a GPU resource
    request (that would take a GPU from the engines); off: none of it."""
    pod = build_daemonset(spec({"tiers": {"gpu": {"enabled": True}}}), default_image="img",
                          configuration_hash="h")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert "nvidia.com/gpu" not in str(pod["containers"][0].get("resources"))
    own = build_daemonset(spec({"tiers": {"gpu": {"enabled": True, "runtimeClassName": ""}}}), default_image="img",
                          configuration_hash="h")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in own
    off = build_daemonset(spec({}), default_image="img", configuration_hash="h")["spec"]["template"]["spec"]
    assert "runtimeClassName" not in off
    # no GPU tier: none of the node's GPUs, even for an image that asks for all of them itself
    # (on a node whose default runtime is NVIDIA's)
    assert {e["name"]: e.get("value") for e in off["containers"][0]["env"]}["NVIDIA_VISIBLE_DEVICES"] == "void"
    for pod_spec in (pod, off):
        assert pod_spec["initContainers"][0]["env"] == [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]


@pytest.mark.parametrize(("raw", "wanted"), [
    ({}, []),  # /run/kvpool/ns.pool
    ({"tiers": {"disk": {"path": "/mnt/ns.pool", "size": "1Ti"}}}, []),
    ({"api": {"socketDir": "/var/lib/kvpool/ns.pool"}, "tiers": {"disk": {"path": "/mnt/ns.pool/",
                                                                           "size": "1Ti"}}}, []),
    # below its own directory, which its sidecar owns: a symbolic link there leads anywhere
    ({"tiers": {"disk": {"path": "/mnt/ns.pool/kv", "size": "1Ti"}}}, ["spec.tiers.disk.path (/mnt/ns.pool/kv) must be"]),
    ({"api": {"socketDir": "/run/kvpool/ns.pool/sock"}}, ["spec.api.socketDir (/run/kvpool/ns.pool/sock) must be"]),
    ({"tiers": {"disk": {"path": "/etc", "size": "1Ti"}}}, ["spec.tiers.disk.path (/etc) must be"]),
    ({"api": {"socketDir": "/run/kvpool"}}, ["spec.api.socketDir (/run/kvpool) must be"]),  # a root itself
    ({"tiers": {"disk": {"path": "/mnt/../etc/x", "size": "1Ti"}}}, ["must be a normalized path"]),
    ({"api": {"socketDir": "/run/kvpool/./a"}}, ["must be a normalized path"]),
    ({"api": {"socketDir": "/run/kvpoolx/ns.pool"}}, ["must be"]),  # a sibling of a root is not under it
    # another pool's directories: its socket's (team-b.cache) and a disk path of its own naming
    ({"tiers": {"disk": {"path": "/run/kvpool/team-b.cache", "size": "1Ti"}}}, ["the pool's own directory"]),
    ({"api": {"socketDir": "/run/kvpool/team-b.cache"}}, ["/run/kvpool/ns.pool or /var/lib/kvpool/ns.pool"]),
    ({"tiers": {"disk": {"path": "/mnt/nvme/kv", "size": "1Ti"}}}, ["must be"]),
    ({"tiers": {"disk": {"path": "/mnt/ns.poolx", "size": "1Ti"}}}, ["must be"]),  # another pool's name
    # one directory for both, spelled apart (the CRD's rule compares them as written): the disk
    # tier's 0700 would take the socket from the serving pods
    ({"api": {"socketDir": "/var/lib/kvpool/ns.pool/"}, "tiers": {"disk": {"path": "/var/lib/kvpool/ns.pool",
                                                                            "size": "1Ti"}}}, ["name one directory"]),
])
def test_host_paths_stay_in_the_pools_own_directory_under_the_operators_roots(raw: dict[str, Any],
                                                                              wanted: list[str]) -> None:
    """The init container hands a pool's host directories to the sidecar's user as root, and
    the sidecars adopt the blocks there: a pool must not name /etc, a root itself, a path
    that climbs out of a root, or another pool's directories (only ``<root>/<ns>.<name>``)."""
    found = host_path_problems(spec(raw), DEFAULT_HOST_PATH_ROOTS)
    assert len(found) == len(wanted) and all(w in f for w, f in zip(wanted, found)), found


def test_host_path_roots_come_from_the_operators_environment() -> None:
    assert OperatorSettings.from_env({}).host_path_roots == DEFAULT_HOST_PATH_ROOTS
    roots = OperatorSettings.from_env({"KVPOOL_OPERATOR_HOST_PATH_ROOTS": "/srv/kv/, /data"}).host_path_roots
    assert roots == ("/srv/kv", "/data")
    assert host_path_problems(spec({"tiers": {"disk": {"path": "/data/ns.pool", "size": "1Ti"}}}), roots) == [
        "spec.api.socketDir (/run/kvpool/ns.pool) must be the pool's own directory under one of /srv/kv, /data "
        "(the operator's KVPOOL_OPERATOR_HOST_PATH_ROOTS): /srv/kv/ns.pool or /data/ns.pool, nothing below it; "
        "the sidecars take the directory over and adopt the blocks in it"]
    with pytest.raises(SettingsError, match="HOST_PATH_ROOTS"):
        OperatorSettings.from_env({"KVPOOL_OPERATOR_HOST_PATH_ROOTS": "relative/dir"})
