"""Failures around real sidecars: dead clients, corrupt bytes, disks that fill or vanish, bad start-ups."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvpool_client.client import AsyncPoolClient, PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import ErrorCode, Op, PutStatus
from kvpool_bench.services import RedisServer, free_port
from kvpool_sidecar.errors import SidecarError
from kvpool_sidecar.index.redis import RedisIndex
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (
    DEADLINE_S,
    TCP_TOKEN,
    tcp_tenants,
    Child,
    RawConn,
    assert_serves,
    fresh_keys,
    http_get,
    payload,
    put_all,
    wait_until,
)
from tests.integration.poolfixtures import TOKEN, node_config
from tests.unit.store_support import store_key

pytestmark = pytest.mark.integration

PAGE = 64 << 10
STORED = PutStatus.STORED
Factory = Callable[..., SidecarProcess]


def _client(sp: SidecarProcess) -> PoolClient:
    return PoolClient(sp.socket_path, timeout=DEADLINE_S)


def _sessions(c: PoolClient) -> int:
    return int(c.stats()["sessions"])


def _present(c: PoolClient, keys: list[BlockKey]) -> list[bool]:
    return [c.lookup([k]).prefix == 1 for k in keys]


def _fill(c: PoolClient, n: int, size: int = PAGE) -> list[BlockKey]:
    keys = fresh_keys(n)
    assert put_all(c, keys, [payload(k, size) for k in keys], batch=2) == [STORED] * n
    return keys


def _check_bytes(c: PoolClient, keys: list[BlockKey], sizes: list[int], batch: int = 2) -> tuple[int, int]:
    """Get every key in small batches: each is a miss or exactly its bytes. (hits, misses)"""
    hits = misses = 0
    for i in range(0, len(keys), batch):
        got = c.get(keys[i : i + batch])
        for k, n, g in zip(keys[i : i + batch], sizes[i : i + batch], got):
            if g is None:
                misses += 1
            else:
                assert bytes(g) == payload(k, n), f"wrong bytes for block {k.text}"
                hits += 1
    return hits, misses


def _disk_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.kvb"))


def _record_offsets(segment: Path) -> dict[bytes, int]:
    """Where each block key's record header starts in a segment file (the key sits 12 bytes
    into the header)."""
    data = segment.read_bytes()
    out = {}
    for off in range(0, len(data), 4096):
        if data[off : off + 4] == b"KVPB":
            out[data[off + 12 : off + 60]] = off
    return out


def _disk_keys(path: Path) -> set[bytes]:
    """The block keys a disk tier holds under ``path``, in either layout."""
    keys = {bytes.fromhex(p.name.split(".")[0]) for p in _disk_files(path)}
    for segment in path.rglob("*.kvs"):
        keys |= set(_record_offsets(segment))
    return keys


# ---------------------------------------------------------------------------- dead clients

HOLDER = """
import sys, time
from kvpool_client.client import PoolClient
from kvpool_client.protocol import Op
from tests.integration.support import payload
sock, size = sys.argv[1], int(sys.argv[2])
keys = [bytes.fromhex(h) for h in sys.argv[3].split(",")]
c = PoolClient(sock)
st = c.put(keys, [payload(k, size) for k in keys])
assert all(int(s) == 7 for s in st), st
half = len(keys) // 2
assert c.pin(keys[:half]) == half
acquired = c._call(Op.ACQUIRE, keys[half:])
assert all(a is not None for a in acquired), acquired
print("ready", flush=True)
time.sleep(600)
"""


def test_killed_client_releases_pins_and_read_leases(sidecar_factory: Factory) -> None:
    # LRU: once released, the blocks it read are the oldest and a churn must evict them
    sp = sidecar_factory({"dram": {"size_bytes": 64 * PAGE, "page_bytes": PAGE}, "policy": {"name": "lru"}})
    held = fresh_keys(8)
    child = Child(HOLDER, sp.socket_path, str(PAGE), ",".join(k.raw.hex() for k in held))
    try:
        child.wait_line("ready")
        with _client(sp) as obs:
            assert _sessions(obs) == 2
            # while the holder lives, its pins and read leases keep its blocks through a full churn
            _fill(obs, 128)
            assert _present(obs, held) == [True] * 8
            got = obs.get(held)
            assert [bytes(g) if g is not None else None for g in got] == [payload(k, PAGE) for k in held]
            assert child.kill() == -signal.SIGKILL
            wait_until(lambda: _sessions(obs) == 1, "the killed client's session to close")
            # now they are ordinary blocks: a second churn evicts every one of them
            _fill(obs, 128)
            assert _present(obs, held) == [False] * 8
            stats = obs.stats()
            assert stats["tiers"]["dram"]["used_bytes"] == 64 * PAGE
            assert stats["tiers"]["dram"]["blocks"] == 64
            assert stats["pending_writes"] == 0
    finally:
        child.kill()
    assert_serves(sp)


WRITER = """
import sys, time
from kvpool_client.client import PoolClient
from kvpool_client.protocol import Op
sock, key, size = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
c = PoolClient(sock)
[[status, lease, extents]] = c._call(Op.ALLOC, [[key, size, -1, None]])
c._view[extents[0][0]] = 0xAB  # half-written
print("allocated", status, flush=True)
time.sleep(600)
"""


def test_an_arena_the_client_cannot_map_is_a_lost_connection(sidecar_factory: Factory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``mmap``'s own error (no address space or memory left for the arena) had escaped the
    client as an OSError, past every adapter's handling of KVPoolError, into the engine."""
    sp = sidecar_factory()

    def no_room(*args: object, **kw: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", no_room)
    with pytest.raises(ConnectionLostError, match="cannot map"):
        PoolClient(sp.socket_path, timeout=DEADLINE_S)

    async def connect() -> None:
        await AsyncPoolClient.connect(sp.socket_path, timeout=DEADLINE_S)

    with pytest.raises(ConnectionLostError, match="cannot map"):
        asyncio.run(connect())
    monkeypatch.undo()
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.shm
        wait_until(lambda: c.stats()["sessions"] == 1, "the refused connections to close")


def test_writer_killed_before_commit(sidecar_factory: Factory) -> None:
    sp = sidecar_factory()
    [key] = fresh_keys(1)
    size = 300_000
    child = Child(WRITER, sp.socket_path, key.raw.hex(), str(size))
    try:
        assert child.wait_line("allocated") == f"allocated {int(PutStatus.ALLOCATED)}"
        with _client(sp) as obs:
            assert obs.lookup([key]).prefix == 0, "an uncommitted block must not be visible"
            assert obs.get([key]) == [None]
            assert obs.put([key], [payload(key, size)]) == [PutStatus.PENDING]
            assert obs.stats()["pending_writes"] == 1
            child.kill()
            wait_until(lambda: _sessions(obs) == 1, "the killed writer's session to close")
            stats = obs.stats()
            assert stats["pending_writes"] == 0 and stats["tiers"]["dram"]["used_bytes"] == 0
            assert obs.lookup([key]).prefix == 0
            assert obs.put([key], [payload(key, size)]) == [STORED]
            [got] = obs.get([key])
            assert got is not None and bytes(got) == payload(key, size)
    finally:
        child.kill()


def test_stuck_writer_lease_expires(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"api": {"lease_timeout_s": 1.0}})
    [key] = fresh_keys(1)
    with RawConn(sp.socket_path) as stuck, _client(sp) as obs:
        _, status, [[st, lease, _]] = stuck.call(int(Op.ALLOC), [[key.raw, 5000, -1, None]])
        assert status == 0 and st == int(PutStatus.ALLOCATED)
        assert obs.put([key], [payload(key, 5000)]) == [PutStatus.PENDING]
        wait_until(lambda: obs.stats()["pending_writes"] == 0, "the stuck writer's lease to expire")
        assert obs.put([key], [payload(key, 5000)]) == [STORED]
        # the late commit is refused; the block keeps the second writer's bytes
        _, status, result = stuck.call(int(Op.COMMIT), [[lease, 0]])
        assert status == 0 and result == [-int(ErrorCode.UNKNOWN_LEASE)]
        assert bytes(obs.get([key])[0]) == payload(key, 5000)  # type: ignore[arg-type]


