"""A pool's spec as typed, defaulted values (what the builders work from).

The API server applies the CRD's defaults before the operator sees a pool; the same
defaults are repeated here (a unit test keeps the two equal) so that the builders also
work on raw specs, e.g. in tests or on objects stored before a default was added.
:func:`parse_spec` raises :class:`InvalidSpecError` naming the field for shapes the
schema would have rejected; :func:`spec_problems` lists combinations that it cannot
reject, which the operator reports as a condition.
"""

from __future__ import annotations

import hashlib
import os
import re
from urllib.parse import parse_qsl, urlsplit
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool_operator.errors import InvalidSpecError
from kvpool_operator.quantity import parse_bytes, parse_share

#: Defaults as in crds/kvcachepools.kvpool.io.yaml (dotted spec paths).
DEFAULTS: Mapping[str, object] = {
    "imagePullPolicy": "IfNotPresent",
    "logLevel": "INFO",
    "maxBlockSize": "256Mi",
    "tiers.dram.size": "1Gi",
    "tiers.dram.pageSize": "64Ki",
    "tiers.dram.populate": True,
    "tiers.dram.cleanShare": 0.1,
    "tiers.dram.putWaitsForDisk": False,
    "tiers.disk.enabled": True,
    "tiers.disk.fsync": "never",
    "tiers.disk.compression": "none",
    "tiers.disk.layout": "segments",
    "tiers.gpu.enabled": False,
    "tiers.gpu.device": 0,
    "tiers.gpu.runtimeClassName": "nvidia",
    "api.httpPort": 9466,
    "transport.type": "tcp",
    "transport.port": 9467,
    "redis.external.passwordSecretRef.key": "password",
    "redis.external.cluster": False,
    "eviction.policy": "prefix",
    "eviction.demote": True,
    "tenants[].priority": 0,
    "tenants[].tokenSecret.key": "token",
    "auth.secretRef.key": "token",
    "networkPolicy.enabled": True,
    "kvEvents.enabled": False,
    "kvEvents.port": 5557,
    "kvEvents.topic": "",
    "kvEvents.encoding": "tagged",
}
#: The largest size each quantity field takes, as in the CRD's CEL rules (a unit test keeps
#: the two equal): beyond any machine's DRAM, GPU or disk, well inside the sidecar's 64-bit
#: sizes, and small enough that the status's byte sums over thousands of nodes fit an int64.
MAX_SIZES: Mapping[str, str] = {
    "maxBlockSize": "64Ti",
    "tiers.dram.size": "64Ti",
    "tiers.disk.size": "1Pi",
    "tiers.gpu.size": "4Ti",
    "redis.managed.storage": "1Pi",
    "tenants[].quota": "1Pi",
}
SOCKET_NAME = "kvpool.sock"
#: Without ``spec.api.socketDir`` a pool's socket directory is ``<SOCKET_ROOT>/<namespace>.<name>``
#: (a host directory of its own, so that pools can share a node).
SOCKET_ROOT = "/run/kvpool"
#: The longest Unix socket path the kernel binds (``sun_path`` holds 108 bytes with its NUL).
MAX_SOCKET_PATH = 107
#: The longest ``spec.api.socketDir`` (as in the CRD): its socket path stays within MAX_SOCKET_PATH.
MAX_SOCKET_DIR = MAX_SOCKET_PATH - len("/" + SOCKET_NAME)
#: Hex digits of the digest that ends a cut socket directory name (:func:`default_socket_dir`).
SOCKET_DIR_DIGEST = 16


