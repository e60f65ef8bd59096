"""The rules a sidecar's settings must follow (:func:`check_settings`): each field of its
declared type, each value in its range, and the settings consistent with each other.

:mod:`~kvpool_sidecar.config` builds the settings from a file and the environment and has
them checked here before anything starts; a setting that breaks a rule is a
:class:`~kvpool_sidecar.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from typing import TYPE_CHECKING, Any

from kvpool_client.answers import MOST_ANSWER_BYTES
from kvpool_sidecar.errors import ConfigError

if TYPE_CHECKING:
    from kvpool_sidecar.config import KvEventsSettings, SidecarSettings

#: Peer transports: ``tcp`` (built in) and ``rdma`` (the Mooncake Transfer Engine, RDMA where
#: NICs exist; falls back to tcp where it cannot run). The CRD's ``spec.transport.type``
#: takes the same names.
TRANSPORTS = ("tcp", "rdma")
#: The longest Unix socket path the kernel binds (``sun_path`` holds 108 bytes with its NUL).
MAX_SOCKET_PATH_BYTES = 107
#: How KV events are encoded: ``tagged`` (vLLM's since 2026: each event a map whose
#: ``type`` names it) or ``array`` (the older positional form, the type name first).
KV_EVENT_ENCODINGS = ("tagged", "array")
#: The largest size in bytes, or integer setting (a signed 64-bit count).
MAX_SIZE = 2**63 - 1
#: The largest ``api.max_frame_bytes``: the clients read no answer longer than twice it.
MAX_FRAME_BYTES = MOST_ANSWER_BYTES // 2
#: The largest ``api.max_batch``: an ACQUIRE answer of that many blocks, of up to 2,000
#: extents each, stays within the objects the clients read of one answer.
MAX_BATCH = 16384

#: Tenant and key space names (as in the CRD, upper case allowed): they go into disk block
#: headers and Redis, so they are short and plain.
_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

#: The largest count libzmq's options take (a C int).
_MAX_INT32 = 2**31 - 1


def _check_fields(obj: object, where: str) -> None:
    """Each field of the settings dataclass ``obj`` holds a value of its declared type: a
    ``bool`` a boolean (the string ``"false"`` had turned a tier or the peers on), an ``int``
    an integer of at most 64 bits, a ``float`` a finite number (NaN had passed every range
    check, as ``nan <= 0`` is false: a ``hello_timeout_s`` of NaN never closed a stranger),
    a ``str`` a string; ``None`` only where the type allows it. Sections, tenants and lists
    are checked elsewhere. Raises ConfigError naming the field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        path = f"{where}.{f.name}" if where else f.name
        _check_value(getattr(obj, f.name), hints[f.name], path)


def _check_value(value: object, hint: Any, path: str) -> None:
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            _check_value(value, rest[0], path)
        return
    if hint is bool:
        if type(value) is not bool:
            raise ConfigError(f"{path}: expected true or false, got {_kind(value)}")
    elif hint is int:
        if type(value) is not int:
            raise ConfigError(f"{path}: expected an integer, got {_kind(value)}")
        if abs(value) > MAX_SIZE:
            raise ConfigError(f"{path}: {value} is out of range (at most {MAX_SIZE})")
    elif hint is float:
        if type(value) not in (int, float):
            raise ConfigError(f"{path}: expected a number, got {_kind(value)}")
        if type(value) is int and abs(value) > MAX_SIZE or not math.isfinite(value):  # type: ignore[arg-type]
            raise ConfigError(f"{path}: expected a finite number, got {_kind(value)}")
    elif hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {_kind(value)}")


def _kind(value: object) -> str:
    """What a value of the wrong type is, for an error message: a short scalar's repr, else
    its type's name only (a list may hold a URL with its password)."""
    if value is None:
        return "nothing (null)"
    text = repr(value)
    if isinstance(value, (str, int, float)) and len(text) <= 40:
        return f"{type(value).__name__} {text}"
    return type(value).__name__


