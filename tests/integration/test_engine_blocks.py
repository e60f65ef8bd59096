"""Engine KV blocks through a real sidecar: saved from one paged cache, loaded into another,
byte for byte, in every vLLM layout; a missing block fails itself and every later one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.engines.blockio import BackgroundSaver, load_blocks, save_blocks
from kvpool_client.engines.paged import PagedLayout
from kvpool_client.engines.prefix import LoadSpec, Reconnecting
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, fresh_keys
from tests.unit.test_engine_paged import ORDERS, SHAPE, make_cache

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.integration, pytest.mark.torch]


def connector(sp: SidecarProcess) -> Callable[[], PoolClient]:
    return lambda: PoolClient(sp.socket_path, timeout=DEADLINE_S)


def save_then_load(sp: SidecarProcess, src: PagedLayout, dst: PagedLayout, src_ids: list[int],
                   dst_ids: list[int]) -> Reconnecting[PoolClient]:
    """Save ``src_ids`` of ``src`` through a background saver, load them into ``dst_ids`` of
    ``dst``; every block must arrive. The loading connection, still open."""
    keys = [k.raw for k in fresh_keys(len(src_ids))]
    saver = BackgroundSaver(connector(sp))
    try:
        assert saver.submit(src.gather(src_ids), keys, depth=0, parent=None)
        assert saver.flush(DEADLINE_S) and saver.stats.stored == len(keys)
    finally:
        saver.close()
    conn = Reconnecting(connector(sp))
    assert load_blocks(conn, dst, [LoadSpec("r", 0, [], dst_ids)], [keys]) == set()
    return conn


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_blocks_round_trip_through_the_sidecar_in_every_layout(sidecar: SidecarProcess, name: str) -> None:
    src = PagedLayout(make_cache(ORDERS[name]), SHAPE[1])
    dst_layers = make_cache(ORDERS[name], fill=False)
    dst = PagedLayout(dst_layers, SHAPE[1])
    keys = [k.raw for k in fresh_keys(4)]
    saver = BackgroundSaver(connector(sidecar))
    try:
        assert saver.submit(src.gather([1, 2]), keys[:2], depth=0, parent=None)
        assert saver.submit(src.gather([3, 4]), keys[2:], depth=2, parent=keys[1])
        assert saver.flush(DEADLINE_S)
        assert saver.stats.stored == 4 and saver.stats.failed == 0
    finally:
        saver.close()
    conn = Reconnecting(connector(sidecar))
    specs = [LoadSpec("r", 0, [], [6, 5, 0, 2])]  # other block ids than the source's
    assert load_blocks(conn, dst, specs, [keys]) == set()
    conn.close()
    assert torch.equal(dst.gather([6, 5, 0, 2]), src.gather([1, 2, 3, 4]))
    untouched = [b for b in range(SHAPE[1]) if b not in (6, 5, 0, 2)]
    assert not dst.gather(untouched).any()


def test_a_missing_block_fails_itself_and_every_later_block(sidecar: SidecarProcess) -> None:
    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(4)]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        rows = src.gather([0, 1, 2, 3])
        c.put([keys[0], keys[1], keys[3]], [bytes(rows[0].numpy()), bytes(rows[1].numpy()), bytes(rows[3].numpy())])
    conn = Reconnecting(connector(sidecar))
    failed = load_blocks(conn, dst, [LoadSpec("r", 0, [], [4, 5, 6, 0])], [keys])
    conn.close()
    assert failed == {6, 0}  # block 2 is missing: it and block 3 (held, but after it) recompute
    assert torch.equal(dst.gather([4, 5]), rows[:2])
    assert not dst.gather([6, 0]).any()


def test_a_block_of_another_size_is_never_loaded(sidecar: SidecarProcess) -> None:
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(1)]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        c.put(keys, [b"\x01" * (dst.block_bytes - 2)])
    conn = Reconnecting(connector(sidecar))
    assert load_blocks(conn, dst, [LoadSpec("r", 0, [], [3])], [keys]) == {3}
    conn.close()
    assert not dst.gather([3]).any()


def test_a_dead_sidecar_fails_the_loads_and_drops_nothing_silently(sidecar: SidecarProcess) -> None:
    dst = PagedLayout(make_cache(ORDERS["LBNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(2)]
    sidecar.stop()
    conn = Reconnecting(connector(sidecar))
    assert load_blocks(conn, dst, [LoadSpec("r", 0, [], [1, 2])], [keys]) == {1, 2}
    saver = BackgroundSaver(connector(sidecar))
    try:
        assert saver.submit(dst.gather([1, 2]), keys, depth=0, parent=None)
        assert saver.flush(DEADLINE_S)
        assert saver.stats.failed == 2 and saver.stats.stored == 0
    finally:
        saver.close()


def test_a_full_backlog_drops_saves_instead_of_waiting(sidecar: SidecarProcess) -> None:
    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    saver = BackgroundSaver(connector(sidecar), max_pending_bytes=src.block_bytes)
    try:
        keys = [k.raw for k in fresh_keys(3)]
        accepted = [saver.submit(src.gather([i]), [keys[i]], depth=i, parent=None) for i in range(3)]
        assert saver.flush(DEADLINE_S)
        assert accepted[0] and saver.stats.dropped == accepted.count(False)
        assert saver.stats.stored + saver.stats.dropped == 3
    finally:
        saver.close()


@pytest.mark.gpu
def test_a_save_that_fails_unforeseen_does_not_end_the_saves_after_it(sidecar: SidecarProcess) -> None:
    """An error no save expects (here the first connection's, which is not a KVPoolError) fails
    that save alone: it had ended the saver's thread, and every later save was accepted,
    queued and never stored."""
    src = PagedLayout(make_cache(ORDERS["LBHNC"]), SHAPE[1])
    calls = 0

    def connect() -> PoolClient:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise MemoryError("no room for the arena")
        return PoolClient(sidecar.socket_path, timeout=DEADLINE_S)

    keys = [k.raw for k in fresh_keys(2)]
    saver = BackgroundSaver(connect)
    try:
        assert saver.submit(src.gather([1]), keys[:1], depth=0, parent=None)
        assert saver.flush(DEADLINE_S) and saver.stats.failed == 1
        assert saver.submit(src.gather([2]), keys[1:], depth=0, parent=None)
        assert saver.flush(DEADLINE_S) and saver.stats.stored == 1
    finally:
        saver.close()


def test_blocks_round_trip_between_cuda_caches(sidecar: SidecarProcess) -> None:
    """On a GPU: saves copy device -> pinned host off the forward path; loads DMA straight
    from the pinned-registered arena into device rows, then scatter on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for name in ("BLNHC", "LBNHC"):
        src = PagedLayout([t.cuda() for t in make_cache(ORDERS[name])], SHAPE[1])
        dst = PagedLayout([t.cuda() for t in make_cache(ORDERS[name], fill=False)], SHAPE[1])
        save_then_load(sidecar, src, dst, [0, 4, 6], [1, 2, 3]).close()
        assert torch.equal(dst.gather([1, 2, 3]).cpu(), src.gather([0, 4, 6]).cpu())


def test_blocks_load_inline_where_no_arena_is_mapped(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    """A node that maps no arena into clients (``api.shared_arena: never``): loads read inline."""
    sp = sidecar_factory({"api": {"shared_arena": "never"}, "tenants": [{"name": "default"}, {"name": "other"}]})
    src = PagedLayout(make_cache(ORDERS["LBNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["LBNHC"], fill=False), SHAPE[1])
    conn = save_then_load(sp, src, dst, [0, 1, 2], [4, 5, 6])
    assert not conn.call(lambda c: c.shm)
    conn.close()
    assert torch.equal(dst.gather([4, 5, 6]), src.gather([0, 1, 2]))


def test_a_load_in_rounds_fails_a_damaged_block_and_its_tail_and_holds_nothing_after(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool_client import tensors
    from kvpool_client.client import HeldBlocks

    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(6)]
    rows = src.gather([0, 1, 2, 3, 4, 5])
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        c.put(keys, [bytes(r.numpy()) for r in rows])
        with c.acquire(keys[1:2]) as held:  # block 1 damaged in the arena, as a hostile writer of the space could
            off = held.extents[0][0][0]  # type: ignore[index]
        arena = tensors.arena_tensor(c)
        arena[off] ^= 0xFF
        del arena
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * src.block_bytes)  # three rounds of two blocks
    acquired: list[int] = []
    released: list[int] = []
    acquire, release = PoolClient.acquire, HeldBlocks.release
    monkeypatch.setattr(PoolClient, "acquire", lambda self, ks, *a: acquired.append(len(ks)) or acquire(self, ks, *a))
    monkeypatch.setattr(HeldBlocks, "release", lambda self: released.append(len(self)) or release(self))
    conn = Reconnecting(connector(sidecar))
    specs = [LoadSpec("a", 0, [], [6, 5, 4]), LoadSpec("b", 0, [], [3, 2, 1])]
    failed = load_blocks(conn, dst, specs, [keys[:3], keys[3:]])
    conn.close()
    assert acquired == [2, 2, 2] and released == [2, 2, 2]  # every round let go by the return
    assert failed == {5, 4}  # request a: its block 1 is damaged, block 2 comes after it
    assert torch.equal(dst.gather([6, 3, 2, 1]), rows[[0, 3, 4, 5]])
    assert not dst.gather([5, 4]).any()


def test_a_load_in_rounds_ends_by_one_deadline_and_gives_back_what_it_held(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sidecar slow to answer had held a load ``timeout_s`` per round. Past the load's one
    deadline no further round is asked for, every block is recomputed, and the rounds
    already acquired are released."""
    from kvpool_client import tensors
    from kvpool_client.client import HeldBlocks

    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(6)]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        c.put(keys, [bytes(r.numpy()) for r in src.gather([0, 1, 2, 3, 4, 5])])
    monkeypatch.setattr(tensors, "ROUND_BYTES", 2 * src.block_bytes)  # three rounds of two blocks
    acquired: list[int] = []
    released: list[int] = []
    acquire, release = PoolClient.acquire, HeldBlocks.release

    def slow_acquire(self: PoolClient, ks: list[bytes], *sizes: Any) -> HeldBlocks:
        held = acquire(self, ks, *sizes)
        acquired.append(len(ks))
        if self._cap is not None:  # noqa: SLF001 - the round took the whole time the load was given
            self._cap = time.monotonic() - 1  # noqa: SLF001
        return held

    monkeypatch.setattr(PoolClient, "acquire", slow_acquire)
    monkeypatch.setattr(HeldBlocks, "release", lambda self: released.append(len(self)) or release(self))
    conn = Reconnecting(connector(sidecar))
    failed = load_blocks(conn, dst, [LoadSpec("a", 0, [], [6, 5, 4, 3, 2, 1])], [keys])
    conn.close()
    assert acquired == [2] and released == [2]  # no second round asked; the first let go
    assert failed == {6, 5, 4, 3, 2, 1}
    assert not dst.gather([6, 5, 4, 3, 2, 1]).any()
    monkeypatch.setattr(PoolClient, "acquire", acquire)
    conn = Reconnecting(connector(sidecar))  # the same load without the slow rounds: all of it arrives
    assert load_blocks(conn, dst, [LoadSpec("a", 0, [], [6, 5, 4, 3, 2, 1])], [keys]) == set()
    conn.close()
    assert torch.equal(dst.gather([6, 5, 4, 3, 2, 1]), src.gather([0, 1, 2, 3, 4, 5]))


def test_a_load_that_runs_out_of_device_memory_is_recomputed_not_a_dead_worker(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a step's loads land in are allocated on the device at once: out of memory
    there (torch's RuntimeError) had escaped into the engine's step and ended the worker."""
    from kvpool_client.engines import blockio

    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(2)]
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        c.put(keys, [bytes(r.numpy()) for r in src.gather([0, 1])])

    def out_of_memory(*args: object) -> None:
        raise RuntimeError("CUDA out of memory. Tried to allocate 3.90 GiB")

    monkeypatch.setattr(blockio, "_read_in_place", out_of_memory)
    conn = Reconnecting(connector(sidecar))
    assert load_blocks(conn, dst, [LoadSpec("r", 0, [], [4, 5])], [keys]) == {4, 5}
    conn.close()


def test_a_large_load_stages_a_batch_at_a_time_and_a_broken_block_fails_the_rest_across_batches(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's loads had been staged in device rows all at once (4 GiB for a 32k-token prompt
    of an 8B model, on top of the KV cache). They go a batch of ``stage_bytes`` at a time; a
    request's blocks still load up to its first bad one, across batches."""
    from kvpool_client.engines import blockio

    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    dst = PagedLayout(make_cache(ORDERS["BLNHC"], fill=False), SHAPE[1])
    keys = [k.raw for k in fresh_keys(7)]
    rows = src.gather([0, 1, 2, 3, 4, 5, 6])
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        held = [i for i in range(7) if i != 1]  # request a's second block is missing
        c.put([keys[i] for i in held], [bytes(rows[i].numpy()) for i in held])
    staged: list[int] = []
    read = blockio._read_in_place  # noqa: SLF001
    monkeypatch.setattr(blockio, "_read_in_place",
                        lambda tc, client, layout, flat, on: staged.append(len(flat)) or read(tc, client, layout, flat, on))
    conn = Reconnecting(connector(sidecar))
    specs = [LoadSpec("a", 0, [], [6, 5, 4]), LoadSpec("b", 0, [], [3, 2, 1, 0])]
    failed = load_blocks(conn, dst, specs, [keys[:3], keys[3:]], stage_bytes=2 * src.block_bytes)
    conn.close()
    assert staged == [2, 2, 2, 1]
    assert failed == {5, 4}  # a's block 1 is missing; block 2, in the next batch, comes after it
    assert torch.equal(dst.gather([6, 3, 2, 1, 0]), rows[[0, 3, 4, 5, 6]])
    assert not dst.gather([5, 4]).any()


def test_a_large_save_is_gathered_a_batch_at_a_time_and_stops_where_the_backlog_is_full(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's saves had been gathered on the device all at once. They go a batch at a time,
    each checked against the backlog before it is gathered; where one has no room, it and
    every later one are not gathered, and the caller is told how many went."""
    src = PagedLayout(make_cache(ORDERS["BLNHC"]), SHAPE[1])
    keys = [k.raw for k in fresh_keys(5)]
    gathered: list[int] = []
    gather = PagedLayout.gather
    monkeypatch.setattr(PagedLayout, "gather", lambda self, ids, out=None: gathered.append(len(ids)) or gather(self, ids, out))
    saver = BackgroundSaver(connector(sidecar))
    try:
        assert save_blocks(saver, src, [0, 1, 2, 3, 4], keys, depth=0, parent=None,
                           stage_bytes=2 * src.block_bytes) == 5
        assert saver.flush(DEADLINE_S) and saver.stats.stored == 5 and gathered == [2, 2, 1]
    finally:
        saver.close()
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.lookup(keys).prefix == 5  # one chain, batch after batch
        got = c.get(keys)
    assert all(bytes(g) == bytes(r.numpy()) for g, r in zip(got, src.gather([0, 1, 2, 3, 4])))  # type: ignore[arg-type]

    gathered.clear()
    saver = BackgroundSaver(connector(sidecar), max_pending_bytes=4 * src.block_bytes)
    try:
        others = [k.raw for k in fresh_keys(5)]
        assert saver.submit(src.gather([0]), others[:1], depth=0, parent=None, hold=7)  # held: a block of room taken
        gathered.clear()
        assert save_blocks(saver, src, [1, 2, 3, 4], others[1:], depth=1, parent=others[0],
                           stage_bytes=2 * src.block_bytes) == 2
        assert gathered == [2]  # the second batch was not gathered: no room for it
        assert saver.stats.dropped == 2
    finally:
        saver.close()