def default_socket_dir(namespace: str, name: str) -> str:
    """``/run/kvpool/<namespace>.<name>``: the pool's own host directory for its socket.

    Namespace and name are DNS labels (no dots), so the directory is unique per pool. When
    the socket path would pass :data:`MAX_SOCKET_PATH` (a namespace and name of more than 83
    characters together) the directory is cut to its first 66 characters and ends in ``_``
    and :data:`SOCKET_DIR_DIGEST` (16) hex digits of a sha256 of the whole
    ``<namespace>.<name>``, which keeps it unique: no pool name holds a ``_``, so no pool can
    spell another's cut form (with a ``-`` there, a second pool of the same namespace named
    after the cut form had been handed the first one's directories), and 64 bits of digest
    cannot be searched for a name whose cut form is another pool's (8 digits, 32 bits, could
    be, offline, in minutes). The CSI node plugin calls this function too.
    """
    pool = "{}.{}".format(namespace, name)
    room = MAX_SOCKET_DIR - len(SOCKET_ROOT + "/")
    if len(pool) > room:
        digest = hashlib.sha256(pool.encode()).hexdigest()[:SOCKET_DIR_DIGEST]
        pool = "{}_{}".format(pool[:room - SOCKET_DIR_DIGEST - 1], digest)
    return "{}/{}".format(SOCKET_ROOT, pool)


@dataclass(frozen=True)
class SecretKeyRef:
    """One key of a Secret in the pool's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class DramTier:
    size_bytes: int
    page_bytes: int
    populate: bool
    #: The share of the arena the write-ahead keeps free or already on disk (with a disk tier).
    clean_share: float = 0.1
    #: A put that finds no clean room waits for a disk write instead of being answered FULL.
    put_waits_for_disk: bool = False


@dataclass(frozen=True)
class DiskTier:
    #: Host directory (mounted at the same path in the sidecar).
    path: str
    size_bytes: int
    fsync: str
    compression: str
    compression_level: int | None
    layout: str = "segments"


@dataclass(frozen=True)
class GpuTier:
    device: int
    size_bytes: int | None
    fraction: float | None
    #: The RuntimeClass that gives the sidecar's container the node's GPUs ("" for none).
    runtime_class: str = "nvidia"


@dataclass(frozen=True)
class ManagedRedis:
    image: str | None
    #: Persistent volume size as given (a quantity); emptyDir when None.
    storage: str | None
    storage_class: str | None
    resources: Mapping[str, Any]


@dataclass(frozen=True)
class KvEvents:
    """vLLM-format KV events for routers (``spec.kvEvents``): published on ``port``, which only
    the ``routers`` pods may reach, or sent to a router that listens at ``connect_to``."""

    port: int
    replay_port: int | None
    connect_to: str | None
    topic: str
    tenants: tuple[str, ...]
    encoding: str
    #: A NetworkPolicy peer (``podSelector`` and maybe ``namespaceSelector``): who may subscribe.
    routers: Mapping[str, Any] | None


@dataclass(frozen=True)
class ExternalRedis:
    url: str
    password: SecretKeyRef | None
    cluster: bool


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int
    quota_bytes: int | None
    #: The quota as a fraction of each node's DRAM tier (``quota: 25%``); excludes quota_bytes.
    quota_share: float | None = None
    #: Tenants with the same key space share blocks (default: the tenant's own).
    key_space: str | None = None
    #: Who may act as the tenant: pods of these uids or primary gids, or presenting the
    #: token in this Secret key (any one suffices; none: open to pods mounting the socket).
    uids: tuple[int, ...] = ()
    gids: tuple[int, ...] = ()
    token_secret: SecretKeyRef | None = None


@dataclass(frozen=True)
class PoolSpec:
    """Everything the manifest builders need to know about one pool."""

    name: str
    namespace: str
    image: str | None
    image_pull_policy: str
    image_pull_secrets: tuple[str, ...]
    node_selector: Mapping[str, str]
    affinity: Mapping[str, Any] | None
    tolerations: tuple[Mapping[str, Any], ...]
    priority_class_name: str | None
    resources: Mapping[str, Any]
    log_level: str
    max_block_bytes: int
    dram: DramTier
    disk: DiskTier | None
    gpu: GpuTier | None
    #: Host directory of the socket (``spec.api.socketDir`` or :func:`default_socket_dir`),
    #: mounted at the same path in the sidecar; serving pods mount it too.
    socket_dir: str
    http_port: int
    transport: str
    peer_port: int
    managed_redis: ManagedRedis | None
    external_redis: ExternalRedis | None
    eviction_policy: str
    demote: bool
    tenants: tuple[Tenant, ...]
    auth: SecretKeyRef | None
    network_policy: bool
    kv_events: KvEvents | None = None

    @property
    def pool_id(self) -> str:
        """The pool's name in the index (``kvp:<pool_id>:*``), unique per Redis.

        Namespace and name are DNS labels (no dots), so ``<namespace>.<name>`` is
        unambiguous and two namespaces may share an external Redis.
        """
        return "{}.{}".format(self.namespace, self.name)

    @property
    def socket_path(self) -> str:
        """The socket's path on the host and in the sidecar (serving pods mount its directory)."""
        return self.socket_dir.rstrip("/") + "/" + SOCKET_NAME


