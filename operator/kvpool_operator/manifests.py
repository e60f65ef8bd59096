"""Pure manifest builders: a pool's spec in, Kubernetes objects (plain dicts) out.

Nothing here talks to the API or reads settings from the environment, so every
builder is tested as a function. Owner references are added by the caller
(``kopf.append_owner_reference``: never the pool's labels, which ``kopf.adopt`` would copy).
Children of pool ``P``:

=====================  ==================  ==========================================
kind                   name                content
=====================  ==================  ==========================================
ConfigMap              ``P-config``        ``sidecar.yaml`` (the sidecar's config file)
Secret                 ``P-auth``          generated peer token (unless spec.auth names one)
DaemonSet              ``P-sidecar``       one sidecar per selected node
Service (headless)     ``P-sidecar``       peer and HTTP ports of every sidecar
NetworkPolicy          ``P-sidecar``       peer port open to the pool's own pods only
StatefulSet, Service,  ``P-redis``         managed Redis (only with spec.redis.managed); the
Secret, NetworkPolicy                      Secret holds its generated password
=====================  ==================  ==========================================

The managed Redis requires its password (``requirepass`` in a config file from the
Secret: never on a command line or in an environment); the sidecars read it from the
same Secret (``index.password_file``), and its NetworkPolicy admits the pool's own
sidecars and the operator's pods only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvpool_operator.spec import KvEvents, PoolSpec

Manifest = dict[str, Any]

GROUP = "kvpool.io"
VERSION = "v1alpha1"
CONFIG_HASH_ANNOTATION = "kvpool.io/config-hash"
POOL_LABEL = "kvpool.io/pool"
SIDECAR_CONFIG_KEY = "sidecar.yaml"
TOKEN_KEY = "token"
CONFIG_DIR = "/etc/kvpool/config"
AUTH_DIR = "/etc/kvpool/auth"
#: Each tenant's token Secret is mounted in a directory of its own under this one.
TENANTS_DIR = "/etc/kvpool/tenants"
#: The sidecar image's user and group (docker/sidecar.Dockerfile). The socket's directory
#: (0750, made so by ``prepare-dirs``) and the socket (``api.socket_mode`` 0660) belong to
#: them: serving pods that use the socket join the group with ``supplementalGroups: [10001]``.
SIDECAR_UID = 10001
SIDECAR_GID = 10001
#: Where the sidecar finds the index password (one key of a Secret).
REDIS_SECRET_DIR = "/etc/kvpool/redis"
REDIS_PORT = 6379
#: Keys of the managed Redis's Secret: the password (the sidecars and the operator read it)
#: and a ``redis.conf`` with ``requirepass`` (the Redis container reads it at start).
REDIS_PASSWORD_KEY = "password"
REDIS_CONFIG_KEY = "redis.conf"
#: Where the Redis container mounts its ``redis.conf``.
REDIS_CONFIG_DIR = "/etc/kvpool/redis-config"
#: A digest of the managed Redis's password on the pod templates of Redis and the sidecars:
#: a new password (the Secret was deleted and generated again) restarts both.
REDIS_AUTH_HASH_ANNOTATION = "kvpool.io/redis-auth-hash"
#: What a managed Redis password may hold: it goes into ``redis.conf`` unquoted.
_REDIS_PASSWORD = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
#: Labels of the operator's own pods (the chart's, whatever its name or release); the managed
#: Redis admits them from the operator's namespace (``build_redis_network_policy``).
OPERATOR_POD_LABELS: Mapping[str, str] = {"app.kubernetes.io/part-of": "kvpool",
                                          "app.kubernetes.io/component": "operator"}
#: The label the API server puts on every namespace (Kubernetes 1.21+): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class ChildNames:
    """Names of a pool's children (derived from the pool's name only)."""

    config: str
    auth: str
    sidecar: str
    redis: str


def names(pool: str) -> ChildNames:
    return ChildNames(config=pool + "-config", auth=pool + "-auth", sidecar=pool + "-sidecar",
                      redis=pool + "-redis")


def selector_labels(spec: PoolSpec, component: str) -> dict[str, str]:
    """The immutable labels selecting a component's pods (``sidecar`` or ``redis``)."""
    return {
        "app.kubernetes.io/name": "kvpool",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def labels(spec: PoolSpec, component: str) -> dict[str, str]:
    return {**selector_labels(spec, component), "app.kubernetes.io/managed-by": "kvpool-operator",
            POOL_LABEL: spec.name}


def _meta(spec: PoolSpec, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component)}


