"""The sidecars' workload and network: the DaemonSet (one sidecar per selected node, its
``prepare-dirs`` step and its volumes), the headless Service of their ports and the
NetworkPolicy that fences them.
"""

from __future__ import annotations

from typing import Any

from kvpool_operator.childnames import (
    AUTH_DIR, CONFIG_DIR, CONFIG_HASH_ANNOTATION, REDIS_AUTH_HASH_ANNOTATION, REDIS_SECRET_DIR,
    SIDECAR_CONFIG_KEY, SIDECAR_GID, SIDECAR_UID, TENANTS_DIR, Manifest, auth_secret_ref, labels, meta, names,
    redis_password_ref, selector_labels,
)
from kvpool_operator.spec import PoolSpec


def _kv_event_ports(spec: PoolSpec) -> list[tuple[str, int]]:
    """The ports the sidecar binds for KV events, by name."""
    k = spec.kv_events
    if k is None:
        return []
    ports = [] if k.connect_to is not None else [("kv-events", k.port)]
    return ports + ([("kv-replay", k.replay_port)] if k.replay_port is not None else [])


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
    ``redis_auth``: :func:`~kvpool_operator.managedredis.redis_auth_hash` of the managed
    Redis's password, so that a new password restarts the sidecars (they read it once, at
    start).
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
        "metadata": meta(spec, n.sidecar, "sidecar"),
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
        "metadata": meta(spec, names(spec.name).sidecar, "sidecar"),
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
        "metadata": meta(spec, names(spec.name).sidecar, "sidecar"),
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
