"""The fused copies' machinery: copies at any distance within a page (the slow ones through
the bounce buffer), batches shared over threads, and the buffers a copy may never write."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_client import integrity
from kvpool_client.integrity import (
    PAGE,
    address,
    checksum_many,
    checksums_until,
    copy_many,
    copy_with_checksum,
    gather_many,
    gather_with_checksum,
    landing,
    slow_skew,
)

SIZE = 3 * PAGE + 123


@pytest.fixture
def pages() -> Iterator[tuple[memoryview, memoryview]]:
    """Two page-aligned regions, to place a source and a destination at chosen offsets."""
    a, b = mmap.mmap(-1, 8 * PAGE), mmap.mmap(-1, 8 * PAGE)
    va, vb = memoryview(a), memoryview(b)
    yield va, vb
    va.release()
    vb.release()
    a.close()
    b.close()


@pytest.fixture
def bounces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the copies that went through the bounce buffer; small chunks cross boundaries.
    (Shared by the examples of a hypothesis test: each clears it first.)"""
    seen: list[int] = []
    near = integrity._Bounce.near

    def spy(self: integrity._Bounce, src: int) -> int:
        seen.append(src)
        return near(self, src)

    monkeypatch.setattr(integrity._Bounce, "near", spy)
    monkeypatch.setattr(integrity, "BOUNCE_CHUNK", 1000)
    monkeypatch.setattr(integrity, "CHUNK", 3000)
    return seen


def test_address_is_the_first_byte_and_a_read_only_buffer_is_never_a_destination() -> None:
    raw = bytearray(b"\0" * 64)
    view = memoryview(raw)
    assert address(view[10:]) == address(view) + 10
    with pytest.raises(BufferError):
        address(memoryview(b"immutable"), writable=True)
    with pytest.raises(BufferError):
        address(view[::2])  # not contiguous: never copied by address


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, PAGE - 1), st.integers(0, PAGE - 1))
def test_copies_are_right_at_every_distance_and_bounce_exactly_when_slow(
        pages: tuple[memoryview, memoryview], bounces: list[int], src_off: int, dst_off: int) -> None:
    a, b = pages
    data = os.urandom(SIZE)
    src = a[src_off : src_off + SIZE]
    src[:] = data
    slow = slow_skew(address(b) + dst_off, address(src))
    assert slow == (0 < (dst_off - src_off) % PAGE < integrity.SLOW_SKEW)
    bounces.clear()
    dst = b[dst_off : dst_off + SIZE]
    assert gather_with_checksum(dst, [src[:100], src[100:]]) == xxhash.xxh3_64_intdigest(data)
    assert bytes(dst) == data
    assert bool(bounces) == slow
    bounces.clear()
    dst[:] = bytes(SIZE)
    assert copy_with_checksum([dst[:5000], dst[5000:]], src) == xxhash.xxh3_64_intdigest(data)
    assert bytes(dst) == data
    assert bool(bounces) == slow


def test_a_size_mismatch_copies_nothing() -> None:
    dst = bytearray(10)
    with pytest.raises(ValueError):
        gather_with_checksum(memoryview(dst), [memoryview(b"x" * 11)])
    with pytest.raises(ValueError):
        copy_with_checksum([memoryview(dst)], memoryview(b"y" * 9))
    assert dst == bytearray(10)
    with pytest.raises(BufferError):
        gather_with_checksum(memoryview(b"z" * 4), [memoryview(b"1234")])


