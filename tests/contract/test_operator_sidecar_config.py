"""Contracts between the operator and the sidecar (DESIGN.md, Layout).

1. Every config the operator renders loads in the sidecar, and means the same.
2. What the sidecar writes to the Redis index (docs/redis-schema.md) the operator reads
   into the pool's figures, and the operator's finalizer removes all of it: on one
   redis-server, one with a password, and a 3-shard Redis Cluster.

These tests import both packages; the operator package itself never imports the sidecar.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_operator import index as operator_index
from kvpool_operator.errors import IndexUnavailableError
from kvpool_operator.manifests import (
    AUTH_DIR,
    CONFIG_DIR,
    REDIS_PASSWORD_KEY,
    REDIS_SECRET_DIR,
    TOKEN_KEY,
    SIDECAR_CONFIG_KEY,
    build_configmap,
    build_daemonset,
    build_sidecar_config,
    config_hash,
    redis_password_ref,
    redis_url,
)
from kvpool_operator.quantity import parse_bytes
from kvpool_operator.spec import DEFAULTS, PoolSpec, parse_spec
from kvpool_operator.status import pool_figures
from kvpool_sidecar.configcheck import TRANSPORTS
from kvpool_sidecar.config import (
    ApiSettings,
    PeerSettings,
    SidecarSettings,
    TenantSettings,
    load_settings,
    settings_from_mapping,
)
from kvpool_sidecar.index.redis import RedisIndex
from tests.unit.operator_support import walk_schema

REPO = Path(__file__).resolve().parents[2]

SPECS: dict[str, dict[str, Any]] = {
    "empty": {},
    "dram-only": {"tiers": {"dram": {"size": "64Mi", "pageSize": "4Ki", "populate": False}}, "maxBlockSize": "1Mi"},
    "disk": {"tiers": {"disk": {"path": "/mnt/nvme/kv", "size": "1Ti", "fsync": "always",
                                "compression": "zstd", "compressionLevel": 19,
                                "layout": "files"}}},
    "disk-off": {"tiers": {"disk": {"enabled": False, "path": "/mnt/x", "size": "1Gi"}}},
    "gpu-size": {"tiers": {"gpu": {"enabled": True, "device": 3, "size": "8Gi"}}},
    "gpu-fraction": {"tiers": {"gpu": {"enabled": True, "fraction": 0.9}}},
    "tenants": {"tenants": [{"name": "prod", "priority": 1000, "quota": "1.5Gi"}, {"name": "batch", "priority": -5},
                            {"name": "default", "quota": 4096}, {"name": "share", "quota": "12.5%"},
                            {"name": "team-a", "keySpace": "team"}, {"name": "team-b", "keySpace": "team"}]},
    "external": {"redis": {"external": {"url": "rediss://redis.infra:6380/3",
                                        "passwordSecretRef": {"name": "r", "key": "pw"}}}},
    "ports": {"api": {"socketDir": "/var/run/kv/", "httpPort": 19466}, "transport": {"port": 17470}},
    "decimal-units": {"tiers": {"dram": {"size": "2G"}}, "maxBlockSize": "100M", "logLevel": "WARNING"},
    "no-demote": {"eviction": {"policy": "lru", "demote": False}},
    "tenant-rules": {"tenants": [{"name": "default", "uids": [1000]}, {"name": "b", "gids": [7, 8]}]},
    "arc-only": {"eviction": {"policy": "prefix-arc"}},
    "rdma": {"transport": {"type": "rdma", "port": 7000}, "auth": {"secretRef": {"name": "t", "key": "k"}}},
    "cluster": {"redis": {"external": {"url": "redis://redis-0.infra:6379", "cluster": True}}},
}


def _examples() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "KVCachePool":
                found["example:" + path.stem] = doc["spec"] or {}
    return found


ALL = {**SPECS, **_examples()}


def render(spec: PoolSpec) -> tuple[dict[str, Any], SidecarSettings]:
    cm = build_configmap(spec)
    data = yaml.safe_load(cm["data"][SIDECAR_CONFIG_KEY])
    return data, settings_from_mapping(data)


@pytest.mark.parametrize("name", sorted(ALL))
def test_rendered_config_loads_in_the_sidecar(name: str) -> None:
    spec = parse_spec("pool-" + name.replace(":", "-"), "ns", ALL[name])
    _, s = render(spec)
    assert s.pool == spec.pool_id
    assert s.max_block_bytes == spec.max_block_bytes
    assert s.log_level == spec.log_level
    assert (s.dram.size_bytes, s.dram.page_bytes, s.dram.populate) == \
        (spec.dram.size_bytes, spec.dram.page_bytes, spec.dram.populate)
    if spec.disk is None:
        assert s.disk.path is None
    else:
        assert (s.disk.path, s.disk.size_bytes, s.disk.fsync, s.disk.compression) == \
            (spec.disk.path, spec.disk.size_bytes, spec.disk.fsync, spec.disk.compression)
        assert s.disk.compression_level == (spec.disk.compression_level or 1)
    assert s.gpu.enabled == (spec.gpu is not None)
    if spec.gpu is not None:
        assert s.gpu.device == spec.gpu.device
        assert s.gpu.size_bytes == (spec.gpu.size_bytes or 0)
    assert s.api.socket_path == spec.socket_path
    assert s.api.http_port == spec.http_port
    assert s.api.http_host == "0.0.0.0"  # kubelet probes reach the pod IP
    assert (s.policy.name, s.policy.demote) == (spec.eviction_policy, spec.demote)
    assert s.index.backend == "redis" and s.index.url == redis_url(spec)
    ext = spec.external_redis
    assert s.index.cluster == (ext is not None and ext.cluster)
    # the managed Redis's generated password, or the external Redis's Secret, or none
    password_ref = redis_password_ref(spec)
    assert s.index.password_file == (
        "{}/{}".format(REDIS_SECRET_DIR, password_ref[1]) if password_ref is not None else None)
    if spec.managed_redis is not None:
        assert password_ref == ("{}-redis".format(spec.name), REDIS_PASSWORD_KEY)
    elif ext is not None and ext.password is not None:
        assert password_ref == (ext.password.name, ext.password.key)
    else:
        assert password_ref is None
    assert s.peer.enabled and s.peer.host == "0.0.0.0" and s.peer.port == spec.peer_port
    assert s.peer.transport == spec.transport  # one name: the CRD's is the sidecar's
    assert s.peer.token_file == "{}/{}".format(AUTH_DIR, spec.auth.key if spec.auth else TOKEN_KEY)
    if spec.tenants:
        assert [(t.name, t.priority, t.quota_bytes, t.quota_share, t.space, t.uids, t.gids) for t in s.tenants] == \
            [(t.name, t.priority, t.quota_bytes, t.quota_share, t.key_space or t.name, t.uids, t.gids)
             for t in spec.tenants]
    else:
        assert [t.name for t in s.tenants] == ["default"]


# -- one name per setting, one default per port ------------------------------------------------
#
# The rule (kvpool_sidecar/config.py, "Names from the KVCachePool CRD"): a CRD field's section
# maps by SECTIONS, its name from camelCase to snake_case, and a size named ``size`` or ``...Size``
# ends in ``bytes`` (``size`` -> ``size_bytes``, ``pageSize`` -> ``page_bytes``). EXCEPTIONS are the
# fields whose value changes form on the way. NOT_SIDECAR fields configure the pods or the
# cluster, not the sidecar. Every field of the CRD's spec is in exactly one of these.

SECTIONS = {"": "", "tiers.dram": "dram", "tiers.disk": "disk", "tiers.gpu": "gpu", "api": "api",
            "transport": "peer", "eviction": "policy", "redis.external": "index", "tenants[]": "tenants[]",
            "kvEvents": "kv_events"}
#: CRD field -> (sidecar setting, whether the value stays the same).
EXCEPTIONS: dict[str, tuple[str, bool]] = {
    "transport.type": ("peer.transport", True),
    "eviction.policy": ("policy.name", True),
    "api.socketDir": ("api.socket_path", False),  # the directory + /kvpool.sock
    "auth.secretRef.key": ("peer.token_file", False),  # the Secret key, mounted as a file
    "redis.external.passwordSecretRef.key": ("index.password_file", False),
    "tenants[].tokenSecret.key": ("tenants[].token_file", False),
    "tenants[].quota": ("tenants[].quota_bytes", False),  # or quota_share for a percentage
    "tiers.disk.enabled": ("disk.path", False),  # false: no disk.path
    "kvEvents.port": ("kv_events.endpoint", False),  # tcp://*:PORT
    "kvEvents.replayPort": ("kv_events.replay_endpoint", False),  # tcp://*:PORT
    "kvEvents.connectTo": ("kv_events.endpoint", False),  # the address, with kv_events.connect
}
#: A second setting an exception may render into instead: a quota given as a percentage.
ALSO = {"tenants[].quota": "tenants[].quota_share", "kvEvents.connectTo": "kv_events.connect"}
NOT_SIDECAR = ("image", "imagePullPolicy", "imagePullSecrets", "nodeSelector", "affinity", "tolerations",
               "priorityClassName", "resources", "networkPolicy", "redis.managed", "auth.secretRef.name",
               "redis.external.passwordSecretRef.name", "tenants[].tokenSecret.name",
               "tiers.gpu.runtimeClassName",  # the pod's RuntimeClass, not a sidecar setting
               "api.allowedNamespaces",  # read by the CSI node plugin (kvpool_csi.pools), not the sidecar
               "kvEvents.routers")  # a NetworkPolicy rule, not a sidecar setting
#: Settings the operator sets by itself (no CRD field): the pool's id, bind addresses, the index.
OPERATOR_SET = {"pool", "api.http_host", "peer.enabled", "peer.host", "index.backend"}
#: Sections of the sidecar's settings with no CRD field, and why.
SIDECAR_ONLY: dict[str, str] = {}
#: Specs that set every field the operator renders (gpu.size and gpu.fraction exclude each other).
FULL: list[dict[str, Any]] = [
    {"logLevel": "DEBUG", "maxBlockSize": "2Mi",
     "tiers": {"dram": {"size": "2Gi", "pageSize": "128Ki", "populate": False, "cleanShare": 0.25,
                        "putWaitsForDisk": True},
               "disk": {"enabled": True, "path": "/mnt/kv", "size": "1Ti", "fsync": "always",
                        "compression": "zstd", "compressionLevel": 5, "layout": "files"},
               "gpu": {"enabled": True, "device": 1, "size": "4Gi"}},
     "api": {"socketDir": "/var/run/kv", "httpPort": 19466},
     "transport": {"type": "rdma", "port": 17470},
     "eviction": {"policy": "lru", "demote": False},
     "redis": {"external": {"url": "rediss://r.infra:6380/1", "cluster": True,
                            "passwordSecretRef": {"name": "r", "key": "pw"}}},
     "auth": {"secretRef": {"name": "peer", "key": "tok"}},
     "tenants": [{"name": "a", "priority": 5, "quota": "1Gi", "keySpace": "shared", "uids": [1000],
                  "gids": [2000], "tokenSecret": {"name": "a-token", "key": "t"}}],
     "kvEvents": {"enabled": True, "port": 15557, "replayPort": 15558, "topic": "kv@{node}", "tenants": ["a"],
                  "encoding": "array", "routers": {"podSelector": {"matchLabels": {"app": "router"}}}}},
    {"tiers": {"gpu": {"enabled": True, "fraction": 0.5}}, "tenants": [{"name": "b", "quota": "25%"}],
     "kvEvents": {"enabled": True, "connectTo": "tcp://router.infra:5557"}},
]


def _crd_spec_fields() -> dict[str, dict[str, Any]]:
    """The CRD's spec fields that hold a value (not an object of fields), by dotted path."""
    schema = yaml.safe_load((REPO / "crds" / "kvcachepools.kvpool.io.yaml").read_text())
    spec = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    fields: dict[str, dict[str, Any]] = {}
    for path, node in walk_schema(spec, ""):
        path = path.lstrip(".")
        if path.startswith(NOT_SIDECAR):
            continue
        items = node.get("items")
        has_fields = "properties" in node or (isinstance(items, dict) and "properties" in items)
        if not has_fields and not path.endswith("[]"):  # a list of ids is one setting
            fields[path] = node
    return fields


