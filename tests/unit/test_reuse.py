"""The reuse estimator: classes, the frequency sketch, sessions, what it learns and what it
costs (bounded whatever clients send)."""

from __future__ import annotations

import itertools
import zlib

import pytest

from kvpool_sidecar import reuse as U
from kvpool_sidecar.policy import LEARNED, BlockMeta, Hints, PrefixAwarePolicy


def cls(uses: int = 1, *, tail: bool = False, returning: bool = False, depth: int = 3,
        hints: Hints | None = None) -> int:
    return U.block_class(BlockMeta(b"k", 100, depth=depth, hints=hints), uses, tail, returning)


def key(i: int) -> bytes:
    return b"key-%08d" % i


def test_classes_are_bounded_and_tell_the_dimensions_apart() -> None:
    seen = {cls(u, tail=t, depth=d, hints=h, returning=r)
            for u in (1, 2, 3, 9) for t in (False, True) for d in (-1, 0, 1, 5, 40, 10_000)
            for r in (False, True)
            for h in (None, Hints(), Hints(1), Hints(100), Hints(1 << 24, "s", "x"), Hints(7, None, "y"))}
    assert all(0 <= c < U.CLASSES for c in seen)
    assert cls(3) == cls(9)  # three uses or more are one class
    assert len({cls(1), cls(2), cls(3), cls(tail=True)}) == 4
    assert cls(hints=Hints(40)) == cls(hints=Hints(63)) != cls(hints=Hints(64))  # log-bucketed
    assert cls(hints=Hints(session="a")) != cls(hints=Hints(session="a"), returning=True)
    assert cls(hints=Hints()) == cls()  # empty hints are no hints
    assert cls(depth=0) != cls(depth=1) and cls(depth=40) == cls(depth=10_000)


def test_sessions_are_remembered_boundedly() -> None:
    t = U.SessionTable(limit=3)
    assert not t.note("t", "a") and t.note("t", "a")
    for s in ("b", "c", "d"):
        t.note("t", s)
    assert len(t) == 3 and not t.note("t", "a")  # least recently seen, forgotten first


