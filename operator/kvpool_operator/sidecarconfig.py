"""The sidecars' configuration: their config file (``sidecar.yaml``, in the pool's ConfigMap,
and its digest, which rolls the pods when it changes) and the generated peer token (the
Secret ``P-auth``, unless ``spec.auth`` names one).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import yaml

from kvpool_operator.childnames import (
    AUTH_DIR, REDIS_SECRET_DIR, SIDECAR_CONFIG_KEY, TENANTS_DIR, TOKEN_KEY, Manifest, auth_secret_ref, meta,
    names, redis_password_ref, redis_url,
)
from kvpool_operator.spec import KvEvents, PoolSpec


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


def _dump(data: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(data), sort_keys=True, default_flow_style=False)


def build_configmap(spec: PoolSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(spec, names(spec.name).config, "sidecar"),
        "data": {
            SIDECAR_CONFIG_KEY: _dump(build_sidecar_config(spec)),
        },
    }


def config_hash(configmap: Mapping[str, Any]) -> str:
    """A stable digest of a ConfigMap's data: on the pod template, so a change rolls the pods."""
    canonical = json.dumps(configmap.get("data", {}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def build_auth_secret(spec: PoolSpec, token: str) -> Manifest:
    """The generated peer token (the caller keeps an existing token: no churn)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(spec, names(spec.name).auth, "sidecar"),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }
