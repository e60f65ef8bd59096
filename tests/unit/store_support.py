"""Helpers for tests that drive in-process stores: build one, put and read raw blocks, see
where the store keeps a block, and read a local API's answers off a socket."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvpool_client.integrity import checksum
from kvpool_client.keys import RAW_KEY_BYTES
from kvpool_client.protocol import HEADER, decode
from kvpool_sidecar.policy import EvictionPolicy, LRUPolicy
from kvpool_sidecar.store import Entry, StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tiers.base import BlockRecord
from kvpool_sidecar.tiers.keyed import KeyedDiskTier
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tenancy import KeySpaces


def make_store(size: int = 8 << 20, page: int = 4096, *, policy: EvictionPolicy | None = None,
               settings: StoreSettings | None = None, spaces: list[str] | None = None) -> TieredStore:
    """A store over real (unpopulated) shared arenas; LRU and the default tenant unless told.

    ``spaces``: tenants each in a key space (and an arena) of its own, the first ``default``.
    """
    names = spaces or ["default"]
    arenas = [SharedArena(size, populate=False) for _ in names]
    if settings is None and spaces:
        settings = StoreSettings(tenants={name: TenantLimits() for name in names})
    return TieredStore([DramTier(size, page, arenas, {name: i for i, name in enumerate(names)})],
                       policy or LRUPolicy(), settings or StoreSettings())


def close_store(store: TieredStore) -> None:
    """Unmap the store's arenas (views caught in reference cycles are collected first)."""
    gc.collect()
    store.close()


def dram(store: TieredStore) -> DramTier:
    """The store's DRAM tier."""
    return next(t for t in store.tiers if isinstance(t, DramTier))


def disk(store: TieredStore) -> KeyedDiskTier | None:
    """The store's disk tier (of either layout), if it has one."""
    return next((t for t in store.tiers if isinstance(t, KeyedDiskTier)), None)


def entry(store: TieredStore, key: bytes) -> Entry:
    return store._entries[key]  # noqa: SLF001 - where the store keeps its blocks, for white-box checks


def in_tier(store: TieredStore, key: bytes | Entry, tier: str) -> bool:
    """Whether the store keeps a copy of the block in ``tier`` ("gpu", "dram", "disk")."""
    e = key if isinstance(key, Entry) else store._entries.get(key)  # noqa: SLF001
    names = [t.kind.value for t in store.tiers]
    return e is not None and tier in names and e.place(names.index(tier)) is not None


async def put(store: TieredStore, key: bytes, data: bytes, tenant: str | None = None) -> None:
    """Two-phase put of ``data`` as ``key`` (by ``tenant``), as a local client would."""
    s = store.open_session()
    _, lease = await store.allocate(s, key, len(data), tenant=tenant)
    if lease is None:
        raise AssertionError(f"no room for a block of {len(data)} bytes")
    pos = 0
    for v in store.host.views(lease.place):
        v[:] = data[pos : pos + v.nbytes]
        pos += v.nbytes
    store.commit(s, lease.id, checksum(memoryview(data)))


async def fragment(store: TieredStore, pages: int) -> list[bytes]:
    """Cut the store's DRAM tier into one-page holes: a one-byte block of the default
    tenant in each of ``pages`` pages, then every other one removed. The store keys of the
    blocks left, one page apart (the client keys are ``fragment_key(i)``, odd ``i``)."""
    keys = [store_key(fragment_key(i)) for i in range(pages)]
    for k in keys:
        await put(store, k, b"x")
    s = store.open_session()
    assert store.remove(s, keys[::2]) == len(keys[::2])
    store.close_session(s)
    return keys[1::2]


def fragment_key(i: int) -> bytes:
    """A client's key of :func:`fragment`'s block ``i``."""
    return hashlib.blake2b(b"fragment-%d" % i, digest_size=RAW_KEY_BYTES).digest()


async def read(store: TieredStore, key: bytes) -> bytes | None:
    """The block's bytes, or None on a miss."""
    s = store.open_session()
    lease = await store.acquire(s, key)
    if lease is None:
        return None
    data = b"".join(bytes(v) for v in store.host.views(lease.place))
    store.release(s, lease.id)
    return data


