"""Sidecar settings: sizes, env overrides and validation errors that name their field."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_sidecar.config import (
    DiskSettings,
    SidecarSettings,
    load_settings,
    parse_size,
    settings_from_mapping,
    tenant_connection_cap,
    tenant_connection_reserve,
)
from kvpool_sidecar.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("1G", 10**9),
        ("10G", 10 * 10**9),
        ("64Ki", 65536),
        ("2k", 2000),
        ("3K", 3000),
        ("1Ti", 2**40),
        ("1.5Gi", 3 * 2**29),
        (" 8Mi ", 8 * 2**20),
    ],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", ["4GB", "Gi", "-1Gi", "4 G i", "abc", "", True, 1.5, None, [1], -1])
def test_parse_size_rejects(value: object) -> None:
    with pytest.raises(ConfigError, match="^dram.size_bytes: "):
        parse_size(value, "dram.size_bytes")


def test_defaults_are_valid() -> None:
    s = load_settings(None, env={})
    assert isinstance(s, SidecarSettings)
    assert s.dram.page_bytes == 64 << 10
    assert s.disk.path is None
    assert s.tenant("default") is not None and s.tenant("nope") is None


def test_load_file_with_sizes(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        """
node_name: n1
max_block_bytes: 16Mi
dram: {size_bytes: 4Gi, page_bytes: 128Ki, populate: false}
disk: {path: /var/kvpool, size_bytes: 1G, fsync: always, compression: zstd}
tenants:
  - {name: a, priority: 2, quota_bytes: 512Mi}
  - {name: b}
