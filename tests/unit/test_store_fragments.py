"""A DRAM tier cut into one-page holes: a block is gathered from at most ``MAX_RUNS``
extents (eviction merges holes for a larger one), and the requests that gather or give
back many extents let the event loop turn between them (a review's tenant had filled a
4 GiB tier with one-byte blocks, removed every other one, then ALLOCed and ABORTed 256 MiB
blocks of 4,096 extents each: 150 to 230 ms of the loop a request, every other client
waiting). Scaled down: at most 8 extents a block, the loop turning every 16."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.protocol import PutStatus
from kvpool_sidecar.api import writes
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.store import TieredStore, facade, room
from kvpool_sidecar.tenancy import TenantAccess
from kvpool_sidecar.tiers import alloc
from tests.conftest import LoopTurns
from tests.unit.store_support import close_store, dram, dram_place, fragment, fragment_key, make_store, put, store_key

PAGE = 4096
PAGES = 256  # 128 one-page holes once fragmented
RUNS = 8  # the most extents a block is gathered from, here
BLOCK = RUNS * PAGE  # a block gathered from RUNS holes
N = 8  # blocks per request: RUNS * N extents
TOKEN = b"fragments-test-token-0123456789"
ACCESS = TenantAccess.with_tokens({"default": TOKEN})


@pytest.fixture
def small_cap(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``MAX_RUNS`` of 8, the loop turning every 16 extents (and not every so many blocks or
    bytes). ``raising=False``: on a tree without them the tests fail on what they check."""
    monkeypatch.setattr(alloc, "MAX_RUNS", RUNS, raising=False)
    monkeypatch.setattr(writes, "EXTENT_SLICE", 2 * RUNS, raising=False)
    monkeypatch.setattr(writes, "BATCH_SLICE", 4096)
    yield


async def test_a_block_larger_than_the_cap_is_stored_once_eviction_merges_holes(small_cap: None) -> None:
    """A block that would need more than ``MAX_RUNS`` of the holes evicts (the coldest
    blocks, which merges the holes beside them) until it fits in that many extents; while
    every block between the holes is pinned it is refused (FULL) rather than gathered from
    one extent a page, and stored once the pins go."""
    st = make_store(PAGES * PAGE, PAGE)
    try:
        left = await fragment(st, PAGES)
        s = st.open_session()
        assert st.pin(s, left) == len(left)
        big = store_key(b"b" * 48)
        status, lease = await st.allocate(s, big, 8 * BLOCK)  # 64 pages, 128 free in holes
        assert (status, lease) == (PutStatus.FULL, None)  # before: 64 extents
        assert st.unpin(s, left) == len(left)
        status, lease = await st.allocate(s, big, 8 * BLOCK)
        assert status == PutStatus.ALLOCATED and lease is not None
        assert len(lease.place) <= RUNS
        assert sum(n for _, n in lease.place) == 8 * BLOCK
        gone = [k for k in left if not st.contains(k)]
        assert 0 < len(gone) < len(left)  # evicted for it, not everything
        st.abort(s, lease.id)
        assert dram(st).scattered("default") == 0
    finally:
        close_store(st)


async def test_evictions_for_one_put_let_the_loop_turn(monkeypatch: pytest.MonkeyPatch,
                                                       loop_turns: LoopTurns) -> None:
    """A put that evicts many blocks (a large block in a tier full of small ones) lets the
    loop turn every ``EVICTIONS_PER_TURN`` evictions: all of them had run in one step."""
    monkeypatch.setattr(room, "EVICTIONS_PER_TURN", 4, raising=False)
    st = make_store(PAGES * PAGE, PAGE)
    try:
        for i in range(PAGES):
            await put(st, store_key(fragment_key(i)), b"x")
        s = st.open_session()
        before = loop_turns.count
        status, lease = await st.allocate(s, store_key(b"b" * 48), 32 * PAGE)  # evicts 32 blocks
        assert status == PutStatus.ALLOCATED and lease is not None
        assert loop_turns.count - before >= 32 // 4 - 1  # before: 0
        st.abort(s, lease.id)
    finally:
        close_store(st)


