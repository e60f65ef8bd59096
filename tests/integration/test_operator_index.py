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
