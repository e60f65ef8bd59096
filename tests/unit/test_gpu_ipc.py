"""CUDA IPC descriptors of GPU-tier blocks, sidecar side, and opened in another process.

Without a GPU: :func:`ipc_descriptor` refuses what is not a CUDA buffer and extents outside
it, and turns ``reduce_tensor``'s output (faked: a CPU tensor that calls itself CUDA) into
plain values the client accepts. The tests marked ``gpu`` share a real CUDA buffer with a
spawned child that reads the parent's bytes and copies them device to device.
"""

from __future__ import annotations

import multiprocessing
import random
from multiprocessing.connection import wait
from typing import Any

import msgpack
import pytest

torch = pytest.importorskip("torch")

from kvpool_client.cudaipc import (  # noqa: E402
    DESCRIPTOR_VERSION, copy_descriptor_into, open_descriptor, parse_descriptor,
)
from kvpool_sidecar.errors import TierError  # noqa: E402
from kvpool_sidecar.tiers import gpu_ipc  # noqa: E402
from kvpool_sidecar.tiers.gpu_ipc import ipc_descriptor  # noqa: E402

pytestmark = pytest.mark.torch
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PAGE = 4096
CHILD_DEADLINE_S = 180.0


class CallsItselfCuda(torch.Tensor):  # type: ignore[misc]
    """A CPU tensor that passes the buffer checks, for the fake ``reduce_tensor``."""

    @property
    def is_cuda(self) -> bool:
        return True


def fake_cuda(nbytes: int) -> Any:
    return torch.zeros(nbytes, dtype=torch.uint8).as_subclass(CallsItselfCuda)


def plain(value: Any) -> bool:
    """Only what msgpack carries without extensions: ints, bytes, bools, lists of those."""
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return type(value) in (int, bytes, bool)


# ------------------------------------------------------------- without CUDA
def test_a_cpu_buffer_is_refused() -> None:
    with pytest.raises(TierError, match="CUDA IPC needs a CUDA buffer; this one is on cpu"):
        ipc_descriptor(torch.zeros(4 * PAGE, dtype=torch.uint8), [(0, PAGE)])


def test_what_is_not_a_tensor_is_refused() -> None:
    with pytest.raises(TierError, match="needs a CUDA tensor, not bytearray"):
        ipc_descriptor(bytearray(PAGE), [(0, PAGE)])  # type: ignore[arg-type]


@pytest.mark.parametrize("extents", [[], [(0, PAGE + 1)], [(-1, 8)], [(8, 0)], [(PAGE, 1)], [(0, 8.0)]],
                         ids=["none", "past-end", "negative", "empty", "at-end", "float"])
def test_extents_outside_the_buffer_are_refused(extents: list[tuple[int, int]]) -> None:
    with pytest.raises(TierError, match="extent|extents"):
        ipc_descriptor(fake_cuda(PAGE), extents)


def test_a_non_contiguous_buffer_is_refused() -> None:
    with pytest.raises(TierError, match="contiguous"):
        ipc_descriptor(fake_cuda(2 * PAGE)[::2], [(0, 8)])