def redis_url(spec: PoolSpec) -> str:
    """The index URL the sidecars and the operator use (no credentials in it)."""
    if spec.external_redis is not None:
        return spec.external_redis.url
    return "redis://{}.{}.svc:{}/0".format(names(spec.name).redis, spec.namespace, REDIS_PORT)


def redis_password_ref(spec: PoolSpec) -> tuple[str, str] | None:
    """(Secret name, key) of the index password: the managed Redis's generated one, the
    external Redis's ``passwordSecretRef``, or None (an external Redis without one)."""
    if spec.managed_redis is not None:
        return names(spec.name).redis, REDIS_PASSWORD_KEY
    if spec.external_redis is not None and spec.external_redis.password is not None:
        return spec.external_redis.password.name, spec.external_redis.password.key
    return None


def usable_redis_password(password: str) -> bool:
    """True when ``password`` may be a managed Redis's: 16 to 512 URL-safe or base64 characters
    (``secrets.token_urlsafe(32)`` is), nothing a ``redis.conf`` line would read otherwise."""
    return _REDIS_PASSWORD.fullmatch(password) is not None


def redis_auth_hash(password: str) -> str:
    """A digest of the managed Redis's password for :data:`REDIS_AUTH_HASH_ANNOTATION`.

    One-way, and of a random 256-bit password: it tells only whether the password changed.
    """
    return hashlib.sha256(b"kvpool-redis-auth\0" + password.encode()).hexdigest()[:32]


def auth_secret_ref(spec: PoolSpec) -> tuple[str, str]:
    """(Secret name, key) of the peer token: the user's, or the generated one."""
    if spec.auth is not None:
        return spec.auth.name, spec.auth.key
    return names(spec.name).auth, TOKEN_KEY


# -- configuration ------------------------------------------------------------------


def build_sidecar_config(spec: PoolSpec) -> dict[str, Any]:
    """The sidecar's config file (``kvpool_sidecar.config`` format).

    Names follow the rules in that module's docstring: the CRD's words in snake_case
    (``maxBlockSize`` -> ``max_block_bytes``, ``transport.type: rdma`` -> ``peer.transport:
    rdma``); the contract test checks every field rendered here against them.

    Left to the environment the DaemonSet sets: ``node_name`` (``KVPOOL_NODE_NAME``, the
    node's name) and ``peer.advertise`` (``KVPOOL_PEER_ADVERTISE``, the pod IP and port).
    Secrets are files: ``peer.token_file`` and ``index.password_file``.
    """
    _, token_key = auth_secret_ref(spec)
    index: dict[str, Any] = {"backend": "redis", "url": redis_url(spec)}
    if spec.external_redis is not None and spec.external_redis.cluster:
        index["cluster"] = True
    password_ref = redis_password_ref(spec)
    if password_ref is not None:
        index["password_file"] = "{}/{}".format(REDIS_SECRET_DIR, password_ref[1])
    config: dict[str, Any] = {
        "pool": spec.pool_id,
        "max_block_bytes": spec.max_block_bytes,
        "log_level": spec.log_level,
        "dram": {"size_bytes": spec.dram.size_bytes, "page_bytes": spec.dram.page_bytes,
                 "populate": spec.dram.populate, "clean_share": spec.dram.clean_share,
                 "put_waits_for_disk": spec.dram.put_waits_for_disk},
        "api": {"socket_path": spec.socket_path, "http_host": "0.0.0.0", "http_port": spec.http_port},
        "policy": {"name": spec.eviction_policy, "demote": spec.demote},
        "index": index,
        "peer": {"enabled": True, "host": "0.0.0.0", "port": spec.peer_port,
                 "transport": spec.transport,
                 "token_file": "{}/{}".format(AUTH_DIR, token_key)},
    }
    if spec.disk is not None:
        disk: dict[str, Any] = {"path": spec.disk.path, "size_bytes": spec.disk.size_bytes,
                                "fsync": spec.disk.fsync, "compression": spec.disk.compression,
                                "layout": spec.disk.layout}
        if spec.disk.compression_level is not None:
            disk["compression_level"] = spec.disk.compression_level
        config["disk"] = disk
    if spec.gpu is not None:
        gpu: dict[str, Any] = {"enabled": True, "device": spec.gpu.device}
        if spec.gpu.size_bytes is not None:
            gpu["size_bytes"] = spec.gpu.size_bytes
        if spec.gpu.fraction is not None:
            gpu["fraction"] = spec.gpu.fraction
        config["gpu"] = gpu
    else:  # the sidecar turns the GPU tier on wherever CUDA is: a pool that says off means off
        config["gpu"] = {"enabled": False}
    if spec.kv_events is not None:
        config["kv_events"] = _kv_events_config(spec.kv_events)
    if spec.tenants:
        config["tenants"] = [
            {"name": t.name, "priority": t.priority,
             **({"quota_bytes": t.quota_bytes} if t.quota_bytes is not None else {}),
             **({"quota_share": t.quota_share} if t.quota_share is not None else {}),
             **({"key_space": t.key_space} if t.key_space is not None else {}),
             **({"uids": list(t.uids)} if t.uids else {}),
             **({"gids": list(t.gids)} if t.gids else {}),
             **({"token_file": "{}/{}/{}".format(TENANTS_DIR, t.name, t.token_secret.key)}
                if t.token_secret is not None else {})}
            for t in spec.tenants
        ]
    return config


