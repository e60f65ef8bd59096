"""What the Redis index reads is bounded: anyone who can write to Redis controls it."""

from __future__ import annotations

import pytest

from kvpool_sidecar.errors import IndexUnavailableError
from kvpool_sidecar.index.redisconn import translated
from kvpool_sidecar.index.redisrecords import (
    MAX_HOLDERS_BYTES,
    MAX_HOLDERS_PER_KEY,
    MAX_NODES,
    bounded_names,
    held_values,
    node_record,
)
from kvpool_sidecar.transfer import auth


def test_a_holders_value_past_the_bound_is_no_holders() -> None:
    forged = " ".join("fake%d@dram" % i for i in range(MAX_HOLDERS_BYTES // 8))
    assert len(forged) > MAX_HOLDERS_BYTES
    values, lists = held_values([[forged, forged]])  # a chain: the quick path
    assert values == [None, None] and lists == []
    values, lists = held_values([["a@dram b@disk", forged]])
    assert values == [["a@dram", "b@disk"], None] and lists == [["a@dram", "b@disk"]]


def test_a_nodes_set_past_the_bound_keeps_the_live_ones_and_a_sample() -> None:
    live = {"real-%d" % i for i in range(10)}
    names = ["fake-%06d" % i for i in range(3 * MAX_NODES)] + sorted(live)
    kept = bounded_names(names, live)
    assert len(kept) == MAX_NODES and live <= set(kept) and kept == sorted(kept)
    few = ["b", "a"]
    assert bounded_names(few, set()) == ["a", "b"]
    assert bounded_names(["a", "x" * 100_000, "ü", "-lead", "ok.name_1"], set()) == ["a", "ok.name_1"]


def test_a_holders_value_within_the_bytes_gives_at_most_its_share_of_holders() -> None:
    """Tens of thousands of short names under the byte bound: what a lookup splits, checks
    for liveness and chooses among is the first few."""
    forged = " ".join("%x@dram" % i for i in range(MAX_HOLDERS_BYTES // 10))
    assert len(forged) <= MAX_HOLDERS_BYTES
    values, lists = held_values([[forged]])
    assert values[0] is not None and len(values[0]) == MAX_HOLDERS_PER_KEY and values[0][1] == "1@dram"
    values, lists = held_values([["a@dram", forged]])
    assert [len(v or []) for v in values] == [1, MAX_HOLDERS_PER_KEY]


def test_a_malformed_node_record_parses_to_none_and_never_raises() -> None:
    good = {"address": "10.0.0.1:7000", "heartbeat": "1.5", "tiers": '{"dram": {"used_bytes": 1}}', "gpus": "[]"}
    record = node_record("n1", good)
    assert record is not None and record["tiers"] == {"dram": {"used_bytes": 1}}
    for bad in ({"tiers": "[]"}, {"tiers": '{"dram": 5}'}, {"gpus": "{}"}, {"heartbeat": "soon"},
                {"gpus": "[" * 100_000 + "]" * 100_000}, {"tiers": '{"x": {}}' + " " * (1 << 17)},
                {"address": "1:1" * 100_000}, {"sig": "f" * 1_000_000}, {"heartbeat": "9" * 10_000},
                {"hits": "9" * 100_000}, {"heartbeat": "inf"}, {"heartbeat": "nan"},
                {"tiers": '{"dram": {"used_bytes": Infinity}}'}, {"tiers": '{"dram": {"used_bytes": 1e999}}'},
                {"tiers": '{"dram": {"used_bytes": NaN}}'}, {"gpus": "[-Infinity]"}):
        assert node_record("n1", {**good, **bad}) is None, bad


def test_a_nodes_load_from_tiers_of_any_numbers_is_a_share_never_raised() -> None:
    from kvpool_sidecar.peers import _load

    assert _load({"dram": {"used_bytes": 1, "capacity_bytes": 4}}) == 0.25
    for tiers in ({"dram": {"used_bytes": float("inf"), "capacity_bytes": 1}},
                  {"dram": {"used_bytes": float("nan"), "capacity_bytes": 1}},
                  {"dram": {"used_bytes": 10 ** 400, "capacity_bytes": 1}},
                  {"dram": {"used_bytes": -5, "capacity_bytes": 1}}, {"dram": 3}, []):
        assert _load(tiers) == 1.0, tiers


def test_a_node_signature_of_any_string_is_refused_never_raised() -> None:
    """A writer to Redis chooses the signature: not ASCII (which ``hmac.compare_digest``
    refuses with TypeError), the wrong length, or empty, it is simply not the pool's."""
    token = b"the-pool-secret-0123456789"
    good = auth.sign_node(token, "p", "n1", "10.0.0.1:7000", "1.5")
    assert auth.check_node(token, "p", "n1", "10.0.0.1:7000", "1.5", good)
    for sig in ("é", "é" * 64, good[:-1] + "é", "", good + "0", good.upper()):
        assert not auth.check_node(token, "p", "n1", "10.0.0.1:7000", "1.5", sig), sig


def test_a_reply_redis_py_fails_to_decode_is_the_index_unavailable_and_a_bug_of_ours_is_not() -> None:
    """What redis-py raises on a reply of a shape Redis never gives (here its scan parser on
    an integer) is the index unavailable; the same error raised in the index's own code stays
    what it is (a programming error is not taken for Redis down)."""
    from redis._parsers.helpers import parse_scan

    with pytest.raises(IndexUnavailableError, match="scan: a reply Redis does not give"):
        with translated("scan"):
            parse_scan(7)  # type: ignore[no-untyped-call]
    with pytest.raises(TypeError):
        with translated("ours"):
            len(7)  # type: ignore[arg-type]
