"""The local wire format and the fused copy-and-checksum helpers."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvpool_client import integrity
from kvpool_client.errors import KVPoolError, ProtocolError
from kvpool_client.integrity import checksum, copy_with_checksum, gather_with_checksum
from kvpool_client.protocol import HEADER, UNCOUNTED_FRAME_BYTES, ErrorCode, Op, PutStatus, decode, encode

# ------------------------------------------------------------------------ frames
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
    st.text(max_size=20), st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
bodies = st.lists(values, min_size=2, max_size=8)


@given(bodies)
def test_encode_decode_round_trip(body: list[object]) -> None:
    frame = encode(body)
    (n,) = HEADER.unpack_from(frame)
    assert n == len(frame) - HEADER.size
    assert decode(frame[HEADER.size :]) == body
    assert decode(memoryview(frame)[HEADER.size :]) == body


def test_request_shapes_round_trip() -> None:
    key = bytes(range(48))
    body = [int(Op.ALLOC), 7, [[key, 4096, -1, None]]]
    assert decode(encode(body)[HEADER.size :]) == body
    resp = [7, int(ErrorCode.FULL), ["FULL", "no room"]]
    assert decode(encode(resp)[HEADER.size :]) == resp
    assert int(PutStatus.STORED) == 7 and PutStatus(4) is PutStatus.FULL


def test_bytes_and_str_stay_distinct() -> None:
    body = decode(encode([b"abc", "abc"])[HEADER.size :])
    assert body == [b"abc", "abc"]
    assert isinstance(body[0], bytes) and isinstance(body[1], str)


@pytest.mark.parametrize("body", [[object(), 1], [2**64, 1], [-(2**63) - 1, 1], [{1, 2}, 1]])
def test_unencodable_bodies_raise_protocol_error(body: list[object]) -> None:
    with pytest.raises(ProtocolError):
        encode(body)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used type byte
        b"\x92\x01",  # list of two with one item: truncated
        b"\x93\x01\x02\x03\x04",  # trailing bytes
        b"\xdb\xff\xff\xff\xff",  # str32 with a huge length
        b"\x92\xa2\xff\xfe\x01",  # invalid utf-8 in a str
        msgpack.packb([{1: 2}, 1]),  # non-str map keys are refused
        b"\x92\xd4\xff\x01\x01",  # a malformed timestamp extension
        b"\x91" * 5000 + b"\x01",  # nesting deeper than the unpacker allows
    ],
)
def test_malformed_bytes_raise_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(payload)


@pytest.mark.parametrize("body", [1, "x", b"x", None, {"a": 1}, [], [1], 3.5])
def test_non_list_or_short_bodies_raise_protocol_error(body: object) -> None:
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body, use_bin_type=True))


@given(st.binary(max_size=32))
def test_arbitrary_bytes_raise_only_protocol_error(data: bytes) -> None:
    try:
        body = decode(data)
    except ProtocolError:
        return
    assert isinstance(body, list) and len(body) >= 2


def test_a_large_frame_counts_its_lists_maps_and_the_items_of_lists_of_other_things_than_numbers() -> None:
    numbers = [2, 1, [list(range(300, 400)) for _ in range(1000)]]  # about 300 KB
    frame = msgpack.packb(numbers)
    assert len(frame) > UNCOUNTED_FRAME_BYTES
    # the body and its 3 items, the middle list and its 1,000 items (lists), and the 1,000
    # lists: numbers do not count
    assert decode(frame, max_objects=2005) == numbers
    with pytest.raises(ProtocolError, match="more than 2004 lists, maps and items"):
        decode(frame, max_objects=2004)
    strings = msgpack.packb([2, 1, [["ab"] * 100 for _ in range(300)]])  # 30,000 short strings
    with pytest.raises(ProtocolError, match="lists, maps and items"):
        decode(strings, max_objects=10_000)
    maps = msgpack.packb([2, 1, [[{}] * 100 for _ in range(700)]])  # 70,000 empty maps
    with pytest.raises(ProtocolError, match="lists, maps and items"):
        decode(maps, max_objects=10_000)
    small = msgpack.packb([2, 1, [{}] * 1000])  # too small to matter: not counted
    assert decode(small, max_objects=10) == [2, 1, [{}] * 1000]
    with pytest.raises(ProtocolError, match="map key"):  # the hooks keep the other bounds
        decode(msgpack.packb([2, 1, [{1: 2}] * 40000]), max_objects=10**6)


def test_a_large_frame_counts_the_numbers_of_its_long_lists_apart() -> None:
    """A block's tokens: five bytes each on the wire, some 36 in memory. Lists of 16 numbers
    or fewer count as one list each, as before."""
    tokens = [2, 1, [list(range(100_000, 100_100)) for _ in range(1000)]]  # 100,000 numbers
    frame = msgpack.packb(tokens)
    assert decode(frame, max_objects=2005, max_numbers=100_000) == tokens
    with pytest.raises(ProtocolError, match="more than 99999 numbers in lists of more than 16"):
        decode(frame, max_objects=2005, max_numbers=99_999)
    assert decode(frame, max_objects=2005) == tokens  # no bound unless asked
    short = [2, 1, [list(range(100_000, 100_016)) for _ in range(5000)]]
    assert decode(msgpack.packb(short), max_objects=10_005, max_numbers=0) == short


def test_a_large_frame_counts_every_entry_of_its_maps_and_every_item_of_its_short_lists() -> None:
    """A map of 64 entries or a list of 16 short strings had counted as one object: 31,000
    such maps fitted a budget of 32,832 and held a sidecar's loop for seconds."""
    maps = msgpack.packb([2, 1, [{f"k{i:02}": "v" for i in range(64)} for _ in range(1000)]])
    assert len(maps) > UNCOUNTED_FRAME_BYTES
    # the body and its 3 items, the list and its 1,000 maps, each map and its 64 entries
    assert len(decode(maps, max_objects=4 + 1001 + 65_000)[2]) == 1000
    with pytest.raises(ProtocolError, match="lists, maps and items"):
        decode(maps, max_objects=4 + 1001 + 64_999)
    # a key repeated: every entry sent is decoded, however few the map keeps
    repeated = b"\x93\x02\x01\xdc" + (1000).to_bytes(2, "big") + (b"\xde\x00\x40" + b"\xa1a\x01" * 64) * 1000
    with pytest.raises(ProtocolError, match="lists, maps and items"):
        decode(repeated, max_objects=4 + 1001 + 64_999)
    assert decode(repeated, max_objects=4 + 1001 + 65_000)[2] == [{"a": 1}] * 1000
    strings = msgpack.packb([2, 1, [["ab"] * 16 for _ in range(3000)]])  # 16 strings a list
    assert len(strings) > UNCOUNTED_FRAME_BYTES
    assert len(decode(strings, max_objects=4 + 3001 + 3000 * 17)[2]) == 3000
    with pytest.raises(ProtocolError, match="lists, maps and items"):
        decode(strings, max_objects=4 + 3001 + 3000 * 17 - 1)