def _kv_events_config(k: KvEvents) -> dict[str, Any]:
    """``kv_events``: bound on every interface of the pod (the NetworkPolicy admits the
    routers only), or connected to the router at ``connectTo``."""
    config: dict[str, Any] = {"enabled": True, "topic": k.topic, "encoding": k.encoding, "tenants": list(k.tenants)}
    if k.connect_to is not None:
        config.update(endpoint=k.connect_to, connect=True)
    else:
        config["endpoint"] = "tcp://*:{}".format(k.port)
    if k.replay_port is not None:
        config["replay_endpoint"] = "tcp://*:{}".format(k.replay_port)
    return config


def _kv_event_ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The ports the sidecar binds for KV events, by name."""
    k = spec.kv_events
    if k is None:
        return []
    ports = [] if k.connect_to is not None else [("kv-events", k.port)]
    return ports + ([("kv-replay", k.replay_port)] if k.replay_port is not None else [])


def _dump(data: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(data), sort_keys=True, default_flow_style=False)


def build_configmap(spec: PoolSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec, names(spec.name).config, "sidecar"),
        "data": {
            SIDECAR_CONFIG_KEY: _dump(build_sidecar_config(spec)),
        },
    }


def config_hash(configmap: Mapping[str, Any]) -> str:
    """A stable digest of a ConfigMap's data: on the pod template, so a change rolls the pods."""
    canonical = json.dumps(configmap.get("data", {}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def build_redis_secret(spec: PoolSpec, password: str) -> Manifest:
    """The managed Redis's password, and the ``redis.conf`` that requires it (the caller
    keeps an existing password: it is generated once per pool)."""
    if not usable_redis_password(password):
        raise ValueError("build_redis_secret: the password must be 16 to 512 characters of "
                         "[A-Za-z0-9._~+/=-]")
    conf = "requirepass {}\n".format(password)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, names(spec.name).redis, "redis"),
        "type": "Opaque",
        "data": {REDIS_PASSWORD_KEY: base64.b64encode(password.encode()).decode(),
                 REDIS_CONFIG_KEY: base64.b64encode(conf.encode()).decode()},
    }


