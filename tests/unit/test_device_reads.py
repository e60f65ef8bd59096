"""GPU-tier reads (``ACQUIRE_DEVICE``) through the local API, on the CPU.

The GPU tier is played by plain memory that lends "descriptors" naming its extents, so the
handler, the leases and the client's ``get_cuda`` run here for real over a Unix socket; the
device copy itself (CUDA IPC) runs in ``tests/integration/test_device_reads.py`` on a GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool_client import devread
from kvpool_client.client import AsyncPoolClient
from kvpool_client.devread import DeviceHit
from kvpool_client.errors import CudaIpcError, KVPoolError, ProtocolError
from kvpool_client.integrity import checksum
from kvpool_client.protocol import Op
from kvpool_client.tensors import TensorLayoutError
from kvpool_sidecar.api.local import LocalLimits, LocalServer
from kvpool_sidecar.policy import LRUPolicy
from kvpool_sidecar.store import StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tenancy import KeySpaces, TenantAccess
from kvpool_sidecar.tiers.base import Place
from kvpool_sidecar.tiers.dram import DramTier, SharedArena
from kvpool_sidecar.tiers.hostmem import HostMemoryTier
from tests.unit.store_support import close_store, entry, in_tier, put, read, store_key

PAGE = 4096
DRAM_PAGES = 8
GPU_PAGES = 4


class LendingMemoryTier(HostMemoryTier):
    """The GPU tier played by plain memory, lending a "descriptor" of a block's extents."""

    def ipc_descriptor(self, place: Place) -> dict[str, Any]:
        return {"extents": [[off, n] for off, n in place]}

    def bytes_at(self, descriptor: Mapping[str, Any]) -> bytes:
        return b"".join(bytes(self._mem[off : off + n]) for off, n in descriptor["extents"])


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=48).digest()


def sk(i: int) -> bytes:
    """The store's key of client key ``key(i)`` (the default tenant's space)."""
    return store_key(key(i))


def data(i: int) -> bytes:
    return hashlib.shake_256(str(i).encode()).digest(PAGE)


class Node:
    """An in-process store (lending GPU tier, DRAM) behind a real local server."""

    def __init__(self, tmp_path: Path, *, spaces: int = 1, session_share: float = 1.0) -> None:
        names = ["default", "other"][:spaces]
        self.gpu = LendingMemoryTier(GPU_PAGES * PAGE, PAGE)
        arenas = [SharedArena(DRAM_PAGES * PAGE, populate=False) for _ in names]
        dram = DramTier(DRAM_PAGES * PAGE, PAGE, arenas, {name: i for i, name in enumerate(names)})
        self.store = TieredStore([self.gpu, dram], LRUPolicy(), StoreSettings(
            tenants={name: TenantLimits() for name in names}, block_max_bytes=PAGE, promote_hits=1,
            session_share=session_share))
        self.socket_path = str(tmp_path / "s.sock")
        self.limits = LocalLimits(1 << 20, 64, "n", spaces=KeySpaces({name: name for name in names}),
                                  access=TenantAccess.from_settings([SimpleNamespace(name=n) for n in names]))
        self.server = LocalServer(self.store, self.limits, socket_path=self.socket_path)

    async def promoted(self, i: int) -> None:
        """Block ``i`` stored and read once (copied up to the GPU tier)."""
        k = sk(i)
        await put(self.store, k, data(i))
        assert await read(self.store, k) == data(i)
        await self.store.settle()
        assert in_tier(self.store, k, "gpu")


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path)
    await n.server.start()
    yield n
    await n.server.stop()
    close_store(n.store)


async def test_a_gpu_tier_hit_comes_with_a_lease_that_keeps_it_there_until_released(node: Node) -> None:
    st = node.store
    for i in range(2):
        await put(st, sk(i), data(i))
    assert await read(st, sk(0)) == data(0)
    await st.settle()
    async with await AsyncPoolClient.connect(node.socket_path) as c:
        assert c.device_reads
        held, miss, unknown = await c._call(Op.ACQUIRE_DEVICE, [key(0), key(1), key(9)])  # noqa: SLF001
        assert miss is None and unknown is None  # key 1 is in DRAM only; key 9 nowhere
        lease, size, csum, desc = held
        assert size == PAGE and csum == checksum(memoryview(data(0)))
        assert node.gpu.bytes_at(desc) == data(0)
        # the GPU tier fills up with blocks read after it: the held block stays
        for i in range(2, 2 + GPU_PAGES):
            await node.promoted(i)
        assert in_tier(st, sk(0), "gpu") and entry(st, sk(0)).readers == 1
        assert await c._call(Op.RELEASE, [[lease, False]]) == 1  # noqa: SLF001
        assert await c._call(Op.RELEASE, [[lease, False]]) == 0  # ended  # noqa: SLF001
        assert entry(st, sk(0)).readers == 0
        # released, it is the coldest block there: the next one copied up takes its room
        await node.promoted(2 + GPU_PAGES)
        assert not in_tier(st, sk(0), "gpu") and in_tier(st, sk(0), "dram")
        assert await c._call(Op.ACQUIRE_DEVICE, [key(0)]) == [None]  # noqa: SLF001


