"""kvpool's Mooncake-compatible API on real sidecars, where things go wrong: evicted chunks,
upserts that cannot be stored, another writer of the same key, a stalled index, batches of
large values, readers over TCP, tenants sharing a key space, forged heads, odd tensors."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool_bench.services import RedisServer
from kvpool_client.client import PoolClient
from kvpool_client.errors import ConnectionLostError
from kvpool_client.mooncake import ErrorCode, KeyMap, MooncakeDistributedStore
from kvpool_client.mooncake.layout import HEADER, MIN_CHUNK_BYTES, Header
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.poolfixtures import TOKEN, node_config
from tests.integration.support import DEADLINE_S, TCP_TOKEN, tcp_tenants

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
BLOCK = 64 << 10
SETUP = ("127.0.0.1", "P2PHANDSHAKE", 1 << 30, 1 << 27, "tcp", "", "127.0.0.1:50051")


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(n * 7919 + seed).randbytes(n)


def connect(sp: SidecarProcess, timeout: float = DEADLINE_S, **kw: object) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore(socket_path=sp.socket_path, timeout=timeout, **kw)  # type: ignore[arg-type]
    assert s.setup(*SETUP) == 0
    return s


def blocks(sp: SidecarProcess, tenant: str = "default") -> int:
    """How many blocks the node holds (of every tenant)."""
    with PoolClient(sp.socket_path, tenant=tenant, timeout=DEADLINE_S) as c:
        n: int = c.stats()["blocks"]
        return n


def header(sp: SidecarProcess, key: str) -> Header:
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        got = c.get([KeyMap().head(key)])[0]
        assert got is not None
        return Header.parse(bytes(got[: HEADER.size]), got.nbytes)


# ---------------------------------------------------------------------- a broken value
def test_a_put_rewrites_a_value_whose_chunk_was_evicted(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    value = blob(3 * BLOCK)
    assert s.put("v", value) == 0
    old = header(sp, "v")
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.remove([KeyMap().chunk("v", old.nonce, 2)]) == 1  # as an eviction would
    assert s.get("v") == b""
    assert s.put("v", value) == 0  # the head is here, but not its chunks: written again
    assert s.get("v") == value
    new = header(sp, "v")
    assert new.nonce != old.nonce and blocks(sp) == new.blocks  # what was left of the old one went
    s.close()


def test_a_small_put_over_a_broken_chunked_value_rewrites_it(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    assert s.put("v", blob(3 * BLOCK)) == 0
    old = header(sp, "v")
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.remove([KeyMap().chunk("v", old.nonce, 2)]) == 1  # as an eviction would
    assert s.put("v", b"small value") == 0  # a value of one block: the head was found held
    assert s.get("v") == b"small value" and blocks(sp) == 1  # the broken one went, chunks and all
    assert s.put_batch(["v", "w"], [b"other", b"w"]) == 0 and s.get("v") == b"small value"  # whole: kept
    s.close()


def test_a_put_that_found_a_broken_head_leaves_the_value_another_client_put_meanwhile(
        sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    a, b = connect(sp), connect(sp)
    assert a.put("v", blob(3 * BLOCK)) == 0
    old = header(sp, "v")
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert c.remove([KeyMap().chunk("v", old.nonce, 2)]) == 1
    objects = a._objects  # noqa: SLF001
    assert objects is not None
    broken = objects._broken  # noqa: SLF001
    v2 = blob(2 * BLOCK, 2)

    def then_another_client_upserts(key: str) -> int | None:
        found = broken(key)
        assert b.upsert("v", v2) == 0  # between this put's look and its removal
        return found

    monkeypatch.setattr(objects, "_broken", then_another_client_upserts)
    assert a.put("v", blob(3 * BLOCK, 3)) == 0  # the key holds a value: a put keeps it
    assert a.get("v") == v2 and b.get("v") == v2
    a.close()
    b.close()


def test_a_put_after_real_evictions_leaves_a_readable_value(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK, "dram": {"size_bytes": "2Mi"}})
    s = connect(sp)
    values = {f"k{i}": bytes([i % 251]) * (3 * BLOCK - 100) for i in range(60)}
    for k, v in values.items():
        assert s.put(k, v) == 0
    broken = [k for k in values if s.is_exist(k) == 1 and s.get(k) == b""]  # chunks go before their head
    for k in broken:  # miss, recompute, put, get: the cache pattern
        assert s.put(k, values[k]) == 0 and s.get(k) == values[k], k
    s.close()


# ---------------------------------------------------------------------- upsert
def test_an_upsert_that_can_never_be_stored_keeps_the_old_value(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK, "dram": {"size_bytes": "1Mi"}})
    s = connect(sp)
    small, chunked = b"v1" * 1000, blob(3 * BLOCK)
    assert s.put("small", small) == 0 and s.put("chunked", chunked) == 0
    for key, old in (("small", small), ("chunked", chunked)):  # more than the node's tiers hold
        assert s.upsert(key, b"v2" * (1 << 20)) == ErrorCode.NO_AVAILABLE_HANDLE
        assert s.get(key) == old
    s.close()
    # a single block larger than the DRAM tier (a disk tier behind it): never stored either
    sp = sidecar_factory({"max_block_bytes": 2 << 20, "dram": {"size_bytes": "1Mi"},
                          "disk": {"path": str(tmp_path / "disk"), "size_bytes": "16Mi"}})
    s = connect(sp)
    assert s.put("k", small) == 0
    assert s.upsert("k", blob(1536 << 10)) == ErrorCode.NO_AVAILABLE_HANDLE
    assert s.get("k") == small
    s.close()


def test_an_upsert_whose_new_head_is_refused_puts_the_old_one_back(sidecar_factory: Factory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    old = blob(3 * BLOCK + 5)
    assert s.put("k", old) == 0
    held = blocks(sp)
    client = s._objects.client  # type: ignore[union-attr]
    head = KeyMap().head("k")
    real = client.put
    refused: list[bool] = []

    def put(keys: Sequence[Any], payloads: Sequence[Any], **kw: Any) -> list[PutStatus]:
        if list(keys) == [head] and not refused:  # the new head: no room for it (once)
            refused.append(True)
            return [PutStatus.FULL]
        return real(keys, payloads, **kw)

    monkeypatch.setattr(client, "put", put)
    assert s.upsert("k", blob(2 * BLOCK + 7)) == ErrorCode.NO_AVAILABLE_HANDLE
    assert refused and s.get("k") == old and blocks(sp) == held  # the new chunks went too
    assert s.upsert("k", b"new") == 0 and s.get("k") == b"new" and blocks(sp) == 1
    s.close()


def test_an_upsert_that_cannot_put_the_old_head_back_leaves_no_orphan_chunks(
        sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    assert s.put("k", blob(3 * BLOCK + 5)) == 0
    client = s._objects.client  # type: ignore[union-attr]
    head = KeyMap().head("k")
    real = client.put

    def put(keys: Sequence[Any], payloads: Sequence[Any], **kw: Any) -> list[PutStatus]:
        if list(keys) == [head]:  # another client holds the head's room: neither head goes in
            return [PutStatus.PENDING]
        return real(keys, payloads, **kw)

    monkeypatch.setattr(client, "put", put)
    assert s.upsert("k", blob(2 * BLOCK + 7)) == ErrorCode.REPLICA_IS_NOT_READY
    assert blocks(sp) == 0  # the old value's chunks, which no head names any more, went too
    s.close()


# ---------------------------------------------------------------------- another writer
def test_a_key_another_client_is_writing_is_not_reported_stored(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as other:
        for key, value in (("small", b"x" * 1000), ("chunked", blob(3 * BLOCK))):
            writing = other.reserve([KeyMap().head(key)], [100])  # its write of the head is under way
            assert s.put(key, value) == ErrorCode.REPLICA_IS_NOT_READY
            assert s.upsert(key, value) == ErrorCode.REPLICA_IS_NOT_READY
            assert s.put_batch([key], [value]) == ErrorCode.REPLICA_IS_NOT_READY
            writing.abort()  # and it fails: nothing is stored
            assert s.get(key) == b"" and s.is_exist(key) == 0
            assert s.put(key, value) == 0 and s.get(key) == value  # so the caller tries again
    assert blocks(sp) == 1 + header(sp, "chunked").blocks
    s.close()


# ---------------------------------------------------------------------- deadline
@pytest.mark.redis
def test_batch_calls_end_by_the_stores_timeout_while_the_index_stalls(tmp_path: Path,
                                                                      sidecar_factory: Factory) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    timeout = 1.0
    absent = [f"absent-{i}" for i in range(40)]
    calls: list[tuple[Callable[[MooncakeDistributedStore], list[int]], list[int]]] = [
        # a LOOKUP a key: the first waits out the index's deadline, and the index is skipped
        # after it (indexwatch): the answers are this node's (they had run out of time, 10 s)
        (lambda s: s.batch_is_exist(absent), [0] * 40),
        (lambda s: s.batch_remove(absent), [int(ErrorCode.OBJECT_NOT_FOUND)] * 40)]
    with RedisServer() as redis:
        sp = sidecar_factory(node_config("a", "127.0.0.11", redis.url, token))  # a peer lookup: up to 0.25 s
        s = connect(sp, timeout=timeout)
        assert s.put("here", b"value") == 0
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            for call, expected in calls:
                start = time.monotonic()
                got = call(s)
                elapsed = time.monotonic() - start
                assert got == expected and elapsed < timeout + 1.5, (elapsed, got)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert s.get("here") == b"value" and s.is_exist("here") == 1
        s.close()


# ---------------------------------------------------------------------- batches of large values
def test_a_batch_of_values_larger_than_a_block_is_read_whole(sidecar_factory: Factory) -> None:
    big = 8 << 20
    sp = sidecar_factory({"max_block_bytes": big, "dram": {"size_bytes": "128Mi"}, "api": {"max_session_share": 0.5}})
    s = connect(sp)
    values = {f"v{i}": bytes([i + 1]) * (big + 1000) for i in range(9)}  # a whole head block each
    assert s.put_batch(list(values), list(values.values())) == 0
    assert s.get_batch(list(values)) == list(values.values())  # their heads had filled the share: all missed
    size = big + 1000
    buf = (ctypes.c_ubyte * (size * len(values)))()
    ptr = ctypes.addressof(buf)
    assert s.register_buffer(ptr, len(buf)) == 0
    assert s.batch_get_into(list(values), [ptr + i * size for i in range(len(values))], [size] * len(values)) \
        == [size] * len(values)
    assert bytes(buf) == b"".join(values.values())
    s.close()


def test_a_batch_of_small_values_is_read_in_one_round_trip(sidecar_factory: Factory,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    sp = sidecar_factory({"max_block_bytes": 8 << 20})  # (heads as large as a block may be)
    s = connect(sp)
    values = {f"s{i}": blob(1000, i) for i in range(64)}
    values["chunked"] = blob((8 << 20) + 1000)
    assert s.put_batch(list(values), list(values.values())) == 0
    acquired: list[int] = []
    acquire = PoolClient.acquire

    def counted(self: PoolClient, keys: Sequence[Any]) -> Any:
        acquired.append(len(keys))
        return acquire(self, keys)

    monkeypatch.setattr(PoolClient, "acquire", counted)
    assert s.get_batch([*values, "absent"]) == [*values.values(), b""]
    assert acquired == [66, 1]  # every head (and a miss) at once, then the chunked value's chunk
    s.close()


# ---------------------------------------------------------------------- TCP
def test_a_value_put_over_the_arena_is_read_over_tcp(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"max_block_bytes": 4 << 20, "tenants": tcp_tenants(tmp_path),
                          "api": {"max_frame_bytes": 1 << 20, "max_unread_bytes": 1 << 20, "tcp_port": 0}})
    unix = connect(sp)
    tcp = MooncakeDistributedStore(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S)
    assert tcp.setup(*SETUP) == 0
    value = blob(2 << 20)
    assert unix.put("big", value) == 0
    assert tcp.get_size("big") == len(value) and tcp.get("big") == value  # its blocks fit one TCP answer
    unix.close()
    tcp.close()


# ---------------------------------------------------------------------- shared key space
def test_a_tenant_cannot_remove_what_another_tenant_of_its_key_space_wrote(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK,
                          "tenants": [{"name": "a", "key_space": "shared"}, {"name": "b", "key_space": "shared"}]})
    a, b = connect(sp, tenant="a"), connect(sp, tenant="b")
    values = {"small": b"from a", "chunked": blob(3 * BLOCK)}
    for key, value in values.items():
        assert a.put(key, value) == 0 and b.get(key) == value
    held = blocks(sp, "a")
    for key, value in values.items():  # not a lease: trying again would never end
        assert b.remove(key) == ErrorCode.ILLEGAL_CLIENT
        assert b.upsert(key, b"from b") == ErrorCode.ILLEGAL_CLIENT
        assert b.upsert(key, blob(2 * BLOCK, 1)) == ErrorCode.ILLEGAL_CLIENT
        assert a.get(key) == value
    assert blocks(sp, "a") == held  # b's new chunks went again
    assert a.batch_remove(list(values)) == [0, 0] and blocks(sp, "a") == 0
    a.close()
    b.close()


# ---------------------------------------------------------------------- forged heads
def test_a_head_that_claims_a_huge_value_reads_as_a_miss(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = connect(sp)
    h = Header.plan(1 << 50, BLOCK, nonce=1, checksum=0)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # any client of the key space
        c.put([KeyMap().head("k")], [h.pack() + bytes(BLOCK - HEADER.size)])
        assert s.get("k") == b"" and s.get_buffer("k") is None  # its last chunk is not held
        c.put([KeyMap().chunk("k", 1, h.blocks - 1)], [b"last"])
        assert s.get("k") == b"" and s.batch_get_buffer(["k"]) == [None]  # more than this process can hold
    assert s.get_size("k") == ErrorCode.OBJECT_NOT_FOUND  # (a claim past the node's tiers: a forged head)
    s.close()


SHARED = [{"name": "a", "key_space": "shared"}, {"name": "b", "key_space": "shared"}]


def plant(sp: SidecarProcess, key: str, h: Header, *chunks: int) -> None:
    """Tenant a puts a head block carrying ``h`` (as large as ``h`` says its head is) and the
    chunks of ``h`` numbered ``chunks``, one byte each."""
    keys = KeyMap()
    with PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) as c:
        got = c.put([keys.head(key)] + [keys.chunk(key, h.nonce, i) for i in chunks],
                    [h.pack() + bytes(h.head_bytes)] + [b"z"] * len(chunks))
        assert got == [PutStatus.STORED] * (1 + len(chunks))


def measured(call: Callable[[], object]) -> tuple[object, float, int]:
    """What ``call`` answers, the seconds it took and the most bytes Python held meanwhile."""
    tracemalloc.start()
    try:
        t = time.monotonic()
        got = call()
        return got, time.monotonic() - t, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_forged_head_of_tiny_chunks_is_a_quick_miss_and_a_put_over_it_answers(sidecar_factory: Factory,
                                                                                  tmp_path: Path) -> None:
    """A 64-byte head claiming 256 MiB in 64-byte chunks (4 Mi of them), planted by another
    tenant of the key space with its last chunk, on a node whose tiers could hold the claim:
    the reader's get is a miss within its deadline, without room for the claim (it had
    zero-filled 256 MiB, built a set of 4 Mi ints and walked every chunk), and its put
    answers a code at once (it had built the list of every chunk key the head names)."""
    sp = sidecar_factory({"max_block_bytes": BLOCK, "tenants": SHARED,
                          "disk": {"path": str(tmp_path / "disk"), "size_bytes": "512Mi"}})
    deadline = 5.0
    a, b = connect(sp, tenant="a"), connect(sp, tenant="b", timeout=deadline)
    h = Header.plan(256 << 20, 64, nonce=7, checksum=0)
    plant(sp, "k", h, h.blocks - 1)
    got, took, peak = measured(lambda: b.get("k"))
    assert got == b"" and took < deadline and peak < 16 << 20, (took, peak)
    buf = (ctypes.c_ubyte * 4096)()
    assert b.register_buffer(ctypes.addressof(buf), 4096) == 0
    got, took, peak = measured(lambda: (b.get_buffer("k"), b.get_size("k"), b.get_into("k", ctypes.addressof(buf), 4096)))
    assert got == (None, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_NOT_FOUND) and took < deadline and peak < 16 << 20
    got, took, peak = measured(lambda: b.put("k", b"b's value"))  # a's head: not b's to replace
    assert got == ErrorCode.ILLEGAL_CLIENT and took < deadline and peak < 16 << 20, (got, took, peak)
    assert a.put("k", b"a's value") == 0 and b.get("k") == b"a's value"  # its writer's put rewrites it
    a.close()
    b.close()


def test_a_forged_head_whose_last_chunk_alone_is_held_is_a_miss_before_room_is_taken(sidecar_factory: Factory) -> None:
    """A head of chunks this API could write (MIN_CHUNK_BYTES), claiming 48 MiB, and only its
    last chunk: the reader finds its first chunk missing before it allocates the claim."""
    sp = sidecar_factory({"max_block_bytes": BLOCK, "tenants": SHARED})
    a, b = connect(sp, tenant="a"), connect(sp, tenant="b")
    h = Header.plan(48 << 20, MIN_CHUNK_BYTES, nonce=9, checksum=0)
    plant(sp, "k", h, h.blocks - 1)
    got, took, peak = measured(lambda: b.get("k"))
    assert got == b"" and peak < 8 << 20, (took, peak)
    assert b.put("k", b"b's value") == ErrorCode.ILLEGAL_CLIENT
    assert a.put("k", b"a's value") == 0 and b.get("k") == b"a's value"
    assert blocks(sp, "a") == 1  # the planted chunk went with its head
    a.close()
    b.close()


def test_setup_refuses_blocks_smaller_than_readers_take(sidecar_factory: Factory) -> None:
    sp = sidecar_factory()
    small = MooncakeDistributedStore(socket_path=sp.socket_path, timeout=DEADLINE_S, block_bytes=MIN_CHUNK_BYTES - 1)
    assert small.setup(*SETUP) == ErrorCode.INTERNAL_ERROR
    s = connect(sp, block_bytes=MIN_CHUNK_BYTES)  # the smallest: its values read back
    value = blob(3 * MIN_CHUNK_BYTES)
    assert s.put("v", value) == 0 and header(sp, "v").blocks == 4 and s.get("v") == value
    s.close()


# ---------------------------------------------------------------------- a call cut short
def test_a_connection_lost_in_the_middle_of_a_read_is_a_miss(sidecar_factory: Factory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection is dropped while views of the arena (the heads read) are still named by
    the error's frames: get answers a miss (a BufferError from unmapping the arena had
    escaped), and the next call connects afresh."""
    s = connect(sidecar_factory({"max_block_bytes": BLOCK}))
    value = blob(3 * BLOCK)
    assert s.put("v", value) == 0
    real, calls = PoolClient.acquire, []

    def acquire(self: PoolClient, keys: Sequence[Any]) -> Any:
        calls.append(len(keys))
        if len(calls) == 2:  # the chunks, once the heads were read
            raise ConnectionLostError("the sidecar went away (injected)")
        return real(self, keys)

    monkeypatch.setattr(PoolClient, "acquire", acquire)
    assert s.get("v") == b"" and len(calls) == 2
    assert s.get("v") == value
    s.close()


