"""Helpers for tests that drive in-process stores: build one, put and read raw blocks."""

from __future__ import annotations

from kvpool_client.integrity import checksum
from kvpool_sidecar.policy import EvictionPolicy, LRUPolicy
from kvpool_sidecar.store import StoreSettings, TieredStore
from kvpool_sidecar.tiers.dram import DramTier, SharedArena


def make_store(size: int = 8 << 20, page: int = 4096, *, policy: EvictionPolicy | None = None,
               settings: StoreSettings | None = None) -> TieredStore:
    """A store over a real (unpopulated) shared arena; LRU and the default tenant unless told."""
    return TieredStore(DramTier(size, page, SharedArena(size, populate=False)), policy or LRUPolicy(),
                       settings or StoreSettings())


async def put(store: TieredStore, key: bytes, data: bytes) -> None:
    """Two-phase put of ``data`` as ``key``, as a local client would."""
    s = store.open_session()
    _, lease = await store.allocate(s, key, len(data))
    if lease is None:
        raise AssertionError(f"no room for a block of {len(data)} bytes")
    pos = 0
    for v in store.dram.views(lease.extents):
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    store.commit(s, lease.id, checksum(memoryview(data)))


async def read(store: TieredStore, key: bytes) -> bytes | None:
    """The block's bytes, or None on a miss."""
    s = store.open_session()
    lease = await store.acquire(s, key)
    if lease is None:
        return None
    data = b"".join(bytes(v) for v in store.dram.views(lease.extents))
    store.release(s, lease.id)
    return data
