"""The index's Redis connections pack commands with hiredis: byte for byte what redis-py's
own packer sends, and the same refusals."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import DataError

from kvpool_sidecar.index.redispack import use_hiredis_packing

COMMANDS: list[tuple[Any, ...]] = [
    ("PING",),
    ("HMGET", "kvp:p:held", *(bytes([i]) * 48 for i in range(64))),
    ("HSET", "kvp:p:node:a", "address", "10.0.0.1:7070", "hits", 5, "load", 0.25, "big", 1e20),
    ("SADD", "kvp:p:blk:" + "ab" * 48, "a@dram", "é@disk"),
    ("SCRIPT LOAD", "return 1"),
    ("EVALSHA", "0" * 40, 0, "kvp:p:node:", b"\x00\xff" * 100, 96, 48, 2000),
    (b"GET", b"k"),
    ("SET", "k", memoryview(b"abc")),  # hiredis refuses: redis-py packs it
]


@pytest.fixture
def connections() -> tuple[Connection, Connection]:
    client = Redis()
    plain = client.connection_pool.connection_class()
    assert use_hiredis_packing(client)
    assert use_hiredis_packing(client)  # twice: still one wrapper
    packing = client.connection_pool.connection_class()
    assert type(packing).__mro__[1] is type(plain)
    return plain, packing  # type: ignore[return-value]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: str(c[0]))
def test_the_bytes_are_redis_pys(connections: tuple[Connection, Connection], cmd: tuple[Any, ...]) -> None:
    plain, packing = connections
    assert b"".join(packing.pack_command(*cmd)) == b"".join(plain.pack_command(*cmd))
    pipe = [cmd, ("PING",), cmd]
    assert b"".join(packing.pack_commands(pipe)) == b"".join(plain.pack_commands(pipe))


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_refused(connections: tuple[Connection, Connection], bad: Any) -> None:
    _, packing = connections
    with pytest.raises(DataError):
        packing.pack_command("SET", "k", bad)
