"""The pure parts of the Mooncake-compatible API: key mapping, object headers, registered
memory and the tensor encoding (the API itself runs on real sidecars in tests/contract and
tests/integration)."""

from __future__ import annotations

import ctypes
import itertools
import tracemalloc

import pytest

from kvpool_client.errors import KVPoolError
from kvpool_client.keys import ModelFingerprint
from kvpool_client.mooncake.buffers import BufferHandle, Registry
from kvpool_client.mooncake.codes import ErrorCode
from kvpool_client.mooncake.layout import HEADER, MIN_CHUNK_BYTES, Delivery, Header, KeyMap, LayoutError, fingerprint


def test_every_string_has_its_own_key() -> None:
    m = KeyMap()
    names = ["", "a", "a\x00", "ab", "b", "é", "e\u0301", "\ud800", "x" * 10_000, "x" * 9_999 + "y"]
    heads = [m.head(n) for n in names]
    assert len({h.raw for h in heads}) == len(names)
    assert m.head("a") == KeyMap().head("a")  # stable
    assert len(m.head("x" * 10_000).raw) == 48
    # a head never equals a chunk, and chunks differ by key, nonce and index
    chunks = {m.chunk(n, nonce, i).raw for n in ("a", "b") for nonce in (0, 1) for i in (1, 2)}
    assert len(chunks) == 8 and not chunks & {h.raw for h in heads}
    assert m.chunks("é", 3, [1, 2, 7]) == [m.chunk("é", 3, i).raw for i in (1, 2, 7)]  # (a batch at a time)
    with pytest.raises(TypeError):
        m.head(b"bytes")  # type: ignore[arg-type]


def test_namespaces_are_key_spaces_of_their_own() -> None:
    a, b = KeyMap(""), KeyMap("team")
    assert a.head("k") != b.head("k") and a.head("k").fingerprint != b.head("k").fingerprint
    assert a.head("k").fingerprint == fingerprint("").digest()
    kv = ModelFingerprint(model="m", dtype="bf16", block_tokens=16, kv_layout="x")
    assert fingerprint("").digest() != kv.digest()


