"""The GPU tier: clean absence without CUDA, sizing, extents and copies, CUDA IPC.

The copy and accounting logic also runs here on a CPU buffer (``GpuTier(cpu_tensor, page)``);
the tests marked ``gpu`` repeat it on a real device and open blocks from a child process.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest

from kvpool_sidecar.config import GpuSettings
from kvpool_sidecar.errors import TierError
from kvpool_sidecar.tiers.base import TierKind
from kvpool_sidecar.gpus import gpu_inventory
from kvpool_sidecar.tiers import gpu as gpu_module
from kvpool_sidecar.tiers.gpu import GpuTier, tier_bytes

PAGE = 4096
MiB = 1 << 20


def _torch() -> Any:
    return pytest.importorskip("torch")


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_cuda = pytest.mark.skipif(not _cuda(), reason="needs CUDA")


def split(data: bytes, cuts: list[int]) -> list[memoryview]:
    """``data`` as views cut at ``cuts`` (pieces that do not line up with the extents)."""
    bounds = [0, *sorted(cuts), len(data)]
    return [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]


# ------------------------------------------------------------- without CUDA
@pytest.mark.skipif(_cuda(), reason="checks the behaviour without CUDA")
def test_create_returns_none_without_cuda(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    assert GpuTier.create(GpuSettings(enabled=True, size_bytes=64 * MiB), PAGE) is None
    assert "GPU tier" in caplog.text


def test_create_does_not_import_torch_without_an_nvidia_device(monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gpu_module, "_NVIDIA_DEVICES", ("/nonexistent/nvidia0",))
    monkeypatch.setitem(sys.modules, "torch", None)  # an import would fail loudly
    caplog.set_level("INFO")
    assert GpuTier.create(GpuSettings(), PAGE) is None  # on by default, off without a device
    assert "no NVIDIA device" in caplog.text


def test_create_returns_none_when_cuda_is_unavailable(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    torch = _torch()
    monkeypatch.setattr(gpu_module, "_NVIDIA_DEVICES", ("/",))  # as if the node had a device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GpuTier.create(GpuSettings(enabled=True), PAGE) is None
    assert "CUDA is not available" in caplog.text


def test_create_returns_none_without_torch(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gpu_module, "_NVIDIA_DEVICES", ("/",))
    monkeypatch.setitem(sys.modules, "torch", None)
    assert GpuTier.create(GpuSettings(enabled=True), PAGE) is None
    assert "pip install kvpool[torch]" in caplog.text


def test_create_returns_none_when_disabled() -> None:
    assert GpuTier.create(GpuSettings(enabled=False), PAGE) is None


@pytest.mark.skipif(_cuda(), reason="checks the behaviour without GPUs")
def test_inventory_is_empty_without_gpus() -> None:
    assert gpu_inventory() == []


def test_inventory_is_empty_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_inventory() == []


def test_tier_bytes() -> None:
    assert tier_bytes(GpuSettings(size_bytes=10 * PAGE + 5), 0, 0, PAGE) == 10 * PAGE
    assert tier_bytes(GpuSettings(fraction=0.25, engine_reserve=0), 400 * PAGE, 400 * PAGE, PAGE) == 100 * PAGE
    assert tier_bytes(GpuSettings(fraction=0.1, engine_reserve=0), 9 * PAGE, 9 * PAGE, PAGE) == 0


def test_the_tier_leaves_the_engines_their_share() -> None:
    total = 1000 * PAGE
    idle = GpuSettings(fraction=0.1)  # engine_reserve 0.95: at most 5% of an idle device
    assert tier_bytes(idle, total, total, PAGE) == 50 * PAGE
    # the engine came first and holds 90%: nothing is left over its reserve
    assert tier_bytes(idle, 100 * PAGE, total, PAGE) == 0
    # a fixed size is capped as well
    assert tier_bytes(GpuSettings(size_bytes=300 * PAGE), total, total, PAGE) == 50 * PAGE
    assert tier_bytes(GpuSettings(size_bytes=300 * PAGE, engine_reserve=0.5), total, total, PAGE) == 300 * PAGE


# ------------------------------------------------------------- logic on a CPU buffer
def test_cpu_buffer_round_trip_and_accounts() -> None:
    torch = _torch()
    tier = GpuTier(torch.zeros(64 * PAGE, dtype=torch.uint8), PAGE)
    exercise(tier)


def test_cpu_buffer_has_no_ipc() -> None:
    torch = _torch()
    tier = GpuTier(torch.zeros(4 * PAGE, dtype=torch.uint8), PAGE)
    with pytest.raises(TierError, match="CUDA"):
        tier.ipc_descriptor(tier.allocate(100) or [])


def test_a_failed_device_copy_is_the_tiers_io_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch raises CUDA's errors as RuntimeError: the tier hands them on as TierIOError, which
    the store takes as one copy's failure (a block kept where it was), not as its own error."""
    from kvpool_sidecar.errors import TierIOError

    torch = _torch()
    tier = GpuTier(torch.zeros(4 * PAGE, dtype=torch.uint8), PAGE)
    place = tier.allocate(PAGE)
    assert place is not None

    def lost() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tier, "_sync", lost)
    with pytest.raises(TierIOError, match="illegal memory access"):
        tier.write(place, [memoryview(bytes(PAGE))])
    with pytest.raises(TierIOError, match="illegal memory access"):
        tier.read_into(place, [memoryview(bytearray(PAGE))])