def _snake(name: str) -> str:
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()
    if snake == "size":
        return "size_bytes"
    return snake[:-len("_size")] + "_bytes" if snake.endswith("_size") else snake


def sidecar_name(crd_path: str) -> tuple[str, bool]:
    """The sidecar setting a CRD field renders into, and whether its value stays the same."""
    if crd_path in EXCEPTIONS:
        return EXCEPTIONS[crd_path]
    section, _, name = crd_path.rpartition(".")
    if section not in SECTIONS:
        raise KeyError("{}: no section rule for {!r}".format(crd_path, section))
    target = SECTIONS[section]
    return (target + "." if target else "") + _snake(name), True


def _is_setting(path: str) -> bool:
    """Whether ``path`` (``dram.size_bytes``, ``tenants[].uids``) names a field of the sidecar's settings."""
    *sections, name = path.split(".")
    cls: Any = SidecarSettings
    for section in sections:
        cls = TenantSettings if section == "tenants[]" else type(getattr(SidecarSettings(), section))
    return name in {f.name for f in dataclasses.fields(cls)}


def _values(data: Any, path: str) -> list[Any]:
    """Every value at dotted ``path`` in ``data`` (``[]`` steps into each list item)."""
    found = [data]
    for part in path.split("."):
        key, many = (part[:-2], True) if part.endswith("[]") else (part, False)
        step = [d[key] for d in found if isinstance(d, dict) and key in d]
        found = [x for v in step for x in v] if many else step
    return found


