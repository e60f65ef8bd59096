"""The local API of a real sidecar process: Unix socket + shared arena, TCP, HTTP, drain."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
from collections.abc import Callable
from typing import Any

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_client.client import AsyncPoolClient, Lookup, PoolClient
from kvpool_client.errors import ConnectionLostError, KVPoolError
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import Op, PutStatus
from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (
    DEADLINE_S,
    TCP_TOKEN,
    tcp_tenants,
    assert_serves,
    fresh_keys,
    http_get,
    http_json,
    payload,
    put_all,
    wait_until,
)

pytestmark = pytest.mark.integration

#: Sizes around the 64 KiB page and the 256 KiB copy chunk, and a few multi-MiB blocks.
SIZES = [1, 17, 4095, 4096, 65_535, 65_536, 65_537, 100_000, 262_147, 1 << 20, (1 << 20) + 1, 3_000_001]
STORED = PutStatus.STORED
Factory = Callable[..., SidecarProcess]


def _sizes(n: int, shift: int = 0) -> list[int]:
    return [SIZES[(i + shift) % len(SIZES)] for i in range(n)]


# ---------------------------------------------------------------------------- sync client


def test_put_get_lookup_round_trip_mixed_sizes(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(36)
    datas = [payload(k, n) for k, n in zip(keys, _sizes(len(keys)))]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.shm
        assert c.lookup(keys) == Lookup(0, [])
        # one chained batch, then the rest in smaller batches
        assert c.put(keys[:12], datas[:12], chain=True) == [STORED] * 12
        assert put_all(c, keys[12:], datas[12:], batch=5) == [STORED] * 24
        assert c.lookup(keys) == Lookup(36, ["dram"] * 36)
        got = c.get(keys)
        assert len(got) == len(keys)
        for i, (g, d) in enumerate(zip(got, datas)):
            assert g is not None, f"block {i} missing"
            assert g.nbytes == len(d)
            assert bytes(g) == d, f"block {i} ({len(d)} bytes) differs"
        # a second client sees the same bytes
        with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c2:
            assert [bytes(g) for g in c2.get(keys[::-1]) if g is not None] == datas[::-1]


def test_lookup_returns_longest_prefix_and_tiers(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(10)
    datas = [payload(k, 5000 + i) for i, k in enumerate(keys)]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        # store blocks 0..5 and 7..9, not 6
        assert c.put(keys[:6], datas[:6], chain=True) == [STORED] * 6
        assert c.put(keys[7:], datas[7:]) == [STORED] * 3
        assert c.lookup(keys) == Lookup(6, ["dram"] * 6)
        assert c.lookup(keys[:3]) == Lookup(3, ["dram"] * 3)
        assert c.lookup(keys[7:]) == Lookup(3, ["dram"] * 3)
        assert c.lookup(keys[6:]) == Lookup(0, [])
        assert c.lookup([]) == Lookup(0, [])
        # BlockKey and raw bytes are the same key
        assert c.lookup([k.raw for k in keys[:2]]) == Lookup(2, ["dram", "dram"])
        # a key of another fingerprint never matches
        other = fresh_keys(1)[0]
        assert c.lookup([keys[0], other, keys[1]]).prefix == 1


def test_get_into_caller_buffers(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(8)
    datas = [payload(k, n) for k, n in zip(keys, _sizes(8, 3))]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, datas) == [STORED] * 8
        missing = fresh_keys(1)[0]
        bufs = [bytearray(b"\xee" * (len(d) + 100)) for d in datas] + [bytearray(b"\xee" * 10)]
        got = c.get([*keys, missing], into=bufs)
        assert got[-1] is None
        assert bufs[-1] == bytearray(b"\xee" * 10), "a miss must not touch its buffer"
        for g, d, b in zip(got, datas, bufs):
            assert g is not None and g.nbytes == len(d)
            assert g.obj is b, "the result must be a view of the caller's buffer"
            assert bytes(b[: len(d)]) == d
            assert b[len(d) :] == bytearray(b"\xee" * 100), "bytes past the block were overwritten"
        # memoryviews (of a larger buffer) work as destinations too
        big = bytearray(sum(len(d) for d in datas))
        views, pos = [], 0
        for d in datas:
            views.append(memoryview(big)[pos : pos + len(d)])
            pos += len(d)
        got = c.get(keys, into=views)
        assert bytes(big) == b"".join(datas)
        # a destination too small is refused, and the connection stays usable
        small = max(range(8), key=lambda i: len(datas[i]))
        with pytest.raises(KVPoolError, match="too small"):
            c.get([keys[small]], into=[bytearray(len(datas[small]) - 1)])
        assert c.lookup(keys) == Lookup(8, ["dram"] * 8)
        [g] = c.get([keys[small]])
        assert g is not None and bytes(g) == datas[small]


def test_a_get_into_fewer_buffers_than_keys_is_refused_before_anything_is_held(sidecar: SidecarProcess) -> None:
    """Both clients had acquired the blocks past the last buffer and never released them (held
    until the connection closed), and returned fewer results than keys."""
    keys = fresh_keys(3)
    datas = [payload(k, n) for k, n in zip(keys, _sizes(3))]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, datas) == [STORED] * 3
        with pytest.raises(KVPoolError, match="2 buffers to read 3 blocks"):
            c.get(keys, into=[bytearray(len(d)) for d in datas[:2]])
        with pytest.raises(KVPoolError, match="buffer 1 .* is read-only"):  # (was a BufferError, after the read)
            c.get(keys, into=[bytearray(len(datas[0])), bytes(len(datas[1])), bytearray(len(datas[2]))])
        assert [bytes(g or b"") for g in c.get(keys)] == datas

        async def run() -> None:
            a = await AsyncPoolClient.connect(sidecar.socket_path, timeout=DEADLINE_S)
            try:
                with pytest.raises(KVPoolError, match="2 buffers to read 3 blocks"):
                    await a.get(keys, into=[bytearray(len(d)) for d in datas[:2]])
                assert [bytes(g or b"") for g in await a.get(keys)] == datas
            finally:
                await a.close()

        asyncio.run(run())


def test_a_batch_in_pieces_round_trips_and_a_corrupt_block_in_a_later_piece_is_a_miss(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of 40 blocks of 300-700 KB goes in pieces (kvpool_client.pipeline), several
    requests in flight at once on the connection: every block lands and comes back whole,
    paired with its own key, and a block corrupted in the arena is a miss however late its
    piece comes, the rest served."""
    keys = fresh_keys(40)
    datas = [payload(k, 300_000 + 10_007 * i) for i, k in enumerate(keys)]
    sent: list[int] = []
    real_send = PoolClient._send

    def counting(self: PoolClient, op: Op, *args: Any, **kw: Any) -> int:
        sent.append(int(op))
        return real_send(self, op, *args, **kw)

    monkeypatch.setattr(PoolClient, "_send", counting)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, datas, chain=True) == [STORED] * 40
        assert sent.count(Op.ALLOC) > 1 and sent.count(Op.COMMIT) == sent.count(Op.ALLOC)
        bufs = [bytearray(len(d)) for d in datas]
        sent.clear()
        got = c.get(keys, into=bufs)
        assert sent.count(Op.ACQUIRE) > 1
        assert [bytes(g) if g is not None else None for g in got] == datas
        sent.clear()
        with c.acquire(keys, [len(d) for d in datas]) as held:  # verified in place, in pieces
            assert sent.count(Op.ACQUIRE) > 1
            assert [b"".join(bytes(v) for v in vs) if vs is not None else None for vs in held.views] == datas
        _stray_write(c, keys[-2])  # a block of the last piece
        bufs = [bytearray(len(d)) for d in datas]
        got = c.get(keys, into=bufs)
        assert got[-2] is None
        assert [bytes(g) if g is not None else None for g in got[:-2]] == datas[:-2]
        assert got[-1] is not None and bytes(got[-1]) == datas[-1]
        assert c.lookup(keys).prefix == 38  # the corrupt block was reported and dropped


