"""A batched ACQUIRE or ALLOC that fails part way (an error the store raises for one of its
keys) answers an error, so the leases it had granted for the keys before are never named to
the client: they are given back before the error goes out (real store, the local API's
request handlers)."""

from __future__ import annotations

from typing import Any

import pytest

from kvpool_sidecar.api.budget import IndexBudget
from kvpool_sidecar.api.limits import LocalLimits
from kvpool_sidecar.api.localclient import LocalClient
from kvpool_sidecar.api.reads import ReadRequests
from kvpool_sidecar.api.unread import Unread
from kvpool_sidecar.api.writes import WriteRequests
from kvpool_sidecar.errors import TierIOError
from kvpool_sidecar.store import TieredStore
from tests.unit.store_support import close_store, make_store, put

KEYS = [bytes([i]) * 48 for i in range(1, 5)]


def _client(st: TieredStore) -> LocalClient:
    c = LocalClient(st, LocalLimits(max_frame_bytes=64 << 20, max_batch=4096, node="n"), shm=True)
    c.session = st.open_session()
    c.arena = 0
    c.version = 3
    return c


def _failing_at(real: Any, bad: bytes) -> Any:
    async def call(session: Any, key: bytes, *a: Any, **kw: Any) -> Any:
        if key == bad:
            raise TierIOError("the disk could not read it")  # (any error of the store's, part way)
        return await real(session, key, *a, **kw)

    return call


async def test_an_acquire_that_fails_part_way_gives_back_the_leases_it_granted() -> None:
    st = make_store()
    try:
        c = _client(st)
        scoped = c.scoped(KEYS)
        for k in scoped:
            await put(st, k, b"x" * 8192)
        reads = ReadRequests(c, peers=None, budget=IndexBudget(4, 1e9), unread=Unread(1 << 30),
                             inbound=Unread(1 << 30))
        st.acquire = _failing_at(st.acquire, scoped[2])  # type: ignore[method-assign]
        with pytest.raises(TierIOError):
            await reads.acquire(KEYS)
        assert c.active_session.reads == {}  # before: the first two, held until the connection closed
        assert [st._entries[k].readers for k in scoped] == [0] * 4  # noqa: SLF001
        assert c.active_session.held_bytes == 0
    finally:
        close_store(st)


async def test_an_alloc_that_fails_part_way_aborts_the_leases_it_granted() -> None:
    st = make_store()
    try:
        c = _client(st)
        scoped = c.scoped(KEYS)
        writes = WriteRequests(c)
        st.allocate = _failing_at(st.allocate, scoped[2])  # type: ignore[method-assign]
        with pytest.raises(TierIOError):
            await writes.alloc([[k, 8192, -1, None] for k in KEYS])
        assert c.active_session.writes == {}  # before: two keys PENDING until their leases expired
        assert c.active_session.held_bytes == 0
        del st.allocate  # (the store's own again)
        assert not any(k in st._pending for k in scoped)  # noqa: SLF001
    finally:
        close_store(st)