def test_reduce_tensor_output_becomes_plain_values_the_client_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``reduce_tensor``'s arguments for ``rebuild_cuda_tensor`` (in torch's order, as
    ``reductions.reduce_tensor`` builds them for a CUDA tensor) land in the right fields."""
    from torch.multiprocessing import reductions

    handle, ref, event = bytes([2]) + b"c" + bytes(range(64)), b"/torch_77_1_0", bytes(range(64, 128))
    seen: list[Any] = []

    def reduce_tensor(t: Any) -> tuple[Any, tuple[Any, ...]]:
        seen.append(t)
        return (reductions.rebuild_cuda_tensor,
                (type(t), t.size(), t.stride(), t.storage_offset(), torch.TypedStorage, t.dtype,
                 3, handle, 8 * PAGE, 2 * PAGE, False, ref, 42, event, True))

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(gpu_ipc, "device_uuid", lambda index: bytes(range(index, index + 16)))
    buffer = fake_cuda(8 * PAGE)[PAGE:]  # the tier's buffer starts a page into its storage
    desc = ipc_descriptor(buffer, [(2 * PAGE, PAGE), (0, 100)])
    assert len(seen) == 1
    assert desc == {
        "v": DESCRIPTOR_VERSION, "device": 3, "device_uuid": bytes(range(3, 19)), "handle": handle,
        "storage_size": 8 * PAGE, "storage_offset": 2 * PAGE, "ref_counter_handle": ref, "ref_counter_offset": 42,
        "event_handle": event, "event_sync_required": True, "buffer_offset": PAGE,
        "extents": [[2 * PAGE, PAGE], [0, 100]], "nbytes": PAGE + 100,
    }
    assert all(plain(v) for v in desc.values())
    wire = msgpack.unpackb(msgpack.packb(desc, use_bin_type=True), raw=False)
    assert parse_descriptor(wire).extents == ((3 * PAGE, PAGE), (PAGE, 100))


def test_a_handle_the_client_would_refuse_is_caught_at_the_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.multiprocessing import reductions

    def reduce_tensor(t: Any) -> tuple[Any, tuple[Any, ...]]:
        return (reductions.rebuild_cuda_tensor,
                (type(t), t.size(), t.stride(), 0, torch.TypedStorage, t.dtype,
                 0, b"?" * 10, PAGE, 0, False, b"/torch_1", 0, bytes(64), False))

    monkeypatch.setattr(reductions, "reduce_tensor", reduce_tensor)
    monkeypatch.setattr(gpu_ipc, "device_uuid", lambda index: b"")
    with pytest.raises(TierError, match="cannot send: malformed CUDA IPC descriptor: 'handle'"):
        ipc_descriptor(fake_cuda(PAGE), [(0, 8)])


# ------------------------------------------------------------- CUDA only
def _child_reads_and_flips(packed: bytes, conn: Any) -> None:
    """Open the descriptor (once), send its bytes back, and invert them in place."""
    parts = open_descriptor(msgpack.unpackb(packed, raw=False))
    data = b"".join(p.cpu().numpy().tobytes() for p in parts)
    for p in parts:
        p.bitwise_not_()  # a write the parent must see in its own buffer
    torch.cuda.synchronize()
    conn.send(data)


def _child_copies(packed: bytes, nbytes: int, conn: Any) -> None:
    """copy_descriptor_into a bfloat16 CUDA tensor; send its bytes back."""
    dest = torch.full((nbytes // 2,), 7.0, dtype=torch.bfloat16, device="cuda")
    copy_descriptor_into(msgpack.unpackb(packed, raw=False), dest)
    conn.send(dest.view(torch.uint8).cpu().numpy().tobytes())


def in_child(target: Any, *args: Any) -> Any:
    """Run ``target(*args, conn)`` in a spawned process and return what it sent."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=target, args=(*args, theirs))
    child.start()
    theirs.close()
    try:
        ready = wait([mine, child.sentinel], timeout=CHILD_DEADLINE_S)
        assert ready, "the child neither answered nor exited"
        assert mine.poll(), f"the child exited with code {child.exitcode} before it answered"
        return mine.recv()
    finally:
        child.join(timeout=60)
        if child.exitcode is None:
            child.kill()
            child.join()


def _written(buffer: Any, extents: list[tuple[int, int]], seed: int) -> bytes:
    """Write random bytes into ``buffer``'s extents (block order); the block's bytes."""
    data = random.Random(seed).randbytes(sum(n for _, n in extents))
    pos = 0
    for off, n in extents:
        buffer[off : off + n].copy_(torch.frombuffer(bytearray(data[pos : pos + n]), dtype=torch.uint8))
        pos += n
    torch.cuda.synchronize()
    return data


@pytest.mark.gpu
@needs_cuda
def test_a_real_descriptor_is_plain_and_well_formed() -> None:
    storage = torch.zeros(16 * PAGE, dtype=torch.uint8, device="cuda")
    desc = ipc_descriptor(storage[PAGE:], [(0, PAGE), (3 * PAGE, 10)])
    assert all(plain(v) for v in desc.values())
    d = parse_descriptor(msgpack.unpackb(msgpack.packb(desc, use_bin_type=True), raw=False))
    assert d.buffer_offset == PAGE and d.storage_size >= 16 * PAGE and d.nbytes == PAGE + 10
    assert d.device == storage.device.index and len(d.device_uuid) in (0, 16)


@pytest.mark.gpu
@needs_cuda
def test_a_child_process_reads_the_bytes_the_parent_wrote() -> None:
    buffer = torch.zeros(16 * PAGE, dtype=torch.uint8, device="cuda")
    extents = [(5 * PAGE, 2 * PAGE + 11), (PAGE, PAGE), (12 * PAGE, 300)]
    data = _written(buffer, extents, seed=9)
    packed = msgpack.packb(ipc_descriptor(buffer, extents), use_bin_type=True)
    seen = in_child(_child_reads_and_flips, packed)
    assert seen == data
    flipped = b"".join(buffer[o : o + n].cpu().numpy().tobytes() for o, n in extents)
    assert flipped == bytes(b ^ 0xFF for b in data)
    assert not buffer[:PAGE].any()  # bytes outside the block untouched


@pytest.mark.gpu
@needs_cuda
def test_copy_descriptor_into_gives_the_same_bytes() -> None:
    buffer = torch.zeros(32 * PAGE, dtype=torch.uint8, device="cuda")
    # the first two extents continue each other (one copy), the rest do not
    extents = [(2 * PAGE, PAGE), (3 * PAGE, 2 * PAGE), (20 * PAGE, 4 * PAGE), (0, 2 * PAGE - 64)]
    data = _written(buffer, extents, seed=10)
    packed = msgpack.packb(ipc_descriptor(buffer, extents), use_bin_type=True)
    assert in_child(_child_copies, packed, len(data)) == data