def test_an_expired_write_leases_pages_stay_held_until_its_writer_goes(sidecar_factory: Factory) -> None:
    """A writer that allocated all of DRAM and stalls past its lease loses the key, not the
    pages: a slow DMA may still land in them, and a block placed there would take those
    bytes (served, if a reader in place had checked it first). They come back when its
    connection closes."""
    sp = sidecar_factory({"dram": {"size_bytes": 8 * PAGE, "page_bytes": PAGE}, "policy": {"name": "lru"},
                          "api": {"lease_timeout_s": 1.0}})
    hog, [key] = fresh_keys(1), fresh_keys(1)
    with _client(sp) as obs:
        stuck = _client(sp)
        try:
            [[st, _, extents]] = stuck._call(Op.ALLOC, [[hog[0].raw, 8 * PAGE, -1, None]])  # noqa: SLF001
            assert st == int(PutStatus.ALLOCATED)
            assert obs.put([key], [payload(key, PAGE)]) == [PutStatus.FULL]  # all of DRAM is leased
            wait_until(lambda: obs.stats()["pending_writes"] == 0, "the stalled writer's lease to expire")
            assert obs.lookup(hog).prefix == 0 and obs.stats()["lapsed_writes"] == 1  # the key is free ...
            assert obs.put([key], [payload(key, PAGE)]) == [PutStatus.FULL]  # ... its pages are not
            view = stuck._view  # noqa: SLF001
            assert view is not None
            for off, n in extents:  # the stalled writer wakes up and writes its block after all
                view[off : off + n] = b"\xee" * n
        finally:
            stuck.close()
        wait_until(lambda: obs.put([key], [payload(key, PAGE)]) == [STORED], "the writer's pages to come back")
        assert bytes(obs.get([key])[0] or b"") == payload(key, PAGE)