def test_a_tenant_naming_new_sessions_forgets_its_own_first() -> None:
    """The tables were one for all tenants: a tenant (without a quota) naming a new session
    in every put pushed every other tenant's sessions out, and their returning requests
    counted as first ones. Now the tenant holding the most sessions forgets first."""
    t = U.SessionTable(limit=256)
    for i in range(20):
        t.note("victim", f"conv-{i}")
    for i in range(10_000):
        t.note("flood", f"s-{i}")
    assert len(t) == 256
    assert all(t.note("victim", f"conv-{i}") for i in range(20))
    t.resize(U.MIN_SESSIONS)  # a smaller cache: the largest table gives up its sessions first
    assert len(t) == U.MIN_SESSIONS and all(t.note("victim", f"conv-{i}") for i in range(20))
    for i in range(20, 60):  # the victim names more than an equal share: its own go then
        t.note("victim", f"conv-{i}")
    assert len(t) == U.MIN_SESSIONS
    assert all(t.note("victim", f"conv-{i}") for i in range(60 - U.MIN_SESSIONS // 2, 60))
    assert t.note("flood", f"s-{9_999}")  # and the flood keeps its share


def test_a_tenants_returning_sessions_outlast_another_tenants_flood_of_new_ones() -> None:
    """Through the policy: a victim's session stays known, and its next request counts as a
    returning one, however many new sessions another tenant names in between."""
    p = PrefixAwarePolicy()
    learning = p._learning
    assert learning is not None
    p.admit("dram", BlockMeta(key(0), 100, tenant="v", depth=0, hints=Hints(session="conv-1")))
    assert learning.returning is False
    for i in range(1, 3 * U.MAX_SESSIONS):
        p.admit("dram", BlockMeta(key(i), 100, tenant="a", depth=0, hints=Hints(session=f"s-{i}")))
    p.admit("dram", BlockMeta(key(0), 100, tenant="v", depth=0, hints=Hints(session="conv-1")))
    assert learning.returning is True


def test_the_sketch_counts_and_forgets() -> None:
    s = U.FrequencySketch(blocks=64)
    assert [s.add(b"x") for _ in range(3)] == [1, 2, 3]
    assert s.add(b"y") == 1
    for _ in range(40):
        s.add(b"z")
    assert s.add(b"z") == 15  # saturates
    for i in range(2 * U.MIN_HORIZON):  # two windows of other keys: halved twice
        s.add(key(i))
    assert s.add(b"x") <= 2


def feed(e: U.ReuseEstimator, rounds: int, *, back: int, gone: int) -> None:
    """Each round touches eight blocks of class ``back`` that come back two rounds later, and
    eight new blocks of class ``gone`` that never come back."""
    n = 0
    for r in range(rounds):
        for i in range(8):
            e.touched(key(10**6 + (r % 2) * 8 + i), back, 100)
        for _ in range(8):
            e.touched(key(n), gone, 100)
            n += 1


def test_a_class_that_comes_back_is_worth_more_than_one_that_does_not() -> None:
    e = U.ReuseEstimator()
    back, gone = cls(hints=Hints(label="doc")), cls(hints=Hints(label="chat"))
    assert e.relative(back) is None  # no evidence yet
    feed(e, 1500, back=back, gone=gone)
    hot, cold = e.relative(back), e.relative(gone)
    assert hot is not None and cold is not None
    assert hot > 1.5 and cold < 0.2
    # a class never seen borrows from the coarser ones: between the two
    other = e.relative(cls(hints=Hints(label="other")))
    assert other is not None and cold < other < hot


def test_a_class_reused_soon_but_seldom_is_worth_no_more_than_the_average() -> None:
    """Worth is the chance of reuse, not the density of hits per byte kept: a class whose
    blocks are touched four times in a row and never again (a partial tail each turn sends
    again) has three times the density of one whose blocks all come back a horizon later,
    yet keeping its blocks longer gains nothing, while keeping the others does."""
    e = U.ReuseEstimator()
    soon, later = cls(hints=Hints(label="chat")), cls(hints=Hints(label="doc"))
    cycle = 90  # rounds before a block of ``later`` comes back: 90 x 40 touches, within a horizon
    n = 0
    for r in range(3 * cycle):
        for i in range(8):
            e.touched(key(10**6 + (r % cycle) * 8 + i), later, 100)
        for _ in range(8):
            for _ in range(4):
                e.touched(key(n), soon, 100)
            n += 1
    fast, slow = e.relative(soon), e.relative(later)
    assert fast is not None and slow is not None
    assert fast <= 1.0 < slow, (fast, slow)


def test_a_followed_key_costs_a_hash_and_one_int() -> None:
    """Most keys the estimator follows are no longer resident: it keeps 60 bits of their hash
    and their last touch, class and size in one int (about 150 bytes with the ordered dict's
    own, where a 48-byte key and a tuple of three had taken about 260)."""
    from kvpool_bench.footprint import deep_bytes

    e = U.ReuseEstimator()
    for i in range(4000):
        e.touched(i.to_bytes(8, "big") * 6, 5 + i % 7, 1 << 20)
    assert e.followed == 4000
    assert deep_bytes(e._followed, set()) < 200 * 4000
    e.touched((7).to_bytes(8, "big") * 6, 5, 1 << 20)  # touched again: scored as a reuse
    assert e.followed == 4000 and e._outcomes == 1


def test_class_sums_decay_and_classes_that_die_out_give_their_room_to_new_ones() -> None:
    stats = U.ClassStats()
    for k in range(10):
        stats.add(k, 1.0, 5.0)
    stats.add(3, 0.0, 7.0)
    assert stats.get(3) == (2.0, 1.0, 12.0) and stats.get(99) is None and len(stats) == 10
    stats.decay(0.5)
    assert stats.get(3) == (1.0, 0.5, 6.0)
    for _ in range(6):  # the others are down to 1/128 of an outcome: gone; 3 has 1/64 left
        stats.decay(0.5)
    assert len(stats) == 1 and stats.get(0) is None and stats.get(3) is not None
    used = len(stats._sums)
    for k in range(100, 109):
        stats.add(k, 0.0, 1.0)
    assert len(stats._sums) == used and stats.get(105) == (1.0, 0.0, 1.0)


def test_estimates_follow_a_changing_workload() -> None:
    e = U.ReuseEstimator()
    a, b = cls(hints=Hints(1)), cls(hints=Hints(1000))
    feed(e, 1500, back=a, gone=b)
    before = e.relative(a)
    feed(e, 6000, back=b, gone=a)  # the roles swap
    after = e.relative(a)
    assert before is not None and after is not None and after < 0.5 < before


def test_state_stays_bounded_whatever_clients_send() -> None:
    p = PrefixAwarePolicy()
    for i in range(20_000):  # a hostile client: every put a new session and a new label
        m = BlockMeta(key(i), 100, depth=0, hints=Hints(i, f"session-{i}", f"label-{i}"))
        p.admit("dram", m)
        p.inserted("dram", m)
        if i >= 100:
            p.removed("dram", BlockMeta(key(i - 100), 100, depth=0))
    learning = p._learning
    assert learning is not None
    assert len(learning.sessions) <= U.MAX_SESSIONS
    assert learning.estimator.classes <= 3 * U.TENANT_CLASSES * U.CLASSES + 1
    assert learning.estimator.followed <= 2 * U.MIN_FOLLOWED


class Cache:
    """Drives a policy as the store does: a request reads a held block, or puts it."""

    def __init__(self, policy: PrefixAwarePolicy, capacity: int) -> None:
        self.p = policy
        self.capacity = capacity
        self.held: dict[bytes, BlockMeta] = {}

    def touch(self, m: BlockMeta) -> None:
        if m.key in self.held:
            self.p.accessed("dram", self.held[m.key])
            return
        self.p.admit("dram", m)
        while len(self.held) >= self.capacity:
            victim = next(iter(self.p.victims("dram")))
            del self.held[victim.key]
            self.p.removed("dram", victim)
        self.held[m.key] = m
        self.p.inserted("dram", m)


def block(i: int, label: str | None) -> BlockMeta:
    return BlockMeta(key(i), 100, depth=0, hints=Hints(1, None, label))


@pytest.mark.parametrize("labels", [True, False])
def test_the_learned_order_keeps_what_its_label_says_comes_back(labels: bool) -> None:
    """New blocks labelled ``doc`` are read again a few requests later, new ``chat`` ones
    never. Once it has learned that, the learned order evicts a new chat block before an
    older new doc block; without the labels it cannot tell them apart and goes by recency."""
    cache = Cache(PrefixAwarePolicy(duel=False, order=LEARNED), capacity=12)
    doc, chat = ("doc", "chat") if labels else (None, None)
    for r in range(1500):
        if r >= 8:
            cache.touch(block(2 * (r - 8), doc))  # the doc put 8 rounds ago, read again
        cache.touch(block(2 * r, doc))
        cache.touch(block(2 * r + 1, chat))
    old, new = block(10**6, doc), block(10**6 + 1, chat)
    cache.touch(old)
    cache.touch(new)
    # another request's read: the current request's blocks go last in any order (they are
    # the room's own chain), so the two are compared once theirs is over
    cache.touch(next(m for k, m in cache.held.items() if k not in (old.key, new.key)))
    order = [m.key for m in cache.p.victims("dram") if m.key in (old.key, new.key)]
    assert order == ([new.key, old.key] if labels else [old.key, new.key])


@pytest.mark.parametrize(("blocks", "share"), [(10, U.MIN_FOLLOWED / U.MIN_HORIZON), (100_000, 1 / U.SAMPLE_RATE)])
def test_the_sample_follows_the_cache(blocks: int, share: float) -> None:
    e = U.ReuseEstimator()
    e.resize(blocks)
    touches = 3 * U.MIN_HORIZON
    for i in range(touches):  # every key once: none comes back
        e.touched(key(i), 0, 100)
    expect = share * min(touches, max(U.MIN_HORIZON, U.HORIZON_PER_BLOCK * blocks))
    assert 0.7 * expect <= e.followed <= 1.3 * expect


def test_one_tenants_blocks_never_score_another_tenants_class() -> None:
    """A tenant that chose a label in another's bucket, and blocks touched three times then
    abandoned, made the other's class look worthless: its hit rate fell from 0.99 to 0.81 (a
    review's labels.py; 0.98 with classes of their own). Each tenant's classes are its own,
    at every level but all blocks together; past the first TENANT_CLASSES tenants, they share
    the last."""
    learning = U.Learning()
    hints = Hints(prompt_blocks=8, label="doc")
    mine, theirs = (BlockMeta(b"k" * 32, 4096, tenant, depth=3, hints=hints) for tenant in ("victim", "attacker"))
    a, b = learning.block_class(mine), learning.block_class(theirs)
    assert a != b
    assert U._coarser(a)[:2] != U._coarser(b)[:2] and U._coarser(a)[2] == U._coarser(b)[2]  # noqa: SLF001
    many = {learning.block_class(BlockMeta(b"k" * 32, 4096, f"t{i}", depth=3, hints=hints)) for i in range(40)}
    assert len(many) == U.TENANT_CLASSES - 2  # (two seen already; the last is shared by all after it)
    assert max(max(U._coarser(c)) for c in many) < 3 * U.TENANT_CLASSES * U.CLASSES + 1  # noqa: SLF001


def test_a_session_is_known_per_tenant() -> None:
    """The table of sessions seen is the node's: one tenant naming a session first had made
    another tenant's first request of that name count as a returning session's."""
    p = PrefixAwarePolicy()
    learning = p._learning
    assert learning is not None
    p.admit("dram", BlockMeta(key(0), 100, tenant="a", depth=0))  # (a request of no session first)
    p.admit("dram", BlockMeta(key(1), 100, tenant="a", depth=0, hints=Hints(session="conv-8")))
    assert learning.returning is False
    p.admit("dram", BlockMeta(key(2), 100, tenant="b", depth=0, hints=Hints(session="conv-8")))
    assert learning.returning is False
    p.admit("dram", BlockMeta(key(3), 100, tenant="b", depth=0, hints=Hints(session="conv-8")))
    assert learning.returning is True


def _crc_forged(prefix: bytes, target: int) -> bytes:
    """``prefix`` and four bytes more whose CRC-32 is ``target`` (CRC-32 is linear: the
    bytes that take its register to any value can be solved for, one table lookup each)."""
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0xEDB88320 if c & 1 else 0)
        table.append(c)
    top = {t >> 24: i for i, t in enumerate(table)}
    want, picks = target ^ 0xFFFFFFFF, []
    for _ in range(4):
        i = top[want >> 24]
        picks.append(i)
        want = ((want ^ table[i]) << 8) & 0xFFFFFFFF
    crc, tail = zlib.crc32(prefix) ^ 0xFFFFFFFF, bytearray()
    for i in reversed(picks):
        b = (crc ^ i) & 0xFF
        tail.append(b)
        crc = (crc >> 8) ^ table[(crc ^ b) & 0xFF]
    return prefix + bytes(tail)


def test_no_tenant_can_name_a_session_that_another_tenant_has_seen() -> None:
    """Sessions are remembered by a hash of the tenant and the session's name: by CRC-32, a
    tenant could compute a name of its own with the hash of another tenant's session (a
    review's, in ASCII), and that tenant's first request of it then counted as returning."""
    target = zlib.crc32(b"v\0conv-42")
    name = next(s for n in itertools.count()
                if max(s := _crc_forged(b"a\0x" + str(n).encode(), target)[2:]) < 0x80).decode()
    assert zlib.crc32(("a\0" + name).encode()) == target  # (what the table had been keyed by)
    p = PrefixAwarePolicy()
    learning = p._learning
    assert learning is not None
    p.admit("dram", BlockMeta(key(0), 100, tenant="v", depth=0))
    p.admit("dram", BlockMeta(key(1), 100, tenant="a", depth=0, hints=Hints(session=name)))
    p.admit("dram", BlockMeta(key(2), 100, tenant="v", depth=0, hints=Hints(session="conv-42")))
    assert learning.returning is False
