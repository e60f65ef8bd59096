"""How a pool's children are named and refer to each other: their names (derived from the
pool's name alone), the labels that select and mark them, and the keys, mount paths and ports
one child's manifest names in another's (the sidecars' config file and Secrets, the managed
Redis's Secret and port).

Every builder of a pool's children (:mod:`~kvpool_operator.manifests`) starts from these;
the operator's reconcile, preflight and deletion find the children by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpool_operator.spec import PoolSpec

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
#: A digest of the managed Redis's password on the pod templates of Redis and the sidecars:
#: a new password (the Secret was deleted and generated again) restarts both.
REDIS_AUTH_HASH_ANNOTATION = "kvpool.io/redis-auth-hash"


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


def meta(spec: PoolSpec, name: str, component: str) -> dict[str, Any]:
    """A child's metadata: its name, the pool's namespace and its component's labels."""
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


def auth_secret_ref(spec: PoolSpec) -> tuple[str, str]:
    """(Secret name, key) of the peer token: the user's, or the generated one."""
    if spec.auth is not None:
        return spec.auth.name, spec.auth.key
    return names(spec.name).auth, TOKEN_KEY


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