def test_every_crd_field_maps_to_a_sidecar_setting_by_the_documented_rule() -> None:
    """Each CRD field the operator renders has the sidecar setting the naming rule gives it."""
    unmapped = {path: sidecar_name(path)[0] for path in _crd_spec_fields()
                if not _is_setting(sidecar_name(path)[0])}
    assert unmapped == {}, "CRD field -> no such sidecar setting (rename one of the two)"


def test_the_operator_renders_each_field_into_that_setting_with_the_same_value() -> None:
    fields = _crd_spec_fields()
    rendered = [build_sidecar_config(parse_spec("full", "ns", raw)) for raw in FULL]
    for raw, config in zip(FULL, rendered):
        settings_from_mapping(config)  # and it loads
    for path in fields:
        target, same = sidecar_name(path)
        pairs = [(_values(raw, path), _values(config, target)) for raw, config in zip(FULL, rendered)
                 if _values(raw, path)]
        assert pairs, "{}: set it in one of FULL so that its rendering is checked".format(path)
        for given, got in pairs:
            assert got or path in ALSO, "{} is set, yet the rendered config has no {}".format(path, target)
            if same:
                want = [parse_bytes(v, path) for v in given] if target.endswith("_bytes") else given
                assert got == want, (path, target)
    if "tenants[].quota" in fields:
        assert [_values(config, ALSO["tenants[].quota"]) for config in rendered] == [[], [0.25]]
    targets = {t.replace("[]", "") for t in [sidecar_name(p)[0] for p in fields] + list(ALSO.values())}
    targets |= OPERATOR_SET
    extra = {"{}.{}".format(k, sub) if isinstance(v, dict) else k
             for config in rendered for k, v in config.items() if k != "tenants"
             for sub in (v if isinstance(v, dict) else [None])} - targets
    extra |= {"tenants." + k for config in rendered for t in config.get("tenants", []) for k in t} - targets
    assert extra == set(), "rendered settings no CRD field maps to (add the field or OPERATOR_SET)"