def _size(value: object, key: str, path: str | None = None) -> int:
    """Bytes of the quantity field ``key`` (a :data:`MAX_SIZES` key), at most its maximum."""
    field = path or "spec." + key
    size = parse_bytes(value, field)
    limit = MAX_SIZES[key]
    if size > parse_bytes(limit, field):
        raise InvalidSpecError(field, "{!r} is too large: at most {} is allowed".format(value, limit))
    return size


def _get(data: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpecError(path, "expected an object")
    return value


def _typed(data: Mapping[str, Any], key: str, kind: type[Any], default: Any, path: str) -> Any:
    value = data.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind is not bool:
        raise InvalidSpecError(path, "expected {}, got a boolean".format(kind.__name__))
    if kind is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, kind):
        raise InvalidSpecError(path, "expected {}, got {}".format(kind.__name__, type(value).__name__))
    return value


#: A Secret's name (a DNS-1123 subdomain) and a key in it, as the API server allows them.
SECRET_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


def _secret_ref(data: Mapping[str, Any], path: str, default_key: str) -> SecretKeyRef:
    """A Secret and key of the pool's namespace. The name goes into the API's paths: one
    such as ``../../team-b/secrets/db`` had the operator read another namespace's Secret
    (and tell the pool's status whether it existed and whom it belonged to)."""
    name = _typed(data, "name", str, "", path + ".name")
    if not name:
        raise InvalidSpecError(path + ".name", "is required")
    if len(name) > 253 or not SECRET_NAME.fullmatch(name):
        raise InvalidSpecError(path + ".name", "is not a Secret's name (lower case letters, digits, '-' and '.')")
    key = _typed(data, "key", str, default_key, path + ".key")
    if len(key) > 253 or not SECRET_KEY.fullmatch(key):
        raise InvalidSpecError(path + ".key", "is not a key of a Secret (letters, digits, '-', '_' and '.')")
    return SecretKeyRef(name=name, key=key)


def _ids(data: Mapping[str, Any], key: str, path: str) -> tuple[int, ...]:
    ids = _list(data, key, path)
    if not all(type(x) is int and 0 <= x < 2**32 - 1 for x in ids):
        raise InvalidSpecError(path, "expected a list of user or group ids")
    return tuple(ids)


