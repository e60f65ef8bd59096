"""What the Redis index reads is bounded: anyone who can write to Redis controls it."""

from __future__ import annotations

from kvpool_sidecar.index.redis import MAX_HOLDERS_BYTES, MAX_NODES, _bounded_names, _held_values, _node_record


def test_a_holders_value_past_the_bound_is_no_holders() -> None:
    forged = " ".join("fake%d@dram" % i for i in range(MAX_HOLDERS_BYTES // 8))
    assert len(forged) > MAX_HOLDERS_BYTES
    values, lists = _held_values([[forged, forged]])  # a chain: the quick path
    assert values == [None, None] and lists == []
    values, lists = _held_values([["a@dram b@disk", forged]])
    assert values == [["a@dram", "b@disk"], None] and lists == [["a@dram", "b@disk"]]


def test_a_nodes_set_past_the_bound_keeps_the_live_ones_and_a_sample() -> None:
    live = {"real-%d" % i for i in range(10)}
    names = ["fake-%06d" % i for i in range(3 * MAX_NODES)] + sorted(live)
    kept = _bounded_names(names, live)
    assert len(kept) == MAX_NODES and live <= set(kept) and kept == sorted(kept)
    few = ["b", "a"]
    assert _bounded_names(few, set()) == ["a", "b"]


def test_a_malformed_node_record_parses_to_none_and_never_raises() -> None:
    good = {"address": "10.0.0.1:7000", "heartbeat": "1.5", "tiers": '{"dram": {"used_bytes": 1}}', "gpus": "[]"}
    record = _node_record("n1", good)
    assert record is not None and record["tiers"] == {"dram": {"used_bytes": 1}}
    for bad in ({"tiers": "[]"}, {"tiers": '{"dram": 5}'}, {"gpus": "{}"}, {"heartbeat": "soon"},
                {"gpus": "[" * 100_000 + "]" * 100_000}, {"tiers": '{"x": {}}' + " " * (1 << 17)}):
        assert _node_record("n1", {**good, **bad}) is None, bad