def test_every_sidecar_section_has_a_crd_section_or_says_why_not() -> None:
    sections = {f.name for f in dataclasses.fields(SidecarSettings)
                if dataclasses.is_dataclass(f.default) or f.name == "tenants"}
    from_crd = {target.rstrip("[]") for target in SECTIONS.values() if target}
    assert sections - from_crd == set(SIDECAR_ONLY)
    rendered = [build_sidecar_config(parse_spec("full", "ns", raw)) for raw in FULL]
    assert not any(name in config for config in rendered for name in SIDECAR_ONLY)


@pytest.mark.parametrize("path", ["transport.type", "eviction.policy", "tiers.disk.fsync",
                                  "tiers.disk.compression", "tiers.disk.layout", "logLevel"])
def test_every_crd_enum_value_is_the_sidecars_name_for_it(path: str) -> None:
    """One name per choice: each value the CRD allows reaches the sidecar unchanged, and it loads."""
    from kvpool_sidecar.policy import POLICIES

    node = _crd_spec_fields()[path]
    target, same = sidecar_name(path)
    assert same
    for value in node["enum"]:
        raw: dict[str, Any] = {}
        cursor = raw
        *parents, leaf = path.split(".")
        for part in parents:
            cursor = cursor.setdefault(part, {})
        cursor[leaf] = value
        if path.startswith("tiers.disk"):
            raw["tiers"]["disk"].update(path="/mnt/kv", size="1Gi")
        config = build_sidecar_config(parse_spec("enum", "ns", raw))
        assert _values(config, target) == [value], (path, value)
        settings = settings_from_mapping(config)
        if path == "eviction.policy":
            assert settings.policy.name in POLICIES
    if path == "transport.type":
        assert tuple(node["enum"]) == TRANSPORTS
    if path == "eviction.policy":
        assert sorted(node["enum"]) == sorted(POLICIES)  # every policy the sidecar has can be asked for


