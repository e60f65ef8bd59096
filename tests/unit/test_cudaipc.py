"""CUDA IPC descriptors, client side, without a GPU: every malformed field gets a clear
:class:`IpcDescriptorError` (never a KeyError or TypeError), extents coalesce into the
fewest copies, the GPU is found by UUID, and opening needs torch and CUDA.

Opening and copying on a real device: ``tests/unit/test_gpu_ipc.py`` (marked ``gpu``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool_client.cudaipc import (
    DESCRIPTOR_VERSION, MAX_EXTENTS, OpenedDescriptor, coalesce, open_descriptor, parse_descriptor, resolve_device,
)
from kvpool_client.errors import CudaIpcError, IpcDescriptorError, KVPoolError
from kvpool_client.tensors import TensorLayoutError, TorchUnavailableError

UUID0, UUID1 = bytes(range(16)), bytes(range(16, 32))


def valid() -> dict[str, Any]:
    """A well-formed descriptor, shaped like ``ipc_descriptor``'s output."""
    return {
        "v": DESCRIPTOR_VERSION, "device": 0, "device_uuid": UUID0,
        "handle": bytes([2]) + b"c" + bytes(range(64)), "storage_size": 1 << 20, "storage_offset": 4096,
        "ref_counter_handle": b"/torch_1234_567_0", "ref_counter_offset": 7,
        "event_handle": bytes(64), "event_sync_required": True,
        "buffer_offset": 512, "extents": [[8192, 4096], [0, 100], [4096, 4096]], "nbytes": 8292,
    }


def with_(**changes: Any) -> dict[str, Any]:
    d = valid()
    d.update(changes)
    return d


def without(field: str) -> dict[str, Any]:
    d = valid()
    del d[field]
    return d


# ------------------------------------------------------------- well-formed
def test_a_valid_descriptor_parses_with_extents_in_the_storage() -> None:
    d = parse_descriptor(valid())
    assert d.device == 0 and d.device_uuid == UUID0 and d.storage_size == 1 << 20 and d.storage_offset == 4096
    assert d.extents == ((8704, 4096), (512, 100), (4608, 4096))  # buffer_offset added, block order kept
    assert d.nbytes == 8292 and d.event_sync_required is True and d.ref_counter_offset == 7


def test_a_descriptor_survives_msgpack_and_tuples_and_bytearrays() -> None:
    """What the wire gives back (lists, or tuples with use_list=False) parses the same."""
    d = valid()
    assert parse_descriptor(msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)) == parse_descriptor(d)
    assert parse_descriptor(msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False, use_list=False)) \
        == parse_descriptor(d)
    assert parse_descriptor(with_(handle=bytearray(d["handle"]))) == parse_descriptor(d)


@pytest.mark.parametrize("handle", [bytes(64), bytes([3]) + b"c" + bytes(64), bytes([2]) + b"e" + bytes(300)],
                         ids=["bare-64", "versioned-malloc", "expandable"])
def test_every_known_handle_shape_is_accepted(handle: bytes) -> None:
    assert parse_descriptor(with_(handle=handle)).handle == handle


def test_an_empty_uuid_means_open_by_index() -> None:
    assert parse_descriptor(with_(device_uuid=b"")).device_uuid == b""