async def test_a_closing_session_gives_back_leases_of_many_extents_a_few_at_a_time(
        small_cap: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection's session closes ``most`` leases at a time, and no more than about
    ``CLOSE_EXTENTS_PER_LEASE`` extents a lease: write leases gathered from holes count by
    their extents."""
    monkeypatch.setattr(facade, "CLOSE_EXTENTS_PER_LEASE", 1, raising=False)
    st = make_store(PAGES * PAGE, PAGE)
    try:
        await fragment(st, PAGES)
        s = st.open_session()
        for i in range(N):
            status, lease = await st.allocate(s, store_key(bytes([i + 1]) * 48), BLOCK)
            assert status == PutStatus.ALLOCATED and lease is not None and len(lease.place) == RUNS
        free = dram(st).free_bytes
        assert not st.close_session(s, RUNS)  # a budget of 8 extents: one lease of 8 (before: all 8 leases)
        assert len(s.writes) == N - 1
        assert dram(st).free_bytes == free + BLOCK
        assert [st.close_session(s, RUNS) for _ in range(N - 1)] == [False] * (N - 2) + [True]
        assert dram(st).scattered("default") == 0
    finally:
        close_store(st)


async def _serve(st: TieredStore, tmp_path: Path) -> LocalServer:
    server = LocalServer(st, LocalLimits(8 << 20, 4096, "n", access=ACCESS), socket_path=str(tmp_path / "s.sock"),
                         tcp=("127.0.0.1", 0))
    await server.start()
    return server


@pytest.mark.parametrize("op", ["alloc", "put_inline", "abort", "release", "remove"])
async def test_requests_over_many_extents_let_the_loop_turn_between_them(
        small_cap: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, op: str, loop_turns: LoopTurns) -> None:
    """ALLOC and PUT_INLINE of blocks gathered from holes, and ABORT, RELEASE and REMOVE of
    such blocks (a few requests, each of a few items: no slice by count), let the loop turn
    every ``EXTENT_SLICE`` extents they gather or give back (2 blocks here): each had run
    whole in one step."""
    from kvpool_client.client import PoolClient

    st = make_store(PAGES * PAGE, PAGE)
    await fragment(st, PAGES)
    server = await _serve(st, tmp_path)
    keys = [bytes([i + 1]) * 48 for i in range(N)]
    data = [bytes([i + 1]) * BLOCK for i in range(N)]
    name = {"alloc": "allocate", "put_inline": "allocate"}.get(op, op)
    real = getattr(st, name)
    seen: list[int] = []

    def noting(*args: Any, **kw: Any) -> Any:
        seen.append(loop_turns.count)
        return real(*args, **kw)

    try:
        if op == "put_inline":  # over TCP the data travels inline
            c = await asyncio.to_thread(PoolClient, host="127.0.0.1", port=server.tcp_port, token=TOKEN)
        else:
            c = await asyncio.to_thread(PoolClient, str(tmp_path / "s.sock"), token=TOKEN, prefault=False)
        try:
            if op in ("release", "remove"):
                assert await asyncio.to_thread(c.put, keys, data) == [PutStatus.STORED] * N
                assert all(len(dram_place(st, store_key(k)) or []) == RUNS for k in keys)
                assert (await asyncio.to_thread(c.lookup, keys)).prefix == N  # (weighed, answered at once)
            monkeypatch.setattr(st, name, noting)
            if op in ("alloc", "abort"):
                r = await asyncio.to_thread(c.reserve, keys, [BLOCK] * N)
                assert all(len(e or []) == RUNS for e in r.extents)
                await asyncio.to_thread(r.abort)
            elif op == "put_inline":
                assert await asyncio.to_thread(c.put, keys, data) == [PutStatus.STORED] * N
            elif op == "release":
                got = await asyncio.to_thread(c.get, keys)
                assert [bytes(g) for g in got if g is not None] == data
            else:
                assert await asyncio.to_thread(c.remove, keys) == N
        finally:
            await asyncio.to_thread(c.close)
    finally:
        await server.stop()
        close_store(st)
    if op == "remove":
        assert len(seen) == N // 2  # slices of 2 blocks: 16 extents
    else:
        assert len(seen) == N
    assert len(set(seen)) >= N // 2  # the loop turned every 16 extents
