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

The builders live by the pool's part they build, all re-exported here:
:mod:`~kvpool_operator.childnames` (the children's names, labels, keys and paths),
:mod:`~kvpool_operator.sidecarconfig` (the ConfigMap and the peer token's Secret),
:mod:`~kvpool_operator.sidecarpods` (the DaemonSet, its Service and NetworkPolicy) and
:mod:`~kvpool_operator.managedredis` (the managed Redis's four children); this module puts
them together (:func:`build_children`).
"""

from __future__ import annotations

from kvpool_operator.childnames import (
    AUTH_DIR, CONFIG_DIR, CONFIG_HASH_ANNOTATION, GROUP, POOL_LABEL, REDIS_AUTH_HASH_ANNOTATION,
    REDIS_CONFIG_KEY, REDIS_PASSWORD_KEY, REDIS_PORT, REDIS_SECRET_DIR, SIDECAR_CONFIG_KEY, SIDECAR_GID,
    SIDECAR_UID, TENANTS_DIR, TOKEN_KEY, VERSION, ChildKey, ChildNames, Manifest, auth_secret_ref, child_key,
    labels, names, possible_children, redis_password_ref, redis_url, selector_labels,
)
from kvpool_operator.managedredis import (
    NAMESPACE_NAME_LABEL, OPERATOR_POD_LABELS, REDIS_CONFIG_DIR, build_redis_network_policy,
    build_redis_secret, build_redis_service, build_redis_statefulset, redis_auth_hash, usable_redis_password,
)
from kvpool_operator.sidecarconfig import (
    build_auth_secret, build_configmap, build_sidecar_config, config_hash,
)
from kvpool_operator.sidecarpods import build_daemonset, build_network_policy, build_service
from kvpool_operator.spec import PoolSpec

__all__ = ["AUTH_DIR", "CONFIG_DIR", "CONFIG_HASH_ANNOTATION", "GROUP", "NAMESPACE_NAME_LABEL",
           "OPERATOR_POD_LABELS", "POOL_LABEL", "REDIS_AUTH_HASH_ANNOTATION", "REDIS_CONFIG_DIR",
           "REDIS_CONFIG_KEY", "REDIS_PASSWORD_KEY", "REDIS_PORT", "REDIS_SECRET_DIR", "SIDECAR_CONFIG_KEY",
           "SIDECAR_GID", "SIDECAR_UID", "TENANTS_DIR", "TOKEN_KEY", "VERSION", "ChildKey", "ChildNames",
           "Manifest", "auth_secret_ref", "build_auth_secret", "build_children", "build_configmap",
           "build_daemonset", "build_network_policy", "build_redis_network_policy", "build_redis_secret",
           "build_redis_service", "build_redis_statefulset", "build_service", "build_sidecar_config",
           "child_key", "config_hash", "labels", "names", "possible_children", "redis_auth_hash",
           "redis_password_ref", "redis_url", "selector_labels", "usable_redis_password"]


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
    :func:`~kvpool_operator.managedredis.build_redis_network_policy`.
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