def _disk_config(tmp: Path, dram: int, disk: int = 256 << 20, **disk_kw: Any) -> dict[str, Any]:
    # Puts into a DRAM tier this small outrun the write-ahead at once: these tests are of the
    # copies down a put waits for (by default such a put is FULL at once: test_write_ahead.py)
    return {"dram": {"size_bytes": dram, "page_bytes": PAGE, "put_waits_for_disk": True},
            "disk": {"path": str(tmp), "size_bytes": disk, **disk_kw}}


BIG = 4 << 20


def test_writer_lost_while_its_allocation_evicts(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A connection that dies while its ALLOC is still demoting victims leaves no key reserved."""
    sp = sidecar_factory(_disk_config(tmp_path / "disk", dram=10 * BIG))
    with _client(sp) as obs:
        for attempt in range(3):
            _fill(obs, 10, BIG)  # DRAM is full of unpinned blocks that must be demoted to make room
            [key] = fresh_keys(1)
            conn = RawConn(sp.socket_path)
            conn.request(int(Op.ALLOC), [[key.raw, 9 * BIG, -1, None]])
            time.sleep(0.002 * (attempt + 1))  # let the allocation start evicting
            conn.close()
            wait_until(lambda: _sessions(obs) == 1, "the lost writer's session to close")
            wait_until(lambda: obs.stats()["pending_writes"] == 0,
                       f"attempt {attempt}: the lost writer's key to be released", timeout=10)
            assert obs.lookup([key]).prefix == 0
            data = payload(key, 9 * BIG)
            assert obs.put([key], [data]) == [STORED], f"attempt {attempt}: the key stayed reserved"
            [got] = obs.get([key])
            assert got is not None and bytes(got) == data
    assert_serves(sp)


def test_reader_lost_during_promotion_leaks_no_dram(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A connection that dies while its ACQUIRE promotes blocks from disk leaks no arena pages."""
    sp = sidecar_factory(_disk_config(tmp_path / "disk", dram=10 * BIG))

    def consistent() -> bool:
        s = obs.stats()
        dram = s["tiers"]["dram"]
        return bool(s["sessions"] == 1 and s["pending_writes"] == 0
                    and dram["used_bytes"] == dram["blocks"] * BIG)

    with _client(sp) as obs:
        for attempt in range(3):
            keys = _fill(obs, 20, BIG)  # the first ten are now on disk only
            assert obs.lookup(keys).tiers[:10] == ["disk"] * 10
            # make room for them without eviction: reserve nine blocks' worth, then abort
            [[st, lease, _]] = obs._call(Op.ALLOC, [[fresh_keys(1)[0].raw, 9 * BIG, -1, None]])  # noqa: SLF001
            assert st == int(PutStatus.ALLOCATED)
            assert obs._call(Op.ABORT, [lease]) == 1  # noqa: SLF001
            conn = RawConn(sp.socket_path)
            conn.request(int(Op.ACQUIRE), [k.raw for k in keys[:9]])
            time.sleep(0.002 * (attempt + 1))  # let the promotions start
            conn.close()
            wait_until(consistent, f"attempt {attempt}: DRAM accounts to match the resident blocks "
                                   f"(pages leaked by an interrupted promotion?)", timeout=10)
            hits, _ = _check_bytes(obs, keys, [BIG] * 20, batch=1)
            assert hits == 20
    assert_serves(sp)


def test_sigterm_during_disk_copies_drains_cleanly(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A drain that lands while blocks move between disk and the arena still exits 0."""
    sp = sidecar_factory(_disk_config(tmp_path / "disk", dram=10 * BIG))
    with _client(sp) as obs:
        keys = _fill(obs, 20, BIG)  # ten in DRAM, ten on disk only
    conn = RawConn(sp.socket_path)
    try:
        conn.request(int(Op.ACQUIRE), [k.raw for k in keys[:10]])  # promotions, which demote others
        assert sp.proc is not None
        sp.proc.send_signal(signal.SIGTERM)
        rc = sp.stop()
    finally:
        conn.close()
    assert rc == 0, sp.log_tail(30)
    assert "Traceback" not in sp.log_path.read_text(), sp.log_tail(30)
    assert not os.path.exists(sp.socket_path)


# ---------------------------------------------------------------------------- corruption


def test_corrupted_arena_bytes_are_a_miss_and_dropped(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    keys = fresh_keys(3)
    sizes = [3 * PAGE + 5, 100_000, 50_000]
    with _client(sp) as writer, _client(sp) as corrupter, \
            PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as tcp:
        assert writer.put(keys, [payload(k, n) for k, n in zip(keys, sizes)]) == [STORED] * 3
        acquired = corrupter._call(Op.ACQUIRE, [k.raw for k in keys[:2]])  # noqa: SLF001 - find the extents
        corrupter._call(Op.RELEASE, [[a[0], False] for a in acquired])  # noqa: SLF001
        view = corrupter._view  # noqa: SLF001 - a second mapping of the same shared arena
        assert view is not None
        off0 = acquired[0][3][0][0] + 12_345
        view[off0] ^= 0xFF  # block 0: one bit-flipped byte in the middle
        last_off, last_len = acquired[1][3][-1]
        view[last_off + last_len - 1] ^= 0x01  # block 1: its very last byte

        # the shared-memory reader verifies and reports; the TCP path is verified by the sidecar
        assert writer.get(keys[:1]) == [None]
        assert tcp.get(keys[1:2]) == [None]
        assert writer.lookup(keys[:1]).prefix == 0, "a corrupt block must be dropped"
        assert tcp.lookup(keys[1:2]).prefix == 0
        assert writer.get(keys[:2]) == [None, None]
        # the untouched block is intact, and the dropped keys can be written again
        assert bytes(writer.get(keys[2:])[0]) == payload(keys[2], sizes[2])  # type: ignore[arg-type]
        assert writer.put(keys[:2], [payload(k, n) for k, n in zip(keys[:2], sizes)]) == [STORED] * 2
        hits, _ = _check_bytes(writer, keys, sizes)
        assert hits == 3
        counters = writer.stats()["counters"]
        assert counters.get("corrupt_dram") == 2
    assert_serves(sp)


def test_corrupted_block_is_not_demoted(sidecar_factory: Factory, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    # LRU: the block read once is still the first victim of the fill below
    sp = sidecar_factory({**_disk_config(disk, dram=8 * PAGE), "policy": {"name": "lru"}})
    with _client(sp) as c:
        [bad] = fresh_keys(1)
        assert c.put([bad], [payload(bad, PAGE)]) == [STORED]
        [[lease, _, _, extents]] = c._call(Op.ACQUIRE, [bad.raw])  # noqa: SLF001
        c._call(Op.RELEASE, [[lease, False]])  # noqa: SLF001
        assert c._view is not None  # noqa: SLF001
        c._view[extents[0][0] + 7] ^= 0x40  # noqa: SLF001
        others = _fill(c, 16)  # evicts (tries to demote) the corrupt block
        assert c.lookup([bad]).prefix == 0
        assert c.get([bad]) == [None]
        assert store_key(bad.raw) not in _disk_keys(disk)
        assert c.stats()["counters"].get("corrupt_dram") == 1
        hits, misses = _check_bytes(c, others, [PAGE] * 16)
        assert hits == 16 and misses == 0


# ---------------------------------------------------------------------------- disk tier


@pytest.mark.parametrize("layout", ["segments", "files"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_disk_tier_demotes_and_promotes_identical_bytes(sidecar_factory: Factory, tmp_path: Path,
                                                        compression: str, layout: str) -> None:
    disk = tmp_path / "disk"
    sp = sidecar_factory(_disk_config(disk, dram=16 * PAGE, disk=64 << 20, compression=compression, layout=layout))
    keys = fresh_keys(40)
    sizes = [[1, 4096, PAGE, PAGE + 1, 200_000, 3 * PAGE][i % 6] for i in range(40)]

    def data(k: BlockKey, n: int) -> bytes:  # half random, half zeros: compressible
        return payload(k, n // 2) + bytes(n - n // 2)

    with _client(sp) as c:
        for i in range(0, 40, 4):
            assert c.put(keys[i : i + 4], [data(k, n) for k, n in zip(keys[i : i + 4], sizes[i : i + 4])]) \
                == [STORED] * 4
        found = c.lookup(keys)
        assert found.prefix == 40, "demoted blocks must stay findable"
        assert found.tiers[0] == "disk" and found.tiers[-1] == "dram"
        stats = c.stats()
        assert stats["tiers"]["disk"]["blocks"] >= found.tiers.count("disk")
        # every file is a block the store counts (the write-ahead may be between writing a
        # file and counting it: wait for the two to agree, as they must once it rests)
        if layout == "files":
            wait_until(lambda: len(_disk_files(disk)) == c.stats()["tiers"]["disk"]["blocks"],
                       "the disk's files to be exactly the blocks the store counts on disk")
        else:
            assert not _disk_files(disk) and list(disk.rglob("*.kvs"))
        assert stats["tiers"]["disk"]["used_bytes"] > 0
        # read everything back in small batches: disk-only blocks are promoted
        for i in range(0, 40, 2):
            got = c.get(keys[i : i + 2])
            for k, n, g in zip(keys[i : i + 2], sizes[i : i + 2], got):
                assert g is not None, f"block {keys.index(k)} was lost"
                assert bytes(g) == data(k, n), f"block {keys.index(k)} came back different"
        counters = c.stats()["counters"]
        assert counters.get("demote_ok", 0) > 0 and counters.get("promote_ok", 0) > 0
        assert c.lookup(keys[:1]).prefix == 1
    assert_serves(sp)


@pytest.mark.parametrize("layout", ["segments", "files"])
def test_warm_restart_serves_blocks_from_disk(sidecar_factory: Factory, tmp_path: Path, layout: str) -> None:
    disk = tmp_path / "disk"
    cfg = _disk_config(disk, dram=16 * PAGE, disk=64 << 20, layout=layout)
    first = sidecar_factory(cfg)
    keys = fresh_keys(30)
    sizes = [[PAGE, 1000, 2 * PAGE + 3][i % 3] for i in range(30)]
    with _client(first) as c:
        assert put_all(c, keys, [payload(k, n) for k, n in zip(keys, sizes)], batch=3) == [STORED] * 30
        before = c.lookup(keys)
        assert before.prefix == 30
    on_disk = [i for i, t in enumerate(before.tiers) if t == "disk"]
    assert len(on_disk) >= 10
    assert first.stop() == 0, first.log_tail()

    second = sidecar_factory(cfg)
    with _client(second) as c:
        held = c.stats()["tiers"]["disk"]["blocks"]
        assert held == len(_disk_files(disk)) if layout == "files" else held >= len(on_disk)
        for i in on_disk:
            assert c.lookup([keys[i]]).tiers == ["disk"], f"block {i} was on disk before the restart"
        for i in on_disk:
            [g] = c.get([keys[i]])
            assert g is not None and bytes(g) == payload(keys[i], sizes[i]), f"block {i} differs after restart"
        hits, _ = _check_bytes(c, keys, sizes)  # DRAM-only blocks may be gone, never wrong
        assert hits >= len(on_disk)
    assert_serves(second)


def _twelve_demoted_then_stopped(sidecar_factory: Factory, cfg: dict[str, Any]) -> list[BlockKey]:
    """Twelve blocks of a page put on a sidecar whose DRAM holds four (the first eight are
    then on disk only), and the sidecar stopped cleanly."""
    first = sidecar_factory(cfg)
    keys = fresh_keys(12)
    with _client(first) as c:
        assert put_all(c, keys, [payload(k, PAGE) for k in keys], batch=2) == [STORED] * 12
        assert c.lookup(keys).tiers[:8] == ["disk"] * 8
    assert first.stop() == 0
    return keys


def test_damaged_disk_files_are_misses_after_restart(sidecar_factory: Factory, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    cfg = _disk_config(disk, dram=4 * PAGE, disk=64 << 20, layout="files")
    keys = _twelve_demoted_then_stopped(sidecar_factory, cfg)
    files = {p.name.split(".")[0]: p for p in _disk_files(disk)}
    flipped, truncated = files[store_key(keys[0].raw).hex()], files[store_key(keys[1].raw).hex()]
    with open(flipped, "r+b") as f:  # one payload byte
        f.seek(-100, os.SEEK_END)
        b = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) - 1)
    (flipped.parent / ".leftover.kvb.123.0.tmp").write_bytes(b"partial")

    second = sidecar_factory(cfg)
    with _client(second) as c:
        assert c.lookup([keys[1]]).prefix == 0, "a torn file must be discarded at start-up"
        assert not truncated.exists()
        assert c.get([keys[0]]) == [None], "a corrupt disk block must be a miss"
        assert c.lookup([keys[0]]).prefix == 0 and not flipped.exists()
        hits, misses = _check_bytes(c, keys[2:8], [PAGE] * 6)
        assert hits == 6 and misses == 0
        assert c.stats()["counters"].get("corrupt_disk") == 1
    assert not list(disk.rglob("*.tmp"))


def test_damaged_segment_records_are_misses_after_restart(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A payload byte flipped inside a segment is a miss at its first read; a record cut
    short at a segment's end (a torn write) is discarded at start-up; the rest serve."""
    disk = tmp_path / "disk"
    cfg = _disk_config(disk, dram=4 * PAGE, disk=64 << 20)
    keys = _twelve_demoted_then_stopped(sidecar_factory, cfg)
    [segment] = list((disk / "segments").glob("*.kvs"))
    offsets = _record_offsets(segment)
    offsets = {k.raw: offsets[store_key(k.raw)] for k in keys if store_key(k.raw) in offsets}
    on_disk = [k for k in keys if k.raw in offsets]
    assert len(on_disk) >= 8
    last = max(on_disk, key=lambda k: offsets[k.raw])
    flipped = next(k for k in on_disk if k is not last)
    with open(segment, "r+b") as f:
        f.seek(offsets[flipped.raw] + 4096 + 100)  # a payload byte (the header is under 4 KiB)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
        f.truncate(offsets[last.raw] + 4096 + PAGE // 2)  # the last record, torn

    second = sidecar_factory(cfg)
    with _client(second) as c:
        assert c.lookup([last]).prefix == 0, "a torn record must be discarded at start-up"
        assert c.get([flipped]) == [None], "a corrupt disk block must be a miss"
        assert c.lookup([flipped]).prefix == 0
        rest = [k for k in on_disk if k not in (last, flipped)]
        hits, misses = _check_bytes(c, rest, [PAGE] * len(rest))
        assert hits == len(rest) and misses == 0
        assert c.stats()["counters"].get("corrupt_disk") == 1


def test_full_disk_keeps_serving(sidecar_factory: Factory, tmp_path: Path) -> None:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=60, check=False)
    if r.returncode != 0:
        if "permission denied" in r.stderr.lower() or "not permitted" in r.stderr.lower():
            pytest.skip(f"cannot mount a tmpfs here (EPERM): {r.stderr.strip()}")
        pytest.fail(f"mount failed: {r.stderr}")
    sp: SidecarProcess | None = None
    try:
        sp = sidecar_factory(_disk_config(mnt, dram=16 * PAGE, disk=64 << 20))
        keys = fresh_keys(120)  # about 7 MiB through a 1 MiB arena onto a 2 MiB disk
        size = 60_000
        with _client(sp) as c:
            statuses = put_all(c, keys, [payload(k, size) for k in keys], batch=8)
            assert statuses == [STORED] * 120, "puts must keep succeeding in DRAM when the disk is full"
            counters = c.stats()["counters"]
            # the 2 MiB filesystem, not the configured 64 MiB, bounds the tier: once it is
            # full the store evicts disk blocks to demote newer ones instead of failing
            assert counters.get("evicted_disk", 0) > 0, "the disk never filled up"
            assert counters.get("demote_ok", 0) > counters.get("demote_failed", 0)
            assert sp.proc is not None and sp.proc.poll() is None
            hits, misses = _check_bytes(c, keys, [size] * 120, batch=4)
            assert hits >= 16 and hits + misses == 120
            status, _ = http_get(sp.ready["http_port"], "/healthz")
            assert status == 200
        assert not list(mnt.rglob("*.tmp")), "failed writes must not leave temp files"
        assert_serves(sp)
    finally:
        if sp is not None:
            sp.stop()
        u = subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60, check=False)
        if u.returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60, check=False)