def test_a_memory_error_is_a_code(sidecar_factory: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    s = connect(sidecar_factory({"max_block_bytes": BLOCK}))
    real = PoolClient.put

    def put(self: PoolClient, *args: Any, **kw: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(PoolClient, "put", put)
    assert s.put("v", b"value") == ErrorCode.NO_AVAILABLE_HANDLE  # (a MemoryError had escaped)
    monkeypatch.setattr(PoolClient, "put", real)
    assert s.put("v", b"value") == 0 and s.get("v") == b"value"  # on a new connection
    s.close()


# ---------------------------------------------------------------------- tensors
@pytest.mark.torch
def test_a_conjugate_view_is_stored_and_a_tensor_that_cannot_be_fails_alone(sidecar_factory: Factory) -> None:
    torch = pytest.importorskip("torch")
    s = connect(sidecar_factory())
    plain, conj = torch.ones(4), torch.tensor([1 + 2j, 3 - 4j]).conj()
    meta = torch.empty(4, device="meta")
    assert s.batch_put_tensor(["plain", "conj", "meta"], [plain, conj, meta]) == [0, 0, ErrorCode.INVALID_PARAMS]
    assert torch.equal(s.get_tensor("plain"), plain)
    assert torch.equal(s.get_tensor("conj"), torch.tensor([1 - 2j, 3 + 4j]))
    assert s.upsert_tensor("neg", conj.imag) == 0 and torch.equal(s.get_tensor("neg"), torch.tensor([-2.0, 4.0]))
    assert s.is_exist("meta") == 0
    s.close()
