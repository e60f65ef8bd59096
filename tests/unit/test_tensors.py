"""torch helpers against a real sidecar: tensor round trips, layout checks, the arena tensor.

CUDA-only tests (pinned registration, GPU destinations) are marked ``gpu`` and skip
without CUDA; ``make gpu-check`` / ``scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvpool_client.client import PoolClient  # noqa: E402
from kvpool_client.errors import KVPoolError  # noqa: E402
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys  # noqa: E402
from kvpool_client.protocol import PutStatus  # noqa: E402
from kvpool_client import tensors  # noqa: E402
from kvpool_client.tensors import (  # noqa: E402
    TensorLayoutError, TorchUnavailableError, arena_tensor, get_tensors, get_tensors_in_place, put_tensors,
    register_arena_pinned, tensor_bytes, unregister_arena_pinned,
)

pytestmark = pytest.mark.torch
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: One block of a small Llama-shaped model: (layers, K/V, block_tokens, kv_heads, head_dim).
KV_SHAPE = (4, 2, 16, 8, 64)
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


def keys_for(tag: str, n: int, dtype: Any = torch.bfloat16) -> list[BlockKey]:
    fp = ModelFingerprint(model="test/" + tag, dtype=str(dtype), block_tokens=16, kv_layout="LKTHD")
    return block_keys(fp, list(range(16 * n)))


def kv_blocks(n: int, dtype: Any, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return [torch.randint(-128, 128, KV_SHAPE, dtype=torch.int8, generator=g) for _ in range(n)]
    return [torch.randn(KV_SHAPE, generator=g).to(dtype) for _ in range(n)]


@pytest.fixture
def client(sidecar: Any) -> Iterator[PoolClient]:
    with PoolClient(sidecar.socket_path) as c:
        assert c.shm
        yield c


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_into_new_tensors(client: PoolClient, dtype: Any) -> None:
    keys, blocks = keys_for("rt", 6, dtype), kv_blocks(6, dtype)
    assert put_tensors(client, keys, blocks, chain=True) == [PutStatus.STORED] * 6
    got = get_tensors(client, keys, like=blocks[0])
    for want, t in zip(blocks, got):
        assert t is not None and t.dtype == dtype and t.shape == want.shape
        assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_into_caller_buffers(client: PoolClient, dtype: Any) -> None:
    keys, blocks = keys_for("inplace", 3, dtype), kv_blocks(3, dtype, seed=1)
    put_tensors(client, keys, blocks)
    dests = [torch.zeros(KV_SHAPE, dtype=dtype) for _ in keys]
    ptrs = [d.data_ptr() for d in dests]
    got = get_tensors(client, keys, like=dests)
    assert [t is d for t, d in zip(got, dests)] == [True] * 3
    assert [d.data_ptr() for d in dests] == ptrs
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))


def test_tensor_bytes_is_zero_copy() -> None:
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    view = tensor_bytes(t)
    assert view.nbytes == 64 and view.format == "B" and not view.readonly
    view[2:4] = bytes(tensor_bytes(torch.tensor([1.5], dtype=torch.bfloat16)))
    assert t[0, 1].item() == 1.5 and t.sum().item() == 1.5
    t[3, 7] = -2.0
    assert bytes(view[62:64]) == bytes(tensor_bytes(torch.tensor([-2.0], dtype=torch.bfloat16)))
    assert view.obj._kvpool_owner is t  # the view keeps its tensor alive
    sliced = torch.arange(16, dtype=torch.int32)[4:8]
    assert bytes(tensor_bytes(sliced)) == bytes(tensor_bytes(torch.arange(4, 8, dtype=torch.int32)))


def test_non_contiguous_input_is_rejected(client: PoolClient) -> None:
    keys = keys_for("noncontig", 1)
    strided = kv_blocks(1, torch.float16)[0].transpose(2, 3)
    with pytest.raises(TensorLayoutError, match="contiguous"):
        put_tensors(client, keys, [strided])
    assert client.lookup(keys).prefix == 0
    put_tensors(client, keys, [strided.contiguous()])
    got = get_tensors(client, keys, like=strided.contiguous())[0]
    assert got is not None and torch.equal(got, strided)
    with pytest.raises(TensorLayoutError, match="contiguous"):
        get_tensors(client, keys, like=[torch.empty(KV_SHAPE, dtype=torch.float16).transpose(2, 3)])


def test_empty_tensor_is_rejected(client: PoolClient) -> None:
    with pytest.raises(TensorLayoutError, match="empty"):
        put_tensors(client, keys_for("empty", 1), [torch.empty(0)])


def test_miss_returns_none(client: PoolClient) -> None:
    keys, blocks = keys_for("miss", 3), kv_blocks(3, torch.bfloat16)
    put_tensors(client, keys[:1], blocks[:1])
    got = get_tensors(client, keys, like=blocks[0])
    assert got[0] is not None and torch.equal(got[0], blocks[0])
    assert got[1:] == [None, None]


def test_size_mismatch_raises(client: PoolClient) -> None:
    keys = keys_for("size", 1)
    put_tensors(client, keys, kv_blocks(1, torch.bfloat16))
    with pytest.raises(TensorLayoutError, match="does not fill"):
        get_tensors(client, keys, like=torch.empty(KV_SHAPE, dtype=torch.float32))
    with pytest.raises(KVPoolError, match="too small"):
        get_tensors(client, keys, like=torch.empty(KV_SHAPE, dtype=torch.int8))


def test_argument_errors(client: PoolClient) -> None:
    keys, blocks = keys_for("args", 2), kv_blocks(2, torch.bfloat16)
    with pytest.raises(KVPoolError, match="one tensor per key"):
        put_tensors(client, keys, blocks[:1])
    with pytest.raises(KVPoolError, match="one destination per key"):
        get_tensors(client, keys, like=blocks[:1])
    with pytest.raises(KVPoolError, match="device"):
        get_tensors(client, keys, like=blocks, device="cpu")


def test_arena_tensor_aliases_the_arena(client: PoolClient) -> None:
    arena = arena_tensor(client)
    view = client._view
    assert view is not None and arena.numel() == view.nbytes and arena.dtype == torch.uint8
    pattern = torch.randint(0, 256, (64 << 10,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    put_tensors(client, keys_for("arena", 1), [pattern])
    off = view.tobytes().find(bytes(tensor_bytes(pattern)))
    assert off >= 0, "the block's bytes are not in the arena"
    assert torch.equal(arena[off : off + pattern.numel()], pattern)
    arena[off] = 255 - int(arena[off])  # a write through the tensor is a write to the mapping
    assert view[off] == 255 - int(pattern[0])
    with pytest.raises(BufferError):  # the mapping cannot be unmapped under a live arena tensor
        client.close()
    del arena
    client.close()


def test_pinning_without_cuda_returns_false(client: PoolClient, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.INFO, logger="kvpool_client.tensors"):
        assert register_arena_pinned(client) is False
    assert "CUDA is not available" in caplog.text
    assert unregister_arena_pinned(client) is False


class FakeCudart:
    """Records what would go to CUDA's runtime (this machine has no GPU)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", ptr))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def test_closing_a_client_unregisters_its_pinned_arena(sidecar: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    c = PoolClient(sidecar.socket_path)
    assert register_arena_pinned(c) is True
    ptr = rt.calls[0][1]
    c.close()  # the arena is unmapped: CUDA must have forgotten it first
    assert rt.calls == [("register", ptr), ("unregister", ptr)]
    assert unregister_arena_pinned(c) is False