async def test_a_block_removed_under_a_device_lease_keeps_its_gpu_pages_until_the_lease_goes(node: Node) -> None:
    """The engine copies through its descriptor with no check of its own: a dead block's GPU
    pages had been given back at once, the next block copied up took them, and the engine
    read that block's bytes under the first key."""
    await node.promoted(0)
    async with await AsyncPoolClient.connect(node.socket_path) as engine, \
            await AsyncPoolClient.connect(node.socket_path) as other:
        [[lease, _, _, desc]] = await engine._call(Op.ACQUIRE_DEVICE, [key(0)])  # noqa: SLF001
        assert await other._call(Op.REMOVE, [key(0)]) == 1  # noqa: SLF001
        for i in range(1, 1 + GPU_PAGES):  # blocks read after it are copied up
            await node.promoted(i)
        assert node.gpu.bytes_at(desc) == data(0)
        assert await engine._call(Op.RELEASE, [[lease, False]]) == 1  # noqa: SLF001
        await node.promoted(GPU_PAGES + 1)  # its room is given back now
        assert node.gpu.used_bytes <= GPU_PAGES * PAGE


async def test_get_cuda_fills_the_hits_and_releases_every_lease_also_on_error(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's path with the CUDA parts played on the CPU: the destination checks
    pass, and the copy reads the lending tier."""
    st = node.store
    await node.promoted(0)
    await node.promoted(1)
    await put(st, sk(2), data(2))
    monkeypatch.setattr(devread, "check_destinations", lambda keys, into: None)

    def copy(desc: Mapping[str, Any], dest: torch.Tensor) -> None:
        dest.copy_(torch.frombuffer(bytearray(node.gpu.bytes_at(desc)), dtype=torch.uint8))

    monkeypatch.setattr(devread, "copy_descriptor_into", copy)
    async with await AsyncPoolClient.connect(node.socket_path) as c:
        dests = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(3)]
        assert await c.get_cuda([key(0), key(2), key(1)], dests) == [True, False, True]
        assert bytes(dests[0].numpy()) == data(0) and bytes(dests[2].numpy()) == data(1)
        assert not dests[1].any()  # a miss is left alone, for the DRAM path
        await c.stats()  # the releases were sent before it: done by its answer
        assert entry(st, sk(0)).readers == entry(st, sk(1)).readers == 0

        def broken(desc: Mapping[str, Any], dest: torch.Tensor) -> None:
            raise CudaIpcError("cannot open the CUDA IPC handle")

        monkeypatch.setattr(devread, "copy_descriptor_into", broken)
        with pytest.raises(CudaIpcError):
            await c.get_cuda([key(0), key(1)], dests[:2])
        with pytest.raises(TensorLayoutError, match="block 1 is 4096 bytes"):
            await c.get_cuda([key(0), key(1)], [dests[0], torch.zeros(PAGE // 2, dtype=torch.uint8)])
        await c.stats()
        assert entry(st, sk(0)).readers == entry(st, sk(1)).readers == 0


async def test_get_cuda_asks_in_requests_of_at_most_the_sidecars_max_batch(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get_cuda of more keys than the sidecar takes in one request goes in several (the
    sidecar refuses a longer one whole), its hits and leases as one request's would be."""
    st = node.store
    await node.promoted(0)
    await node.promoted(1)
    await put(st, sk(2), data(2))
    monkeypatch.setattr(devread, "check_destinations", lambda keys, into: None)
    monkeypatch.setattr(devread, "copy_descriptor_into", lambda desc, dest: dest.copy_(
        torch.frombuffer(bytearray(node.gpu.bytes_at(desc)), dtype=torch.uint8)))
    asked: list[int] = []
    send = AsyncPoolClient._send  # noqa: SLF001

    def counting(self: AsyncPoolClient, op: Op, *args: Any) -> Any:
        if op == Op.ACQUIRE_DEVICE:
            asked.append(len(args[0]))
        return send(self, op, *args)

    monkeypatch.setattr(AsyncPoolClient, "_send", counting)
    async with await AsyncPoolClient.connect(node.socket_path) as c:
        c.info["max_batch"] = 2
        dests = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(3)]
        assert await c.get_cuda([key(0), key(2), key(1)], dests) == [True, False, True]
        assert asked == [2, 1]
        assert bytes(dests[0].numpy()) == data(0) and bytes(dests[2].numpy()) == data(1)
        await c.stats()
        assert entry(st, sk(0)).readers == entry(st, sk(1)).readers == 0


