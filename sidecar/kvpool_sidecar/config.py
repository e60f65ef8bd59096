"""The sidecar's settings: one typed object, loaded from a YAML file and ``KVPOOL_*`` env.

Of the daemon's modules this is the only one that reads configuration files or the
environment, with one exception: the Mooncake transport
(:mod:`kvpool_sidecar.transfer.mooncake`) reads ``KVPOOL_MOONCAKE_PROTOCOL`` and
``KVPOOL_MOONCAKE_DEVICE`` when it starts. The file is what the operator renders into the
pool's ConfigMap; a contract test checks that every rendering loads here. Sizes accept
integers (bytes) or Kubernetes quantities ("4Gi", "512Mi", "10G"). Invalid settings raise
:class:`ConfigError` naming the field.

Environment overrides (applied after the file):

``KVPOOL_NODE_NAME``, ``KVPOOL_SOCKET_PATH``, ``KVPOOL_DRAM_SIZE``, ``KVPOOL_DISK_PATH``,
``KVPOOL_DISK_SIZE``, ``KVPOOL_HTTP_PORT``, ``KVPOOL_TCP_PORT``, ``KVPOOL_LOG_LEVEL``,
``KVPOOL_PEER_HOST``, ``KVPOOL_PEER_ADVERTISE``, ``KVPOOL_REDIS_URL``.

Names from the ``KVCachePool`` CRD (what the operator renders into this file): a setting
has the same words in both, camelCase in the CRD and snake_case here, by these rules
(``tests/contract/test_operator_sidecar_config.py`` checks every field the operator
renders against them):

- sections: ``spec.tiers.dram|disk|gpu`` -> ``dram|disk|gpu``, ``spec.api`` -> ``api``,
  ``spec.transport`` -> ``peer``, ``spec.eviction`` -> ``policy``, ``spec.redis.external``
  (or the managed Redis) -> ``index``, ``spec.tenants[]`` -> ``tenants[]``, the rest of
  ``spec`` -> the top level;
- a field: camelCase -> snake_case; a size (a quantity) named ``size`` or ``...Size``
  takes ``bytes`` for ``size``: ``size`` -> ``size_bytes``, ``pageSize`` -> ``page_bytes``,
  ``maxBlockSize`` -> ``max_block_bytes``;
- values of enumerations are the same words (``transport.type: rdma`` -> ``peer.transport:
  rdma``), and defaults the same values (the peer port is 9467, the HTTP port 9466), except
  the GPU tier's: the CRD's ``spec.tiers.gpu.enabled`` defaults to false, the sidecar's
  ``gpu.enabled`` to true (on where it finds a GPU and torch with CUDA); the operator always
  renders ``gpu.enabled``, so a pool's sidecars follow the CRD;
- the exceptions, each because the value changes form: ``transport.type`` ->
  ``peer.transport``; ``eviction.policy`` -> ``policy.name``; ``api.socketDir`` ->
  ``api.socket_path`` (the directory joined with ``kvpool.sock``); a Secret reference
  (``auth.secretRef``, ``redis.external.passwordSecretRef``, ``tenants[].tokenSecret``) ->
  the file it is mounted as (``peer.token_file``, ``index.password_file``,
  ``tenants[].token_file``); ``tenants[].quota`` -> ``quota_bytes`` or, for a percentage,
  ``quota_share``; ``tiers.disk.enabled: false`` -> no ``disk.path``.

``kv_events`` (vLLM-format KV events for routers) comes from ``spec.kvEvents``: its port
becomes ``kv_events.endpoint`` (``tcp://*:PORT``), ``replayPort`` ``kv_events.replay_endpoint``
the same way, and ``connectTo`` (a router that listens) ``kv_events.endpoint`` with
``kv_events.connect``; ``routers`` is the pool's NetworkPolicy rule, not a setting.

Deprecated names, still read (each logs a warning naming the new one): ``block_max_bytes``
(now ``max_block_bytes``) and ``peer.transport: mooncake`` (now ``rdma``).

The sections' settings are in modules of their own, each class importable from here too:
:mod:`~kvpool_sidecar.configtiers` (``dram``, ``disk``, ``gpu``, ``policy``),
:mod:`~kvpool_sidecar.configapi` (``api``), :mod:`~kvpool_sidecar.configtenants`
(``tenants[]``), :mod:`~kvpool_sidecar.configpool` (``index``, ``peer``) and
:mod:`~kvpool_sidecar.configevents` (``kv_events``). This module holds the top level
(:class:`SidecarSettings`) and the loading: sizes, deprecated names, the file, the
environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpool_sidecar.configapi import ApiSettings
from kvpool_sidecar.configcheck import MAX_SIZE, check_settings
from kvpool_sidecar.configevents import KvEventsSettings
from kvpool_sidecar.configpool import IndexSettings, PeerSettings
from kvpool_sidecar.configtenants import TenantSettings
from kvpool_sidecar.configtiers import DiskSettings, DramSettings, GpuSettings, PolicySettings
from kvpool_sidecar.errors import ConfigError

__all__ = ["DEPRECATED_NAMES", "ApiSettings", "DiskSettings", "DramSettings", "GpuSettings", "IndexSettings",
           "KvEventsSettings", "PeerSettings", "PolicySettings", "SidecarSettings", "TenantSettings",
           "load_settings", "parse_size", "read_secret", "settings_from_mapping", "tenant_connection_cap",
           "tenant_connection_reserve", "validate"]

logger = logging.getLogger(__name__)

#: Old names still read, with a warning: setting -> (old name, new name).
DEPRECATED_NAMES = {"max_block_bytes": ("block_max_bytes", "max_block_bytes"),
                    "peer.transport": ("mooncake", "rdma")}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?|k|)\s*$")
_FACTORS = {
    "": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}


def parse_size(value: object, field_name: str) -> int:
    """Bytes from an int or a Kubernetes quantity string; raises ConfigError.

    A size must fit in a signed 64-bit byte count (what mmap, ftruncate and the kernel
    take); a larger one is a ConfigError naming the field, not an OverflowError later.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        m = _QUANTITY.match(value)
        if not m:
            raise ConfigError(f"{field_name}: {value!r} is not a size (e.g. 4Gi, 512Mi, 1000000)")
        try:
            size = int(float(m.group(1)) * _FACTORS[m.group(2)])
        except OverflowError:  # so many digits that the float is infinite
            size = MAX_SIZE + 1
    else:
        raise ConfigError(f"{field_name}: expected a size, got {type(value).__name__}")
    if size < 0:
        raise ConfigError(f"{field_name}: size must not be negative")
    if size > MAX_SIZE:
        raise ConfigError(f"{field_name}: {value!r} is too large (at most {MAX_SIZE} bytes)")
    return size


