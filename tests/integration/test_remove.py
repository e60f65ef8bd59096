"""REMOVE on a real sidecar: a client deletes blocks of its own key space from its node."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpool_client.client import AsyncPoolClient, Lookup, PoolClient
from kvpool_client.protocol import Op, PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, RawConn, fresh_keys, payload

pytestmark = pytest.mark.integration

STORED = PutStatus.STORED
Factory = Callable[..., SidecarProcess]


def test_remove_deletes_blocks_and_frees_their_room(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(4)
    data = [payload(k, 100_000) for k in keys]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, data, chain=True) == [STORED] * 4
        used = c.stats()["tiers"]["dram"]["used_bytes"]
        assert c.remove([keys[1], keys[3], fresh_keys(1)[0]]) == 2
        assert c.get(keys) == [memoryview(data[0]), None, memoryview(data[2]), None]
        assert c.lookup(keys) == Lookup(1, ["dram"])
        stats = c.stats()
        assert stats["blocks"] == 2 and stats["tiers"]["dram"]["used_bytes"] < used
        assert c.remove(keys[1:2]) == 0  # gone already
        assert c.put(keys[1:2], [b"new"]) == [STORED]  # the key takes a new block
        assert c.get(keys[1:2]) == [memoryview(b"new")]


def test_a_reader_keeps_what_it_holds(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(2)
    data = [payload(k, 200_000) for k in keys]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as reader, \
            PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as writer:
        assert writer.put(keys, data) == [STORED] * 2
        with reader.acquire(keys) as held:
            assert writer.remove(keys) == 2
            assert writer.get(keys) == [None, None]
            assert writer.put(keys[:1], [b"replacement"]) == [STORED]
            assert [b"".join(v) for v in held.views if v is not None] == data  # untouched
        assert reader.get(keys) == [memoryview(b"replacement"), None]


def test_a_tenant_removes_only_its_own_key_space(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"tenants": [{"name": "default"}, {"name": "a"}, {"name": "b"}]})
    keys = fresh_keys(3)
    data = [payload(k, 10_000) for k in keys]
    with PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) as a, \
            PoolClient(sp.socket_path, tenant="b", timeout=DEADLINE_S) as b:
        assert a.put(keys, data) == [STORED] * 3
        assert b.remove(keys) == 0  # the same keys name nothing in b's space
        assert a.lookup(keys).prefix == 3
        assert b.put(keys[:1], [b"b's own"]) == [STORED]
        assert a.remove(keys[:1]) == 1
        assert b.get(keys[:1]) == [memoryview(b"b's own")]


def test_bad_remove_requests_are_refused_and_the_connection_stays(sidecar: SidecarProcess) -> None:
    with RawConn(sidecar.socket_path) as raw:
        for args in ((b"x" * 48,), ([b"x" * 47],), ([5],), ([b"x" * 48] * 5000,), ()):
            _, status, result = raw.call(int(Op.REMOVE), *args)
            assert status != 0 and result[0] == "bad_request", args
        _, status, result = raw.call(int(Op.REMOVE), [fresh_keys(1)[0].raw])
        assert (status, result) == (0, 0)


async def test_async_remove(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(2)
    client = await AsyncPoolClient.connect(sidecar.socket_path, timeout=DEADLINE_S)
    async with client:
        assert await client.put(keys, [b"a", b"b"]) == [STORED] * 2
        assert await client.remove(keys) == 2
        assert await client.get(keys) == [None, None]