# ------------------------------------------------------------- malformed
MALFORMED: list[tuple[str, Callable[[], Any], str]] = [
    ("not-a-mapping", lambda: [("v", 1)], "a mapping expected"),
    ("int-key", lambda: {**valid(), 3: 1}, "field names must be strings"),
    ("unknown-field", lambda: with_(extra=1), "unknown extra"),
    ("v-2", lambda: with_(v=2), "'v' must be 1"),
    ("v-str", lambda: with_(v="1"), "'v' must be 1"),
    ("v-bool", lambda: with_(v=True), "'v' must be 1"),
    ("device-negative", lambda: with_(device=-1), "'device' must be in [0, 1023]"),
    ("device-huge", lambda: with_(device=1 << 40), "'device' must be in [0, 1023]"),
    ("device-bool", lambda: with_(device=False), "'device' must be an integer, not bool"),
    ("device-float", lambda: with_(device=0.0), "'device' must be an integer, not float"),
    ("device-str", lambda: with_(device="0"), "'device' must be an integer, not str"),
    ("uuid-short", lambda: with_(device_uuid=bytes(5)), "'device_uuid' must be 16 bytes or empty"),
    ("uuid-long", lambda: with_(device_uuid=bytes(17)), "'device_uuid' must be 0 to 16 bytes"),
    ("uuid-str", lambda: with_(device_uuid="GPU-0"), "'device_uuid' must be bytes, not str"),
    ("handle-none", lambda: with_(handle=None), "'handle' must be bytes, not NoneType"),
    ("handle-str", lambda: with_(handle="c" * 66), "'handle' must be bytes, not str"),
    ("handle-empty", lambda: with_(handle=b""), "'handle' must be 2 to"),
    ("handle-malloc-short", lambda: with_(handle=bytes([2]) + b"c" + bytes(63)), "kind 'c' must be 66 bytes, got 65"),
    ("handle-malloc-long", lambda: with_(handle=bytes([2]) + b"c" + bytes(65)), "kind 'c' must be 66 bytes, got 67"),
    ("handle-expandable-empty", lambda: with_(handle=bytes([2]) + b"e"), "kind 'e' has no payload"),
    ("handle-unknown-kind", lambda: with_(handle=bytes([2]) + b"x" + bytes(64)), "unknown kind 0x78"),
    ("handle-huge", lambda: with_(handle=bytes([2]) + b"e" + bytes(1 << 20)), "'handle' must be 2 to 1048576 bytes"),
    ("storage-size-zero", lambda: with_(storage_size=0), "'storage_size' must be in [1,"),
    ("storage-size-huge", lambda: with_(storage_size=1 << 60), "'storage_size' must be in [1,"),
    ("storage-size-str", lambda: with_(storage_size="1048576"), "'storage_size' must be an integer"),
    ("storage-offset-negative", lambda: with_(storage_offset=-1), "'storage_offset' must be in [0,"),
    ("ref-handle-empty", lambda: with_(ref_counter_handle=b""), "'ref_counter_handle' must be 1 to 255 bytes"),
    ("ref-handle-long", lambda: with_(ref_counter_handle=b"/" * 256), "'ref_counter_handle' must be 1 to 255 bytes"),
    ("ref-handle-nul", lambda: with_(ref_counter_handle=b"/torch\0x"), "without NUL bytes"),
    ("ref-handle-str", lambda: with_(ref_counter_handle="/torch_1"), "'ref_counter_handle' must be bytes"),
    ("ref-offset-negative", lambda: with_(ref_counter_offset=-1), "'ref_counter_offset' must be in [0, 9999]"),
    ("ref-offset-past-file", lambda: with_(ref_counter_offset=10_000), "'ref_counter_offset' must be in [0, 9999]"),
    ("event-short", lambda: with_(event_handle=bytes(63)), "'event_handle' must be 64 bytes, got 63"),
    ("event-long", lambda: with_(event_handle=bytes(65)), "'event_handle' must be 64 bytes, got 65"),
    ("event-list", lambda: with_(event_handle=[0] * 64), "'event_handle' must be bytes, not list"),
    ("event-sync-int", lambda: with_(event_sync_required=1), "'event_sync_required' must be a bool, not int"),
    ("event-sync-none", lambda: with_(event_sync_required=None), "'event_sync_required' must be a bool"),
    ("buffer-offset-negative", lambda: with_(buffer_offset=-1), "'buffer_offset' must be in [0, 1048575]"),
    ("buffer-offset-at-end", lambda: with_(buffer_offset=1 << 20), "'buffer_offset' must be in [0, 1048575]"),
    ("extents-dict", lambda: with_(extents={0: 1}), "'extents' must be a list of [offset, length] pairs, not dict"),
    ("extents-bytes", lambda: with_(extents=b"\0\1"), "'extents' must be a list"),
    ("extents-empty", lambda: with_(extents=[], nbytes=1), "'extents' must hold 1 to 65536 runs, got 0"),
    ("extents-too-many", lambda: with_(extents=[[i, 1] for i in range(MAX_EXTENTS + 1)]), "got 65537"),
    ("extent-triple", lambda: with_(extents=[[0, 1, 2]]), "[0] must be an [offset, length] pair"),
    ("extent-scalar", lambda: with_(extents=[5]), "[0] must be an [offset, length] pair"),
    ("extent-float", lambda: with_(extents=[[0.0, 8]]), "[0] must be an [offset, length] pair of integers"),
    ("extent-bool", lambda: with_(extents=[[0, True]]), "[0] must be an [offset, length] pair of integers"),
    ("extent-negative", lambda: with_(extents=[[0, 8], [-8, 8]]), "[1] must have offset >= 0 and length > 0"),
    ("extent-empty", lambda: with_(extents=[[0, 0]]), "[0] must have offset >= 0 and length > 0"),
    ("extent-past-storage", lambda: with_(extents=[[(1 << 20) - 512 - 4, 8]], nbytes=8),
     "ends past the 1048064 bytes of the buffer"),
    ("extents-overlap", lambda: with_(extents=[[0, 100], [4000, 200], [50, 10]], nbytes=310),
     "overlap at buffer offset 50"),
    ("nbytes-mismatch", lambda: with_(nbytes=8291), "'nbytes' is 8291 but the extents add up to 8292"),
    ("nbytes-bool", lambda: with_(nbytes=True), "'nbytes' must be an integer, not bool"),
]