def _parse_share(value: str, field_name: str) -> float:
    """A fraction from ``"25%"`` or ``"0.25"``; raises ConfigError."""
    text = value.strip()
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ConfigError(f"{field_name}: {value!r} is not a share (e.g. 25% or 0.25)") from None


@dataclass(frozen=True)
class SidecarSettings:
    """Everything the sidecar is configured with."""

    #: This node's name in the pool's index and in its node record (not empty); default the
    #: host name.
    node_name: str = field(default_factory=socket.gethostname)
    #: The pool's name in the index: the sidecars of one pool share it (with the redis index:
    #: letters, digits, '.', '_' and '-'; the operator renders ``<namespace>.<name>``);
    #: default ``default``.
    pool: str = "default"
    #: The largest block a client may put (the CRD's ``spec.maxBlockSize``); formerly
    #: ``block_max_bytes``, which is still read.
    max_block_bytes: int = 256 << 20
    dram: DramSettings = DramSettings()
    disk: DiskSettings = DiskSettings()
    gpu: GpuSettings = GpuSettings()
    api: ApiSettings = ApiSettings()
    policy: PolicySettings = PolicySettings()
    index: IndexSettings = IndexSettings()
    peer: PeerSettings = PeerSettings()
    kv_events: KvEventsSettings = KvEventsSettings()
    tenants: tuple[TenantSettings, ...] = (TenantSettings("default"),)
    #: The sidecar's logging level: DEBUG, INFO, WARNING or ERROR (any case); default INFO.
    log_level: str = "INFO"
    #: Freeze the objects that outlive a full garbage collection, so the next one walks
    #: only those made since (:mod:`kvpool_sidecar.collector`); false: Python's collector
    #: as it is, which walks every object the sidecar holds (half a second at 300,000 blocks).
    gc_freeze: bool = True
    #: Seconds between the collections of everything frozen (cycles among frozen objects
    #: wait for it; it pauses the sidecar as long as a full collection of its whole heap);
    #: 0: never.
    gc_reclaim_interval_s: float = 3600.0

    def tenant(self, name: str) -> TenantSettings | None:
        for t in self.tenants:
            if t.name == name:
                return t
        return None


_SIZE_FIELDS = {"size_bytes", "page_bytes", "max_frame_bytes", "max_unread_bytes", "quota_bytes", "max_block_bytes", "buffer_bytes",
                "min_block_bytes"}