def _list(data: Mapping[str, Any], key: str, path: str) -> Sequence[Any]:
    value = data.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidSpecError(path, "expected a list")
    return value


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any]) -> PoolSpec:
    """Typed, defaulted pool settings from a KVCachePool's ``spec``."""
    tiers = _get(spec, "tiers", "spec.tiers")
    dram_raw = _get(tiers, "dram", "spec.tiers.dram")
    dram = DramTier(
        size_bytes=_size(dram_raw.get("size", DEFAULTS["tiers.dram.size"]), "tiers.dram.size"),
        page_bytes=parse_bytes(dram_raw.get("pageSize", DEFAULTS["tiers.dram.pageSize"]), "spec.tiers.dram.pageSize"),
        populate=_typed(dram_raw, "populate", bool, True, "spec.tiers.dram.populate"),
        clean_share=_typed(dram_raw, "cleanShare", float, DEFAULTS["tiers.dram.cleanShare"],
                           "spec.tiers.dram.cleanShare"),
        put_waits_for_disk=_typed(dram_raw, "putWaitsForDisk", bool, DEFAULTS["tiers.dram.putWaitsForDisk"],
                                  "spec.tiers.dram.putWaitsForDisk"),
    )
    if not 0 <= dram.clean_share < 1:
        raise InvalidSpecError("spec.tiers.dram.cleanShare", "must be a fraction in [0, 1), not {!r}".format(
            dram.clean_share))
    disk: DiskTier | None = None
    if "disk" in tiers:
        raw = _get(tiers, "disk", "spec.tiers.disk")
        if _typed(raw, "enabled", bool, True, "spec.tiers.disk.enabled"):
            path = _typed(raw, "path", str, "", "spec.tiers.disk.path")
            if not path.startswith("/"):
                raise InvalidSpecError("spec.tiers.disk.path", "an absolute path is required for the disk tier")
            if "size" not in raw:
                raise InvalidSpecError("spec.tiers.disk.size", "is required for the disk tier")
            disk = DiskTier(
                path=path,
                size_bytes=_size(raw["size"], "tiers.disk.size"),
                fsync=_typed(raw, "fsync", str, "never", "spec.tiers.disk.fsync"),
                compression=_typed(raw, "compression", str, "none", "spec.tiers.disk.compression"),
                compression_level=_typed(raw, "compressionLevel", int, None, "spec.tiers.disk.compressionLevel"),
                layout=_typed(raw, "layout", str, "segments", "spec.tiers.disk.layout"),
            )
    gpu: GpuTier | None = None
    gpu_raw = _get(tiers, "gpu", "spec.tiers.gpu")
    if _typed(gpu_raw, "enabled", bool, False, "spec.tiers.gpu.enabled"):
        gpu = GpuTier(
            device=_typed(gpu_raw, "device", int, 0, "spec.tiers.gpu.device"),
            size_bytes=_size(gpu_raw["size"], "tiers.gpu.size") if "size" in gpu_raw else None,
            fraction=_typed(gpu_raw, "fraction", float, None, "spec.tiers.gpu.fraction"),
            runtime_class=_typed(gpu_raw, "runtimeClassName", str, DEFAULTS["tiers.gpu.runtimeClassName"],
                                 "spec.tiers.gpu.runtimeClassName"),
        )
    api = _get(spec, "api", "spec.api")
    transport = _get(spec, "transport", "spec.transport")
    redis = _get(spec, "redis", "spec.redis") or {"managed": {}}
    managed: ManagedRedis | None = None
    external: ExternalRedis | None = None
    if "managed" in redis and "external" in redis:
        raise InvalidSpecError("spec.redis", "exactly one of spec.redis.managed and spec.redis.external must be set")
    if "external" in redis:
        ext = _get(redis, "external", "spec.redis.external")
        url = _typed(ext, "url", str, "", "spec.redis.external.url")
        if not url.startswith(("redis://", "rediss://")):
            raise InvalidSpecError("spec.redis.external.url", "a redis:// or rediss:// URL is required")
        parts = urlsplit(url)
        options = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True)} - {"db"})
        if options or parts.fragment or (parts.query and not parse_qsl(parts.query, keep_blank_values=True)):
            # redis-py takes any option from the query: ?port= (where the URL names none) sends
            # the password to another port than the one its Secret allows, ?ssl_cert_reqs=none
            # turns TLS verification off
            raise InvalidSpecError("spec.redis.external.url", "no options in the URL but db (found {}): the "
                                   "host, port and TLS checks are the URL's own".format(
                                       ", ".join(options) or "a fragment or a malformed query"))
        pw = ext.get("passwordSecretRef")
        external = ExternalRedis(
            url=url,
            password=_secret_ref(_get(ext, "passwordSecretRef", "spec.redis.external.passwordSecretRef"),
                                 "spec.redis.external.passwordSecretRef", "password") if pw else None,
            cluster=_typed(ext, "cluster", bool, False, "spec.redis.external.cluster"),
        )
    else:
        mgd = _get(redis, "managed", "spec.redis.managed")
        storage = mgd.get("storage")
        if storage is not None:
            _size(storage, "redis.managed.storage")
        managed = ManagedRedis(
            image=_typed(mgd, "image", str, None, "spec.redis.managed.image"),
            storage=str(storage) if storage is not None else None,
            storage_class=_typed(mgd, "storageClassName", str, None, "spec.redis.managed.storageClassName"),
            resources=_get(mgd, "resources", "spec.redis.managed.resources"),
        )
    eviction = _get(spec, "eviction", "spec.eviction")
    tenants = []
    for i, t in enumerate(_list(spec, "tenants", "spec.tenants")):
        where = "spec.tenants[{}]".format(i)
        if not isinstance(t, Mapping):
            raise InvalidSpecError(where, "expected an object")
        tname = _typed(t, "name", str, "", where + ".name")
        if not tname:
            raise InvalidSpecError(where + ".name", "is required")
        quota = t.get("quota")
        share = isinstance(quota, str) and quota.strip().endswith("%")
        tenants.append(Tenant(
            name=tname,
            priority=_typed(t, "priority", int, 0, where + ".priority"),
            quota_bytes=_size(quota, "tenants[].quota", where + ".quota") if quota is not None and not share else None,
            quota_share=parse_share(str(quota), where + ".quota") if share else None,
            key_space=_typed(t, "keySpace", str, None, where + ".keySpace") or None,
            uids=_ids(t, "uids", where + ".uids"),
            gids=_ids(t, "gids", where + ".gids"),
            token_secret=_secret_ref(t["tokenSecret"], where + ".tokenSecret", "token")
            if isinstance(t.get("tokenSecret"), Mapping) else None,
        ))
    auth_raw = _get(spec, "auth", "spec.auth")
    auth = _secret_ref(_get(auth_raw, "secretRef", "spec.auth.secretRef"), "spec.auth.secretRef", "token") \
        if auth_raw else None
    pull_secrets = tuple(
        _typed(s, "name", str, "", "spec.imagePullSecrets[{}].name".format(i)) if isinstance(s, Mapping) else ""
        for i, s in enumerate(_list(spec, "imagePullSecrets", "spec.imagePullSecrets"))
    )
    affinity = spec.get("affinity")
    socket_dir = _typed(api, "socketDir", str, "", "spec.api.socketDir") or default_socket_dir(namespace, name)
    if not socket_dir.startswith("/"):
        raise InvalidSpecError("spec.api.socketDir", "an absolute path is required")
    if len(socket_dir.rstrip("/").encode()) > MAX_SOCKET_DIR:
        raise InvalidSpecError("spec.api.socketDir", "at most {} bytes: the socket path in it must fit the {} bytes "
                                                     "of a Unix socket address".format(MAX_SOCKET_DIR, MAX_SOCKET_PATH))
    return PoolSpec(
        kv_events=_kv_events(_get(spec, "kvEvents", "spec.kvEvents")),
        name=name,
        namespace=namespace,
        image=_typed(spec, "image", str, None, "spec.image") or None,
        image_pull_policy=_typed(spec, "imagePullPolicy", str, "IfNotPresent", "spec.imagePullPolicy"),
        image_pull_secrets=tuple(s for s in pull_secrets if s),
        node_selector=dict(_get(spec, "nodeSelector", "spec.nodeSelector")),
        affinity=dict(affinity) if isinstance(affinity, Mapping) and affinity else None,
        tolerations=tuple(t for t in _list(spec, "tolerations", "spec.tolerations") if isinstance(t, Mapping)),
        priority_class_name=_typed(spec, "priorityClassName", str, None, "spec.priorityClassName") or None,
        resources=dict(_get(spec, "resources", "spec.resources")),
        log_level=_typed(spec, "logLevel", str, "INFO", "spec.logLevel"),
        max_block_bytes=_size(spec.get("maxBlockSize", DEFAULTS["maxBlockSize"]), "maxBlockSize"),
        dram=dram,
        disk=disk,
        gpu=gpu,
        socket_dir=socket_dir,
        http_port=_typed(api, "httpPort", int, DEFAULTS["api.httpPort"], "spec.api.httpPort"),
        transport=_typed(transport, "type", str, DEFAULTS["transport.type"], "spec.transport.type"),
        peer_port=_typed(transport, "port", int, DEFAULTS["transport.port"], "spec.transport.port"),
        managed_redis=managed,
        external_redis=external,
        eviction_policy=_typed(eviction, "policy", str, "prefix", "spec.eviction.policy"),
        demote=_typed(eviction, "demote", bool, True, "spec.eviction.demote"),
        tenants=tuple(tenants),
        auth=auth,
        network_policy=_typed(_get(spec, "networkPolicy", "spec.networkPolicy"), "enabled", bool, True,
                              "spec.networkPolicy.enabled"),
    )