def exercise(tier: GpuTier) -> None:
    """Allocate, fragment, write, read back and free; checks every figure on the way."""
    assert tier.kind is TierKind.GPU
    pages = tier.capacity_bytes // PAGE
    assert tier.free_bytes == tier.capacity_bytes and tier.used_bytes == 0
    with pytest.raises(ValueError):
        tier.allocate(0)
    # Fill with one-page blocks, free every other one: a large block must gather extents.
    singles = [tier.allocate(PAGE) for _ in range(pages)]
    assert all(s is not None for s in singles) and tier.allocate(1) is None and tier.free_bytes == 0
    for s in singles[::2]:
        tier.free(s or [])
    assert tier.used_bytes == pages // 2 * PAGE
    rng = random.Random(5)
    size = 3 * PAGE + 123
    data = rng.randbytes(size)
    extents = tier.allocate(size)
    assert extents is not None and len(extents) == 4 and sum(n for _, n in extents) == size
    assert tier.used_bytes == (pages // 2 + 4) * PAGE and tier.footprint(size) == 4 * PAGE
    tier.write(extents, split(data, [1, PAGE + 7, 2 * PAGE]))
    out = bytearray(size)
    tier.read_into(extents, [memoryview(out)])
    assert bytes(out) == data
    pieces = [bytearray(n) for n in (5, size - 5)]
    tier.read_into(extents, [memoryview(p) for p in pieces])
    assert b"".join(pieces) == data
    with pytest.raises(TierError):
        tier.write(extents, [memoryview(data[:-1])])
    with pytest.raises(TierError):
        tier.read_into(extents, [memoryview(bytearray(size + 1))])
    tier.free(extents)
    with pytest.raises(ValueError, match="double free"):
        tier.free(extents)
    for s in singles[1::2]:
        tier.free(s or [])
    assert tier.used_bytes == 0 and tier.free_bytes == tier.capacity_bytes


# ------------------------------------------------------------- CUDA only
@pytest.mark.gpu
@needs_cuda
def test_gpu_round_trip_and_accounts() -> None:
    tier = GpuTier.create(GpuSettings(enabled=True, size_bytes=64 * PAGE), PAGE)
    assert tier is not None and tier.buffer.is_cuda and tier.capacity_bytes == 64 * PAGE
    exercise(tier)
    big = bytes(range(256)) * (40 * PAGE // 256)
    ext = tier.allocate(len(big))
    assert ext is not None
    tier.write(ext, [memoryview(big)])
    out = bytearray(len(big))
    tier.read_into(ext, [memoryview(out)])
    assert out == big


@pytest.mark.gpu
@needs_cuda
def test_gpu_sized_from_free_memory_and_inventory() -> None:
    import torch

    inv = gpu_inventory()
    assert len(inv) >= torch.cuda.device_count()
    assert all(g["total_bytes"] >= g["free_bytes"] > 0 and g["name"] for g in inv)
    total = torch.cuda.get_device_properties(0).total_memory
    tier = GpuTier.create(GpuSettings(enabled=True, fraction=0.01), 1 * MiB)
    assert tier is not None
    assert 0 < tier.capacity_bytes <= total * 0.01 and tier.buffer.numel() == tier.capacity_bytes


def _open_in_child(descriptor: Any, queue: Any) -> None:
    import torch

    from kvpool_client.cudaipc import open_descriptor

    parts = open_descriptor(descriptor)
    data = b"".join(bytes(p.cpu().tolist()) for p in parts)
    for p in parts:
        p.bitwise_not_()  # a write the parent must see through its own buffer
    torch.cuda.synchronize()
    queue.put(data)


@pytest.mark.gpu
@needs_cuda
def test_ipc_descriptor_opens_in_a_child_process() -> None:
    import torch
    import torch.multiprocessing as tmp

    tier = GpuTier.create(GpuSettings(enabled=True, size_bytes=16 * PAGE), PAGE)
    assert tier is not None
    pad = tier.allocate(PAGE)
    size = 2 * PAGE + 11
    ext = tier.allocate(size)
    assert pad is not None and ext is not None
    data = random.Random(9).randbytes(size)
    tier.write(ext, [memoryview(data)])
    handle = tier.ipc_descriptor(ext)
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_open_in_child, args=(handle, queue))
    child.start()
    try:
        seen = queue.get(timeout=180)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert seen == data
    out = bytearray(size)
    tier.read_into(ext, [memoryview(out)])
    assert out == bytes(b ^ 0xFF for b in data)
    torch.cuda.synchronize()


def test_what_goes_up_is_what_was_checked_whatever_writes_into_the_source_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The source is the shared arena, which any client of its space maps: hashed, then read
    again to be staged, it let bytes written between the two reach the GPU tier under a
    checksum that had been right, served unchecked to every device read after."""
    from kvpool_client.integrity import checksum as real_checksum
    from kvpool_sidecar.errors import CorruptBlockError
    from kvpool_sidecar.tiers.base import BlockRecord

    torch = _torch()
    tier = GpuTier(torch.zeros(4 * PAGE, dtype=torch.uint8), PAGE)
    source = bytearray(random.Random(7).randbytes(PAGE))
    record = BlockRecord(b"k" * 48, PAGE, real_checksum(memoryview(bytes(source))))

    def hashed_then_overwritten(views: Any) -> int:
        got = real_checksum(views)
        source[0] ^= 0xFF  # another client writes into the arena right after the check
        return got

    monkeypatch.setattr(gpu_module, "checksum", hashed_then_overwritten)
    place = tier.allocate(PAGE)
    assert place is not None
    expected = bytes(source)
    tier.write_copy(place, record, [memoryview(source)])
    out = bytearray(PAGE)
    tier.read_into(place, [memoryview(out)])
    assert bytes(out) == expected  # what was checked is what went up
    with pytest.raises(CorruptBlockError):  # and bytes changed before the check fail it
        tier.write_copy(place, record, [memoryview(source)])