def test_one_default_per_port_in_the_crd_operator_chart_image_and_sidecar() -> None:
    fields = _crd_spec_fields()
    peer, http = fields["transport.port"]["default"], fields["api.httpPort"]["default"]
    assert peer == DEFAULTS["transport.port"] == PeerSettings().port == parse_spec("p", "ns", {}).peer_port
    assert http == DEFAULTS["api.httpPort"] == ApiSettings().http_port == parse_spec("p", "ns", {}).http_port
    assert peer != http
    chart_crd = REPO / "charts" / "kvpool" / "crds" / "kvcachepools.kvpool.io.yaml"
    assert chart_crd.read_bytes() == (REPO / "crds" / "kvcachepools.kvpool.io.yaml").read_bytes()
    exposed = re.search(r"^EXPOSE (.+)$", (REPO / "docker" / "sidecar.Dockerfile").read_text(), re.M)
    assert exposed is not None and set(exposed.group(1).split()) == {str(peer), str(http)}
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(example.read_text()):
            port = ((doc or {}).get("spec") or {}).get("transport", {}).get("port") \
                if (doc or {}).get("kind") == "KVCachePool" else None
            assert port in (None, peer), "{} spells out a peer port other than the default".format(example.name)


def test_socket_access_needs_the_group_the_docs_name() -> None:
    """The socket's directory is 0750 and the socket 0660 (the sidecar's default mode), both the
    sidecar's user's and group's (10001 in the DaemonSet), so a serving pod needs that group:
    the README, docs/security.md and the chart's NOTES say so, with the same number."""
    assert ApiSettings().socket_mode == 0o660
    spec = parse_spec("p", "ns", {})
    pod = build_daemonset(spec, default_image="img", configuration_hash="h")["spec"]["template"]["spec"]
    group = pod["containers"][0]["securityContext"]["runAsGroup"]
    assert "socket_mode" not in build_sidecar_config(spec)["api"]  # so the sidecar's 0660 holds
    (prepare,) = pod["initContainers"]
    assert "chown {0}:{0}".format(group) in prepare["command"][2] and 'chmod 0750 "$1"' in prepare["command"][2]
    assert spec.socket_dir in prepare["command"]
    for doc in ("README.md", "docs/security.md", "charts/kvpool/templates/NOTES.txt"):
        assert "supplementalGroups: [{}]".format(group) in (REPO / doc).read_text(), doc


@pytest.mark.skipif(os.geteuid() != 0, reason="the script chowns to the sidecar's user: needs root")
def test_prepare_dirs_gives_the_socket_directory_0750_and_the_disk_tier_0700(tmp_path: Path) -> None:
    """Run as the init container runs it (sh, the host directories as arguments): the group
    reaches the socket but cannot swap it; the disk tier is the sidecar's alone."""
    spec = parse_spec("p", "ns", SPECS["disk"])
    pod = build_daemonset(spec, default_image="img", configuration_hash="h")["spec"]["template"]["spec"]
    (prepare,) = pod["initContainers"]
    args = prepare["command"][4:]
    assert args == [spec.socket_dir, spec.disk.path]
    dirs = [tmp_path / "socket", tmp_path / "disk"]
    for d in dirs:
        d.mkdir(mode=0o777)
    subprocess.run([*prepare["command"][:4], *map(str, dirs)], check=True)
    assert [(stat.S_IMODE(d.stat().st_mode), d.stat().st_uid) for d in dirs] == [(0o750, 10001), (0o700, 10001)]