def build_auth_secret(spec: PoolSpec, token: str) -> Manifest:
    """The generated peer token (the caller keeps an existing token: no churn)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(spec, names(spec.name).auth, "sidecar"),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


# -- sidecars -------------------------------------------------------------------------


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def build_daemonset(spec: PoolSpec, *, default_image: str, configuration_hash: str,
                    redis_auth: str | None = None) -> Manifest:
    """The sidecars: one per selected node; no privilege and no host namespaces, but hostPath
    volumes (the socket directory, the disk tier), which Pod Security "baseline" refuses: the
    pool's namespace must allow them (README "Serving pods" says which level and why).

    Host paths: the socket directory (shared with serving pods) and the disk tier. The one
    step that runs as root (``prepare-dirs``, which hands them to the sidecar's user) runs
    ``default_image``, the operator's own sidecar image, whatever ``spec.image`` names: whoever
    may create a pool chooses what runs as the sidecar's user, never what runs as root.
    ``redis_auth``: :func:`redis_auth_hash` of the managed Redis's password, so that a new
    password restarts the sidecars (they read it once, at start).
    """
    n = names(spec.name)
    token_secret, _ = auth_secret_ref(spec)
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True},
        {"name": "socket", "mountPath": spec.socket_dir},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": n.config}},
        {"name": "auth", "secret": {"secretName": token_secret, "defaultMode": 0o400}},
        {"name": "socket", "hostPath": {"path": spec.socket_dir, "type": "DirectoryOrCreate"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}},
    ]
    for i, t in enumerate(spec.tenants):
        if t.token_secret is not None:  # each tenant's token, readable by the sidecar alone
            mounts.append({"name": "tenant-{}".format(i), "mountPath": "{}/{}".format(TENANTS_DIR, t.name),
                           "readOnly": True})
            volumes.append({"name": "tenant-{}".format(i), "secret": {
                "secretName": t.token_secret.name, "defaultMode": 0o400,
                "items": [{"key": t.token_secret.key, "path": t.token_secret.key}]}})
    if spec.disk is not None:
        mounts.append({"name": "disk", "mountPath": spec.disk.path})
        volumes.append({"name": "disk", "hostPath": {"path": spec.disk.path, "type": "DirectoryOrCreate"}})
    password_ref = redis_password_ref(spec)
    if password_ref is not None:
        secret_name, secret_key = password_ref
        mounts.append({"name": "redis-password", "mountPath": REDIS_SECRET_DIR, "readOnly": True})
        volumes.append({"name": "redis-password", "secret": {
            "secretName": secret_name, "defaultMode": 0o400,
            "items": [{"key": secret_key, "path": secret_key}]}})
    container: dict[str, Any] = {
        "name": "sidecar",
        "image": spec.image or default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["kvpool", "sidecar", "--config", "{}/{}".format(CONFIG_DIR, SIDECAR_CONFIG_KEY)],
        "env": [
            {"name": "KVPOOL_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "KVPOOL_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # Peers reach this sidecar at its pod IP (the kubelet expands $(VAR) references).
            {"name": "KVPOOL_PEER_ADVERTISE", "value": "$(KVPOOL_POD_IP):{}".format(spec.peer_port)},
        ],
        "ports": [
            {"name": "peer", "containerPort": spec.peer_port, "protocol": "TCP"},
            {"name": "http", "containerPort": spec.http_port, "protocol": "TCP"},
            *({"name": name, "containerPort": port, "protocol": "TCP"} for name, port in _kv_event_ports(spec)),
        ],
        "startupProbe": _probe("/healthz", 5, 120),  # populating a large arena takes a while
        "readinessProbe": _probe("/healthz", 5, 3),
        "livenessProbe": _probe("/healthz", 10, 6),
        "resources": dict(spec.resources),
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": SIDECAR_UID,
            "runAsGroup": SIDECAR_GID,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    # hostPath directories are created by the kubelet as root: hand them to the sidecar's
    # user (the only step that runs as root, with nothing but CHOWN and FOWNER, and in the
    # operator's image, not the pool's: see the docstring). The socket's
    # directory is 0750: its group (the serving pods) reaches the socket but cannot replace
    # it with one of its own; the disk tier's is the sidecar's alone (0700).
    modes = {"socket": "0750", "disk": "0700"}
    host_dirs = [(m["mountPath"], modes[m["name"]]) for m in mounts if m["name"] in modes]
    script = 'chown {}:{} "$@"'.format(SIDECAR_UID, SIDECAR_GID) + "".join(
        ' && chmod {} "${}"'.format(mode, i) for i, (_, mode) in enumerate(host_dirs, start=1))
    prepare: dict[str, Any] = {
        "name": "prepare-dirs",
        "image": default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["sh", "-c", script, "prepare-dirs", *(path for path, _ in host_dirs)],
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": False,
            "runAsUser": 0,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
        },
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [m for m in mounts if m["name"] in ("socket", "disk")],
    }
    pod_spec: dict[str, Any] = {
        "hostIPC": False,
        "hostPID": False,
        "hostNetwork": False,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 60,
        # fsGroup: the kubelet gives the Secret and ConfigMap files to this group (0400 -> 0440),
        # else they stay root's and the sidecar's user cannot read its token or password.
        # Not applied to hostPath volumes (prepare-dirs hands those over).
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}, "fsGroup": SIDECAR_GID},
        "initContainers": [prepare],
        "containers": [container],
        "volumes": volumes,
    }
    if spec.gpu is not None:
        # The GPU tier sees the node's GPUs through the NVIDIA container runtime, without a
        # device plugin resource (a request for nvidia.com/gpu would take a GPU from the
        # engines); where the runtime refuses that, see README "GPU nodes".
        if spec.gpu.runtime_class:
            pod_spec["runtimeClassName"] = spec.gpu.runtime_class
        container["env"] += [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                             {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}]
    else:
        # No GPU: where the node's default runtime is NVIDIA's, an image whose own
        # environment says NVIDIA_VISIBLE_DEVICES=all would see every GPU (past the
        # operator's GPU_IMAGES), so the pod's environment, which wins, says none.
        container["env"] += [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    prepare["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod_spec["affinity"] = dict(spec.affinity)
    if spec.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    annotations = {CONFIG_HASH_ANNOTATION: configuration_hash}
    if redis_auth:
        annotations[REDIS_AUTH_HASH_ANNOTATION] = redis_auth
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(spec, n.sidecar, "sidecar"),
        "spec": {
            "selector": {"matchLabels": selector_labels(spec, "sidecar")},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": labels(spec, "sidecar"), "annotations": annotations},
                "spec": pod_spec,
            },
        },
    }


def build_service(spec: PoolSpec) -> Manifest:
    """Headless: one DNS record per ready sidecar, for peers and scrapers."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, names(spec.name).sidecar, "sidecar"),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(spec, "sidecar"),
            "ports": [
                {"name": "peer", "port": spec.peer_port, "targetPort": "peer", "protocol": "TCP"},
                {"name": "http", "port": spec.http_port, "targetPort": "http", "protocol": "TCP"},
                *({"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                  for name, port in _kv_event_ports(spec)),
            ],
        },
    }


def build_network_policy(spec: PoolSpec) -> Manifest:
    """Peer port: the pool's own sidecars only. HTTP (probes, metrics): open. KV-event ports
    (``spec.kvEvents``): the routers' pods only."""
    kv_ports = _kv_event_ports(spec)
    routers = spec.kv_events.routers if spec.kv_events is not None else None
    kv_rule = [{"from": [dict(routers)], "ports": [{"protocol": "TCP", "port": port} for _, port in kv_ports]}] \
        if kv_ports and routers is not None else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(spec, names(spec.name).sidecar, "sidecar"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, "sidecar")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": selector_labels(spec, "sidecar")}}],
                 "ports": [{"protocol": "TCP", "port": spec.peer_port}]},
                {"ports": [{"protocol": "TCP", "port": spec.http_port}]},
                *kv_rule,
            ],
        },
    }