def test_header_plan_and_pieces() -> None:
    block = 1000
    single = Header.plan(block - HEADER.size, block)
    assert single.blocks == 1 and single.piece(0) == (0, block - HEADER.size)
    h = Header.plan(3000, block, nonce=7, checksum=9)
    head = block - HEADER.size
    assert h.blocks == 1 + -(-(3000 - head) // block) == 4
    pieces = [h.piece(i) for i in range(h.blocks)]
    assert pieces[0] == (0, head) and pieces[-1][1] == 3000
    assert all(pieces[i][1] == pieces[i + 1][0] for i in range(h.blocks - 1))
    assert list(h.pieces_of(0, 3000)) == [0, 1, 2, 3]
    assert list(h.pieces_of(head - 1, head + 1)) == [0, 1]
    assert list(h.pieces_of(head, head + block)) == [1]
    assert list(h.pieces_of(2999, 3000)) == [3] and list(h.pieces_of(5, 5)) == []
    with pytest.raises(KVPoolError):
        Header.plan(10, HEADER.size)  # no room for any value byte


def test_header_parse_checks_the_block() -> None:
    h = Header.plan(3000, 1000, nonce=5, checksum=6)
    packed = h.pack()
    assert len(packed) == HEADER.size
    assert Header.parse(packed, 1000) == h
    for bad, size in ((packed, 999), (b"XXXX" + packed[4:], 1000), (packed[:10], 1000),
                      (Header(3000, 3, 1000).pack(), 1000), (b"\x00" * 48, 48)):
        with pytest.raises(LayoutError):
            Header.parse(bad, size)


def test_a_header_is_plausible_only_with_chunks_a_store_writes_and_a_value_the_node_holds() -> None:
    assert Header.plan(3000, MIN_CHUNK_BYTES).plausible(None)
    assert Header.plan(30 << 20, MIN_CHUNK_BYTES).plausible(30 << 20)
    assert not Header.plan(30 << 20, MIN_CHUNK_BYTES).plausible((30 << 20) - 1)  # larger than the node
    assert Header.plan(100, 1000).plausible(None)  # one block: any block size
    assert not Header.plan(3000, 1000).plausible(None)  # chunks smaller than MIN_CHUNK_BYTES
    assert not Header.plan(1 << 40, 64).plausible(None)


def test_a_delivery_builds_nothing_per_block() -> None:
    """A header claiming a million blocks: the chunks a fragment needs are a range, walked one
    at a time (a set of every block number had been built first: tens of MiB)."""
    h = Header.plan(64 << 20, 64)
    tracemalloc.start()
    try:
        whole = Delivery(h, [(0, h.size, memoryview(bytearray(0)))], whole=True)
        assert list(itertools.islice(whole.chunks(), 3)) == [1, 2, 3] and not whole.failed
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    whole.deliver(1, None)  # a missing chunk fails the whole read: nothing more to read
    assert whole.failed and whole.outcome() == [ErrorCode.OBJECT_NOT_FOUND]
    buf = memoryview(bytearray(200))
    frags = [(h.head_bytes + 64 * 5, 10, buf[:10]), (0, 10, buf[10:20]), (h.head_bytes + 64 * 5 + 1, 100, buf[30:130])]
    some = Delivery(h, frags, whole=False)
    assert list(some.chunks()) == [6, 7]  # (the head's bytes are delivered from the head)
    some.deliver(7, None)
    assert not some.failed and some.results == [10, 10, ErrorCode.OBJECT_NOT_FOUND]


def test_registry() -> None:
    buf = (ctypes.c_ubyte * 64)()
    ptr = ctypes.addressof(buf)
    r = Registry()
    assert not r.register(ptr, 0) and not r.register(0, 8) and not r.register(ptr, -1)
    assert not r.register(True, 8)  # type: ignore[arg-type]
    assert r.register(ptr, 32) and r.register(ptr + 32, 32)
    assert not r.register(ptr + 31, 2)
    assert r.view(ptr + 40, 30) is None  # runs past the buffer it starts in
    assert r.view(ptr + 64, 0) is None and r.view(ptr - 1, 1) is None
    v = r.view(ptr + 32, 32)
    assert v is not None and v.nbytes == 32
    v[:3] = b"abc"
    assert bytes(buf[32:35]) == b"abc"
    assert not r.unregister(ptr + 1) and r.unregister(ptr) and r.view(ptr, 1) is None


def test_buffer_handle() -> None:
    h = BufferHandle(b"xyz")
    assert h.size() == 3 and bytes(memoryview(h)) == b"xyz"
    assert ctypes.string_at(h.ptr(), 3) == b"xyz"
    assert BufferHandle().ptr() == 0


def test_tensor_encoding_keeps_dtype_and_shape() -> None:
    torch = pytest.importorskip("torch")
    from kvpool_client.mooncake import tensorcodec

    cases = [torch.tensor(3.5), torch.empty(0, 3), torch.zeros(2, 1, 3, dtype=torch.float16),
             torch.tensor([1 + 2j], dtype=torch.complex64), torch.arange(5, dtype=torch.int8),
             torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()]
    for t in cases:
        value = bytearray(b"".join(tensorcodec.encode(t)))
        got = tensorcodec.decode(value)
        assert got is not None and got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t)
    value = bytearray(b"".join(tensorcodec.encode(torch.arange(4.0))))
    assert tensorcodec.decode(value[:-1]) is None  # a short value is not a tensor
    assert tensorcodec.decode(bytearray(b"KVTN" + bytes(60))) is None
    assert tensorcodec.decode(bytearray(b"plain bytes")) is None
    # a zero dimension beside one past int64 passes the size check: still not a tensor (torch raised)
    head = bytearray(b"".join(tensorcodec.encode(torch.empty((0, 3)))))
    at = head.index((3).to_bytes(8, "little"))
    head[at : at + 8] = (2**63 + 5).to_bytes(8, "little")
    assert tensorcodec.decode(head) is None
    wide = bytearray(b"".join(tensorcodec.encode(torch.empty((0, 3, 5)))))  # strides past int64, each size under it
    at = wide.index((3).to_bytes(8, "little"))
    wide[at : at + 16] = (2**62).to_bytes(8, "little") + (2**62).to_bytes(8, "little")
    assert tensorcodec.decode(wide) is None
