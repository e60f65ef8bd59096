"""The page allocator and the DRAM tier over a real (small) shared arena."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvpool_sidecar.errors import TierError, UnknownSpaceError
from kvpool_sidecar.tiers import alloc
from kvpool_sidecar.tiers.alloc import PageAllocator, Run
from kvpool_sidecar.tiers.dram import DramTier, SharedArena

PAGE = 4096


def pages_of(runs: list[Run]) -> int:
    return sum(n for _, n in runs)


def mark(bitmap: bytearray, runs: list[Run]) -> None:
    """Set the pages of ``runs``; fails if any is already set (an overlap)."""
    for start, n in runs:
        assert n > 0
        assert 0 <= start and start + n <= len(bitmap)
        for p in range(start, start + n):
            assert not bitmap[p], f"page {p} handed out twice"
            bitmap[p] = 1


def unmark(bitmap: bytearray, runs: list[Run]) -> None:
    for start, n in runs:
        for p in range(start, start + n):
            assert bitmap[p]
            bitmap[p] = 0


# ------------------------------------------------------------------------ allocator
def test_allocate_and_free_account_exactly() -> None:
    a = PageAllocator(100)
    r1 = a.allocate(30)
    r2 = a.allocate(50)
    assert r1 == [(0, 30)] and r2 == [(30, 50)]
    assert a.free_pages == 20
    assert a.allocate(21) is None
    assert a.free_pages == 20
    r3 = a.allocate(20)
    assert r3 == [(80, 20)] and a.free_pages == 0
    assert a.allocate(1) is None
    a.free(r2)
    assert a.free_pages == 50 and a.free_runs == 1
    a.free(r1)
    a.free(r3)
    assert a.free_pages == 100 and a.free_runs == 1
    assert a.allocate(100) == [(0, 100)]


def test_best_fit_picks_the_smallest_run_that_fits() -> None:
    a = PageAllocator(100)
    blocks = [a.allocate(n) for n in (10, 1, 5, 1, 20, 1, 62)]
    assert all(b is not None for b in blocks)
    # Free runs of 10, 5 and 20 pages, separated by live single pages.
    a.free(blocks[0])  # (0, 10)
    a.free(blocks[2])  # (11, 5)
    a.free(blocks[4])  # (17, 20)
    assert a.free_runs == 3
    assert a.allocate(4) == [(11, 4)]  # 5-run is the best fit
    assert a.allocate(6) == [(0, 6)]  # 10-run next
    assert a.allocate(15) == [(17, 15)]  # only the 20-run fits contiguously
    assert a.free_pages == 1 + 4 + 5


def test_scatter_when_no_run_is_large_enough() -> None:
    a = PageAllocator(10)
    blocks = [a.allocate(1) for _ in range(10)]
    for b in blocks[::2]:
        a.free(b)  # five free single pages
    assert a.free_runs == 5
    got = a.allocate(5)
    assert got is not None and pages_of(got) == 5
    assert sorted(got) == got
    assert {s for s, _ in got} == {0, 2, 4, 6, 8}
    assert a.free_pages == 0


def test_scatter_prefers_large_runs_and_leaves_the_rest_free() -> None:
    a = PageAllocator(20)
    blocks = [a.allocate(n) for n in (2, 1, 6, 1, 4, 1, 5)]
    for i in (0, 2, 4):
        a.free(blocks[i])  # free runs of 2, 6 and 4 pages
    got = a.allocate(9)
    assert got is not None and pages_of(got) == 9
    assert (2 + 1, 6) in got  # the whole 6-run
    assert a.free_pages == 3


def test_a_block_is_gathered_from_at_most_max_runs_runs() -> None:
    """One-page holes alternating with live pages: a block is gathered from at most
    ``MAX_RUNS`` of them, and one that would need more is refused with nothing taken (it had
    been gathered from one extent a page: 4,096 of them for a 256 MiB block, each a step of
    the event loop to gather, map and free)."""
    cap = alloc.MAX_RUNS
    a = PageAllocator(4 * cap)
    singles = [a.allocate(1) for _ in range(4 * cap)]
    for b in singles[::2]:
        assert b is not None
        a.free(b)  # 2 * cap one-page holes
    assert a.free_runs == 2 * cap and a.free_pages == 2 * cap
    assert a.allocate(cap + 1) is None  # before: cap + 1 runs of one page
    assert a.free_runs == 2 * cap and a.free_pages == 2 * cap  # nothing taken
    got = a.allocate(cap)
    assert got is not None and len(got) == cap and pages_of(got) == cap
    assert a.allocate(4, max_runs=3) is None and a.allocate(3, max_runs=3) is not None


def test_a_refused_block_fits_once_the_pages_beside_the_holes_are_freed() -> None:
    """Freeing the live pages between holes (what eviction does) merges them into runs long
    enough for a block the cap refused."""
    a = PageAllocator(64)
    singles = [a.allocate(1) for _ in range(64)]
    for b in singles[::2]:
        assert b is not None
        a.free(b)
    assert a.allocate(12, max_runs=4) is None
    for b in singles[1:12:2]:  # pages 1, 3, ... 11: one run of pages 0-12
        assert b is not None
        a.free(b)
    got = a.allocate(12, max_runs=4)
    assert got == [(0, 12)]


def free_run_lengths(bitmap: bytearray) -> list[int]:
    """The lengths of the free runs of ``bitmap`` (0: free), longest first."""
    runs: list[int] = []
    n = 0
    for used in [*bitmap, 1]:
        if used:
            if n:
                runs.append(n)
            n = 0
        else:
            n += 1
    return sorted(runs, reverse=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_block_is_refused_exactly_when_its_largest_runs_fall_short(seed: int) -> None:
    """Under random churn, a block of ``n`` pages capped at ``k`` runs is allocated exactly
    when the ``k`` longest free runs hold ``n`` pages, in at most ``k`` runs."""
    rnd = random.Random(seed)
    total = 512
    a = PageAllocator(total)
    bitmap = bytearray(total)
    live: list[list[Run]] = []
    for _ in range(3000):
        if live and (rnd.random() < 0.5 or a.free_pages < 8):
            runs = live.pop(rnd.randrange(len(live)))
            unmark(bitmap, runs)
            a.free(runs)
            continue
        n, k = rnd.randint(1, 48), rnd.randint(1, 12)
        fits = sum(free_run_lengths(bitmap)[:k]) >= n
        got = a.allocate(n, max_runs=k)
        assert (got is not None) == fits
        if got is not None:
            assert pages_of(got) == n and len(got) <= k
            mark(bitmap, got)
            live.append(got)
        assert a.free_pages == total - sum(bitmap) and a.free_runs == len(free_run_lengths(bitmap))


@pytest.mark.parametrize("pages", [0, -1])
def test_allocate_needs_a_positive_count(pages: int) -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(pages)


def test_allocator_needs_pages() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)


def test_double_free_raises() -> None:
    a = PageAllocator(8)
    r = a.allocate(3)
    assert r is not None
    a.free(r)
    with pytest.raises(ValueError):
        a.free(r)
    assert a.free_pages == 8


def test_double_free_inside_a_coalesced_run_raises() -> None:
    a = PageAllocator(6)
    runs = [a.allocate(2) for _ in range(3)]
    for r in runs:
        assert r is not None
        a.free(r)
    assert a.free_runs == 1
    with pytest.raises(ValueError):
        a.free(runs[1])  # (2, 2): neither end touches the free run's ends
    assert a.free_pages == 6 and a.free_runs == 1


@pytest.mark.parametrize("bad", [[(0, 5)], [(2, 1)], [(1, 2)], [(8, 3)], [(9, 1)], [(10, 2)]])
def test_partial_overlap_with_free_space_raises(bad: list[Run]) -> None:
    a = PageAllocator(12)
    r = a.allocate(12)
    assert r is not None
    a.free([(2, 1), (9, 2)])  # pages 2 and 9-10 free
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.free_pages == 3


def test_failed_free_keeps_the_accounts_consistent() -> None:
    a = PageAllocator(10)
    r = a.allocate(10)
    assert r is not None
    a.free([(0, 2)])
    with pytest.raises(ValueError):
        a.free([(5, 2), (1, 1)])  # the first run is valid, the second is already free
    # The valid run was freed and counted; nothing else changed.
    assert a.free_pages == 4
    rest = a.allocate(4)
    assert rest is not None and sorted(rest) == [(0, 2), (5, 2)]
    assert a.free_pages == 0


@pytest.mark.parametrize("bad", [(-1, 1), (0, 0), (3, -1), (9, 2), (10, 1)])
def test_out_of_range_free_raises(bad: Run) -> None:
    a = PageAllocator(10)
    assert a.allocate(10) is not None
    with pytest.raises(ValueError):
        a.free([bad])
    assert a.free_pages == 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_churn_never_overlaps_or_fragments_away(seed: int) -> None:
    rnd = random.Random(seed)
    total = 1024
    a = PageAllocator(total)
    bitmap = bytearray(total)
    live: list[list[Run]] = []
    for _ in range(4000):
        if live and (rnd.random() < 0.45 or a.free_pages < 16):
            runs = live.pop(rnd.randrange(len(live)))
            unmark(bitmap, runs)
            a.free(runs)
        else:
            n = rnd.randint(1, 64)
            free_before = a.free_pages
            got = a.allocate(n)
            if got is None:
                assert n > free_before, f"allocate({n}) failed with {free_before} pages free"
                continue
            assert pages_of(got) == n
            mark(bitmap, got)
            live.append(got)
        assert a.free_pages + sum(pages_of(r) for r in live) == total
        assert a.free_pages == total - sum(bitmap)
    for runs in live:
        a.free(runs)
    assert a.free_pages == total and a.free_runs == 1
    assert a.allocate(total) == [(0, total)]


class AllocatorMachine(RuleBasedStateMachine):
    """Mixed sizes 1..64 over a small arena; every invariant checked after every step."""

    TOTAL = 256
    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.a = PageAllocator(self.TOTAL)
        self.bitmap = bytearray(self.TOTAL)
        self.live: dict[int, list[Run]] = {}
        self.ids = iter(range(10**9))

    @rule(target=blocks, n=st.integers(1, 64))
    def allocate(self, n: int) -> int:
        free_before = self.a.free_pages
        got = self.a.allocate(n)
        if got is None:
            assert n > free_before
            return -1
        assert pages_of(got) == n
        mark(self.bitmap, got)
        i = next(self.ids)
        self.live[i] = got
        return i

    @rule(i=consumes(blocks))
    def free(self, i: int) -> None:
        runs = self.live.pop(i, None)
        if runs is None:
            return
        unmark(self.bitmap, runs)
        self.a.free(runs)

    @rule(i=blocks)
    def double_free(self, i: int) -> None:
        if i in self.live:
            return
        # ``i`` was freed (or never allocated): freeing any page that is free must fail.
        free_pages = [p for p, used in enumerate(self.bitmap) if not used]
        if free_pages:
            with pytest.raises(ValueError):
                self.a.free([(free_pages[0], 1)])

    @invariant()
    def accounts(self) -> None:
        assert self.a.free_pages + sum(pages_of(r) for r in self.live.values()) == self.TOTAL
        assert self.a.free_pages == self.TOTAL - sum(self.bitmap)

    def teardown(self) -> None:
        for runs in self.live.values():
            self.a.free(runs)
        assert self.a.free_pages == self.TOTAL and self.a.free_runs == 1


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=80, deadline=None)


# ------------------------------------------------------------------------ DRAM tier
@pytest.fixture
def arena() -> Iterator[SharedArena]:
    a = SharedArena(16 * PAGE, populate=False)
    yield a
    a.close()


@pytest.mark.parametrize("size", [1, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 17, 16 * PAGE])
def test_dram_extents_cover_exactly_size_bytes(arena: SharedArena, size: int) -> None:
    t = DramTier(16 * PAGE, PAGE, arena)
    ext = t.allocate(size)
    assert ext is not None
    assert sum(n for _, n in ext) == size
    assert all(off % PAGE == 0 for off, _ in ext)
    assert t.used_bytes == t.footprint(size) == -(-size // PAGE) * PAGE
    assert t.free_bytes == 16 * PAGE - t.used_bytes
    t.free(ext)
    assert t.used_bytes == 0 and t.free_bytes == 16 * PAGE and t.fragments == 1


def test_dram_scattered_extents_cover_exactly_size_bytes(arena: SharedArena) -> None:
    t = DramTier(16 * PAGE, PAGE, arena)
    singles = [t.allocate(PAGE) for _ in range(16)]
    assert t.allocate(1) is None
    for e in singles[::2]:
        assert e is not None
        t.free(e)
    size = 5 * PAGE + 100
    ext = t.allocate(size)
    assert ext is not None and len(ext) == 6
    assert sum(n for _, n in ext) == size
    assert all(n == PAGE for _, n in ext[:-1]) and ext[-1][1] == 100
    t.free(ext)
    assert t.free_bytes == 8 * PAGE


def test_dram_views_read_and_write_the_arena(arena: SharedArena) -> None:
    t = DramTier(16 * PAGE, PAGE, arena)
    filler = [t.allocate(PAGE) for _ in range(16)]
    for e in filler[1::2]:
        assert e is not None
        t.free(e)
    size = 3 * PAGE + 5
    ext = t.allocate(size)
    assert ext is not None and len(ext) > 1
    payload = random.Random(7).randbytes(size)
    pos = 0
    for v in t.views(ext):
        v[:] = payload[pos : pos + v.nbytes]
        pos += v.nbytes
    # The bytes are in the arena at the extents' offsets, in order.
    assert b"".join(bytes(arena.view[off : off + n]) for off, n in ext) == payload
    assert b"".join(bytes(v) for v in t.views(ext)) == payload
    # A write through the arena shows in the views (the same memory).
    arena.view[ext[0][0]] ^= 0xFF
    assert t.views(ext)[0][0] == payload[0] ^ 0xFF


def test_dram_accounting_only_mode_has_no_views() -> None:
    t = DramTier(16 * PAGE, PAGE, None)
    ext = t.allocate(PAGE + 1)
    assert ext is not None and t.used_bytes == 2 * PAGE
    with pytest.raises(TierError):
        t.views(ext)


def test_dram_tier_rejects_bad_sizes(arena: SharedArena) -> None:
    with pytest.raises(ValueError):
        DramTier(PAGE - 1, PAGE)
    with pytest.raises(ValueError):
        DramTier(16 * PAGE, 0)
    with pytest.raises(ValueError):
        DramTier(32 * PAGE, PAGE, arena)  # the arena is smaller
    t = DramTier(16 * PAGE, PAGE, arena)
    with pytest.raises(ValueError):
        t.allocate(0)
    assert t.allocate(16 * PAGE + 1) is None


def test_dram_double_free_raises(arena: SharedArena) -> None:
    t = DramTier(16 * PAGE, PAGE, arena)
    ext = t.allocate(2 * PAGE)
    assert ext is not None
    t.free(ext)
    with pytest.raises(ValueError):
        t.free(ext)
    assert t.used_bytes == 0


# --------------------------------------------------------------- one arena per key space
@pytest.fixture
def arenas() -> Iterator[list[SharedArena]]:
    made = [SharedArena(16 * PAGE, populate=False) for _ in range(2)]
    yield made
    for a in made:
        a.close()


def _fill(t: DramTier, ext: list[tuple[int, int]], byte: int) -> None:
    for v in t.views(ext):
        v[:] = bytes([byte]) * v.nbytes


def _arena_bytes(a: SharedArena, ext: list[tuple[int, int]]) -> bytes:
    return b"".join(bytes(a.view[off : off + n]) for off, n in ext)


def test_each_key_space_has_its_own_arena(arenas: list[SharedArena]) -> None:
    t = DramTier(16 * PAGE, PAGE, arenas, {"a": 0, "b": 1})
    ea, eb = t.allocate(3 * PAGE, "a"), t.allocate(2 * PAGE + 9, "b")
    assert ea is not None and eb is not None
    _fill(t, ea, 0xAA)
    _fill(t, eb, 0xBB)
    arena_a, in_a = t.file_extents(ea)
    arena_b, in_b = t.file_extents(eb)
    assert arena_a is arenas[0] and arena_b is arenas[1]
    assert _arena_bytes(arenas[0], in_a) == b"\xaa" * 3 * PAGE
    assert _arena_bytes(arenas[1], in_b) == b"\xbb" * (2 * PAGE + 9)
    assert b"\xbb" not in bytes(arenas[0].view) and b"\xaa" not in bytes(arenas[1].view)
    assert t.used_bytes == 6 * PAGE  # one budget for all spaces
    assert t.arena_of("a") == 0 and t.arena_of("b") == 1
    # a tenant no space names has no arena (not arena 0, the first space's), and takes no page
    with pytest.raises(UnknownSpaceError):
        t.arena_of("someone-else")
    with pytest.raises(UnknownSpaceError):
        t.allocate(PAGE, "someone-else")
    assert t.used_bytes == 6 * PAGE


def test_a_page_moving_to_another_space_leaves_zeros_behind(arenas: list[SharedArena]) -> None:
    t = DramTier(16 * PAGE, PAGE, arenas, {"a": 0, "b": 1})
    ea = t.allocate(16 * PAGE, "a")
    assert ea is not None
    _fill(t, ea, 0xAA)
    t.free(ea)
    eb = t.allocate(5 * PAGE, "b")  # the same pages, now b's
    assert eb is not None
    _fill(t, eb, 0xBB)
    _, in_b = t.file_extents(eb)
    # a's arena no longer holds a's old bytes on those pages: they read as zeros there
    assert _arena_bytes(arenas[0], in_b) == bytes(5 * PAGE)
    assert bytes(arenas[0].view).count(b"\xaa"[0]) == 11 * PAGE  # the pages b did not take
    t.free(eb)
    ea2 = t.allocate(16 * PAGE, "a")  # back to a: b's bytes are gone from b's arena
    assert ea2 is not None
    assert b"\xbb" not in bytes(arenas[1].view)


def test_pages_staying_in_their_space_keep_their_bytes(arenas: list[SharedArena]) -> None:
    t = DramTier(16 * PAGE, PAGE, arenas, {"a": 0, "b": 1})
    ea = t.allocate(4 * PAGE, "a")
    assert ea is not None
    _fill(t, ea, 0xAA)
    t.free(ea)
    again = t.allocate(4 * PAGE, "a")
    assert again == ea
    assert b"".join(bytes(v) for v in t.views(again)) == b"\xaa" * 4 * PAGE  # no punch, no fault


def test_a_client_cannot_resize_its_arena(arena: SharedArena) -> None:
    fd = os.dup(arena.fd)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)  # the sidecar would fault on every later access
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 64 * PAGE)
    finally:
        os.close(fd)
    assert os.fstat(arena.fd).st_size == 16 * PAGE


def test_tenants_named_past_the_arenas_are_refused(arenas: list[SharedArena]) -> None:
    with pytest.raises(ValueError):
        DramTier(16 * PAGE, PAGE, arenas, {"a": 2})