def tenant_connection_cap(s: SidecarSettings) -> int:
    """The open local connections one tenant may hold: ``api.max_connections_per_tenant``,
    or its default (three quarters of ``api.max_connections`` where the node has several
    tenants, else all of them)."""
    if s.api.max_connections_per_tenant is not None:
        return s.api.max_connections_per_tenant
    if len(s.tenants) > 1:
        return max(1, s.api.max_connections * 3 // 4)
    return s.api.max_connections


def tenant_connection_reserve(s: SidecarSettings) -> int:
    """The slots kept for each tenant until it holds them: ``api.reserved_connections_per_tenant``,
    or its default (``api.max_connections`` over twice the tenants where the node has
    several, else none)."""
    if s.api.reserved_connections_per_tenant is not None:
        return s.api.reserved_connections_per_tenant
    if len(s.tenants) > 1:
        return s.api.max_connections // (2 * len(s.tenants))
    return 0


def read_secret(path: str | os.PathLike[str], field_path: str) -> bytes:
    """A secret from a file (a mounted Secret): at least 16 bytes once whitespace is stripped."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"{field_path}: cannot read {path}: {e.strerror}") from e
    if len(secret) < 16:
        raise ConfigError(f"{field_path}: the token in {path} is shorter than 16 bytes")
    return secret


def _build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise ConfigError(f"{where or 'settings'}: unknown setting(s) {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        if name in _SIZE_FIELDS and value is not None:
            value = parse_size(value, path)
        elif name == "quota_share" and isinstance(value, str):
            value = _parse_share(value, path)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where or 'settings'}: {e}") from e


def validate(s: SidecarSettings) -> None:
    """Raise ConfigError for any setting of the wrong type, out of range or inconsistent
    with another (the rules are in :mod:`~kvpool_sidecar.configcheck`)."""
    check_settings(s)


def _renamed(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with deprecated names replaced by their new ones, each with a warning."""
    old, new = DEPRECATED_NAMES["max_block_bytes"]
    if old in data:
        if new in data:
            raise ConfigError(f"{old}: deprecated name of {new}; give only {new}")
        logger.warning("config: %s is deprecated; use %s", old, new)
        data[new] = data.pop(old)
    peer = data.get("peer")
    old, new = DEPRECATED_NAMES["peer.transport"]
    if isinstance(peer, Mapping) and peer.get("transport") == old:
        logger.warning("config: peer.transport %r is deprecated; use %r", old, new)
        data["peer"] = {**peer, "transport": new}
    return data


def settings_from_mapping(data: Mapping[str, Any]) -> SidecarSettings:
    """Build and validate settings from a parsed config file."""
    if not isinstance(data, Mapping):
        raise ConfigError("config: top level must be a mapping")
    data = _renamed(dict(data))
    sections = {
        "dram": DramSettings, "disk": DiskSettings, "gpu": GpuSettings, "api": ApiSettings,
        "policy": PolicySettings, "index": IndexSettings, "peer": PeerSettings, "kv_events": KvEventsSettings,
    }
    kwargs: dict[str, Any] = {}
    for name, cls in sections.items():
        if name in data:
            kwargs[name] = _build(cls, data.pop(name) or {}, name)
    if "tenants" in data:
        raw = data.pop("tenants")
        if not isinstance(raw, list):
            raise ConfigError("tenants: expected a list")
        kwargs["tenants"] = tuple(_build(TenantSettings, t, f"tenants[{i}]") for i, t in enumerate(raw))
    top = _build(SidecarSettings, data, "")
    settings: SidecarSettings = dataclasses.replace(top, **kwargs)
    validate(settings)
    return settings


_ENV = {
    "KVPOOL_NODE_NAME": ("node_name", None),
    "KVPOOL_LOG_LEVEL": ("log_level", None),
    "KVPOOL_SOCKET_PATH": ("socket_path", "api"),
    "KVPOOL_TCP_PORT": ("tcp_port", "api"),
    "KVPOOL_HTTP_PORT": ("http_port", "api"),
    "KVPOOL_DRAM_SIZE": ("size_bytes", "dram"),
    "KVPOOL_DISK_PATH": ("path", "disk"),
    "KVPOOL_DISK_SIZE": ("size_bytes", "disk"),
    "KVPOOL_PEER_HOST": ("host", "peer"),
    "KVPOOL_PEER_ADVERTISE": ("advertise", "peer"),
    "KVPOOL_REDIS_URL": ("url", "index"),
}


def load_settings(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> SidecarSettings:
    """Load the config file at ``path`` (optional), apply ``KVPOOL_*`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if loaded is not None:
            if not isinstance(loaded, dict):
                raise ConfigError(f"config file {path}: top level must be a mapping")
            data = loaded
    env = os.environ if env is None else env
    for var, (name, section) in _ENV.items():
        if var not in env:
            continue
        raw: Any = env[var]
        if name.endswith("port"):
            try:
                raw = int(raw)
            except ValueError as e:
                raise ConfigError(f"{var}: expected a port number, got {raw!r}") from e
        target = data if section is None else data.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected a mapping")
        target[name] = raw
    return settings_from_mapping(data)