@pytest.mark.parametrize("threads", [1, 3])
def test_batches_give_each_blocks_own_result_in_order(monkeypatch: pytest.MonkeyPatch, threads: int) -> None:
    monkeypatch.setattr(integrity, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(integrity, "PARALLEL_BLOCK", 1)
    monkeypatch.setattr(integrity, "COPY_THREADS", threads)
    monkeypatch.setattr(integrity, "_pool", None)
    blocks = [os.urandom(n) for n in (70_000, 1, 300_000, 5, 0, 150_000)]
    outs = [landing(len(b)) for b in blocks]
    sums = gather_many([(o, [memoryview(b)]) for o, b in zip(outs, blocks)])
    assert sums == [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert [bytes(o) for o in outs] == blocks
    assert checksum_many([[o] for o in outs]) == sums
    dsts = [bytearray(len(b)) for b in blocks]
    assert copy_many([([memoryview(d)], memoryview(b)) for d, b in zip(dsts, blocks)]) == sums
    assert [bytes(d) for d in dsts] == blocks


def test_blocks_are_hashed_ahead_in_order_until_told_to_stop() -> None:
    blocks = [memoryview(os.urandom(n)) for n in (5000, 1, 70_000, 300)]
    asked: list[int] = []

    def done_after(k: int) -> Any:
        def done() -> bool:
            asked.append(1)
            return len(asked) > k
        return done

    want = [xxhash.xxh3_64_intdigest(b) for b in blocks]
    assert checksums_until(blocks, done_after(10), every=1) == want
    asked.clear()
    assert checksums_until(blocks, done_after(2), every=1) == want[:2] + [None, None]
    asked.clear()
    assert checksums_until(blocks, done_after(0)) == [None] * 4  # asked before the first block
    asked.clear()
    # asked once per `every` bytes hashed: 5,001 bytes go before the second question
    assert checksums_until(blocks, done_after(1), every=5001) == want[:2] + [None, None]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_block_hashed_ahead_is_copied_whole_and_keeps_its_checksum(
        monkeypatch: pytest.MonkeyPatch, pages: tuple[memoryview, memoryview], threads: int) -> None:
    monkeypatch.setattr(integrity, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(integrity, "PARALLEL_BLOCK", 1)
    monkeypatch.setattr(integrity, "COPY_THREADS", threads)
    monkeypatch.setattr(integrity, "_pool", None)
    a, b = pages
    a[: 4 * PAGE] = os.urandom(4 * PAGE)
    # the same source into a skewed destination (the bounce path) and an aligned one, split
    src = a[5 : 5 + SIZE]
    one, two, three = b[8 : 8 + SIZE], b[4 * PAGE : 4 * PAGE + 100], b[4 * PAGE + 200 : 4 * PAGE + 100 + SIZE]
    jobs = [([one], src), ([two, three], src)]
    try:
        hashed = copy_many(jobs, [1234, None])
        assert hashed == [1234, xxhash.xxh3_64_intdigest(src)]  # a checksum given is not recomputed
        assert bytes(one) == bytes(src)
        assert bytes(two) + bytes(three) == bytes(src)
        with pytest.raises(ValueError):
            copy_many(jobs, [None])
    finally:
        for v in (src, one, two, three):
            v.release()


def test_groups_share_a_big_batch_by_bytes_and_keep_a_small_one_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "COPY_THREADS", 2)
    small = integrity._groups([1000] * 4)
    assert small == [[0, 1, 2, 3]]
    halves = 2 * integrity.PARALLEL_BYTES // integrity.PARALLEL_BLOCK
    assert len(integrity._groups([integrity.PARALLEL_BLOCK // 2] * halves)) == 1  # blocks too small
    big = integrity._groups([integrity.PARALLEL_BYTES] * 3 + [1])
    assert sorted(i for g in big for i in g) == [0, 1, 2, 3] and len(big) == 2


def test_a_failing_block_fails_the_batch_after_every_helper_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(integrity, "PARALLEL_BLOCK", 1)
    monkeypatch.setattr(integrity, "COPY_THREADS", 2)
    monkeypatch.setattr(integrity, "COPY_THREADS", 3)
    monkeypatch.setattr(integrity, "_pool", None)
    good = [bytearray(1000) for _ in range(4)]
    jobs = [(memoryview(g), [memoryview(b"a" * 1000)]) for g in good]
    jobs.insert(2, (memoryview(bytearray(5)), [memoryview(b"b" * 6)]))  # the second group's, in a helper
    with pytest.raises(ValueError):
        gather_many(jobs)
    assert good[3] == bytearray(b"a" * 1000)  # the third group's helper finished first


def test_a_forked_child_copies_a_batch_with_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(integrity, "PARALLEL_BLOCK", 1)
    monkeypatch.setattr(integrity, "COPY_THREADS", 2)
    blocks = [os.urandom(50_000) for _ in range(4)]
    gather_many([(landing(len(b)), [memoryview(b)]) for b in blocks])  # the parent's helpers exist
    pid = os.fork()
    if pid == 0:  # the child: a hang here is the bug (the parent's threads are not in it)
        signal.alarm(30)  # which the alarm turns into a failed exit
        outs = [landing(len(b)) for b in blocks]
        ok = gather_many([(o, [memoryview(b)]) for o, b in zip(outs, blocks)]) == [
            xxhash.xxh3_64_intdigest(b) for b in blocks] and [bytes(o) for o in outs] == blocks
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_landing_is_page_aligned_from_128k() -> None:
    assert address(landing(32 * PAGE)) % PAGE == 0
    assert landing(100).nbytes == 100 and not landing(100).readonly


def test_copy_threads_are_set_at_run_time_and_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "COPY_THREADS", integrity.COPY_THREADS)
    monkeypatch.setattr(integrity, "_pool", None)
    with pytest.raises(ValueError, match="at least 1"):
        integrity.set_copy_threads(0)
    integrity.set_copy_threads(1)
    assert integrity._helpers() == (None, 1)  # the caller's thread alone: no pool at all
    integrity.set_copy_threads(3)
    first, threads = integrity._helpers()
    assert threads == 3 and first is not None and first._max_workers == 2
    integrity.set_copy_threads(5)  # new helpers, as many as asked; the old ones are not shut down
    second, threads = integrity._helpers()
    assert second is not first and threads == 5 and second is not None and second._max_workers == 4
    assert first.submit(lambda: 7).result() == 7  # a batch that still holds the old helpers finishes
    code = "import kvpool_client.integrity as i; print(i.COPY_THREADS)"
    env = {**os.environ, "KVPOOL_COPY_THREADS": "7"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "7"
    for bad in ("0", "two", "\u0663"):  # a bad value is said and the default used: a sidecar still starts
        r = subprocess.run([sys.executable, "-c", code], env={**env, "KVPOOL_COPY_THREADS": bad},
                           capture_output=True, text=True, check=True)
        assert int(r.stdout) == min(8, len(os.sched_getaffinity(0)))
        assert "KVPOOL_COPY_THREADS must be a whole number of at least 1" in r.stderr



@pytest.mark.parametrize(("cpu_max", "want"), [("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None),
                                               ("garbage\n", None), (None, None)])
def test_a_cpu_limit_counts_among_the_cpus_a_process_may_use(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                              cpu_max: str | None, want: int | None) -> None:
    """A pod limited by CPU quota (cgroup v2 ``cpu.max``), not by a cpuset, sees every core in
    its affinity mask: its quota, rounded up, is what it may use."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    monkeypatch.setattr(integrity, "CPU_MAX_PATH", str(path))
    assert integrity.cpus() == (16 if want is None else want)