def _kv_events(raw: Mapping[str, Any]) -> KvEvents | None:
    if not _typed(raw, "enabled", bool, False, "spec.kvEvents.enabled"):
        return None
    routers = _get(raw, "routers", "spec.kvEvents.routers")
    connect_to = _typed(raw, "connectTo", str, None, "spec.kvEvents.connectTo") or None
    if connect_to is not None and not connect_to.startswith("tcp://"):
        raise InvalidSpecError("spec.kvEvents.connectTo", "a tcp://HOST:PORT address is required")
    tenants = _list(raw, "tenants", "spec.kvEvents.tenants")
    if not all(isinstance(t, str) for t in tenants):
        raise InvalidSpecError("spec.kvEvents.tenants", "expected a list of tenant names")
    peer = {k: dict(_get(routers, k, "spec.kvEvents.routers." + k)) for k in ("podSelector", "namespaceSelector")
            if k in routers}
    return KvEvents(
        port=_typed(raw, "port", int, DEFAULTS["kvEvents.port"], "spec.kvEvents.port"),
        replay_port=_typed(raw, "replayPort", int, None, "spec.kvEvents.replayPort"),
        connect_to=connect_to,
        topic=_typed(raw, "topic", str, DEFAULTS["kvEvents.topic"], "spec.kvEvents.topic"),
        tenants=tuple(tenants),
        encoding=_typed(raw, "encoding", str, DEFAULTS["kvEvents.encoding"], "spec.kvEvents.encoding"),
        routers=peer or None,
    )