async def test_device_reads_keep_the_session_limits(tmp_path: Path) -> None:
    node = Node(tmp_path, session_share=1 / DRAM_PAGES)  # one block held at a time
    await node.server.start()
    try:
        await node.promoted(0)
        await node.promoted(1)
        async with await AsyncPoolClient.connect(node.socket_path) as c:
            held, refused = await c._call(Op.ACQUIRE_DEVICE, [key(0), key(1)])  # noqa: SLF001
            assert held is not None and refused is None
            assert await c._call(Op.RELEASE, [[held[0], False]]) == 1  # noqa: SLF001
            [again] = await c._call(Op.ACQUIRE_DEVICE, [key(1)])  # noqa: SLF001
            assert again is not None and node.gpu.bytes_at(again[3]) == data(1)
    finally:
        await node.server.stop()
        close_store(node.store)


async def test_with_two_key_spaces_every_key_is_a_miss(tmp_path: Path) -> None:
    """A descriptor opens the whole GPU buffer, every space's blocks: not lent here."""
    node = Node(tmp_path, spaces=2)
    await node.server.start()
    try:
        await node.promoted(0)
        async with await AsyncPoolClient.connect(node.socket_path) as c:
            assert c.shm and not c.device_reads
            assert await c._call(Op.ACQUIRE_DEVICE, [key(0)]) == [None]  # noqa: SLF001
            assert [bytes(g) for g in await c.get([key(0)]) if g is not None] == [data(0)]  # DRAM serves it
    finally:
        await node.server.stop()
        close_store(node.store)


# ------------------------------------------------------------- the client's checks
def test_answers_are_checked_and_every_lease_is_found() -> None:
    desc = {"extents": [[0, 4]]}
    assert devread.hits([None, [7, 4, 1, desc]], 2) == [None, DeviceHit(7, 4, 1, desc)]
    with pytest.raises(ProtocolError):
        devread.hits([None], 2)
    with pytest.raises(ProtocolError):
        devread.hits([[7, 4, 1, "not a descriptor"]], 1)
    assert devread.releases([None, [7, 4, 1, desc], [8, "junk"], "junk"]) == [[7, False], [8, False]]
    assert devread.releases("junk") == []


def test_a_destination_of_another_size_is_refused_before_any_copy() -> None:
    dests = [torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float16)]
    with pytest.raises(TensorLayoutError, match="block 1 is 8 bytes; its destination holds 4"):
        devread.fill([DeviceHit(1, 8, 0, {}), DeviceHit(2, 8, 0, {})], dests)


def test_get_cuda_refuses_without_cuda_or_with_cpu_destinations(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse: Callable[..., None] = devread.check_destinations
    if not torch.cuda.is_available():
        with pytest.raises(CudaIpcError, match="needs CUDA"):
            refuse(1, [torch.zeros(4)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(TensorLayoutError, match="destination 0 must be a CUDA tensor"):
        refuse(1, [torch.zeros(4)])
    with pytest.raises(KVPoolError, match="one destination per key"):
        refuse(2, [torch.zeros(4)])


async def test_a_device_read_that_fails_part_way_gives_back_the_leases_it_took(
        node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that is no TierError (torch's own, say) on the second key: the first key's
    lease, never named to the client, had held its block and the session's share until the
    connection closed."""
    await node.promoted(0)
    await node.promoted(1)
    lend = node.gpu.ipc_descriptor
    calls: list[Place] = []

    def second_fails(place: Place) -> dict[str, Any]:
        calls.append(place)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return lend(place)

    monkeypatch.setattr(node.gpu, "ipc_descriptor", second_fails)
    async with await AsyncPoolClient.connect(node.socket_path) as c:
        with pytest.raises(KVPoolError, match="internal"):
            await c._call(Op.ACQUIRE_DEVICE, [key(0), key(1)])  # noqa: SLF001
        assert len(calls) == 2
        await c.stats()
        assert entry(node.store, sk(0)).readers == entry(node.store, sk(1)).readers == 0