def test_missing_disk_directory_is_created(sidecar_factory: Factory, tmp_path: Path) -> None:
    disk = tmp_path / "not" / "there" / "yet"
    sp = sidecar_factory(_disk_config(disk, dram=4 * PAGE, disk=16 << 20))
    assert disk.is_dir()
    with _client(sp) as c:
        keys = _fill(c, 12)
        assert len(_disk_keys(disk)) >= 8
        hits, misses = _check_bytes(c, keys, [PAGE] * 12, batch=1)
        assert hits == 12


def test_uncreatable_disk_path_fails_start_clearly(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    sp = SidecarProcess(_disk_config(blocker / "disk", dram=4 * PAGE, disk=16 << 20), workdir=tmp_path / "w")
    try:
        with pytest.raises(SidecarError) as ei:
            sp.start(timeout=DEADLINE_S)
        text = str(ei.value)
        assert "disk" in text and ("ENOTDIR" in text or "Not a directory" in text), text
        assert sp.proc is not None and sp.proc.returncode == 1
        assert not os.path.exists(sp.socket_path)
    finally:
        sp.stop()


# ---------------------------------------------------------------------------- start-up refusals


@pytest.mark.parametrize(("config", "names"), [
    ({"bogus_setting": 1}, ["bogus_setting"]),
    ({"api": {"socket_path": "/tmp/x.sock", "bogus_port": 1}}, ["api", "bogus_port"]),
    ({"dram": {"size_bytes": "lots"}}, ["dram.size_bytes"]),
    ({"disk": {"path": "/tmp/kvpool-disk"}}, ["disk.size_bytes"]),
    ({"tenants": [{"name": "a", "quota": 5}]}, ["tenants[0]", "quota"]),
])
def test_invalid_config_exits_2_naming_the_field(tmp_path: Path, config: dict[str, Any], names: list[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    r = subprocess.run([sys.executable, "-m", "kvpool_sidecar", "--config", str(path)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    for name in names:
        assert name in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("made_by", ["another user", "everyone may write", "sticky, everyone may write",
                                     "another user's link"])
def test_a_socket_directory_another_user_could_write_is_refused(tmp_path: Path, made_by: str) -> None:
    """In such a directory another user could replace the socket with one of its own and read
    the HELLO (and token) of every client that connects next: the sidecar does not start. So
    with a path through a symbolic link another user owns (planted in a sticky directory, it
    points at a directory of ours today, and at one of theirs tomorrow)."""
    where = tmp_path / "run"
    where.mkdir()
    if "everyone may write" not in made_by and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    if made_by == "another user":
        os.chown(where, 2000, 2000)
    elif made_by == "everyone may write":
        where.chmod(0o777)
    elif made_by == "sticky, everyone may write":  # (as /tmp: another user may bind the name while it is free)
        where.chmod(0o1777)
    else:
        (tmp_path / "ours").mkdir(mode=0o750)
        where.rmdir()
        where.symlink_to(tmp_path / "ours")
        os.lchown(where, 2000, 2000)
    sp = SidecarProcess({"node_name": "n", "dram": {"size_bytes": "4Mi"},
                         "api": {"socket_path": str(where / "kvpool.sock")}}, workdir=tmp_path / "work")
    try:
        with pytest.raises(SidecarError, match="could (replace|point|bind)"):
            sp.start(timeout=DEADLINE_S)
    finally:
        sp.stop()
    assert not (where / "kvpool.sock").exists()


def test_second_sidecar_on_a_live_socket_refuses(sidecar_factory: Factory, tmp_path: Path) -> None:
    first = sidecar_factory()
    second = SidecarProcess({"node_name": "second", "dram": {"size_bytes": "4Mi"},
                             "api": {"socket_path": first.socket_path}}, workdir=tmp_path / "second")
    try:
        with pytest.raises(SidecarError) as ei:
            second.start(timeout=DEADLINE_S)
        assert "another sidecar is listening" in str(ei.value)
        assert second.proc is not None and second.proc.returncode == 1
    finally:
        second.stop()
    assert os.path.exists(first.socket_path), "the refused sidecar removed the live socket"
    assert_serves(first)

    # once the first is gone without cleaning up, its stale socket file is replaced
    assert first.proc is not None
    first.proc.kill()
    first.proc.wait(DEADLINE_S)
    assert os.path.exists(first.socket_path)
    third = sidecar_factory({"api": {"socket_path": first.socket_path}})
    assert_serves(third)


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped at the end of the test."""
    with RedisServer() as r:
        yield r


def _refused(sp: SidecarProcess) -> str:
    """Start ``sp``, which must fail: the one line of its log that says why."""
    try:
        with pytest.raises(SidecarError):
            sp.start(timeout=DEADLINE_S)
    finally:
        sp.stop()
    log = sp.log_path.read_text(errors="replace")
    assert sp.proc is not None and sp.proc.returncode == 1, (sp.proc and sp.proc.returncode, log)
    assert "Traceback" not in log, log
    [line] = [ln for ln in log.splitlines() if " ERROR " in ln]
    return line


def _index_view(url: str, keys: list[BlockKey]) -> tuple[list[str], list[list[str]]]:
    """The live nodes of the pool ``itest`` and the holders of ``keys``, as peers read them."""
    async def read() -> tuple[list[str], list[list[str]]]:
        index = RedisIndex.from_url(url, pool="itest", live_cache_s=0.0)
        try:
            return [n["name"] for n in await index.nodes()], await index.lookup([store_key(k.raw) for k in keys])
        finally:
            await index.close()

    return asyncio.run(read())


@pytest.mark.parametrize("taken", ["the socket", "the HTTP port", "the peer port"])
def test_a_second_sidecar_of_a_node_that_cannot_start_leaves_the_live_ones_index_entries(
        sidecar_factory: Factory, redis: RedisServer, tmp_path: Path, taken: str) -> None:
    """A second sidecar of the same node name (a pod being replaced still drains, a second
    install) that cannot have what the live one holds fails before it joins the pool: the
    node's record and blocks in the index are the live one's, and stay (they had been
    unpublished on its way out, and back only at the live one's next heartbeat)."""
    (tmp_path / "token").write_text(TOKEN)
    cfg = node_config("dup", "127.0.0.1", redis.url, tmp_path / "token",
                      index={"backend": "redis", "url": redis.url, "heartbeat_s": 60.0, "sweep_s": 60.0})
    first = sidecar_factory(cfg)
    keys = fresh_keys(8)
    with _client(first) as c:
        assert put_all(c, keys, [payload(k, 1000) for k in keys]) == [STORED] * 8
    wait_until(lambda: _index_view(redis.url, keys) == (["dup"], [["dup@dram"]] * 8), "the blocks published")

    second_cfg = dict(cfg, api={"socket_path": first.socket_path} if taken == "the socket" else
                      {"http_port": first.ready["http_port"]} if taken == "the HTTP port" else {})
    if taken != "the peer port":
        second_cfg["peer"] = dict(cfg["peer"], port=free_port())
    second = SidecarProcess(second_cfg, workdir=tmp_path / "second")
    line = _refused(second)
    assert {"the socket": "another sidecar is listening", "the HTTP port": "api.http_port",
            "the peer port": "peer.port"}[taken] in line, line

    assert _index_view(redis.url, keys) == (["dup"], [["dup@dram"]] * 8), "the refused sidecar unpublished the node"
    assert_serves(first)


@pytest.mark.parametrize("failure", ["HTTP port in use", "TCP port in use", "HTTP host unknown",
                                     "socket directory is a file"])
def test_a_start_that_cannot_have_a_port_or_path_fails_in_one_line(tmp_path: Path, failure: str) -> None:
    """Each says what it could not have and which setting names it, in one line (no
    traceback), exits 1 and leaves no socket file behind."""
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        api: dict[str, Any] = {"socket_path": str(tmp_path / "run" / "kvpool.sock")}
        config: dict[str, Any] = {"node_name": "n", "dram": {"size_bytes": "4Mi"}}
        if failure == "HTTP port in use":
            api["http_port"], setting = port, "api.http_port"
        elif failure == "TCP port in use":
            api.update(tcp_host="127.0.0.1", tcp_port=port)
            config["tenants"] = tcp_tenants(tmp_path)
            setting = "api.tcp_port"
        elif failure == "HTTP host unknown":
            api["http_host"], setting = "no-such-host.invalid", "api.http_host"
        else:
            (tmp_path / "a-file").write_text("not a directory")
            api["socket_path"], setting = str(tmp_path / "a-file" / "kvpool.sock"), "api.socket_path"
        line = _refused(SidecarProcess({**config, "api": api}, workdir=tmp_path / "w"))
    assert setting in line, line
    assert not os.path.exists(api["socket_path"]), "the socket file was left behind"


def test_socket_path_that_is_not_a_socket_refuses(sidecar_factory: Factory, tmp_path: Path) -> None:
    path = tmp_path / "regular-file"
    path.write_text("precious")
    with pytest.raises(SidecarError) as ei:
        sidecar_factory({"api": {"socket_path": str(path)}})
    assert "not a socket" in str(ei.value)
    assert path.read_text() == "precious"


def test_the_sidecar_raises_its_descriptor_limit_to_the_hard_one(tmp_path: Path) -> None:
    """A runtime's soft limit of 1,024 descriptors would run out before api.max_connections
    (1,024 local clients alone) applies: the sidecar raises it to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 512:
        pytest.skip("the hard limit leaves nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the child
    try:
        sp = SidecarProcess({"node_name": "n", "dram": {"size_bytes": "4Mi"}}, workdir=tmp_path / "work").start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        limits = Path(f"/proc/{sp.pid}/limits").read_text()
        row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        soft_now = row.split()[3]  # "Max open files <soft> <hard> files"
        assert soft_now == "unlimited" or int(soft_now) > 256, row
    finally:
        assert sp.stop() == 0, sp.log_tail()