def host_path_problems(spec: PoolSpec, roots: Sequence[str]) -> list[str]:
    """The pool's host directories that are not its own directory under ``roots`` (the
    operator's ``KVPOOL_OPERATOR_HOST_PATH_ROOTS``).

    Its sidecars' init container runs as root and hands them to the sidecar's user, and its
    sidecars adopt the blocks they find there, so a pool must name neither ``/etc`` nor a root
    itself nor another pool's directories (its socket, its disk tier: every pool's sidecars
    run as the same user). Each directory is therefore ``<root>/<namespace>.<name>`` (the name
    of :func:`default_socket_dir`), which no other pool can spell, and nothing below it: the
    sidecar's user owns that directory and may put a symbolic link in it, which the kubelet
    would follow when mounting a path through it (a pool naming ``<own>/x`` after its sidecar
    made ``x`` a link to ``/etc`` had ``/etc`` mounted and handed to the sidecar's user by the
    root init container). ``<root>`` itself belongs to root, so ``<root>/<own>`` is a real
    directory.
    """
    problems: list[str] = []
    own = default_socket_dir(spec.namespace, spec.name).rsplit("/", 1)[1]
    named = [("spec.api.socketDir", spec.socket_dir)]
    if spec.disk is not None:
        named.append(("spec.tiers.disk.path", spec.disk.path))
    for field, path in named:
        plain = path.rstrip("/") or "/"
        if os.path.normpath(plain) != plain or "/../" in plain + "/":
            problems.append("{} ({}) must be a normalized path (no '.', '..' or '//')".format(field, path))
        elif not any(plain == "{}/{}".format(root, own) for root in roots):
            problems.append("{} ({}) must be the pool's own directory under one of {} (the operator's "
                            "KVPOOL_OPERATOR_HOST_PATH_ROOTS): {}, nothing below it; the sidecars take the "
                            "directory over and adopt the blocks in it".format(
                                field, path, ", ".join(roots), " or ".join("{}/{}".format(r, own) for r in roots)))
    if len(named) == 2 and len({p.rstrip("/") or "/" for _, p in named}) == 1:
        # (the CRD's rule compares them as written: a trailing '/' passed it)
        problems.append("spec.api.socketDir and spec.tiers.disk.path ({}) name one directory: the disk tier's "
                        "is made 0700 for the sidecar alone, and serving pods would lose the socket".format(
                            spec.disk.path if spec.disk is not None else ""))
    return problems