def test_a_chain_put_in_pieces_into_a_full_tier_never_evicts_its_own_head(sidecar_factory: Factory) -> None:
    """Each piece is an ALLOC of its own, sent before the pieces ahead of it are committed: a
    later piece's room had been made from the put's own committed head, and a chain of 128
    blocks stored 120 that no lookup reached."""
    sp = sidecar_factory({"dram": {"size_bytes": "24Mi"}, "api": {"max_session_share": 1.0}})
    keys = fresh_keys(128)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        statuses = c.put(keys, [payload(k, 256 << 10) for k in keys], chain=True)  # 32 MiB: in pieces
        stored = statuses.count(STORED)
        assert 0 < stored < 128 and statuses[:stored] == [STORED] * stored
        assert c.lookup(keys).prefix == stored  # every block stored is reachable


def test_every_call_longer_than_the_sidecars_max_batch_goes_in_requests_it_takes(
        sidecar_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sidecar refuses a request naming more than ``api.max_batch`` keys whole (it says
    the bound at HELLO): the client sends every call of more keys (puts of small blocks, which
    go whole otherwise, gets, acquires, reserves, pins, removals, inline puts and gets) in
    requests of at most that many, and a lookup chunk after chunk while each is held whole,
    its answer the longest held prefix as one request's would be."""
    sp = sidecar_factory({"api": {"max_batch": 8, "tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    sent: list[tuple[Op, int]] = []
    real_send = PoolClient._send

    def counting(self: PoolClient, op: Op, *args: Any, **kw: Any) -> int:
        sent.append((Op(op), len(args[0]) if args and isinstance(args[0], list) else 0))
        return real_send(self, op, *args, **kw)

    monkeypatch.setattr(PoolClient, "_send", counting)
    keys = fresh_keys(30)
    datas = [payload(k, 4096) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c, \
            PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as tcp:
        assert c.info["max_batch"] == 8
        assert c.put(keys[:20], datas[:20], chain=True) == [STORED] * 20
        assert c.put(keys[24:], datas[24:], chain=True, depth=24, parent=keys[23]) == [STORED] * 6  # not 20-23
        other = fresh_keys(12)
        assert tcp.put(other, [payload(k, 4096) for k in other]) == [STORED] * 12
        asked = len(sent)
        assert c.lookup(keys) == Lookup(20, ["dram"] * 20)  # the blocks past the gap are not part of it
        assert [n for op, n in sent[asked:] if op == Op.LOOKUP] == [8, 8, 8]  # the third chunk ended the prefix
        assert tcp.lookup(keys[:16]) == Lookup(16, ["dram"] * 16)
        assert [None if g is None else bytes(g) for g in c.get(keys)] == datas[:20] + [None] * 4 + datas[24:]
        assert [None if g is None else bytes(g) for g in tcp.get(keys)] == datas[:20] + [None] * 4 + datas[24:]
        for sizes in (None, [4096] * 30):
            with c.acquire(keys, sizes) as held:
                assert [None if vs is None else b"".join(bytes(v) for v in vs) for vs in held.views] == \
                    datas[:20] + [None] * 4 + datas[24:]
        assert c.pin(keys) == 26 and c.unpin(keys) == 26
        with c.reserve(keys[20:24] + fresh_keys(16), [4096] * 20) as room:
            for vs in room.views:
                for v in vs or []:
                    v[:] = b"\x01" * v.nbytes
            assert room.commit() == [STORED] * 20
        assert c.lookup(keys).prefix == 30
        assert c.remove(keys) == 30 and c.lookup(keys).prefix == 0
    batched = {Op.LOOKUP, Op.ALLOC, Op.COMMIT, Op.ABORT, Op.ACQUIRE, Op.RELEASE, Op.PIN, Op.UNPIN, Op.REMOVE,
               Op.PUT_INLINE, Op.GET_INLINE}
    assert {op for op, _ in sent} >= batched - {Op.ABORT}
    assert max(n for op, n in sent if op in batched) == 8  # none longer than the sidecar takes


async def test_every_async_call_longer_than_the_sidecars_max_batch_goes_in_requests_it_takes(
        sidecar_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for :class:`AsyncPoolClient`, which had sent every call in one request (a get
    of more keys than the sidecar's ``max_batch`` was refused whole)."""
    sp = sidecar_factory({"api": {"max_batch": 8, "tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    sent: list[tuple[Op, int]] = []
    real_send = AsyncPoolClient._send  # noqa: SLF001

    def counting(self: AsyncPoolClient, op: Op, *args: Any) -> Any:
        sent.append((Op(op), len(args[0]) if args and isinstance(args[0], list) else 0))
        return real_send(self, op, *args)

    monkeypatch.setattr(AsyncPoolClient, "_send", counting)
    keys = fresh_keys(30)
    datas = [payload(k, 4096) for k in keys]
    c = await AsyncPoolClient.connect(sp.socket_path, timeout=DEADLINE_S)
    tcp = await AsyncPoolClient.connect(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN,
                                        timeout=DEADLINE_S)
    try:
        assert c.info["max_batch"] == 8
        assert await c.put(keys[:20], datas[:20], chain=True) == [STORED] * 20
        assert await c.put(keys[24:], datas[24:], chain=True, depth=24, parent=keys[23]) == [STORED] * 6
        other = fresh_keys(12)
        assert await tcp.put(other, [payload(k, 4096) for k in other]) == [STORED] * 12
        asked = len(sent)
        assert await c.lookup(keys) == Lookup(20, ["dram"] * 20)
        assert [n for op, n in sent[asked:] if op == Op.LOOKUP] == [8, 8, 8]  # the third chunk ended the prefix
        assert await tcp.lookup(keys[:16]) == Lookup(16, ["dram"] * 16)
        for client in (c, tcp):
            assert [None if g is None else bytes(g) for g in await client.get(keys)] == \
                datas[:20] + [None] * 4 + datas[24:]
        with await c.acquire(keys) as held:
            assert [None if vs is None else b"".join(bytes(v) for v in vs) for vs in held.views] == \
                datas[:20] + [None] * 4 + datas[24:]
        assert await c.pin(keys) == 26 and await c.unpin(keys) == 26
        async with await c.reserve(keys[20:24] + fresh_keys(16), [4096] * 20) as room:
            for vs in room.views:
                for v in vs or []:
                    v[:] = b"\x01" * v.nbytes
            assert await room.commit() == [STORED] * 20
        assert (await c.lookup(keys)).prefix == 30
        assert await c.remove(keys) == 30 and (await c.lookup(keys)).prefix == 0
        assert (await c.stats())["blocks"] >= 0
    finally:
        await c.close()
        await tcp.close()
    batched = {Op.LOOKUP, Op.ALLOC, Op.COMMIT, Op.ACQUIRE, Op.RELEASE, Op.PIN, Op.UNPIN, Op.REMOVE,
               Op.PUT_INLINE, Op.GET_INLINE}
    assert {op for op, _ in sent} >= batched
    assert max(n for op, n in sent if op in batched) == 8  # none longer than the sidecar takes


def test_multi_extent_blocks_round_trip(sidecar_factory: Factory) -> None:
    """Blocks gathered from fragmented free space (several extents) read back intact."""
    page = 64 << 10
    # LRU, so that exactly the untouched (even) blocks are evicted
    sp = sidecar_factory({"dram": {"size_bytes": 16 * page, "page_bytes": page}, "policy": {"name": "lru"}})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        small = fresh_keys(16)
        small_data = [payload(k, page) for k in small]
        assert put_all(c, small, small_data) == [STORED] * 16
        # touch the odd blocks so that LRU evicts the even (non-adjacent) pages first
        assert all(g is not None for g in c.get(small[1::2]))
        big = fresh_keys(2)
        big_data = [payload(big[0], 4 * page - 123), payload(big[1], 3 * page + 1)]
        assert c.put(big, big_data) == [STORED, STORED]
        acquired = c._call(Op.ACQUIRE, [k.raw for k in big])  # noqa: SLF001 - inspect extents
        c._send(Op.RELEASE, [[a[0], False] for a in acquired])  # noqa: SLF001
        assert all(len(a[3]) > 1 for a in acquired), f"expected fragmented extents, got {acquired}"
        got = c.get(big)
        assert [bytes(g) for g in got if g is not None] == big_data
        # the odd blocks survived; the even ones were evicted
        assert all(c.lookup([k]).prefix == 1 for k in small[1::2])
        assert c.lookup([small[0]]).prefix == 0


def test_exists_on_reput(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(4)
    datas = [payload(k, 10_000) for k in keys]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys[:2], datas[:2]) == [STORED, STORED]
        # re-put (even with other bytes) is EXISTS and does not overwrite
        assert c.put(keys, [b"x" * 10_000] * 4) == [PutStatus.EXISTS, PutStatus.EXISTS, STORED, STORED]
        got = c.get(keys)
        assert bytes(got[0]) == datas[0] and bytes(got[1]) == datas[1]  # type: ignore[arg-type]
        assert bytes(got[2]) == b"x" * 10_000  # type: ignore[arg-type]
        # the same key twice in one batch: the second is PENDING behind the first
        [k] = fresh_keys(1)
        st = c.put([k, k], [b"a" * 100, b"b" * 100])
        assert st == [STORED, PutStatus.PENDING]
        assert bytes(c.get([k])[0]) == b"a" * 100  # type: ignore[arg-type]
        assert c.stats()["pending_writes"] == 0


def test_pin_unpin_counts(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(5)
    unknown = fresh_keys(2)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c, \
            PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as other:
        assert c.put(keys, [payload(k, 3000) for k in keys]) == [STORED] * 5
        assert c.pin([*keys[:3], *unknown]) == 3
        assert c.pin(keys[:1]) == 1  # pins stack
        assert other.unpin(keys) == 0, "a session cannot drop another session's pins"
        assert c.unpin([*keys, *unknown]) == 3
        assert c.unpin(keys[:1]) == 1
        assert c.unpin(keys) == 0
        assert c.pin([]) == 0 and c.unpin([]) == 0


def test_stats_fields(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(6)
    sizes = [1000, 65_536, 65_537, 200_000, 1, 70_000]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        before = c.stats()
        assert set(before) >= {"blocks", "tiers", "sessions", "pending_writes", "policy", "counters"}
        assert before["policy"] == "prefix"
        assert "disk" not in before["tiers"]
        dram0 = before["tiers"]["dram"]
        assert dram0["capacity_bytes"] == 64 << 20
        assert before["sessions"] >= 1
        assert c.put(keys, [payload(k, n) for k, n in zip(keys, sizes)]) == [STORED] * 6
        assert all(g is not None for g in c.get(keys[:4]))
        c.lookup([*keys, *fresh_keys(2)])
        after = c.stats()
        assert after["blocks"] == before["blocks"] + 6
        page = 64 << 10
        footprint = sum(-(-n // page) * page for n in sizes)
        assert after["tiers"]["dram"]["used_bytes"] == dram0["used_bytes"] + footprint
        assert after["tiers"]["dram"]["blocks"] == dram0["blocks"] + 6
        assert after["pending_writes"] == 0
        cnt0, cnt = before["counters"], after["counters"]

        def delta(name: str) -> int:
            return int(cnt.get(name, 0)) - int(cnt0.get(name, 0))

        assert delta("put_stored") == 6
        assert delta("put_bytes") == sum(sizes)
        assert delta("get_hit") == 4
        assert delta("get_bytes") == sum(sizes[:4])
        assert delta("lookup_hit") == 6
        assert delta("lookup_miss") == 2
        # HTTP /stats serves the same document
        status, doc = http_json(sidecar.ready["http_port"], "/stats")
        assert status == 200 and doc["blocks"] == after["blocks"]


# ---------------------------------------------------------------------------- async client


async def test_async_client_concurrent_tasks_share_one_client(sidecar: SidecarProcess) -> None:
    async def scenario() -> None:
        client = await AsyncPoolClient.connect(sidecar.socket_path, timeout=DEADLINE_S)
        try:
            assert client.shm

            async def worker(i: int) -> None:
                keys = fresh_keys(6)
                datas = [payload(k, n) for k, n in zip(keys, _sizes(6, i))]
                assert await client.put(keys, datas, chain=True) == [STORED] * 6
                assert await client.lookup(keys) == Lookup(6, ["dram"] * 6)
                got = await client.get(keys)
                assert [bytes(g) for g in got if g is not None] == datas
                bufs = [bytearray(len(d) + 1) for d in datas]
                got = await client.get(keys, into=bufs)
                for g, d, b in zip(got, datas, bufs):
                    assert g is not None and g.obj is b and bytes(b[: len(d)]) == d
                assert await client.put(keys[:2], datas[:2]) == [PutStatus.EXISTS] * 2
                assert await client.pin(keys) == 6
                assert await client.unpin(keys) == 6
                assert await client.get(fresh_keys(2)) == [None, None]

            await asyncio.gather(*(worker(i) for i in range(12)))
            stats = await client.stats()
            assert stats["blocks"] >= 72 and stats["pending_writes"] == 0
        finally:
            await client.close()

    await asyncio.wait_for(scenario(), DEADLINE_S * 3)


# ---------------------------------------------------------------------------- TCP


def test_tcp_path_uses_inline_data(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    port = sp.ready["tcp_port"]
    assert isinstance(port, int) and port > 0
    keys = fresh_keys(14)
    datas = [payload(k, n) for k, n in zip(keys, _sizes(14, 5))]
    with PoolClient(host="127.0.0.1", port=port, token=TCP_TOKEN, timeout=DEADLINE_S) as tcp, \
            PoolClient(sp.socket_path, timeout=DEADLINE_S) as uds:
        assert not tcp.shm and tcp.info["shm"] is False
        assert tcp.put(keys[:7], datas[:7], chain=True) == [STORED] * 7
        assert uds.put(keys[7:], datas[7:]) == [STORED] * 7
        assert tcp.lookup(keys) == Lookup(14, ["dram"] * 14)
        assert tcp.put(keys[:1], datas[:1]) == [PutStatus.EXISTS]
        got_tcp = tcp.get([*keys, fresh_keys(1)[0]])
        assert got_tcp[-1] is None
        assert [bytes(g) for g in got_tcp[:-1] if g is not None] == datas
        got_uds = uds.get(keys)
        assert [bytes(g) for g in got_uds if g is not None] == datas
        bufs = [bytearray(len(d) + 3) for d in datas]
        got = tcp.get(keys, into=bufs)
        for g, d, b in zip(got, datas, bufs):
            assert g is not None and bytes(g) == d and bytes(b[: len(d)]) == d
        with pytest.raises(KVPoolError, match="too small"):
            tcp.get(keys[:1], into=[bytearray(len(datas[0]) - 1)])
        assert tcp.pin(keys) == 14 and tcp.unpin(keys) == 14
        # the shared-memory operations are refused on TCP with a clear error
        from kvpool_client.errors import RemoteError

        with pytest.raises(RemoteError) as ei:
            tcp._call(Op.ALLOC, [[fresh_keys(1)[0].raw, 10, -1, None]])  # noqa: SLF001
        assert ei.value.code == "bad_request" and "inline" in ei.value.message


async def test_async_tcp_round_trip_into_buffers(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    keys = fresh_keys(6)
    datas = [payload(k, n) for k, n in zip(keys, _sizes(6, 2))]

    async def scenario() -> None:
        client = await AsyncPoolClient.connect(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S)
        try:
            assert not client.shm
            assert await client.put(keys, datas) == [STORED] * 6
            assert await client.lookup(keys) == Lookup(6, ["dram"] * 6)
            got = await client.get(keys)
            assert [bytes(g) for g in got if g is not None] == datas
            bufs = [bytearray(len(d) + 2) for d in datas]
            got = await client.get(keys, into=bufs)
            for g, d, b in zip(got, datas, bufs):
                assert g is not None and bytes(g) == d
                assert bytes(b[: len(d)]) == d, "get(into=...) must fill the caller's buffer"
        finally:
            await client.close()

    await asyncio.wait_for(scenario(), DEADLINE_S * 2)


# ---------------------------------------------------------------------------- socket, HTTP, drain


@pytest.mark.parametrize(("config", "mode"), [({}, 0o660), ({"api": {"socket_mode": 0o600}}, 0o600)])
def test_socket_file_mode(sidecar_factory: Factory, config: dict[str, Any], mode: int) -> None:
    sp = sidecar_factory(config)
    st = os.stat(sp.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == mode


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_healthz_and_metrics(sidecar: SidecarProcess) -> None:
    port = sidecar.ready["http_port"]
    status, body = http_get(port, "/healthz")
    assert status == 200
    doc = json.loads(body)
    assert doc["ok"] is True and doc["node"] == sidecar.config["node_name"]

    status, text0 = http_get(port, "/metrics")
    assert status == 200
    m0 = _samples(text0.decode())
    assert any(name.startswith("kvpool_") for name, _ in m0)

    keys = fresh_keys(5)
    datas = [payload(k, 80_000) for k in keys]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, datas) == [STORED] * 5
        assert all(g is not None for g in c.get(keys))
        c.lookup([*keys, *fresh_keys(1)])

    def value(m: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
        return m.get((name, frozenset(labels.items())), 0.0)

    def page() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        status, text = http_get(port, "/metrics")
        assert status == 200
        m = _samples(text.decode())
        stored = value(m, "kvpool_blocks_total", op="put", result="stored")
        return m if stored > value(m0, "kvpool_blocks_total", op="put", result="stored") else None

    # the page is rendered at most once a second: the next one shows the calls above
    m1 = wait_until(page, "a /metrics page rendered after the calls")

    assert value(m1, "kvpool_blocks_total", op="put", result="stored") - \
        value(m0, "kvpool_blocks_total", op="put", result="stored") == 5
    assert value(m1, "kvpool_blocks_total", op="get", result="hit") - \
        value(m0, "kvpool_blocks_total", op="get", result="hit") == 5
    assert value(m1, "kvpool_blocks_total", op="lookup", result="miss") >= 1
    assert value(m1, "kvpool_bytes_total", op="put") - value(m0, "kvpool_bytes_total", op="put") == 400_000
    for op in ("alloc", "commit", "acquire", "lookup"):
        assert value(m1, "kvpool_request_seconds_count", op=op) > value(m0, "kvpool_request_seconds_count", op=op)
    assert value(m1, "kvpool_tier_bytes", tier="dram", kind="capacity") == 64 << 20
    assert value(m1, "kvpool_tier_bytes", tier="dram", kind="used") >= 5 * 128 << 10

    status, _ = http_get(port, "/nope")
    assert status == 404


def test_metrics_say_how_long_the_disk_tier_spent_writing_and_reading(sidecar_factory: Factory,
                                                                     tmp_path: Path) -> None:
    # (puts that outrun the write-ahead wait for their copies down, not FULL: every one is stored)
    sp = sidecar_factory({"dram": {"size_bytes": "2Mi", "put_waits_for_disk": True},
                          "disk": {"path": str(tmp_path / "disk"), "size_bytes": "32Mi"}})
    port = sp.ready["http_port"]
    keys = fresh_keys(60)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        for i in range(0, 60, 10):  # 6 MB into 2 MiB of DRAM: most of it goes to disk
            assert c.put(keys[i:i + 10], [payload(k, 100_000) for k in keys[i:i + 10]]) == [STORED] * 10

        def seconds() -> dict[str, float] | None:
            status, text = http_get(port, "/metrics")
            assert status == 200
            m = _samples(text.decode())
            out = {kind: m.get(("kvpool_disk_io_seconds_total", frozenset({("tier", "disk"), ("kind", kind)})), 0.0)
                   for kind in ("write", "sync", "read", "read_cached", "delete")}
            return out if out["write"] > 0 else None

        written = wait_until(seconds, "the disk tier's write seconds on /metrics")
        assert written["read"] == written["read_cached"] == 0.0
        got = c.get(keys[:10])  # the oldest: on disk only by now, promoted to be read
        assert all(g is not None and bytes(g) == payload(k, 100_000) for g, k in zip(got, keys[:10]))
        read = wait_until(lambda: (s := seconds()) and (s if s["read"] + s["read_cached"] > 0 else None),
                          "the disk tier's read seconds on /metrics")
        assert read["write"] >= written["write"]
        assert c.stats()["tiers"]["disk"]["io_seconds"]["write"] >= written["write"]


def test_sigterm_drains_with_clients_connected(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    keys = fresh_keys(3)
    c = PoolClient(sp.socket_path, timeout=DEADLINE_S)
    tcp = PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S)
    try:
        assert c.put(keys, [payload(k, 100_000) for k in keys]) == [STORED] * 3
        assert c.pin(keys[:1]) == 1
        c._call(Op.ACQUIRE, [k.raw for k in keys])  # noqa: SLF001 - hold read leases through the drain
        c._call(Op.ALLOC, [[fresh_keys(1)[0].raw, 5000, -1, None]])  # noqa: SLF001 - and a write lease
        http_port = sp.ready["http_port"]
        assert sp.proc is not None
        rc = sp.stop()
        assert rc == 0, sp.log_tail()
        assert not os.path.exists(sp.socket_path), "the socket file must be removed on drain"
        assert "Traceback" not in sp.log_path.read_text(), sp.log_tail(40)
        with pytest.raises(ConnectionLostError):
            c.lookup(keys)
        with pytest.raises(ConnectionLostError):
            tcp.lookup(keys)
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", http_port), timeout=5):
            pass
    finally:
        c.close()
        tcp.close()


def test_daemon_serves_after_many_connects(sidecar: SidecarProcess) -> None:
    """Connections that come and go (with and without HELLO) leave no sessions behind."""
    for _ in range(30):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(DEADLINE_S)
        s.connect(sidecar.socket_path)
        s.close()
    for _ in range(10):
        PoolClient(sidecar.socket_path, timeout=DEADLINE_S).close()
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        wait_until(lambda: c.stats()["sessions"] == 1, "closed connections' sessions to close")
    assert_serves(sidecar)


# ---------------------------------------------------------------- zero-copy acquire
def test_acquire_reads_in_place_and_pins_until_released(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    sp = sidecar_factory({"dram": {"size_bytes": "4Mi", "page_bytes": 4096}})
    keys = fresh_keys(4)
    datas = [payload(k, 300_000) for k in keys]
    with PoolClient(sp.socket_path) as c, PoolClient(sp.socket_path) as other:
        assert c.put(keys, datas) == [PutStatus.STORED] * 4
        missing = fresh_keys(1)[0]
        with c.acquire([*keys, missing]) as held:
            assert held.views[-1] is None and held.extents[-1] is None
            for vs, ext, d in zip(held.views[:4], held.extents[:4], datas):
                assert vs is not None and ext is not None
                assert b"".join(bytes(v) for v in vs) == d
                assert sum(n for _, n in ext) == len(d)
                assert all(v.readonly for v in vs)
            # fill the arena from another client: held blocks survive the eviction storm
            filler = fresh_keys(24)
            put_all(other, filler, [payload(k, 300_000) for k in filler])
            assert c.lookup(keys).prefix == 4
            assert [b"".join(bytes(v) for v in vs) for vs in held.views[:4] if vs] == datas
        # released: the next storm evicts them
        filler = fresh_keys(24)
        put_all(other, filler, [payload(k, 300_000) for k in filler])
        assert wait_until(lambda: c.lookup(keys).prefix < 4, "held blocks evicted after release")


def _stray_write(c: PoolClient, key: BlockKey) -> None:
    """Flip the first byte of ``key``'s block in the shared arena, after its commit."""
    with c.acquire([key]) as held:
        ext = held.extents[0]
        assert ext is not None
        off = ext[0][0]
    arena = c._view
    assert arena is not None
    arena[off] ^= 0xFF


def test_acquire_never_hands_out_a_corrupt_block(sidecar: SidecarProcess) -> None:
    [k] = fresh_keys(1)
    data = payload(k, 50_000)
    with PoolClient(sidecar.socket_path) as c:
        c.put([k], [data])
        _stray_write(c, k)
        with c.acquire([k]) as held:
            assert held.views == [None]
        assert c.lookup([k]).prefix == 0  # reported and dropped
        assert c.get([k]) == [None]


def test_acquire_needs_the_arena_and_works_async(sidecar_factory: Callable[..., SidecarProcess], tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    [k] = fresh_keys(1)
    data = payload(k, 10_000)
    with PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN) as tcp:
        assert tcp.put([k], [data]) == [PutStatus.STORED]
        with pytest.raises(KVPoolError):
            tcp.acquire([k])

    async def run() -> bytes:
        async with await AsyncPoolClient.connect(sp.socket_path) as ac:
            held = await ac.acquire([k])
            with held:
                vs = held.views[0]
                assert vs is not None
                return b"".join(bytes(v) for v in vs)

    assert asyncio.run(run()) == data


def test_an_answer_whose_extents_do_not_hold_the_block_gives_no_bytes(sidecar: SidecarProcess,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    keys = fresh_keys(2)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, [payload(k, 5000) for k in keys]) == [STORED] * 2
        real_recv = c._recv  # noqa: SLF001

        def lying_recv(rid: int, *args: Any, **kw: Any) -> Any:
            result = real_recv(rid, *args, **kw)
            if isinstance(result, list) and result and all(isinstance(r, list) and len(r) == 4 for r in result):
                # an ACQUIRE's answer: claim a larger block than the extents hold
                result = [[r[0], r[1] + 4, r[2], r[3]] for r in result]
            return result

        monkeypatch.setattr(c, "_recv", lying_recv)
        assert c.get(keys[:1]) == [None]  # copy path: never a partial block
        with c.acquire(keys[1:]) as held:  # in-place path
            assert held.views == [None]


async def test_async_client_fails_at_once_when_the_sidecar_is_gone(sidecar: SidecarProcess) -> None:
    """Calls after the sidecar went away raise at once, not after the client's timeout."""
    client = await AsyncPoolClient.connect(sidecar.socket_path, timeout=600.0)
    try:
        assert (await client.lookup(fresh_keys(1))).prefix == 0
        sidecar.stop()
        # the client sees the end of the stream before it sends anything more (the socket
        # itself still looks open for writing: a call must not be sent into it and waited on)
        pump = client._pump  # noqa: SLF001
        assert pump is not None
        await asyncio.wait_for(asyncio.shield(pump), DEADLINE_S)
        for _ in range(3):  # each must fail well before the 600 s timeout
            with pytest.raises(ConnectionLostError):
                await asyncio.wait_for(client.lookup(fresh_keys(1)), DEADLINE_S)
    finally:
        await client.close()


def _one_byte_short(op: Op, result: Any) -> Any:
    """An ALLOC answer whose first block's extents are one byte short of the block."""
    if op == Op.ALLOC:
        status, lease, ext = result[0]
        result[0] = [status, lease, [[ext[0][0], ext[0][1] - 1]] + ext[1:]]
    return result


@pytest.mark.parametrize("run_async", [False, True])
def test_reserve_writes_in_place_commits_and_gives_back_what_is_left(sidecar: SidecarProcess, run_async: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Both clients' ``reserve``: the bytes written into the room are what readers get; an
    uncommitted room goes back (the keys can be put again); an ALLOC answer whose extents do
    not hold its block is aborted by the client at once, never handed out."""
    keys = fresh_keys(5)
    sizes = [70_000, 4096, 3000, 5000, 6000]
    data = [payload(k, n) for k, n in zip(keys, sizes)]
    sent: list[Op] = []

    def fill(views: list[list[memoryview] | None], first: int) -> None:
        for i, vs in enumerate(views, first):
            at = 0
            for v in vs or []:
                v[:] = data[i][at:at + v.nbytes]
                at += v.nbytes

    def check(statuses: list[PutStatus], again: list[PutStatus], short: list[PutStatus],
              got: list[memoryview | None]) -> None:
        assert statuses == [STORED, STORED] and again == [STORED] * 2  # keys 2, 3 came back
        assert short == [PutStatus.FULL] and sent.count(Op.ABORT) == 1  # aborted once, at once
        assert [None if g is None else bytes(g) for g in got] == data[:4]

    if not run_async:
        with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
            room = c.reserve(keys[:2], sizes[:2], chain=True)
            fill(room.views, 0)
            statuses = room.commit()
            with c.reserve(keys[2:4], sizes[2:4]) as left:  # not committed: given back
                fill(left.views, 2)
            again = c.put(keys[2:4], data[2:4])
            real = c._call  # noqa: SLF001
            monkeypatch.setattr(c, "_call",
                                lambda op, *a, **kw: sent.append(op) or _one_byte_short(op, real(op, *a, **kw)))
            short = c.reserve(keys[4:], sizes[4:])
            assert short.views == [None] and short.extents == [None]
            short_statuses = short.commit()
            monkeypatch.undo()
            check(statuses, again, short_statuses, c.get(keys[:4]))
        return

    async def run() -> None:
        async with await AsyncPoolClient.connect(sidecar.socket_path, timeout=DEADLINE_S) as c:
            room = await c.reserve(keys[:2], sizes[:2], chain=True)
            fill(room.views, 0)
            statuses = await room.commit()
            with pytest.raises(KVPoolError, match="already committed"):
                await room.commit()
            async with await c.reserve(keys[2:4], sizes[2:4]) as left:
                fill(left.views, 2)
            again = await c.put(keys[2:4], data[2:4])
            real = c._call  # noqa: SLF001

            async def lying(op: Op, *args: Any, **kw: Any) -> Any:
                sent.append(op)
                return _one_byte_short(op, await real(op, *args, **kw))

            monkeypatch.setattr(c, "_call", lying)
            short = await c.reserve(keys[4:], sizes[4:])
            assert short.views == [None] and short.extents == [None]
            short_statuses = await short.commit()
            monkeypatch.undo()
            check(statuses, again, short_statuses, await c.get(keys[:4]))

    asyncio.run(run())


def test_a_stopped_sidecars_log_is_kept_where_the_environment_says(
        sidecar_factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$KVPOOL_SIDECAR_LOGS``: the benches' sidecars run in temporary directories, and the
    GPU check keeps what they logged there."""
    keep = tmp_path / "logs"
    monkeypatch.setenv("KVPOOL_SIDECAR_LOGS", str(keep))
    sp = sidecar_factory({"node_name": "kept"})
    pid = sp.pid
    assert sp.stop() == 0
    kept = (keep / f"kept-{pid}.log").read_text()
    assert "sidecar kept stopped" in kept and kept == sp.log_path.read_text()


def test_a_sidecar_that_fails_to_start_has_its_log_kept_too(tmp_path: Path) -> None:
    """The start that fails is the one most worth a look; the variable may also come in the
    sidecar's own environment."""
    keep = tmp_path / "logs"
    sp = SidecarProcess({"node_name": "broken", "dram": {"size_bytes": "lots"}}, workdir=tmp_path / "work",
                        env={"KVPOOL_SIDECAR_LOGS": str(keep)})
    with pytest.raises(SidecarError):
        sp.start()
    kept = list(keep.glob("broken-*.log"))
    assert len(kept) == 1 and "size_bytes" in kept[0].read_text()
