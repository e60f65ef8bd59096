"""Sizes too large for any machine: refused by name in the operator and in the sidecar."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_operator.errors import InvalidSpecError
from kvpool_operator.quantity import parse_bytes
from kvpool_operator.spec import MAX_SIZES, parse_spec
from kvpool_sidecar.config import parse_size, settings_from_mapping
from kvpool_sidecar.errors import ConfigError


def _spec_with(key: str, value: object) -> dict[str, Any]:
    """A spec that sets the MAX_SIZES field ``key`` to ``value`` (and whatever it needs)."""
    big = {"maxBlockSize": "1Mi", "tiers": {"dram": {"size": "1Gi"}}}
    if key == "maxBlockSize":
        return {**big, "maxBlockSize": value}
    if key == "tiers.dram.size":
        return {"tiers": {"dram": {"size": value}}}
    if key == "tiers.disk.size":
        return {"tiers": {"disk": {"path": "/mnt/kv", "size": value}}}
    if key == "tiers.gpu.size":
        return {"tiers": {"gpu": {"enabled": True, "size": value}}}
    if key == "redis.managed.storage":
        return {"redis": {"managed": {"storage": value}}}
    assert key == "tenants[].quota"
    return {"tenants": [{"name": "a", "quota": value}]}


@pytest.mark.parametrize("key", sorted(MAX_SIZES))
def test_the_operator_refuses_a_size_over_its_maximum_by_name(key: str) -> None:
    field = "spec." + key.replace("[]", "[0]")
    parse_spec("p", "ns", _spec_with(key, MAX_SIZES[key]))  # the maximum itself is fine
    for too_large in ("1000000Ei", parse_bytes(MAX_SIZES[key], "x") + 1):
        with pytest.raises(InvalidSpecError) as info:
            parse_spec("p", "ns", _spec_with(key, too_large))
        assert info.value.field == field and "too large" in str(info.value)
        assert MAX_SIZES[key] in str(info.value)


@pytest.mark.parametrize("value", [2**80, "9" * 400, "99999999999999999999Pi"])
def test_the_sidecar_refuses_a_size_it_cannot_hold(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "dram.size_bytes")
    assert str(info.value).startswith("dram.size_bytes:") and "too large" in str(info.value)


def test_a_rendered_size_too_large_is_a_config_error_naming_the_field() -> None:
    """What an operator without bounds rendered for ``size: 1000000Ei`` (bytes, an int)."""
    with pytest.raises(ConfigError) as info:
        settings_from_mapping({"node_name": "n", "dram": {"size_bytes": parse_bytes("1000000Ei", "x")}})
    assert "dram.size_bytes" in str(info.value) and "too large" in str(info.value)


def test_every_maximum_the_operator_allows_loads_in_the_sidecar() -> None:
    for limit in MAX_SIZES.values():
        assert parse_size(parse_bytes(limit, "x"), "f") == parse_bytes(limit, "x")