@pytest.mark.parametrize("big", [False, True])
def test_extension_types_are_refused_and_timestamps_decode_as_integers(big: bool) -> None:
    pad = ["x" * 70_000] if big else []  # past the counting threshold, or not
    with pytest.raises(ProtocolError, match="extension type 5"):
        decode(msgpack.packb([2, 1, *pad, [msgpack.ExtType(5, b"abc")]]), max_objects=10**6)
    assert decode(msgpack.packb([2, 1, *pad, msgpack.Timestamp(1, 2)]))[-1] == 1_000_000_002


# ------------------------------------------------------------------------ checksums
@st.composite
def split_data(draw: st.DrawFn, max_size: int = 4096) -> tuple[bytes, list[int]]:
    """Random bytes and cut points that split them into consecutive (maybe empty) parts."""
    data = draw(st.binary(min_size=0, max_size=max_size))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    return data, [0, *cuts, len(data)]


def parts(buf: bytes | bytearray, bounds: list[int]) -> list[memoryview]:
    mv = memoryview(buf)
    return [mv[a:b] for a, b in zip(bounds, bounds[1:])]


@given(split_data())
def test_checksum_is_xxh3_of_the_concatenation(sd: tuple[bytes, list[int]]) -> None:
    data, bounds = sd
    expect = xxhash.xxh3_64_intdigest(data)
    assert checksum(memoryview(data)) == expect
    assert checksum(parts(data, bounds)) == expect


@given(split_data())
def test_copy_with_checksum_scatters_and_hashes(sd: tuple[bytes, list[int]]) -> None:
    data, bounds = sd
    dst = bytearray(len(data))
    got = copy_with_checksum(parts(dst, bounds), memoryview(data))
    assert got == checksum(memoryview(data))
    assert bytes(dst) == data


@given(split_data())
def test_gather_with_checksum_gathers_and_hashes(sd: tuple[bytes, list[int]]) -> None:
    data, bounds = sd
    dst = bytearray(len(data))
    got = gather_with_checksum(memoryview(dst), parts(data, bounds))
    assert got == checksum(memoryview(data))
    assert bytes(dst) == data


@given(split_data(max_size=64), st.integers(1, 7))
def test_copy_and_gather_cross_chunk_boundaries(sd: tuple[bytes, list[int]], chunk: int) -> None:
    """With a tiny CHUNK, extents and chunks end at different places."""
    data, bounds = sd
    old = integrity.CHUNK
    integrity.CHUNK = chunk
    try:
        dst = bytearray(len(data))
        assert copy_with_checksum(parts(dst, bounds), memoryview(data)) == checksum(memoryview(data))
        assert bytes(dst) == data
        out = bytearray(len(data))
        assert gather_with_checksum(memoryview(out), parts(data, bounds)) == checksum(memoryview(data))
        assert bytes(out) == data
    finally:
        integrity.CHUNK = old