"""
    )
    s = load_settings(cfg, env={})
    assert s.node_name == "n1"
    assert s.max_block_bytes == 16 << 20
    assert s.dram.size_bytes == 4 << 30 and s.dram.page_bytes == 128 << 10 and s.dram.populate is False
    assert s.disk == DiskSettings(path="/var/kvpool", size_bytes=10**9, fsync="always", compression="zstd")
    assert [(t.name, t.priority, t.quota_bytes) for t in s.tenants] == [("a", 2, 512 << 20), ("b", 0, None)]


def test_env_overrides_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("node_name: from-file\ndram: {size_bytes: 1Gi}\napi: {http_port: 1000}\n")
    env = {
        "KVPOOL_NODE_NAME": "from-env",
        "KVPOOL_DRAM_SIZE": "2Gi",
        "KVPOOL_DISK_PATH": str(tmp_path / "disk"),
        "KVPOOL_DISK_SIZE": "10Gi",
        "KVPOOL_HTTP_PORT": "9999",
        "KVPOOL_TCP_PORT": "7000",
        "KVPOOL_SOCKET_PATH": "/tmp/x.sock",
        "KVPOOL_LOG_LEVEL": "debug",
        "UNRELATED": "1",
    }
    s = load_settings(cfg, env=env)
    assert s.node_name == "from-env"
    assert s.dram.size_bytes == 2 << 30
    assert s.disk.path == str(tmp_path / "disk") and s.disk.size_bytes == 10 << 30
    assert s.api.http_port == 9999 and s.api.tcp_port == 7000
    assert s.api.socket_path == "/tmp/x.sock"
    assert s.log_level == "debug"


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_NODE_NAME", "from-os-env")
    assert load_settings(None).node_name == "from-os-env"


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"KVPOOL_HTTP_PORT": "http"}, "KVPOOL_HTTP_PORT"),
        ({"KVPOOL_TCP_PORT": "99999"}, "api.tcp_port"),
        ({"KVPOOL_DRAM_SIZE": "lots"}, "dram.size_bytes"),
        ({"KVPOOL_DISK_SIZE": "1Gi"}, "disk.path"),
    ],
)
def test_bad_env_names_its_field(env: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        load_settings(None, env=env)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"bogus": 1}, r"settings: unknown setting\(s\) \['bogus'\]"),
        ({"dram": {"size": 1}}, r"dram: unknown setting\(s\) \['size'\]"),
        ({"disk": {"path": "/x", "size_bytes": 1, "sync": "always"}}, r"disk: unknown setting\(s\) \['sync'\]"),
        ({"tenants": [{"name": "a", "weight": 1}]}, r"tenants\[0\]: unknown setting\(s\) \['weight'\]"),
        ({"disk": {"path": "/x", "size_bytes": "1Gi", "fsync": "sometimes"}}, "disk.fsync"),
        ({"disk": {"size_bytes": "1Gi"}}, "disk.path"),
        ({"disk": {"path": "/x"}}, "disk.size_bytes"),
        ({"disk": {"path": "/x", "size_bytes": 1, "compression": "lz4"}}, "disk.compression"),
        ({"disk": {"path": "/x", "size_bytes": 1, "layout": "extents"}}, "disk.layout"),
        ({"disk": {"path": "/x", "size_bytes": "1Mi", "min_block_bytes": "2Mi"}}, "disk.min_block_bytes"),
        ({"disk": {"path": "/x", "size_bytes": "1Mi", "min_block_bytes": -1}}, "disk.min_block_bytes"),
        ({"disk": {"path": "/x", "size_bytes": "1Mi", "min_block_bytes": True}}, "disk.min_block_bytes"),
        ({"dram": {"page_bytes": 1000}}, "dram.page_bytes"),
        ({"dram": {"page_bytes": 6144}}, "dram.page_bytes"),
        ({"dram": {"page_bytes": 2048}}, "dram.page_bytes"),
        ({"dram": {"size_bytes": 4096, "page_bytes": 8192}}, "dram.size_bytes"),
        ({"dram": {"size_bytes": "1Gigabyte"}}, "dram.size_bytes"),
        ({"dram": {"put_waits_for_disk": "no"}}, "dram.put_waits_for_disk"),
        ({"dram": {"populate": "no"}}, "dram.populate"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenants"),
        ({"tenants": []}, "tenants"),
        ({"tenants": {"name": "a"}}, "tenants"),
        ({"tenants": [{"name": "a", "quota_bytes": 0}]}, r"tenants\[0\].quota_bytes"),
        ({"tenants": [{"name": "a", "priority": "high"}]}, r"tenants\[0\].priority"),
        ({"tenants": [{"name": "a", "quota_share": "half"}]}, r"tenants\[0\].quota_share"),
        ({"tenants": [{"name": "t" * 64}]}, r"tenants\[0\].name"),
        ({"tenants": [{"name": "a b"}]}, r"tenants\[0\].name"),
        ({"tenants": [{"name": "-a"}]}, r"tenants\[0\].name"),
        ({"tenants": [{"name": "a", "key_space": ""}]}, r"tenants\[0\].key_space"),
        ({"tenants": [{"name": "a", "key_space": "x/y"}]}, r"tenants\[0\].key_space"),
        ({"tenants": [{"name": "a", "quota_share": 0}]}, r"tenants\[0\].quota_share"),
        ({"tenants": [{"name": "a", "quota_share": "150%"}]}, r"tenants\[0\].quota_share"),
        ({"tenants": [{"name": "a", "quota_share": [1]}]}, r"tenants\[0\].quota_share"),
        ({"tenants": [{"name": "a", "quota_share": 0.5, "quota_bytes": 10}]}, r"tenants\[0\]"),
        ({"api": {"http_port": 70000}}, "api.http_port"),
        ({"api": {"tcp_port": -1}}, "api.tcp_port"),
        ({"api": {"http_port": "80"}}, "api.http_port"),
        ({"api": {"http_port": True}}, "api.http_port"),
        ({"api": {"lease_timeout_s": 0}}, "api.lease_timeout_s"),
        ({"api": {"max_inflight": 0}}, "api.max_inflight"),
        ({"api": {"max_connections": 0}}, "api.max_connections"),
        ({"api": {"max_connections_per_tenant": 0}}, "api.max_connections_per_tenant"),
        ({"api": {"max_connections_per_tenant": True}}, "api.max_connections_per_tenant"),
        ({"api": {"reserved_connections_per_tenant": -1}}, "api.reserved_connections_per_tenant"),
        ({"api": {"reserved_connections_per_tenant": "2"}}, "api.reserved_connections_per_tenant"),
        ({"api": {"max_unread_bytes": "1Mi"}}, "api.max_unread_bytes"),  # less than one answer (64 MiB)
        ({"api": {"max_unread_bytes": 0, "max_frame_bytes": 4096}}, "api.max_unread_bytes"),
        # past half the longest answer the clients read (1 GiB): an inline get of large blocks
        # over TCP had been refused by them on every read
        ({"api": {"max_frame_bytes": "2Gi", "max_unread_bytes": "4Gi"}}, "api.max_frame_bytes"),
        ({"api": {"max_batch": 10_000_000}}, "api.max_batch"),  # answers past what the clients read
        ({"api": {"socket_path": "", "tcp_port": None}}, "api"),
        ({"index": {"backend": "etcd"}}, "index.backend"),
        ({"index": {"backend": "redis"}}, "index.url"),
        ({"gpu": {"fraction": 0.95}}, "gpu.fraction"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"gc_freeze": "yes"}, "gc_freeze"),
        ({"gc_reclaim_interval_s": -1}, "gc_reclaim_interval_s"),
        ({"gc_reclaim_interval_s": float("inf")}, "gc_reclaim_interval_s"),
        ({"gc_reclaim_interval_s": "1h"}, "gc_reclaim_interval_s"),
        ({"node_name": ""}, "node_name"),
        ({"max_block_bytes": 0}, "max_block_bytes"),
        ({"block_max_bytes": 0}, "max_block_bytes"),  # the deprecated name, checked as the new one
        ({"block_max_bytes": "1Mi", "max_block_bytes": "1Mi"}, "block_max_bytes"),
        ({"peer": {"enabled": True, "transport": "udp", "token_file": "/t"},
          "index": {"backend": "redis", "url": "redis://r"}}, "peer.transport"),
        ({"peer": {"enabled": True, "token_file": "/t", "pipelined_receive": "yes"},
          "index": {"backend": "redis", "url": "redis://r"}}, "peer.pipelined_receive"),
        ({"api": {"socket_path": "/run/kvpool/" + "x" * 90 + "/kvpool.sock"}}, "api.socket_path"),
        ({"dram": [1, 2]}, "dram"),
    ],
)
def test_validation_errors_name_their_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}"):
        settings_from_mapping(data)


def test_deprecated_names_are_read_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The CRD's names won (maxBlockSize -> max_block_bytes, transport rdma): files written with
    the sidecar's old names still load, and say which name to use."""
    peer = {"enabled": True, "token_file": "/t", "transport": "mooncake"}
    with caplog.at_level(logging.WARNING, logger="kvpool_sidecar.config"):
        s = settings_from_mapping({"block_max_bytes": "16Mi", "peer": peer,
                                   "index": {"backend": "redis", "url": "redis://r"}})
    assert s.max_block_bytes == 16 << 20 and s.peer.transport == "rdma"
    warned = [r.getMessage() for r in caplog.records]
    assert any("block_max_bytes is deprecated; use max_block_bytes" in m for m in warned), warned
    assert any("'mooncake' is deprecated; use 'rdma'" in m for m in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool_sidecar.config"):
        s = settings_from_mapping({"max_block_bytes": "1Mi", "peer": {**peer, "transport": "rdma"},
                                   "index": {"backend": "redis", "url": "redis://r"}})
    assert s.max_block_bytes == 1 << 20 and s.peer.transport == "rdma" and caplog.records == []


def test_valid_ports_and_tenants_load() -> None:
    s = settings_from_mapping(
        {"api": {"http_port": None, "tcp_port": 0}, "tenants": [{"name": "a", "quota_bytes": "1Mi"}]}
    )
    assert s.api.http_port is None and s.api.tcp_port == 0
    assert s.tenant("a") is not None and s.tenant("a").quota_bytes == 1 << 20  # type: ignore[union-attr]


@pytest.mark.parametrize("field", ["name", "key_space"])
def test_a_tenant_name_ending_in_a_newline_is_refused(field: str) -> None:
    tenant = {"name": "a", field: "a\n"}  # ("$" matches before a final newline: names match whole)
    with pytest.raises(ConfigError, match=field):
        settings_from_mapping({"tenants": [tenant]})


def test_a_quota_share_is_a_fraction_of_the_dram_tier() -> None:
    s = settings_from_mapping({"dram": {"size_bytes": "1Gi"}, "tenants": [
        {"name": "a", "quota_share": "25%"}, {"name": "b", "quota_share": 0.5}, {"name": "c", "quota_bytes": "1Mi"},
        {"name": "d"}]})
    dram = s.dram.size_bytes
    assert [t.quota(dram) for t in s.tenants] == [256 << 20, 512 << 20, 1 << 20, None]


def test_empty_sections_take_defaults() -> None:
    s = settings_from_mapping({"dram": None, "policy": {}})
    assert s.dram == SidecarSettings().dram
    assert s.policy.name == "prefix"


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_settings(tmp_path, env={})  # a directory


@pytest.mark.parametrize("text", ["dram: {size_bytes: [", "a: b: c", "\tdram: 1", "key: 'unterminated"])
def test_invalid_yaml(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(cfg, env={})


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just a string\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_settings(cfg, env={})


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("# nothing\n")
    assert load_settings(cfg, env={}).dram == SidecarSettings().dram


def test_section_env_override_into_a_non_mapping_section(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("dram: 5\n")
    with pytest.raises(ConfigError, match="^dram"):
        load_settings(cfg, env={"KVPOOL_DRAM_SIZE": "1Gi"})


def test_the_store_enforces_the_share_as_bytes() -> None:
    from kvpool_sidecar.__main__ import build_store

    s = settings_from_mapping({"dram": {"size_bytes": "64Mi", "populate": False},
                               "tenants": [{"name": "default"}, {"name": "a", "quota_share": "25%"}]})
    store = build_store(s, None, arena=False)
    assert store.limits("a").quota_bytes == 16 << 20
    assert store.limits("default").quota_bytes is None


def test_the_readme_example_config_loads() -> None:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("node_name: gpu-node-1")
    s = settings_from_mapping(yaml.safe_load(text[start : text.index("```", start)]))
    assert [t.space for t in s.tenants] == ["default", "premium", "batch", "batch"]
    assert s.tenant("batch") is not None and s.tenant("batch").quota(s.dram.size_bytes) == 16 << 30  # type: ignore[union-attr]


def test_the_index_lookup_cache_is_a_setting_with_bounds() -> None:
    assert settings_from_mapping({}).index.lookup_cache_s == 1.0
    assert settings_from_mapping({"index": {"lookup_cache_s": 0}}).index.lookup_cache_s == 0
    for bad in (-1, 61):
        with pytest.raises(ConfigError, match="index.lookup_cache_s"):
            settings_from_mapping({"index": {"lookup_cache_s": bad}})


def test_a_tenants_connection_cap_defaults_to_three_quarters_of_the_slots_where_tenants_share_a_node() -> None:
    one = settings_from_mapping({"api": {"max_connections": 100}})
    several = settings_from_mapping({"api": {"max_connections": 100}, "tenants": [{"name": "default"}, {"name": "a"}]})
    named = settings_from_mapping({"api": {"max_connections": 100, "max_connections_per_tenant": 10},
                                   "tenants": [{"name": "default"}, {"name": "a"}]})
    assert [tenant_connection_cap(s) for s in (one, several, named)] == [100, 75, 10]


def test_each_tenant_keeps_a_reserve_of_slots_where_tenants_share_a_node() -> None:
    one = settings_from_mapping({"api": {"max_connections": 100}})
    three = settings_from_mapping({"api": {"max_connections": 100},
                                   "tenants": [{"name": "default"}, {"name": "a"}, {"name": "b"}]})
    named = settings_from_mapping({"api": {"max_connections": 100, "reserved_connections_per_tenant": 30},
                                   "tenants": [{"name": "default"}, {"name": "a"}, {"name": "b"}]})
    assert [tenant_connection_reserve(s) for s in (one, three, named)] == [0, 16, 30]
    with pytest.raises(ConfigError, match="reserves together exceed api.max_connections"):
        settings_from_mapping({"api": {"max_connections": 100, "reserved_connections_per_tenant": 34},
                               "tenants": [{"name": "default"}, {"name": "a"}, {"name": "b"}]})


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("data", "field"),
    [
        # a quoted boolean is a string, and any non-empty string was true: the tier or the peers on
        ({"gpu": {"enabled": "false"}}, "gpu.enabled"),
        ({"peer": {"enabled": "false", "token_file": "/t"}, "index": {"backend": "redis", "url": "redis://r"}},
         "peer.enabled"),
        ({"policy": {"demote": "no"}}, "policy.demote"),
        ({"index": {"cluster": "false"}}, "index.cluster"),
        ({"peer": {"sendfile": 1}}, "peer.sendfile"),
        # NaN passes every range check (nan <= 0 is false): a stranger never closed, the index never asked
        ({"api": {"hello_timeout_s": _NAN}}, "api.hello_timeout_s"),
        ({"api": {"frame_timeout_s": _NAN}}, "api.frame_timeout_s"),
        ({"api": {"index_keys_per_s": _NAN}}, "api.index_keys_per_s"),
        ({"api": {"lease_timeout_s": _NAN}}, "api.lease_timeout_s"),
        ({"api": {"http_deadline_s": _INF}}, "api.http_deadline_s"),
        ({"api": {"drain_s": _INF}}, "api.drain_s"),
        ({"index": {"heartbeat_s": _NAN}}, "index.heartbeat_s"),
        ({"peer": {"fetch_timeout_s": _NAN}}, "peer.fetch_timeout_s"),
        ({"index": {"heartbeat_s": 10**400}}, "index.heartbeat_s"),  # (math.isfinite overflowed: a traceback)
        # values of the wrong type had raised TypeError or AttributeError, a traceback
        ({"dram": {"clean_share": "10%"}}, "dram.clean_share"),
        ({"gpu": {"fraction": "0.1"}}, "gpu.fraction"),
        ({"api": {"max_batch": "64"}}, "api.max_batch"),
        ({"api": {"max_index_keys": 1.5}}, "api.max_index_keys"),
        ({"api": {"hello_timeout_s": None}}, "api.hello_timeout_s"),
        ({"disk": {"path": "/x", "size_bytes": None}}, "disk.size_bytes"),
        ({"disk": {"path": "/x", "size_bytes": 1, "compression_level": "3"}}, "disk.compression_level"),
        ({"log_level": 10}, "log_level"),
        ({"tenants": [{"name": ["a"]}]}, r"tenants\[0\].name"),
        ({"pool": 5}, "pool"),
        ({"index": {"backend": "redis", "url": 6379}}, "index.url"),
        # accepted, then wrong or a crash at start
        ({"api": {"socket_mode": "0660"}}, "api.socket_mode"),
        ({"api": {"socket_mode": 660}}, "api.socket_mode"),  # decimal: 0o1224
        ({"api": {"socket_mode": -1}}, "api.socket_mode"),
        ({"gpu": {"device": -1}}, "gpu.device"),
        ({"gpu": {"device": "cuda:1"}}, "gpu.device"),
        ({"kv_events": {"hwm": 2**40}}, "kv_events.hwm"),  # libzmq's option is a C int
        ({"tenants": [{"name": "a", "priority": 10**30}]}, r"tenants\[0\].priority"),
    ],
)
def test_a_setting_of_the_wrong_type_or_not_finite_is_refused_naming_it(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        settings_from_mapping(data)


def test_a_not_a_number_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("api:\n  hello_timeout_s: .nan\n")
    with pytest.raises(ConfigError, match="^api.hello_timeout_s: expected a finite number"):
        load_settings(path, env={})