def test_lazy_conjugate_and_negative_views_are_refused(client: PoolClient) -> None:
    z = torch.randn(4, 8, dtype=torch.complex64)
    for lazy in (z.conj(), torch._neg_view(torch.randn(4, 8))):  # noqa: SLF001 - how a neg view is made
        with pytest.raises(TensorLayoutError, match="lazy"):
            tensor_bytes(lazy)
    assert bytes(tensor_bytes(z.conj().resolve_conj())) != bytes(tensor_bytes(z))


def test_module_imports_without_torch_and_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvpool_client.tensors as t\n"
            "try:\n    t.tensor_bytes(None)\nexcept t.TorchUnavailableError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install kvpool[torch]" in out
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(TorchUnavailableError, match=r"pip install kvpool\[torch\]"):
        put_tensors(None, [], [])  # type: ignore[arg-type]
    assert issubclass(TorchUnavailableError, ImportError) and issubclass(TorchUnavailableError, KVPoolError)


class CountingGets:
    """Counts the client's GET and ACQUIRE calls (one per round of a read)."""

    def __init__(self, client: PoolClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gets = self.acquires = 0
        get, acquire = client.get, client.acquire

        def counted_get(*a: Any, **k: Any) -> Any:
            self.gets += 1
            return get(*a, **k)

        def counted_acquire(*a: Any, **k: Any) -> Any:
            self.acquires += 1
            return acquire(*a, **k)

        monkeypatch.setattr(client, "get", counted_get)
        monkeypatch.setattr(client, "acquire", counted_acquire)


def test_rounds_cut_a_read_by_bytes_in_order() -> None:
    block = tensors.ROUND_BYTES // 3
    assert tensors._rounds([block] * 7) == [(0, 3), (3, 6), (6, 7)]
    assert tensors._rounds([tensors.ROUND_BYTES * 2, 1, 1]) == [(0, 1), (1, 3)]  # a big block is a round alone
    assert tensors._rounds([]) == []


def test_a_read_in_rounds_gives_what_one_read_gives(client: PoolClient, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks = keys_for("rounds", 5, torch.float32), kv_blocks(5, torch.float32, seed=5)
    put_tensors(client, keys[:2] + keys[3:], blocks[:2] + blocks[3:])  # the middle one is a miss
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * size)
    calls = CountingGets(client, monkeypatch)
    got = get_tensors(client, keys, like=blocks[0])
    assert calls.gets == 3
    assert got[2] is None
    assert all(t is not None and torch.equal(t, b) for i, (t, b) in enumerate(zip(got, blocks)) if i != 2)
    # CPU destinations (or an arena not registered with CUDA): the in-place read is this one
    dests = [torch.zeros_like(b) for b in blocks]
    got = get_tensors_in_place(client, keys, dests)
    assert calls.acquires == 0 and calls.gets == 6
    assert got[2] is None and all(torch.equal(d, b) for i, (d, b) in enumerate(zip(dests, blocks)) if i != 2)
    with pytest.raises(TensorLayoutError, match="contiguous"):
        get_tensors_in_place(client, keys[:1], [torch.zeros(KV_SHAPE[::-1]).transpose(0, 4)])


def test_the_in_place_read_releases_every_round_also_when_a_block_does_not_fit(
        client: PoolClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_client.client import HeldBlocks

    keys, blocks = keys_for("in-place-cpu", 4, torch.float32), kv_blocks(4, torch.float32, seed=2)
    put_tensors(client, keys, blocks)
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", size)
    released: list[int] = []
    release = HeldBlocks.release
    monkeypatch.setattr(HeldBlocks, "release", lambda self: released.append(len(self)) or release(self))
    dests = [torch.zeros_like(b) for b in blocks]
    got = tensors._in_place(client, keys, dests)  # the CUDA path's logic, on the CPU
    assert all(t is d for t, d in zip(got, dests)) and all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert released == [1, 1, 1, 1]
    released.clear()
    wrong = [torch.zeros_like(b) for b in blocks[:2]] + [torch.zeros(KV_SHAPE, dtype=torch.bfloat16)] * 2
    with pytest.raises(TensorLayoutError, match="does not fill"):
        tensors._in_place(client, keys, wrong)
    assert released == [1, 1, 2]  # every round read so far (the last two half-size dests share one), the failing one too


def test_held_rounds_release_every_round_when_one_release_fails(client: PoolClient,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_client.client import HeldBlocks
    from kvpool_client.errors import ConnectionLostError

    keys = keys_for("held-rounds", 3, torch.float32)
    put_tensors(client, keys, kv_blocks(3, torch.float32))
    size = kv_blocks(1, torch.float32)[0].numel() * 4
    monkeypatch.setattr(tensors, "ROUND_BYTES", size)
    released: list[int] = []
    release = HeldBlocks.release

    def flaky(self: HeldBlocks) -> None:
        released.append(len(self))
        release(self)
        if len(released) == 1:
            raise ConnectionLostError("the sidecar went away")

    monkeypatch.setattr(HeldBlocks, "release", flaky)
    with pytest.raises(ConnectionLostError, match="went away"):
        with tensors.HeldRounds(client, [torch.device("cpu")]) as rounds:
            assert [lo for lo, _ in rounds.acquire(keys, [size] * 3)] == [0, 1, 2]
    assert released == [1, 1, 1]


# ---------------------------------------------------------------- CUDA only
def test_the_in_place_put_commits_round_by_round_what_a_put_would_store(
        client: PoolClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_client.client import PoolClient as Client

    keys, blocks = keys_for("put-in-place-cpu", 5, torch.float32), kv_blocks(5, torch.float32, seed=4)
    assert put_tensors(client, keys[1:2], blocks[1:2]) == [PutStatus.STORED]
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * size)
    reserves: list[tuple[int, int, Any]] = []
    reserve = Client.reserve
    monkeypatch.setattr(Client, "reserve", lambda self, k, sizes, **kw: reserves.append(
        (len(k), kw["depth"], kw["parent"])) or reserve(self, k, sizes, **kw))
    monkeypatch.setattr(Client, "put", lambda *a, **k: pytest.fail("the in-place put copied through put"))
    got = tensors._put_in_place(torch, client, keys, blocks, True, 0, None, None)  # the CUDA path's logic, on the CPU
    assert got == [PutStatus.STORED, PutStatus.EXISTS] + [PutStatus.STORED] * 3
    assert reserves == [(2, 0, None), (2, 2, keys[1]), (1, 4, keys[3])]  # one chain, in rounds
    assert client.lookup(keys).prefix == 5
    back = get_tensors(client, keys, like=blocks[0])
    assert all(t is not None and torch.equal(t, b) for t, b in zip(back, blocks))  # checksums taken in place


def test_an_in_place_put_that_fails_gives_every_open_round_back(client: PoolClient,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks = keys_for("put-in-place-fail", 4, torch.float32), kv_blocks(4, torch.float32, seed=6)
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", size)
    copies = 0
    copy_in = tensors.copy_in

    def failing(arena: Any, src: Any, extents: Any) -> None:
        nonlocal copies
        copies += 1
        if copies == 3:
            raise RuntimeError("a device error")
        copy_in(arena, src, extents)

    monkeypatch.setattr(tensors, "copy_in", failing)
    with pytest.raises(RuntimeError, match="device error"):
        tensors._put_in_place(torch, client, keys, blocks, True, 0, None, None)
    monkeypatch.undo()
    assert client.lookup(keys).prefix == 1  # the first round was committed before the third copy failed
    # the second and third rounds' room was given back: their keys are not pending
    assert put_tensors(client, keys, blocks, chain=True) == [PutStatus.EXISTS] + [PutStatus.STORED] * 3


class _Room:
    """A reservation's stand-in that records what the cleanup did to it."""

    def __init__(self, log: list[str], name: str, fail: bool = False) -> None:
        self.log, self.name, self.fail = log, name, fail

    def abort(self) -> None:
        self.log.append("abort " + self.name)
        if self.fail:
            raise KVPoolError("the sidecar went away")

    def abandon(self) -> None:
        self.log.append("abandon " + self.name)


class _Streams:
    """torch.cuda's streams, for the cleanup alone: synchronizing fails when told to."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.cuda = self

    def current_stream(self, device: Any) -> Any:
        return self

    def synchronize(self) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failed_in_place_put_aborts_every_round_or_leaves_them_to_expire() -> None:
    log: list[str] = []
    rooms = [_Room(log, "a", fail=True), _Room(log, "b")]
    tensors._give_back(_Streams(fail=False), rooms, [torch.device("cuda", 0)])  # type: ignore[arg-type]
    assert log == ["abort a", "abort b"]  # the second room too, though the first abort failed
    log.clear()
    tensors._give_back(_Streams(fail=True), rooms, [torch.device("cuda", 0)])  # type: ignore[arg-type]
    assert log == ["abandon a", "abandon b"]  # a DMA may still land: no room is given back


def test_put_tensors_in_place_without_a_registered_arena_is_put_tensors(client: PoolClient,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    keys, blocks = keys_for("put-in-place-plain", 2, torch.float16), kv_blocks(2, torch.float16, seed=8)
    monkeypatch.setattr(tensors, "_put_in_place", lambda *a: pytest.fail("no registered arena: no in-place put"))
    assert tensors.put_tensors_in_place(client, keys, blocks, chain=True) == [PutStatus.STORED] * 2
    assert client.lookup(keys).prefix == 2
    with pytest.raises(TensorLayoutError, match="contiguous"):
        tensors.put_tensors_in_place(client, keys[:1], [torch.zeros(KV_SHAPE[::-1]).transpose(0, 4)])
    with pytest.raises(KVPoolError, match="one tensor per key"):
        tensors.put_tensors_in_place(client, keys, blocks[:1])


@pytest.mark.gpu
@needs_cuda
def test_register_arena_pinned(client: PoolClient) -> None:
    assert not arena_tensor(client).is_pinned()
    assert register_arena_pinned(client) is True
    assert register_arena_pinned(client) is True  # idempotent
    arena = arena_tensor(client)
    assert arena.is_pinned()
    src = torch.arange(1 << 20, dtype=torch.int32, device="cuda").view(torch.uint8)
    arena[: src.numel()].copy_(src, non_blocking=True)  # device -> arena by DMA
    torch.cuda.synchronize()
    assert torch.equal(arena[: src.numel()], src.cpu())
    del arena
    assert unregister_arena_pinned(client) is True
    assert unregister_arena_pinned(client) is False


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_round_trip(client: PoolClient, dtype: Any) -> None:
    keys, blocks = keys_for("gpu", 4, dtype), [b.cuda() for b in kv_blocks(4, dtype, seed=3)]
    assert put_tensors(client, keys, blocks, chain=True) == [PutStatus.STORED] * 4  # copied to host first
    got = get_tensors(client, keys + keys_for("gpu-miss", 1, dtype)[:1], like=blocks[0])
    assert got[-1] is None
    for want, t in zip(blocks, got):
        assert t is not None and t.is_cuda and torch.equal(t, want)
    dests = [torch.zeros_like(b) for b in blocks] + [torch.zeros(KV_SHAPE, dtype=dtype)]
    got = get_tensors(client, keys + keys[:1], like=dests)  # CUDA and CPU destinations in one batch
    torch.cuda.synchronize()
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks))
    assert torch.equal(dests[-1], blocks[0].cpu())
    host = get_tensors(client, keys[:1], like=blocks[0], device="cpu")[0]
    assert host is not None and host.device.type == "cpu" and torch.equal(host, blocks[0].cpu())


@pytest.mark.gpu
@needs_cuda
def test_gpu_mixed_dtypes_and_odd_sizes_in_one_batch(client: PoolClient) -> None:
    g = torch.Generator().manual_seed(11)
    blocks = [torch.randint(-128, 128, (3, 5, 7), dtype=torch.int8, generator=g),  # 105 bytes
              torch.randn(4, 4, generator=g), torch.randn(3, 3, generator=g).to(torch.bfloat16)]
    keys = keys_for("mixed", 3)
    put_tensors(client, keys, blocks)
    dests = [torch.empty_like(b, device="cuda") for b in blocks]
    got = get_tensors(client, keys, like=dests)
    assert all(t is not None for t in got)
    assert all(torch.equal(d.cpu(), b) for d, b in zip(dests, blocks))


@pytest.mark.gpu
@needs_cuda
def test_gpu_in_place_reads_verify_in_the_arena_in_rounds_and_hold_until_copied(
        client: PoolClient, monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = torch.bfloat16
    keys, blocks = keys_for("in-place", 6, dtype), kv_blocks(6, dtype, seed=9)
    assert put_tensors(client, keys, blocks, chain=True) == [PutStatus.STORED] * 6
    assert register_arena_pinned(client)
    with client.acquire(keys[4:5]) as held:  # one block damaged in the arena, as a hostile writer could
        off = held.extents[0][0][0]
    arena = arena_tensor(client)
    arena[off] ^= 0xFF
    del arena
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * size)
    monkeypatch.setattr(tensors, "get_tensors", lambda *a, **k: pytest.fail("the in-place read staged the bytes"))
    calls = CountingGets(client, monkeypatch)
    dests = [torch.zeros(KV_SHAPE, dtype=dtype, device="cuda") for _ in keys]
    got = get_tensors_in_place(client, keys, dests)
    assert calls.acquires == 3 and calls.gets == 0
    assert got[4] is None
    assert all(t is not None and torch.equal(t.cpu(), b) for i, (t, b) in enumerate(zip(got, blocks)) if i != 4)
    assert client.remove(keys[:4]) == 4  # released: nothing of the read still holds them


@pytest.mark.gpu
@needs_cuda
def test_gpu_in_place_puts_dma_into_the_arena_and_checksum_there(client: PoolClient,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    dtype = torch.bfloat16
    keys, blocks = keys_for("put-in-place", 5, dtype), kv_blocks(5, dtype, seed=11)
    assert register_arena_pinned(client)
    size = blocks[0].numel() * blocks[0].element_size()
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * size)
    monkeypatch.setattr(tensors, "tensor_bytes", lambda *a: pytest.fail("the in-place put staged the bytes"))
    on_gpu = [b.to("cuda") for b in blocks]
    got = tensors.put_tensors_in_place(client, keys, on_gpu, chain=True)
    assert got == [PutStatus.STORED] * 5
    monkeypatch.undo()
    back = get_tensors(client, keys, like=blocks[0])  # a staged read verifies every checksum
    assert all(t is not None and torch.equal(t, b) for t, b in zip(back, blocks))
    assert tensors.put_tensors_in_place(client, keys[:1], on_gpu[:1]) == [PutStatus.EXISTS]