def check_settings(s: SidecarSettings) -> None:
    """Raise ConfigError for any setting of the wrong type, out of range or inconsistent with
    another."""
    _check_fields(s, "")
    for section in ("dram", "disk", "gpu", "api", "policy", "index", "peer", "kv_events"):
        _check_fields(getattr(s, section), section)
    if not isinstance(s.tenants, (list, tuple)):
        raise ConfigError("tenants: expected a list")
    for i, t in enumerate(s.tenants):
        if not dataclasses.is_dataclass(t) or isinstance(t, type):
            raise ConfigError(f"tenants[{i}]: expected a tenant")
        _check_fields(t, f"tenants[{i}]")
    if not s.node_name:
        raise ConfigError("node_name: must not be empty")
    if s.dram.page_bytes < 4096 or s.dram.page_bytes & (s.dram.page_bytes - 1):
        raise ConfigError("dram.page_bytes: must be a power of two of at least 4096")
    if s.dram.size_bytes < s.dram.page_bytes:
        raise ConfigError("dram.size_bytes: must hold at least one page")
    if s.max_block_bytes <= 0:
        raise ConfigError("max_block_bytes: must be positive")
    if s.disk.path is not None:
        if s.disk.size_bytes <= 0:
            raise ConfigError("disk.size_bytes: a disk tier needs a positive size")
    elif s.disk.size_bytes:
        raise ConfigError("disk.path: a disk tier with a size needs a path")
    if s.disk.fsync not in ("always", "never"):
        raise ConfigError("disk.fsync: must be 'always' or 'never'")
    if s.disk.compression not in ("none", "zstd"):
        raise ConfigError("disk.compression: must be 'none' or 'zstd'")
    if not 1 <= s.disk.compression_level <= 22:
        raise ConfigError("disk.compression_level: must be in 1..22")
    if s.disk.layout not in ("segments", "files"):
        raise ConfigError("disk.layout: must be 'segments' or 'files'")
    if s.disk.min_block_bytes is not None:
        if s.disk.min_block_bytes < 0 or (s.disk.path is not None and s.disk.min_block_bytes > s.disk.size_bytes):
            raise ConfigError("disk.min_block_bytes: must be at least 0 and at most disk.size_bytes")
    if not 0.0 <= s.index.lookup_cache_s <= 60.0:
        raise ConfigError("index.lookup_cache_s: must be in [0, 60]")
    if not 0.0 < s.gpu.fraction <= 0.9:
        raise ConfigError("gpu.fraction: must be in (0, 0.9]")
    if not 0.0 <= s.gpu.engine_reserve < 1.0:
        raise ConfigError("gpu.engine_reserve: must be in [0, 1)")
    if not 1 <= s.gpu.promote_after_hits <= 1_000_000:
        raise ConfigError("gpu.promote_after_hits: must be in 1..1000000")
    if s.gpu.device < 0:
        raise ConfigError("gpu.device: must not be negative")
    if not 0 <= s.api.socket_mode <= 0o777:
        raise ConfigError(f"api.socket_mode: {s.api.socket_mode!r} is not a file mode in 0..0o777 (write it in "
                          "octal with a leading zero: 0660 in YAML, not 660)")
    if not s.api.socket_path and s.api.tcp_port is None:
        raise ConfigError("api: give a socket_path, a tcp_port or both")
    if s.api.socket_path:
        if len(os.fsencode(s.api.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(f"api.socket_path: {s.api.socket_path!r} is longer than the "
                              f"{MAX_SOCKET_PATH_BYTES} bytes a Unix socket path may have")
    for port_name, port in (("api.tcp_port", s.api.tcp_port), ("api.http_port", s.api.http_port)):
        if port is not None:
            if not 0 <= port <= 65535:
                raise ConfigError(f"{port_name}: must be in 0..65535")
    if s.api.max_batch <= 0 or s.api.max_frame_bytes < 4096:
        raise ConfigError("api: max_batch must be positive and max_frame_bytes at least 4096")
    if s.api.max_batch > MAX_BATCH:
        # an ACQUIRE answer of that many blocks past the objects the clients read of one
        # answer (kvpool_client.answers.MOST_ANSWER_OBJECTS): refused on every such read
        raise ConfigError(f"api.max_batch: at most {MAX_BATCH}, not {s.api.max_batch}")
    if s.api.max_frame_bytes > MAX_FRAME_BYTES:
        # the clients read no answer past twice this (kvpool_client.answers.MOST_ANSWER_BYTES),
        # whatever HELLO says: a larger frame (an inline get of large blocks) would end its
        # connection on every such read
        raise ConfigError(f"api.max_frame_bytes: at most {MAX_FRAME_BYTES} (512Mi), not {s.api.max_frame_bytes}")
    if s.api.drain_s < 0:
        raise ConfigError("api.drain_s: must not be negative")
    if s.api.max_inflight <= 0:
        raise ConfigError("api.max_inflight: must be positive")
    if s.api.max_connections <= 0:
        raise ConfigError("api.max_connections: must be positive")
    if s.api.http_max_connections <= 0:
        raise ConfigError("api.http_max_connections: must be positive")
    if s.api.http_deadline_s <= 0:
        raise ConfigError("api.http_deadline_s: must be positive")
    if s.api.max_unread_bytes < s.api.max_frame_bytes:
        raise ConfigError("api.max_unread_bytes: must be at least api.max_frame_bytes (one answer)")
    if s.api.max_connections_per_tenant is not None:
        if s.api.max_connections_per_tenant <= 0:
            raise ConfigError("api.max_connections_per_tenant: must be positive (or unset)")
    if s.api.reserved_connections_per_tenant is not None:
        if s.api.reserved_connections_per_tenant < 0:
            raise ConfigError("api.reserved_connections_per_tenant: must not be negative (or unset)")
        if s.api.reserved_connections_per_tenant * max(1, len(s.tenants)) > s.api.max_connections:
            raise ConfigError("api.reserved_connections_per_tenant: the tenants' reserves together exceed "
                              "api.max_connections")
    if s.api.lease_timeout_s <= 0:
        raise ConfigError("api.lease_timeout_s: must be positive")
    if s.index.backend not in ("memory", "redis"):
        raise ConfigError("index.backend: must be 'memory' or 'redis'")
    if s.index.backend == "redis" and not s.index.url:
        raise ConfigError("index.url: the redis index needs a URL")
    if s.index.heartbeat_s <= 0 or s.index.sweep_s <= 0 or s.index.timeout_s <= 0:
        raise ConfigError("index: heartbeat_s, sweep_s and timeout_s must be positive")
    if s.peer.enabled:
        if s.index.backend != "redis":
            raise ConfigError("peer.enabled: peers find each other through the redis index; set index.backend")
        if not s.peer.token_file:
            raise ConfigError("peer.token_file: peer transfers need the pool's shared secret")
        if s.peer.transport not in TRANSPORTS:
            raise ConfigError("peer.transport: must be 'tcp' or 'rdma'")
        if not 0 <= s.peer.port <= 65535:
            raise ConfigError("peer.port: must be in 0..65535")
        if s.peer.fetch_timeout_s <= 0 or s.peer.lookup_timeout_s <= 0 or s.peer.connections_per_peer <= 0:
            raise ConfigError("peer: fetch_timeout_s, lookup_timeout_s and connections_per_peer must be positive")
    names = [t.name for t in s.tenants]
    if not names:
        raise ConfigError("tenants: at least one tenant is needed")
    if len(set(names)) != len(names):
        raise ConfigError("tenants: names must be unique")
    for i, t in enumerate(s.tenants):
        if not _NAME.fullmatch(t.name):
            raise ConfigError(f"tenants[{i}].name: {t.name!r} must be 1-63 letters, digits, '-', '_' or '.', "
                              "starting and ending with a letter or digit")
        if t.quota_bytes is not None and t.quota_bytes <= 0:
            raise ConfigError(f"tenants[{i}].quota_bytes: must be positive")
        if t.key_space is not None:
            if not _NAME.fullmatch(t.key_space):
                raise ConfigError(f"tenants[{i}].key_space: {t.key_space!r} must be a name like a tenant's")
        for field_name in ("uids", "gids"):
            ids = getattr(t, field_name)
            if not isinstance(ids, (list, tuple)) or not all(type(x) is int and x >= 0 for x in ids):
                raise ConfigError(f"tenants[{i}].{field_name}: expected a list of non-negative integers")
            object.__setattr__(t, field_name, tuple(ids))
        if t.quota_share is not None:
            if not 0 < t.quota_share <= 1:
                raise ConfigError(f"tenants[{i}].quota_share: must be a fraction in (0, 1]")
            if t.quota_bytes is not None:
                raise ConfigError(f"tenants[{i}]: set quota_bytes or quota_share, not both")
    if not 0 < s.api.max_session_share <= 1:
        raise ConfigError("api.max_session_share: must be a fraction in (0, 1]")
    if s.api.max_index_keys <= 0 or s.api.index_concurrency <= 0 or s.api.index_keys_per_s <= 0:
        raise ConfigError("api.max_index_keys, api.index_concurrency and api.index_keys_per_s must be positive")
    if s.api.hello_timeout_s <= 0 or s.api.frame_timeout_s <= 0:
        raise ConfigError("api.hello_timeout_s and api.frame_timeout_s must be positive")
    if not 0 <= s.dram.clean_share < 1:
        raise ConfigError("dram.clean_share: must be a fraction in [0, 1)")
    if s.api.shared_arena not in ("per-space", "shared", "never"):
        raise ConfigError("api.shared_arena: must be 'per-space', 'shared' or 'never'")
    if not 0 <= s.gc_reclaim_interval_s < float("inf"):
        raise ConfigError("gc_reclaim_interval_s: must be 0 (never) or a positive number of seconds")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError("log_level: must be DEBUG, INFO, WARNING or ERROR")
    _validate_kv_events(s.kv_events, names)


def _validate_kv_events(k: KvEventsSettings, tenants: list[str]) -> None:
    addresses: list[tuple[str, str]] = [("endpoint", k.endpoint)]
    if k.replay_endpoint is not None:
        addresses.append(("replay_endpoint", k.replay_endpoint))
    for name, value in addresses:  # (strings: every field is of its declared type by now)
        if not value.startswith(("tcp://", "ipc://")) or len(value) <= len("tcp://"):
            raise ConfigError(f"kv_events.{name}: {value!r} is not a ZMQ address (tcp://HOST:PORT or ipc://PATH)")
    if k.replay_endpoint == k.endpoint and not k.endpoint.endswith((":0", ":*")):  # (any free port: two)
        raise ConfigError("kv_events.replay_endpoint: must differ from kv_events.endpoint")
    for name in ("buffer_steps", "buffer_bytes", "queue_size", "hwm"):
        if getattr(k, name) <= 0:
            raise ConfigError(f"kv_events.{name}: must be positive")
    if k.hwm > _MAX_INT32:  # (libzmq takes an int)
        raise ConfigError(f"kv_events.hwm: must be at most {_MAX_INT32}")
    if k.encoding not in KV_EVENT_ENCODINGS:
        raise ConfigError(f"kv_events.encoding: must be one of {', '.join(KV_EVENT_ENCODINGS)}")
    if not isinstance(k.tenants, (list, tuple)) or not all(isinstance(t, str) for t in k.tenants):
        raise ConfigError("kv_events.tenants: expected a list of tenant names")
    unknown = sorted(set(k.tenants) - set(tenants))
    if unknown:
        raise ConfigError(f"kv_events.tenants: no such tenant(s) {unknown}")
    object.__setattr__(k, "tenants", tuple(k.tenants))
