"""The operator's reads of a pool's Redis index against a real redis-server."""

from __future__ import annotations

import pytest

from kvpool_bench.services import RedisServer
from kvpool_operator import index as redis_index
from tests.integration.poolfixtures import redis  # noqa: F401 - fixture


def test_a_purge_reads_as_many_replies_as_it_takes_each_under_the_cap(redis: RedisServer,  # noqa: F811
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap bounds one command's replies, not a reconcile's: a pool of many blocks (a
    cluster keeps one key per block) had failed every purge past the cap's worth of keys."""
    import redis as redis_py

    r = redis_py.Redis.from_url(redis.url)
    pipe = r.pipeline(transaction=False)
    for i in range(20_000):
        pipe.set("kvp:q:blk:%064x" % i, b"")
    pipe.execute()
    r.close()
    monkeypatch.setattr(redis_index, "MAX_REPLY_BYTES", 64 << 10)  # 20,000 keys take 1.6 MiB of replies
    with redis_index.connect(redis.url, None, timeout_s=3.0) as client:
        assert redis_index.purge(client, "q", redis.url) == 20_000
        client.sadd("kvp:q:nodes", *("node-%036d" % i for i in range(4096)))  # one reply past the cap is cut
        with pytest.raises(redis_index.IndexUnavailableError, match="more than"):
            redis_index.read_snapshot(client, "q", redis.url)


def test_a_pool_of_large_nodes_is_read_whole(redis: RedisServer) -> None:  # noqa: F811
    """256 heartbeats of nodes listing 72 GPUs each (17 KiB apiece) in one pipeline had passed the
    cap, and a healthy pool read as unreachable."""
    import json

    import redis as redis_py

    gpus = json.dumps([{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-%032x" % i,
                        "total_bytes": 85520809984, "free_bytes": 85397353195,
                        "health": {"ecc_uncorrected": 0, "retire_pending": False, "temperature_c": 45, "ok": True}}
                       for i in range(72)])
    r = redis_py.Redis.from_url(redis.url)
    prefix = redis_index.key_prefix("big")
    for n in range(256):
        node = "gpu-node-%04d.us-east-1.compute.internal" % n
        r.sadd(prefix + "nodes", node)
        r.hset(prefix + "node:" + node, mapping={
            "address": "10.0.0.%d:7400" % n, "heartbeat": "1764960000.123456", "gpus": gpus, "hits": "123456789",
            "misses": "98765432", "version": "0.9.0", "sig": "ab" * 32, "published": "cd" * 8,
            "tiers": json.dumps({t: {"capacity_bytes": 2**44, "used_bytes": 2**43, "blocks": 123456789}
                                 for t in ("gpu", "dram", "disk")})})
    r.close()
    with redis_index.connect(redis.url, None, timeout_s=3.0) as client:
        assert len(redis_index.read_snapshot(client, "big", redis.url).live) == 256


def test_what_a_reconcile_keeps_of_the_heartbeats_is_bounded_in_all(redis: RedisServer,  # noqa: F811
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pipeline under the per-command cap, heartbeats planted over many nodes (or many
    small fields, each a few Python objects) had added up past the operator's memory limit."""
    import redis as redis_py

    r = redis_py.Redis.from_url(redis.url)
    prefix = redis_index.key_prefix("planted")
    pipe = r.pipeline(transaction=False)
    for n in range(512):
        pipe.sadd(prefix + "nodes", "n%04d" % n)
        pipe.hset(prefix + "node:n%04d" % n, mapping={"f%02d" % f: "x" * 10 for f in range(20)})
    pipe.execute()
    r.close()
    monkeypatch.setattr(redis_index, "MAX_SNAPSHOT_BYTES", 256 << 10)  # 512 nodes of 20 fields: 2.7 MB counted
    with redis_index.connect(redis.url, None, timeout_s=3.0) as client:
        with pytest.raises(redis_index.IndexUnavailableError) as caught:
            redis_index.read_snapshot(client, "planted", redis.url)
    assert caught.value.reason == "ReplyTooLarge"