# -- managed Redis ---------------------------------------------------------------------


def build_redis_statefulset(spec: PoolSpec, *, default_image: str, redis_auth: str | None = None) -> Manifest:
    """One Redis for the pool's index (emptyDir unless storage is asked for).

    It requires the password of the pool's Secret ``P-redis``: its first argument is the
    ``redis.conf`` of that Secret (``requirepass``), so the password is neither on the
    command line nor in the environment. ``redis_auth``: :func:`redis_auth_hash` of the
    password, so that a new password restarts Redis (it reads the file once, at start).
    """
    managed = spec.managed_redis
    if managed is None:
        raise ValueError("build_redis_statefulset: the pool has no managed Redis")
    n = names(spec.name)
    persistent = managed.storage is not None
    args = ["{}/{}".format(REDIS_CONFIG_DIR, REDIS_CONFIG_KEY),
            "--port", str(REDIS_PORT), "--dir", "/data", "--protected-mode", "no"]
    args += ["--appendonly", "yes"] if persistent else ["--save", "", "--appendonly", "no"]
    container: dict[str, Any] = {
        "name": "redis",
        "image": managed.image or default_image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["redis-server"],
        "args": args,
        # no GPU for an image the pool's creator names (see the sidecar's)
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": dict(managed.resources),
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"},
                         {"name": "config", "mountPath": REDIS_CONFIG_DIR, "readOnly": True}],
    }
    # fsGroup 999: the kubelet gives the Secret's file to Redis's group (0400 -> 0440).
    volumes: list[dict[str, Any]] = [{"name": "config", "secret": {
        "secretName": n.redis, "defaultMode": 0o400,
        "items": [{"key": REDIS_CONFIG_KEY, "path": REDIS_CONFIG_KEY}]}}]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsUser": 999, "runAsGroup": 999, "fsGroup": 999, "runAsNonRoot": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    template_meta: dict[str, Any] = {"labels": labels(spec, "redis")}
    if redis_auth:
        template_meta["annotations"] = {REDIS_AUTH_HASH_ANNOTATION: redis_auth}
    sts_spec: dict[str, Any] = {
        "serviceName": n.redis,
        "replicas": 1,
        "selector": {"matchLabels": selector_labels(spec, "redis")},
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    if persistent:
        pvc_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                                    "resources": {"requests": {"storage": managed.storage}}}
        if managed.storage_class:
            pvc_spec["storageClassName"] = managed.storage_class
        sts_spec["volumeClaimTemplates"] = [{"metadata": {"name": "data"}, "spec": pvc_spec}]
        sts_spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete", "whenScaled": "Retain"}
    else:
        volumes.insert(0, {"name": "data", "emptyDir": {}})
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(spec, n.redis, "redis"),
            "spec": sts_spec}


