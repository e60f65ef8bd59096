"""Mooncake Store's Python API as one behaviour suite, run on two implementations:

* ``mooncake``: the real ``mooncake.store.MooncakeDistributedStore`` against a real
  ``mooncake_master`` on loopback (skipped where Mooncake does not import or start), which
  proves that every expectation here is Mooncake's own behaviour;
* ``kvpool``: ``kvpool_client.mooncake.MooncakeDistributedStore`` on a real sidecar whose
  blocks are at most 256 KiB, so the larger values here are split into chunk blocks.

Removals pass ``force=True``: Mooncake refuses to remove an object for a few seconds after a
put or a get (its lease); kvpool holds no lease. Every test uses keys of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool_bench.mooncake import master, mooncake_available
from kvpool_client.mooncake import MooncakeDistributedStore
from kvpool_sidecar.process import SidecarProcess

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
SEGMENT, LOCAL_BUFFER = 256 << 20, 64 << 20
#: The kvpool sidecar's largest block: values past it are chunked.
BLOCK = 256 << 10
OK, INVALID_PARAMS, OBJECT_NOT_FOUND = 0, -600, -704


@pytest.fixture(scope="module")
def mooncake_store() -> Iterator[Any]:
    """One real Mooncake store for the module (its close takes a second)."""
    if not mooncake_available():
        pytest.skip("mooncake.store does not import (pip install mooncake-transfer-engine-non-cuda)")
    from mooncake.store import MooncakeDistributedStore as Real

    with contextlib.ExitStack() as stack:
        try:
            addr = stack.enter_context(master())
        except RuntimeError as e:
            pytest.skip(f"mooncake_master does not start: {e}")
        store = Real()
        code = store.setup(HOST, "P2PHANDSHAKE", SEGMENT, LOCAL_BUFFER, "tcp", "", addr)
        if code != 0:
            pytest.skip(f"Mooncake's setup failed with {code}")
        yield store
        store.close()


@pytest.fixture(params=["mooncake", "kvpool"])
def store(request: pytest.FixtureRequest, sidecar_factory: Callable[..., SidecarProcess]) -> Iterator[Any]:
    if request.param == "mooncake":
        yield request.getfixturevalue("mooncake_store")
        return
    sp = sidecar_factory({"max_block_bytes": BLOCK})
    s = MooncakeDistributedStore(socket_path=sp.socket_path)
    assert s.setup(HOST, "P2PHANDSHAKE", SEGMENT, LOCAL_BUFFER, "tcp", "", "127.0.0.1:50051") == OK
    yield s
    assert s.close() == OK


@pytest.fixture
def k() -> Callable[[str], str]:
    """Keys no other test uses."""
    prefix = uuid.uuid4().hex
    return lambda name: f"{prefix}/{name}"


class Mem:
    """Host memory at a fixed address (what Mooncake's zero-copy calls take)."""

    def __init__(self, size: int) -> None:
        self.buf = (ctypes.c_ubyte * size)()
        self.ptr = ctypes.addressof(self.buf)
        self.size = size

    def __getitem__(self, s: slice) -> bytes:
        return bytes(self.buf[s])

    def write(self, offset: int, data: bytes) -> None:
        self.buf[offset : offset + len(data)] = data  # type: ignore[assignment]


@pytest.fixture
def mem(store: Any) -> Iterator[Callable[[int], Mem]]:
    """``mem(size)``: registered memory, unregistered at the end of the test."""
    made: list[Mem] = []

    def make(size: int) -> Mem:
        m = Mem(size)
        assert store.register_buffer(m.ptr, size) == OK
        made.append(m)
        return m

    yield make
    for m in made:
        store.unregister_buffer(m.ptr)


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(n * 7919 + seed).randbytes(n)


# ---------------------------------------------------------------------------- put / get
def test_put_then_get_and_a_miss_is_empty_bytes(store: Any, k: Callable[[str], str]) -> None:
    assert store.put(k("a"), b"Hello, Mooncake Store!") == OK
    got = store.get(k("a"))
    assert got == b"Hello, Mooncake Store!" and type(got) is bytes
    assert store.get(k("missing")) == b""


def test_put_takes_any_bytes_like_value_and_refuses_a_str(store: Any, k: Callable[[str], str]) -> None:
    np = pytest.importorskip("numpy")
    assert store.put(k("ba"), bytearray(b"xy")) == OK
    assert store.put(k("mv"), memoryview(b"xyz")) == OK
    # (bytes, not items: Mooncake stores len() bytes of an array, so only uint8 agrees)
    assert store.put(k("np"), np.arange(6, dtype=np.uint8)) == OK
    assert store.get_batch([k("ba"), k("mv"), k("np")]) == [b"xy", b"xyz", bytes(range(6))]
    with pytest.raises(TypeError):
        store.put(k("str"), "not bytes")


def test_a_put_of_a_held_key_succeeds_and_keeps_the_first_value(store: Any, k: Callable[[str], str]) -> None:
    assert store.put(k("a"), b"first") == OK
    assert store.put(k("a"), b"second, longer") == OK
    assert store.get(k("a")) == b"first"


def test_an_empty_key_or_value_is_invalid(store: Any, k: Callable[[str], str]) -> None:
    assert store.put("", b"x") == INVALID_PARAMS
    assert store.put(k("empty"), b"") == INVALID_PARAMS
    assert store.upsert(k("empty"), b"") == INVALID_PARAMS
    assert store.is_exist(k("empty")) == 0


def test_batches(store: Any, k: Callable[[str], str]) -> None:
    keys = [k(f"b{i}") for i in range(5)]
    values = [blob(100 + i, i) for i in range(5)]
    assert store.put_batch(keys, values) == OK
    # (no key twice in one get_batch: Mooncake then returns wrong bytes for the first)
    assert store.get_batch([keys[3], k("missing"), keys[0]]) == [values[3], b"", values[0]]
    assert store.put_batch([k("d"), k("d")], [b"1", b"2"]) == OK  # the first of a key wins
    assert store.get(k("d")) == b"1"
    assert store.put_batch(keys[:2], values[:1]) == INVALID_PARAMS
    # one empty value refuses the whole batch: nothing is stored
    assert store.put_batch([k("x"), k("y")], [b"1", b""]) == INVALID_PARAMS
    assert store.batch_is_exist([k("x"), k("y")]) == [0, 0]
    assert store.put_batch([], []) == OK


def test_put_parts_stores_the_concatenation(store: Any, k: Callable[[str], str]) -> None:
    assert store.put_parts(k("g"), b"Hello, ", bytearray(b"World"), memoryview(b"!")) == OK
    assert store.get(k("g")) == b"Hello, World!"
    assert store.put_parts(k("none")) == OK  # nothing to store is not an error ...
    assert store.is_exist(k("none")) == 0  # ... and stores nothing


def test_upsert_inserts_then_replaces(store: Any, k: Callable[[str], str]) -> None:
    assert store.upsert(k("u"), b"abc") == OK
    assert store.get(k("u")) == b"abc"
    assert store.upsert(k("u"), b"a longer value") == OK
    assert store.get(k("u")) == b"a longer value" and store.get_size(k("u")) == 14
    assert store.upsert(k("u"), b"x") == OK
    assert store.get(k("u")) == b"x"
    assert store.upsert_parts(k("u"), b"y", b"z") == OK
    assert store.get(k("u")) == b"yz"
    assert store.upsert_batch([k("u"), k("v")], [b"new u", b"new v"]) == OK
    assert store.get_batch([k("u"), k("v")]) == [b"new u", b"new v"]
    assert store.upsert_batch([k("u")], [b"1", b"2"]) == INVALID_PARAMS


def test_is_exist_and_get_size(store: Any, k: Callable[[str], str]) -> None:
    assert store.put(k("a"), b"12345") == OK
    assert store.is_exist(k("a")) == 1 and store.is_exist(k("missing")) == 0
    assert store.batch_is_exist([k("a"), k("missing"), k("a")]) == [1, 0, 1]
    assert store.batch_is_exist([]) == []
    assert store.get_size(k("a")) == 5
    assert store.get_size(k("missing")) == OBJECT_NOT_FOUND


def test_remove(store: Any, k: Callable[[str], str]) -> None:
    assert store.put_batch([k("a"), k("b"), k("c")], [b"1", b"2", b"3"]) == OK
    assert store.remove(k("a"), True) == OK
    assert store.is_exist(k("a")) == 0 and store.get(k("a")) == b""
    assert store.get_size(k("a")) == OBJECT_NOT_FOUND
    assert store.remove(k("a"), True) == OBJECT_NOT_FOUND
    assert store.remove(k("missing")) == OBJECT_NOT_FOUND
    assert store.batch_remove([k("b"), k("missing"), k("c")], True) == [OK, OBJECT_NOT_FOUND, OK]
    assert store.batch_is_exist([k("b"), k("c")]) == [0, 0]
    assert store.batch_remove([], True) == []
    # the key takes a new value
    assert store.put(k("a"), b"again") == OK and store.get(k("a")) == b"again"


def test_get_buffer(store: Any, k: Callable[[str], str]) -> None:
    assert store.put(k("a"), b"ABCDEFGHIJ") == OK
    buf = store.get_buffer(k("a"))
    assert buf is not None and buf.size() == 10 and len(buf) == 10 and buf.ptr() != 0
    assert bytes(memoryview(buf)) == b"ABCDEFGHIJ"
    assert store.get_buffer(k("missing")) is None
    got = store.batch_get_buffer([k("missing"), k("a")])
    assert got[0] is None and got[1] is not None and bytes(memoryview(got[1])) == b"ABCDEFGHIJ"


def test_a_value_of_many_blocks(store: Any, k: Callable[[str], str], mem: Callable[[int], Mem]) -> None:
    value = blob(3 * BLOCK + 12345)
    assert store.put(k("big"), value) == OK
    assert store.get(k("big")) == value
    assert store.get_size(k("big")) == len(value) and store.is_exist(k("big")) == 1
    buf = store.get_buffer(k("big"))
    assert buf is not None and bytes(memoryview(buf)) == value
    m = mem(len(value) + 100)
    assert store.get_into(k("big"), m.ptr, m.size) == len(value)
    assert m[: len(value)] == value
    assert store.get_into(k("big"), m.ptr, len(value) - 1) == INVALID_PARAMS
    assert store.upsert(k("big"), value[:1000]) == OK
    assert store.get(k("big")) == value[:1000]
    assert store.remove(k("big"), True) == OK and store.get(k("big")) == b""


# ---------------------------------------------------------------------------- registered memory
def test_register_buffer_rules(store: Any) -> None:
    m = Mem(256)
    assert store.register_buffer(m.ptr, 0) == INVALID_PARAMS
    assert store.register_buffer(m.ptr, 128) == OK
    try:
        assert store.register_buffer(m.ptr, 128) == INVALID_PARAMS  # registered already
        assert store.register_buffer(m.ptr + 64, 128) == INVALID_PARAMS  # overlaps
        assert store.register_buffer(m.ptr + 128, 128) == OK  # adjacent
        assert store.unregister_buffer(m.ptr + 128) == OK
        assert store.unregister_buffer(m.ptr + 10) == INVALID_PARAMS  # not where one starts
    finally:
        assert store.unregister_buffer(m.ptr) == OK
    assert store.unregister_buffer(m.ptr) == INVALID_PARAMS


def test_put_from_and_get_into(store: Any, k: Callable[[str], str], mem: Callable[[int], Mem]) -> None:
    src, dst = mem(4096), mem(4096)
    src.write(0, b"HELLO, zero copy")
    assert store.put_from(k("a"), src.ptr, 16) == OK
    assert store.get(k("a")) == b"HELLO, zero copy"
    assert store.get_into(k("a"), dst.ptr + 100, 1000) == 16
    assert dst[100:116] == b"HELLO, zero copy"
    assert store.get_into(k("a"), dst.ptr, 15) == INVALID_PARAMS  # smaller than the value
    assert store.get_into(k("missing"), dst.ptr, 1000) == OBJECT_NOT_FOUND
    assert store.put_from(k("a"), src.ptr + 7, 4) == OK  # held: kept as it was
    assert store.get(k("a")) == b"HELLO, zero copy"
    assert store.upsert_from(k("a"), src.ptr + 7, 4) == OK
    assert store.get(k("a")) == b"zero"
    # a size of 0 stores nothing and is not an error
    assert store.put_from(k("zero"), src.ptr, 0) == OK and store.is_exist(k("zero")) == 0


def test_batch_put_from_and_batch_get_into(store: Any, k: Callable[[str], str], mem: Callable[[int], Mem]) -> None:
    src, dst = mem(1 << 20), mem(1 << 20)
    data = blob(1 << 20)
    src.write(0, data)
    keys = [k("a"), k("b"), k("c")]
    sizes = [1000, 300_000, 5]
    ptrs = [src.ptr, src.ptr + 1000, src.ptr + 400_000]
    assert store.batch_put_from(keys, ptrs, sizes) == [OK] * 3
    out = [dst.ptr, dst.ptr + 1000, dst.ptr + 500_000]
    assert store.batch_get_into([keys[1], k("missing"), keys[0]], out, [400_000, 10, 1000]) == \
        [300_000, OBJECT_NOT_FOUND, 1000]
    assert dst[0:300_000] == data[1000:301_000] and dst[500_000:501_000] == data[:1000]
    assert store.batch_get_into([keys[2]], [dst.ptr], [4]) == [INVALID_PARAMS]
    assert store.batch_get_into(keys, [dst.ptr], [10, 10, 10]) == [INVALID_PARAMS] * 3
    assert store.batch_put_from(keys[:2], [src.ptr], [1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from([k("z0"), k("z1")], [src.ptr, src.ptr], [0, 7]) == [INVALID_PARAMS, OK]
    assert store.batch_is_exist([k("z0"), k("z1")]) == [0, 1]
    assert store.batch_put_from([], [], []) == [] and store.batch_get_into([], [], []) == []
    assert store.batch_upsert_from([keys[2], k("new")], [src.ptr + 9, src.ptr + 9], [3, 3]) == [OK, OK]
    assert store.get_batch([keys[2], k("new")]) == [data[9:12]] * 2


def test_get_into_ranges_gathers_fragments(store: Any, k: Callable[[str], str], mem: Callable[[int], Mem]) -> None:
    key1, key2 = bytes(range(40)), b"abcdefghij"
    assert store.put_batch([k("1"), k("2")], [key1, key2]) == OK
    b0, b1 = mem(32), mem(32)
    got = store.get_into_ranges(
        [b0.ptr, b1.ptr],
        [[k("1"), k("2")], [k("2"), k("1")]],
        [[[0, 20], [8]], [[4], [16]]],
        [[[1, 30], [2]], [[0], [10]]],
        [[[4, 3], [5]], [[6], [4]]],
    )
    assert got == [[[4, 3], [5]], [[6], [4]]]
    assert b0[0:4] == key1[1:5] and b0[20:23] == key1[30:33] and b0[8:13] == key2[2:7]
    assert b1[4:10] == key2[0:6] and b1[16:20] == key1[10:14]
    assert store.get_into_ranges([], [], [], [], []) == []


def test_get_into_ranges_answers_per_fragment(store: Any, k: Callable[[str], str], mem: Callable[[int], Mem]) -> None:
    assert store.put(k("r"), b"0123456789abcdef") == OK
    b = mem(128)

    def one(key: str, dst: int, src: int, n: int, ptr: int = b.ptr) -> list[list[list[int]]]:
        result: list[list[list[int]]] = store.get_into_ranges([ptr], [[key]], [[[dst]]], [[[src]]], [[[n]]])
        return result

    assert one(k("r"), 0, 10, 6) == [[[6]]] and b[0:6] == b"abcdef"  # up to the value's end
    assert one(k("r"), 0, 0, 0) == [[[0]]]
    assert one(k("r"), 0, 10, 10) == [[[INVALID_PARAMS]]]  # past the value's end
    assert one(k("r"), 125, 0, 10) == [[[INVALID_PARAMS]]]  # past the registered buffer
    assert one(k("r"), 0, 0, 4, ptr=b.ptr + 4096) == [[[INVALID_PARAMS]]]  # not registered
    assert store.get_into_ranges([b.ptr], [[k("r"), k("missing")]], [[[0], [4]]], [[[1], [2]]], [[[4], [5]]]) \
        == [[[4], [OBJECT_NOT_FOUND]]]
    # shapes that do not match
    assert store.get_into_ranges([b.ptr, b.ptr], [[k("r")]], [[[0]]], [[[0]]], [[[4]]]) == \
        [[[INVALID_PARAMS]], [[INVALID_PARAMS]]]
    assert store.get_into_ranges([b.ptr], [[k("r"), k("r")]], [[[0]]], [[[0]]], [[[4]]]) == \
        [[[INVALID_PARAMS], [INVALID_PARAMS]]]
    assert store.get_into_ranges([b.ptr], [[k("r")]], [[[0, 4]]], [[[0]]], [[[4]]]) == \
        [[[INVALID_PARAMS, INVALID_PARAMS]]]


def test_get_into_ranges_of_a_value_of_many_blocks(store: Any, k: Callable[[str], str],
                                                   mem: Callable[[int], Mem]) -> None:
    value = blob(4 * BLOCK + 77, 3)
    assert store.put(k("big"), value) == OK
    b = mem(1 << 20)
    starts = [0, BLOCK - 10, 2 * BLOCK + 5, len(value) - 3]
    lengths = [7, 40, BLOCK + 100, 3]
    dsts = [0, 100, 1000, 600_000]
    got = store.get_into_ranges([b.ptr], [[k("big")]], [[dsts]], [[starts]], [[lengths]])
    assert got == [[lengths]]
    for d, s, n in zip(dsts, starts, lengths):
        assert b[d : d + n] == value[s : s + n]


# ---------------------------------------------------------------------------- tensors
def test_tensors(store: Any, k: Callable[[str], str]) -> None:
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cases = {"f32": x, "bf16": x.to(torch.bfloat16), "i64": torch.tensor([1, -2], dtype=torch.int64),
             "bool": torch.tensor([True, False]), "transposed": x.t()}
    for name, t in cases.items():
        assert store.put_tensor(k(name), t) == OK
        got = store.get_tensor(k(name))
        assert got is not None and got.dtype == t.dtype and torch.equal(got, t), name
    assert store.put_tensor(k("f32"), x + 1) == OK  # held: kept as it was
    assert torch.equal(store.get_tensor(k("f32")), x)
    assert store.upsert_tensor(k("f32"), x * 3) == OK
    assert torch.equal(store.get_tensor(k("f32")), x * 3)
    assert store.get_tensor(k("missing")) is None
    assert store.put(k("bytes"), b"not a tensor") == OK
    assert store.get_tensor(k("bytes")) is None
    assert store.put_tensor(k("no"), b"abc") == INVALID_PARAMS
    assert store.batch_put_tensor([k("b1"), k("b2")], [x, x * 2]) == [OK, OK]
    got = store.batch_get_tensor([k("b2"), k("missing"), k("b1")])
    assert torch.equal(got[0], x * 2) and got[1] is None and torch.equal(got[2], x)


def test_hostname_and_health(store: Any) -> None:
    assert store.get_hostname().startswith(HOST)
    assert store.health_check() == 0