@pytest.mark.parametrize(("make", "message"), [(m, msg) for _, m, msg in MALFORMED], ids=[c for c, _, _ in MALFORMED])
def test_every_malformed_field_gets_a_clear_error(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(IpcDescriptorError) as info:
        parse_descriptor(make())
    assert message in str(info.value)
    assert str(info.value).startswith("malformed CUDA IPC descriptor")
    assert isinstance(info.value, KVPoolError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", sorted(valid()))
def test_every_missing_field_is_named(field: str) -> None:
    with pytest.raises(IpcDescriptorError, match=f"missing {field}$"):
        parse_descriptor(without(field))


def test_a_malformed_descriptor_is_refused_before_torch_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(IpcDescriptorError, match="'event_handle' must be 64 bytes"):
        open_descriptor(with_(event_handle=b"x"))
    with pytest.raises(TorchUnavailableError, match="pip install kvpool\\[torch\\]"):
        open_descriptor(valid())


# ------------------------------------------------------------- coalescing
@pytest.mark.parametrize(("extents", "runs"), [
    ([], []),
    ([(100, 8)], [(100, 0, 8)]),
    ([(0, 4), (4, 4), (8, 2)], [(0, 0, 10)]),  # adjacent in the source: one copy
    ([(8, 4), (4, 4), (0, 4)], [(8, 0, 4), (4, 4, 4), (0, 8, 4)]),  # reversed: never adjacent
    ([(0, 4), (16, 4), (20, 8), (4, 4)], [(0, 0, 4), (16, 4, 12), (4, 16, 4)]),
    ([(16, 4), (0, 16)], [(16, 0, 4), (0, 4, 16)]),  # adjacent the other way round: two copies
])
def test_coalesce_merges_runs_that_continue_in_the_source(extents: list[tuple[int, int]],
                                                          runs: list[tuple[int, int, int]]) -> None:
    assert coalesce(extents) == runs


@given(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=40), st.randoms())
def test_coalesced_copies_move_the_same_bytes(pieces: list[tuple[int, int]], rnd: Any) -> None:
    """Any non-overlapping extents: copying the runs gives the block that copying each extent gives."""
    pos, extents = 0, []
    for n, gap in pieces:
        extents.append((pos, n))
        pos += n + gap
    if rnd.random() < 0.5:
        rnd.shuffle(extents)
    source = bytes(rnd.getrandbits(8) for _ in range(pos))
    want = b"".join(source[o : o + n] for o, n in extents)
    got = bytearray(len(want))
    runs = coalesce(extents)
    for src, dst, n in runs:
        got[dst : dst + n] = source[src : src + n]
    assert bytes(got) == want
    breaks = sum(1 for (a, n), (b, _) in zip(extents, extents[1:]) if a + n != b)
    assert len(runs) == 1 + breaks


# ------------------------------------------------------------- devices, opening
def test_the_gpu_is_found_by_uuid_under_another_index() -> None:
    assert resolve_device(0, UUID1, [UUID0, UUID1]) == 1
    assert resolve_device(1, b"", [b"", b""]) == 1
    with pytest.raises(CudaIpcError, match="10111213-1415-1617-1819-1a1b1c1d1e1f is not visible"):
        resolve_device(1, UUID1, [UUID0])
    with pytest.raises(CudaIpcError, match="names cuda:2 but 2 CUDA devices are visible"):
        resolve_device(2, b"", [b"", b""])


def test_opening_without_cuda_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("checks the behaviour without CUDA")
    with pytest.raises(CudaIpcError, match="CUDA is not available"):
        open_descriptor(valid())


def test_a_copy_needs_a_cuda_destination() -> None:
    torch = pytest.importorskip("torch")
    opened = OpenedDescriptor(torch.zeros(64, dtype=torch.uint8), ((0, 16),), 16)
    with pytest.raises(TensorLayoutError, match="must be a CUDA tensor"):
        opened.copy_into(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(TensorLayoutError, match="must be a CUDA tensor"):
        opened.copy_into(bytearray(16))  # type: ignore[arg-type]