def build_redis_service(spec: PoolSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, names(spec.name).redis, "redis"),
        "spec": {"clusterIP": "None", "selector": selector_labels(spec, "redis"),
                 "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}]},
    }


def build_redis_network_policy(spec: PoolSpec, operator_namespace: str | None = None) -> Manifest:
    """Redis port: this pool's sidecars (same namespace) and the operator's pods only.

    The operator reads the index for the pool's status and purges it on deletion. Its pods
    are admitted from ``operator_namespace`` only; None (the operator does not know where
    it runs) admits pods with its labels from any namespace. Labels can be set by anyone
    who creates pods, so the policy narrows who can connect; the password decides who gets in.
    """
    operator: dict[str, Any] = {"podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}
    operator["namespaceSelector"] = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}} if operator_namespace else {})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(spec, names(spec.name).redis, "redis"),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(spec, "redis")},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [
                    {"podSelector": {"matchLabels": selector_labels(spec, "sidecar")}},
                    operator,
                ],
                "ports": [{"protocol": "TCP", "port": REDIS_PORT}],
            }],
        },
    }


# -- all of them -------------------------------------------------------------------------


def build_children(spec: PoolSpec, *, token: str | None, sidecar_image: str, redis_image: str,
                   redis_password: str | None, operator_namespace: str | None = None) -> list[Manifest]:
    """Every child the pool should have, in apply order: what the others depend on first.

    ConfigMap and Secrets (mounted by the pods), then each NetworkPolicy before the pods it
    fences, the Services, the managed Redis, and the DaemonSet last (its config hash is of
    the ConfigMap applied before it).

    ``token`` is the generated peer token; None when ``spec.auth`` names a Secret.
    ``redis_password`` is the managed Redis's (generated once, then kept). None with an
    external Redis, or when the name of its Secret is taken by one the pool does not own:
    then no Secret is built and the pod templates carry no digest of a password (a fresh
    one on every reconcile would restart Redis every time). ``operator_namespace``: see
    :func:`build_redis_network_policy`.
    """
    configmap = build_configmap(spec)
    children: list[Manifest] = [configmap]
    if spec.auth is None:
        if token is None:
            raise ValueError("build_children: a pool without spec.auth needs a generated token")
        children.append(build_auth_secret(spec, token))
    redis_auth: str | None = None
    if spec.managed_redis is not None:
        if redis_password is not None:
            redis_auth = redis_auth_hash(redis_password)
            children.append(build_redis_secret(spec, redis_password))
        if spec.network_policy:
            children.append(build_redis_network_policy(spec, operator_namespace))
        children.append(build_redis_service(spec))
        children.append(build_redis_statefulset(spec, default_image=redis_image, redis_auth=redis_auth))
    if spec.network_policy:
        children.append(build_network_policy(spec))
    children.append(build_service(spec))
    children.append(build_daemonset(spec, default_image=sidecar_image, configuration_hash=config_hash(configmap),
                                    redis_auth=redis_auth))
    return children


#: A child as the API server names it in a namespace: (apiVersion, kind, name).
ChildKey = tuple[str, str, str]


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    return str(obj["apiVersion"]), str(obj["kind"]), str(obj["metadata"]["name"])


#: Every (apiVersion, kind, name) a pool may own, to remove those no longer wanted.
def possible_children(pool: str) -> list[ChildKey]:
    n = names(pool)
    return [
        ("v1", "ConfigMap", n.config),
        ("v1", "Secret", n.auth),
        ("v1", "Secret", n.redis),
        ("v1", "Service", n.redis),
        ("apps/v1", "StatefulSet", n.redis),
        ("networking.k8s.io/v1", "NetworkPolicy", n.redis),
        ("v1", "Service", n.sidecar),
        ("networking.k8s.io/v1", "NetworkPolicy", n.sidecar),
        ("apps/v1", "DaemonSet", n.sidecar),
    ]