def test_large_multi_chunk_copy() -> None:
    data = bytes(range(256)) * (3 * integrity.CHUNK // 256 + 17)
    bounds = [0, 1, integrity.CHUNK + 5, 2 * integrity.CHUNK, len(data)]
    dst = bytearray(len(data))
    assert copy_with_checksum(parts(dst, bounds), memoryview(data)) == xxhash.xxh3_64_intdigest(data)
    assert bytes(dst) == data


def test_checksum_detects_a_flipped_byte() -> None:
    data = bytearray(b"x" * 1000)
    before = checksum(memoryview(data))
    data[500] ^= 1
    assert checksum(memoryview(data)) != before


@pytest.mark.parametrize(("dst_size", "src_size"), [(10, 11), (11, 10), (0, 1)])
def test_copy_with_checksum_needs_exactly_the_source_size(dst_size: int, src_size: int) -> None:
    dst = bytearray(dst_size)
    with pytest.raises(ValueError):
        copy_with_checksum([memoryview(dst)], memoryview(b"s" * src_size))


def test_gather_into_a_too_small_destination_raises() -> None:
    with pytest.raises(ValueError):
        gather_with_checksum(memoryview(bytearray(5)), [memoryview(b"abc"), memoryview(b"def")])


def test_a_block_whose_allocation_answer_is_broken_is_not_reported_stored() -> None:
    """An allocation whose extents do not hold the block is aborted, not committed: it has
    no commit result, and the blocks after it keep their own."""
    from kvpool_client.arena import ArenaCore
    from kvpool_client.reservation import put_statuses

    core = ArenaCore(verify=True)
    arena = bytearray(1 << 16)
    core._view = memoryview(arena)  # noqa: SLF001 - a mapped arena without a sidecar
    blocks = [bytes([i + 1]) * 4096 for i in range(3)]
    allocs = [
        [int(PutStatus.ALLOCATED), 11, [[0, 4096]]],
        [int(PutStatus.ALLOCATED), 12, [[4096, 100]]],  # too small for its block: broken
        [int(PutStatus.ALLOCATED), 13, [[8192, 4096]]],
        [int(PutStatus.EXISTS), 0, None],
    ]
    commits, aborts = core._write(allocs, [memoryview(b) for b in blocks + [b"x" * 4096]])  # noqa: SLF001
    assert [c[0] for c in commits] == [11, 13] and aborts == [12]
    assert bytes(arena[8192:12288]) == blocks[2]
    # the sidecar answers one result per commit sent: the first stored, the second FULL
    assert put_statuses(allocs, [int(PutStatus.STORED), int(PutStatus.FULL)], aborts) == [
        PutStatus.STORED, PutStatus.FULL, PutStatus.FULL, PutStatus.EXISTS]
    assert put_statuses(allocs, [int(PutStatus.STORED)] * 2, aborts)[1:3] == [PutStatus.FULL, PutStatus.STORED]


def test_a_reservation_checksums_in_place_commits_once_and_aborts_a_broken_answer() -> None:
    from kvpool_client.arena import ArenaCore
    from kvpool_client.integrity import checksum
    from kvpool_client.reservation import Reservation

    core = ArenaCore(verify=True)
    arena = bytearray(1 << 16)
    core._view = memoryview(arena)  # noqa: SLF001 - a mapped arena without a sidecar
    allocs = [
        [int(PutStatus.ALLOCATED), 11, [[0, 2048], [8192, 2048]]],  # one block in two extents
        [int(PutStatus.ALLOCATED), 12, [[4096, 100]]],  # too small: broken
        [int(PutStatus.EXISTS), 0, None],
    ]
    past = [[int(PutStatus.ALLOCATED), 31, [[(1 << 16) - 100, 4096]]],  # past the arena's end
            [int(PutStatus.ALLOCATED), 32, [[-4096, 8192], [0, -4096]]]]  # negative: sums right
    assert core._room(past, [4096, 4096])[2] == [31, 32]  # noqa: SLF001
    views, extents, broken = core._room(allocs, [4096, 4096, 4096])  # noqa: SLF001
    assert extents == [[(0, 2048), (8192, 2048)], None, None] and broken == [12]
    sent: list[Any] = []
    room = Reservation(allocs, views, extents, broken, lambda c: sent.append(("commit", c)) or [int(PutStatus.STORED)],
                       lambda a: sent.append(("abort", a)))
    assert sent == []  # the client aborts a broken answer's leases (reserve), not the reservation
    assert room.statuses == [PutStatus.ALLOCATED, PutStatus.FULL, PutStatus.EXISTS]
    data = bytes(range(256)) * 16
    views[0][0][:] = data[:2048]
    views[0][1][:] = data[2048:]
    assert room.commit() == [PutStatus.STORED, PutStatus.FULL, PutStatus.EXISTS]
    assert sent[0] == ("commit", [[11, checksum(memoryview(data))]])  # the bytes where they lie
    with pytest.raises(KVPoolError, match="already committed"):
        room.commit()
    room.abort()  # after a commit: nothing to give back
    assert len(sent) == 1
    with Reservation([[int(PutStatus.ALLOCATED), 21, [[0, 16]]]], [[memoryview(arena)[:16]]], [[(0, 16)]], [],
                     lambda c: pytest.fail("not committed"), lambda a: sent.append(("abort", a))):
        pass
    assert sent[1] == ("abort", [21])  # a reservation left uncommitted gives its room back