def test_the_sidecar_reads_the_file_the_daemonset_points_at(tmp_path: Path) -> None:
    """Mount path + key from the DaemonSet, node name from the env it sets."""
    spec = parse_spec("p", "ns", SPECS["disk"])
    cm = build_configmap(spec)
    ds = build_daemonset(spec, default_image="img", configuration_hash=config_hash(cm))
    container = ds["spec"]["template"]["spec"]["containers"][0]
    config_arg = container["command"][container["command"].index("--config") + 1]
    assert config_arg == "{}/{}".format(CONFIG_DIR, SIDECAR_CONFIG_KEY)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert config_arg.startswith(mount["mountPath"] + "/")
    # Write the ConfigMap's files as the kubelet would, then load like the sidecar does.
    root = tmp_path / mount["mountPath"].lstrip("/")
    root.mkdir(parents=True)
    for key, text in cm["data"].items():
        (root / key).write_text(text)
    env = {e["name"]: e for e in container["env"]}
    assert env["KVPOOL_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The kubelet expands $(KVPOOL_POD_IP) in KVPOOL_PEER_ADVERTISE (defined after it).
    assert list(env).index("KVPOOL_POD_IP") < list(env).index("KVPOOL_PEER_ADVERTISE")
    advertise = env["KVPOOL_PEER_ADVERTISE"]["value"].replace("$(KVPOOL_POD_IP)", "10.1.2.3")
    s = load_settings(root / SIDECAR_CONFIG_KEY, env={"KVPOOL_NODE_NAME": "gpu-node-7",
                                                      "KVPOOL_PEER_ADVERTISE": advertise})
    assert s.node_name == "gpu-node-7"
    assert s.peer.advertise == "10.1.2.3:{}".format(s.peer.port)
    peer_port = next(p for p in container["ports"] if p["name"] == "peer")["containerPort"]
    assert s.peer.port == peer_port
    # The token file is in the mounted auth Secret.
    auth = next(m for m in container["volumeMounts"] if m["name"] == "auth")
    assert s.peer.token_file is not None and Path(s.peer.token_file).parent == Path(auth["mountPath"])
    assert s.disk.path == "/mnt/nvme/kv"
    # The disk path in the config is where the DaemonSet mounts the host directory.
    assert any(m["mountPath"] == s.disk.path for m in container["volumeMounts"])
    # The socket lives in the host directory serving pods mount.
    socket_mount = next(m for m in container["volumeMounts"] if m["name"] == "socket")
    assert Path(s.api.socket_path).parent == Path(socket_mount["mountPath"])
    # The probes hit the port the sidecar serves /healthz on.
    http_port = next(p for p in container["ports"] if p["name"] == "http")["containerPort"]
    assert s.api.http_port == http_port and container["readinessProbe"]["httpGet"]["port"] == "http"


def test_tenant_rules_reach_the_sidecar_with_their_token_mounted(tmp_path: Path) -> None:
    """uids, gids and a token Secret in the pool's spec: the sidecar admits by them, and
    the token file it reads is the Secret key the DaemonSet mounts."""
    spec = parse_spec("p", "ns", {"dram": {"size": "1Gi"}, "tenants": [
        {"name": "default", "uids": [1000, 1001]},
        {"name": "team", "gids": [2000], "tokenSecret": {"name": "team-token", "key": "t"}},
        {"name": "open"}]})
    cm = build_configmap(spec)
    ds = build_daemonset(spec, default_image="img", configuration_hash=config_hash(cm))
    pod = ds["spec"]["template"]["spec"]
    data, s = render(spec)
    team = next(t for t in s.tenants if t.name == "team")
    assert team.gids == (2000,) and team.token_file is not None and not team.uids
    mount = next(m for m in pod["containers"][0]["volumeMounts"]
                 if team.token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] and volume["secret"]["secretName"] == "team-token"
    assert volume["secret"]["items"] == [{"key": "t", "path": Path(team.token_file).name}]
    # as the kubelet would lay the Secret out: the sidecar's access rules load from it
    from kvpool_sidecar.tenancy import Credentials, TenantAccess

    local = tmp_path / "team-token"
    local.write_bytes(b"a-team-token-of-enough-bytes")
    data["tenants"][1]["token_file"] = str(local)
    access = TenantAccess.from_settings(settings_from_mapping(data).tenants)
    assert access.admits("team", b"a-team-token-of-enough-bytes", None)
    assert access.admits("team", None, Credentials(1, 5, 2000)) and not access.admits("team", None,
                                                                                      Credentials(1, 5, 5))
    assert access.admits("default", None, Credentials(1, 1001, 5)) and not access.admits("default", None, None)
    assert access.admits("open", None, Credentials(1, 4242, 4242))


# -- the index: the sidecar writes, the operator reads and purges ----------------------------

TIERS_A = {"dram": {"capacity_bytes": 1 << 30, "used_bytes": 1 << 20, "blocks": 4},
           "disk": {"capacity_bytes": 10 << 30, "used_bytes": 3 << 20, "blocks": 12}}
TIERS_B = {"dram": {"capacity_bytes": 1 << 30, "used_bytes": 0, "blocks": 0}}


async def _sidecar_writes(url: str, pool_id: str, **settings: Any) -> None:
    """Two sidecars heartbeat, one publishes blocks; one dead node left registered."""
    index = RedisIndex.from_url(url, pool=pool_id, **settings)
    try:
        await index.heartbeat("node-a", "10.0.0.1:7470", TIERS_A, 9, 1, [], ttl_s=30)
        await index.heartbeat("node-b", "10.0.0.2:7470", TIERS_B, 0, 2, [], ttl_s=30)
        await index.heartbeat("node-dead", "10.0.0.3:7470", TIERS_B, 5, 5, [], ttl_s=0.05)
    finally:
        await index.close()


def _raw(url: str, cluster: bool, password: str | None) -> Any:
    import redis

    if cluster:
        return redis.RedisCluster.from_url(url, password=password, decode_responses=True)
    return redis.Redis.from_url(url, password=password, decode_responses=True)


def _check_index_contract(url: str, *, cluster: bool = False, password: str | None = None) -> None:
    import asyncio
    import time

    pool_id = "ns.contract-{}".format(int(time.time() * 1e6))
    extra: dict[str, Any] = {"cluster": cluster}
    if password:
        extra["password"] = password
    asyncio.run(_sidecar_writes(url, pool_id, **extra))
    raw = _raw(url, cluster, password)
    # Published blocks, as the sidecar's schema has them (a 96-hex key per block).
    for i in range(20):
        raw.sadd("kvp:{}:blk:{:096x}".format(pool_id, i), "node-a@dram")
        raw.sadd("kvp:{}:inv:node-a".format(pool_id), "{:096x}".format(i))
    neighbour = "kvp:{}x:nodes".format(pool_id)  # another pool whose name extends this one
    raw.sadd(neighbour, "n")
    time.sleep(0.1)  # node-dead's hash expires
    before = len(list(raw.scan_iter(match="kvp:{}:*".format(pool_id))))
    assert before == 2 + 1 + 20 + 1  # live node hashes, the nodes set, blocks, node-a's inventory
    # bytes that are not UTF-8, as any writer to Redis may leave: a key, a registered name, a
    # field of a live node's hash (a decoding client had raised past the Redis errors: the
    # status stopped and the pool's deletion never ended)
    raw.set("kvp:{}:".format(pool_id).encode() + b"\xff", b"\xfe")
    raw.sadd("kvp:{}:nodes".format(pool_id), b"\xffname")
    raw.hset("kvp:{}:node:node-b".format(pool_id), b"\xff", b"\xfe")
    before += 1
    with operator_index.connect(url, password, timeout_s=3, cluster=cluster) as client:
        snapshot = operator_index.read_snapshot(client, pool_id, url)
        assert snapshot.registered == {"node-a", "node-b", "node-dead"}
        assert set(snapshot.live) == {"node-a", "node-b"}
        figures = pool_figures(snapshot.live)
        assert figures.live == 2
        assert figures.tiers["dram"].capacity_bytes == 2 << 30 and figures.tiers["dram"].blocks == 4
        assert figures.tiers["disk"].used_bytes == 3 << 20
        assert (figures.hits, figures.misses) == (9, 3)
        removed = operator_index.purge(client, pool_id, url)
    assert removed == before
    assert list(raw.scan_iter(match="kvp:{}:*".format(pool_id))) == []
    assert raw.exists(neighbour) == 1
    raw.delete(neighbour)
    raw.close()


def test_index_contract_single_server(redis_server: Any) -> None:
    _check_index_contract(redis_server.url)


def test_index_contract_with_password(redis_factory: Any) -> None:
    server = redis_factory("--requirepass", "s3cret-pw")
    _check_index_contract(server.url, password="s3cret-pw")
    with operator_index.connect(server.url, "wrong", timeout_s=2) as client:
        with pytest.raises(IndexUnavailableError) as info:
            operator_index.ping(client, server.url)
    assert info.value.reason == "AuthenticationFailed"


def test_index_contract_redis_cluster(redis_cluster: Any) -> None:
    _check_index_contract(redis_cluster.url, cluster=True)


# -- the managed Redis's password: Redis requires it, the sidecar presents it --------------------


def _lay_out_secret(root: Path, secret: dict[str, Any], mount: str, key: str) -> Path:
    """Write one key of a Secret where the kubelet would mount it under ``root``."""
    import base64

    path = root / mount.lstrip("/") / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(base64.b64decode(secret["data"][key]))
    return path


def test_the_sidecar_authenticates_to_the_managed_redis_with_the_pools_password(
        redis_factory: Any, sidecar_factory: Any, tmp_path: Path) -> None:
    """redis-server reads the redis.conf of the pool's Secret, as the managed Redis does; a real
    sidecar with the rendered index settings reads the password from the file the DaemonSet
    mounts, and registers. With a wrong password it runs on and says why, never hangs."""
    import base64
    import secrets

    import redis as redis_py

    from kvpool_operator.manifests import REDIS_CONFIG_KEY, build_children
    from tests.integration.support import wait_until

    spec = parse_spec("auth", "ns", {})
    password = secrets.token_urlsafe(32)
    built = {(c["kind"], c["metadata"]["name"]): c
             for c in build_children(spec, token="t" * 43, sidecar_image="img", redis_image="redis",
                                     redis_password=password)}
    secret = built[("Secret", "auth-redis")]
    sts_pod = built[("StatefulSet", "auth-redis")]["spec"]["template"]["spec"]
    conf_mount = next(m for m in sts_pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    conf = _lay_out_secret(tmp_path / "redis-pod", secret, conf_mount["mountPath"], REDIS_CONFIG_KEY)
    assert sts_pod["containers"][0]["args"][0] == "{}/{}".format(conf_mount["mountPath"], REDIS_CONFIG_KEY)
    server = redis_factory(config=conf)

    plain = redis_py.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
    with pytest.raises(redis_py.AuthenticationError):  # NOAUTH: the password is required
        plain.set("k", "v")
    plain.close()

    config = yaml.safe_load(built[("ConfigMap", "auth-config")]["data"][SIDECAR_CONFIG_KEY])
    ds_pod = built[("DaemonSet", "auth-sidecar")]["spec"]["template"]["spec"]
    pw_mount = next(m for m in ds_pod["containers"][0]["volumeMounts"] if m["name"] == "redis-password")
    assert config["index"]["password_file"].startswith(pw_mount["mountPath"] + "/")
    key = Path(config["index"]["password_file"]).name
    (pw_volume,) = [v for v in ds_pod["volumes"] if v["name"] == pw_mount["name"]]
    assert pw_volume["secret"]["secretName"] == secret["metadata"]["name"]
    pw_file = _lay_out_secret(tmp_path / "sidecar-pod", secret, pw_mount["mountPath"], key)

    def index_settings(path: Path) -> dict[str, Any]:
        return {**config["index"], "url": server.url, "password_file": str(path), "heartbeat_s": 0.5}

    good = sidecar_factory({"node_name": "good", "pool": spec.pool_id, "index": index_settings(pw_file)})
    client = redis_py.Redis(host="127.0.0.1", port=server.port, password=password, decode_responses=True,
                            socket_timeout=5)
    node_key = "kvp:{}:node:good".format(spec.pool_id)
    wait_until(lambda: client.exists(node_key), "the sidecar's heartbeat in the password-protected Redis")
    assert "AuthenticationError" not in good.log_tail(200)

    wrong_file = tmp_path / "wrong-password"
    wrong_file.write_text(base64.b64encode(b"not-the-password-at-all").decode())
    bad = sidecar_factory({"node_name": "bad", "pool": spec.pool_id, "index": index_settings(wrong_file)})
    line = wait_until(lambda: next((ln for ln in bad.log_tail(200).splitlines() if "AuthenticationError" in ln),
                                   None), "the sidecar to report the refused password")
    assert "index unreachable" in line or "heartbeat failed" in line, line
    assert wrong_file.read_text() not in bad.log_tail(200) and password not in bad.log_tail(200)
    assert bad.proc is not None and bad.proc.poll() is None  # still serving its node, not hung
    assert not client.exists("kvp:{}:node:bad".format(spec.pool_id))
    client.close()