def dram_place(store: TieredStore, key: bytes | Entry) -> list[tuple[int, int]] | None:
    """The DRAM extents of the block (None: no DRAM copy)."""
    e = key if isinstance(key, Entry) else store._entries.get(key)  # noqa: SLF001
    names = [t.kind.value for t in store.tiers]
    return None if e is None else e.place(names.index("dram"))


class HeldWrites:
    """Holds each write of ``tier`` (a copy one tier down) until the test lets it go
    (:meth:`let_one_go`, :meth:`let_all_go`): :meth:`started_or` waits for the next to start."""

    def __init__(self, tier: KeyedDiskTier) -> None:
        self._tier = tier
        self._write = tier.write
        self._loop = asyncio.get_running_loop()
        self._go = threading.Semaphore(0)
        self._all = False
        self.started = asyncio.Event()
        tier.write = self._held  # type: ignore[method-assign]

    def _held(self, record: BlockRecord, views: Sequence[memoryview]) -> int:
        self._loop.call_soon_threadsafe(self.started.set)
        if not self._all and not self._go.acquire(timeout=10):
            raise AssertionError("the test never let this write go")
        return self._write(record, views)

    async def started_or(self, task: Awaitable[Any]) -> None:
        """Until a write starts (not one let go before) or ``task`` is done."""
        started = asyncio.ensure_future(self.started.wait())
        await asyncio.wait({started, asyncio.ensure_future(task)}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        self.started.clear()

    def let_one_go(self) -> None:
        self._go.release()

    def let_all_go(self) -> None:
        """Every write, held now or to come, goes on; the tier writes as before."""
        self._all = True
        self._go.release(64)
        self._tier.write = self._write  # type: ignore[method-assign]


async def until(cond: Callable[[], object], limit: float = 3.0) -> bool:
    """Whether ``cond()`` holds within ``limit`` seconds (checked as the loop runs)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


def store_key(key: bytes, tenant: str = "default") -> bytes:
    """The store's key of a client's ``key`` (its tenant's key space, as the local API maps it)."""
    return KeySpaces({}).scoped(tenant, [key])[0]


async def read_answers(sock: socket.socket, n: int) -> list[list[Any]]:
    """The next ``n`` answers a local API sends on ``sock`` (a non-blocking socket), decoded;
    AssertionError if it closes first (10 s at most for each read)."""
    loop = asyncio.get_running_loop()
    buf = bytearray()
    out: list[list[Any]] = []
    while len(out) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 10)
        if not chunk:
            raise AssertionError("the sidecar closed the connection")
        buf += chunk
        while len(buf) >= HEADER.size:
            (length,) = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + length:
                break
            out.append(decode(bytes(buf[HEADER.size : HEADER.size + length])))
            del buf[: HEADER.size + length]
    return out


async def ask_and_never_read(addr: str, token: bytes, op: int, keys: list[bytes]) -> socket.socket:
    """A peer connection (proved with ``token``), with a tiny receive window, that asks for
    ``keys`` with ``op`` (a GET, or the Mooncake transport's LOOKUP) and never reads the answer."""
    from kvpool_sidecar.transfer import auth, tcpwire

    loop = asyncio.get_running_loop()
    host, _, port = addr.rpartition(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    s.setblocking(False)
    await loop.sock_connect(s, (host, int(port)))
    ours = auth.new_nonce()
    await loop.sock_sendall(s, tcpwire.MAGIC + ours)
    theirs = (await tcpwire._recv_exact(loop, s, auth.NONCE_BYTES + auth.PROOF_BYTES))[: auth.NONCE_BYTES]
    await loop.sock_sendall(s, auth.proof(token, False, theirs, ours))
    if await tcpwire._recv_exact(loop, s, 1) != b"\x01":
        raise AssertionError("the peer refused the handshake")
    frames = auth.FrameSeal(auth.session_key(token, ours, theirs), client=True)
    await loop.sock_sendall(s, frames.seal([op, 1, keys]))
    return s
