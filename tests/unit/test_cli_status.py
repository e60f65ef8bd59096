"""``kvpool status --pool``: the pool a user names, resolved against the pools of the index."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from kvpool_sidecar.cli import PoolNameError, main, resolve_pool

KNOWN = ["default", "prod", "team-a.cache", "team-a.solo", "team-b.cache"]


@pytest.mark.parametrize(("typed", "pool"), [
    ("team-a.cache", "team-a.cache"),  # the index's own name
    ("team-a/cache", "team-a.cache"),  # kubectl's namespace/name
    ("solo", "team-a.solo"),  # a name only one namespace has
    ("default", "default"),  # a standalone sidecar's pool
    ("prod", "prod"),
])
def test_names_users_type_find_the_pool(typed: str, pool: str) -> None:
    assert resolve_pool(typed, KNOWN) == pool


@pytest.mark.parametrize(("typed", "says"), [
    ("cache", "in several namespaces: team-a.cache, team-b.cache"),
    ("team-c/cache", "no pool 'team-c/cache' in this index (pools there: default, prod, team-a.cache"),
    ("cache.team-a", "no pool 'cache.team-a'"),  # name and namespace the wrong way round
    ("a/b/c", "no pool 'a/b/c'"),
])
def test_a_name_of_no_pool_or_of_several_is_an_error_listing_them(typed: str, says: str) -> None:
    with pytest.raises(PoolNameError, match=re.escape(says)):
        resolve_pool(typed, KNOWN)
    with pytest.raises(PoolNameError, match=r"pools there: none\)"):
        resolve_pool("x", [])


# ------------------------------------------------------------------ what the command prints

GOOD_TIERS = {"dram": {"capacity_bytes": 16 << 20, "used_bytes": 1 << 20, "blocks": 4}}


class _Client:
    """Stands in for PoolClient: a sidecar (or whatever listens on the socket) answering STATS."""

    answer: dict[str, Any] = {}

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.info = {"node": "n1"}

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return self.answer


@pytest.mark.parametrize("answer", [
    {"blocks": 1},  # no tiers, no policy
    {"blocks": 1, "policy": "p", "sessions": 0, "tiers": [1, 2]},
    {"blocks": 1, "policy": "p", "sessions": 0, "tiers": {"dram": {"used_bytes": "a lot"}}},
    {"blocks": 1, "policy": "p", "sessions": 0, "tiers": GOOD_TIERS, "counters": {"get_hit": "1", "get_miss": 2}},
])
def test_a_stats_answer_of_another_shape_is_printed_as_far_as_it_goes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], answer: dict[str, Any]) -> None:
    """A STATS answer is any map: a KeyError or TypeError traceback had been the command's output."""
    monkeypatch.setattr("kvpool_client.client.PoolClient", type("C", (_Client,), {"answer": answer}))
    assert main(["status", "--socket", "/nowhere"]) == 0
    assert capsys.readouterr().out.startswith("node n1  blocks 1")


def test_bytes_in_a_stats_answer_are_written_as_hex_in_json(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    answer = {"blocks": b"\x00\x01", "policy": "p", "sessions": 0, "tiers": {}}
    monkeypatch.setattr("kvpool_client.client.PoolClient", type("C", (_Client,), {"answer": answer}))
    assert main(["status", "--socket", "/nowhere", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["blocks"] == "0001"


class _Index:
    """Stands in for RedisIndex: a pool's node records, one of them written by anyone with
    access to Redis."""

    records: list[dict[str, Any]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    async def pools(self) -> list[str]:
        return ["default"]

    async def nodes(self) -> list[dict[str, Any]]:
        return self.records

    async def close(self) -> None:
        pass


def _pool(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], forged: dict[str, Any],
          *flags: str) -> str:
    good = {"name": "good", "address": "10.0.0.1:9467", "tiers": GOOD_TIERS, "hits": 3, "misses": 1, "gpus": []}
    monkeypatch.setattr("kvpool_sidecar.index.redis.RedisIndex",
                        type("I", (_Index,), {"records": [good, {"name": "forged", "gpus": [], **forged}]}))
    assert main(["status", "--redis", "redis://nowhere", *flags]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("tiers", [
    {"dram": {"capacity_bytes": "lots", "used_bytes": 1, "blocks": 1}},
    {"dram": {"capacity_bytes": [1], "used_bytes": 1, "blocks": 1}},
    {"dram": {"capacity_bytes": -5, "used_bytes": 1, "blocks": 1}},
])
def test_a_forged_node_records_tiers_are_left_out_of_the_pools_status(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tiers: dict[str, Any]) -> None:
    """One record with a size of the wrong type had ended ``kvpool status --redis`` in a
    traceback, the pool's other nodes unseen."""
    out = _pool(monkeypatch, capsys, {"address": "10.0.0.2:9467", "tiers": tiers}, "--json")
    assert json.loads(out)["tiers"] == GOOD_TIERS
    out = _pool(monkeypatch, capsys, {"address": "10.0.0.2:9467", "tiers": tiers})
    assert "node good" in out and "node forged" in out and "16 MiB" in out


def test_a_node_records_control_characters_never_reach_the_terminal(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = _pool(monkeypatch, capsys, {"address": "\x1b]0;owned\x07\x1b[2J", "tiers": {"\x1b[31mdram": {}}})
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07" in out


@pytest.mark.parametrize("timeout", ["nan", "inf", "0", "-1"])
def test_the_timeout_must_be_a_positive_finite_number_of_seconds(
        timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["status", "--socket", "/nowhere", "--timeout", timeout])
    assert e.value.code == 2
    assert "--timeout" in capsys.readouterr().err