def spec_problems(spec: PoolSpec) -> list[str]:
    """Combinations the CRD schema cannot reject, each as a message naming the fields."""
    problems: list[str] = []
    limits = spec.resources.get("limits")
    memory = limits.get("memory") if isinstance(limits, Mapping) else None
    if memory is not None:
        try:
            limit = parse_bytes(memory, "spec.resources.limits.memory")
        except InvalidSpecError:
            limit = None  # a CPU-style quantity (e.g. "1500m"); the API server judges it
        if limit is not None and limit <= spec.dram.size_bytes:
            problems.append(
                "spec.resources.limits.memory ({}) must exceed spec.tiers.dram.size ({} bytes): the DRAM arena "
                "is shared memory charged to the sidecar container".format(memory, spec.dram.size_bytes))
    if spec.disk is not None and spec.disk.size_bytes < spec.max_block_bytes:
        problems.append("spec.tiers.disk.size ({} bytes) must be at least spec.maxBlockSize ({} bytes)".format(
            spec.disk.size_bytes, spec.max_block_bytes))
    problems += _kv_events_problems(spec)
    return problems


def _kv_events_problems(spec: PoolSpec) -> list[str]:
    """A port the sidecar binds for KV events is reachable by the ``routers`` pods only: a pool
    that binds one must say who they are (subscribers learn the announced prompts' tokens)."""
    k = spec.kv_events
    if k is None:
        return []
    problems: list[str] = []
    binds = k.connect_to is None or k.replay_port is not None
    if binds and (k.routers is None or "podSelector" not in k.routers):
        problems.append("spec.kvEvents.routers.podSelector is required where the sidecars bind a KV-event port "
                        "(publishing without spec.kvEvents.connectTo, or replaying): only those pods may connect, "
                        "as subscribers learn the token ids of the announced prompts")
    ports = [("spec.transport.port", spec.peer_port), ("spec.api.httpPort", spec.http_port)]
    if k.connect_to is None:
        ports.append(("spec.kvEvents.port", k.port))
    if k.replay_port is not None:
        ports.append(("spec.kvEvents.replayPort", k.replay_port))
    known = {t.name for t in spec.tenants} or {"default"}
    for name in k.tenants:
        if name not in known:
            problems.append("spec.kvEvents.tenants names {!r}, which is not one of the pool's tenants ({})".format(
                name, ", ".join(sorted(known))))
    seen: dict[int, str] = {}
    for field, port in ports:
        if port in seen:
            problems.append("{} and {} must differ (both are {})".format(seen[port], field, port))
        seen.setdefault(port, field)
    return problems
