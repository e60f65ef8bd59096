"""The managed Redis (``spec.redis.managed``): its Secret (the generated password and the
``redis.conf`` that requires it), its StatefulSet, its headless Service and the
NetworkPolicy that admits the pool's sidecars and the operator's pods only.

The password is never on a command line or in an environment: Redis reads it from the
Secret's ``redis.conf``, the sidecars from the same Secret (``index.password_file``), and a
digest of it on both pod templates restarts both when it changes.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from typing import Any

from kvpool_operator.childnames import (
    REDIS_AUTH_HASH_ANNOTATION, REDIS_CONFIG_KEY, REDIS_PASSWORD_KEY, REDIS_PORT, Manifest, labels, meta, names,
    selector_labels,
)
from kvpool_operator.spec import PoolSpec

#: Where the Redis container mounts its ``redis.conf``.
REDIS_CONFIG_DIR = "/etc/kvpool/redis-config"
#: What a managed Redis password may hold: it goes into ``redis.conf`` unquoted.
_REDIS_PASSWORD = re.compile(r"[A-Za-z0-9._~+/=-]{16,512}")
#: Labels of the operator's own pods (the chart's, whatever its name or release); the managed
#: Redis admits them from the operator's namespace (``build_redis_network_policy``).
OPERATOR_POD_LABELS: Mapping[str, str] = {"app.kubernetes.io/part-of": "kvpool",
                                          "app.kubernetes.io/component": "operator"}
#: The label the API server puts on every namespace (Kubernetes 1.21+): its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def usable_redis_password(password: str) -> bool:
    """True when ``password`` may be a managed Redis's: 16 to 512 URL-safe or base64 characters
    (``secrets.token_urlsafe(32)`` is), nothing a ``redis.conf`` line would read otherwise."""
    return _REDIS_PASSWORD.fullmatch(password) is not None


def redis_auth_hash(password: str) -> str:
    """A digest of the managed Redis's password for
    :data:`~kvpool_operator.childnames.REDIS_AUTH_HASH_ANNOTATION`.

    One-way, and of a random 256-bit password: it tells only whether the password changed.
    """
    return hashlib.sha256(b"kvpool-redis-auth\0" + password.encode()).hexdigest()[:32]


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
        "metadata": meta(spec, names(spec.name).redis, "redis"),
        "type": "Opaque",
        "data": {REDIS_PASSWORD_KEY: base64.b64encode(password.encode()).decode(),
                 REDIS_CONFIG_KEY: base64.b64encode(conf.encode()).decode()},
    }


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
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(spec, n.redis, "redis"),
            "spec": sts_spec}


def build_redis_service(spec: PoolSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(spec, names(spec.name).redis, "redis"),
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
        "metadata": meta(spec, names(spec.name).redis, "redis"),
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
