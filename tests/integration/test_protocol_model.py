"""A model-based test of the local protocol against a real sidecar process.

A hypothesis state machine drives seven connections of three tenants (``a`` and ``b``
sharing the key space ``team``; ``c``, with a quota, in a space of its own, one of its
connections over TCP) through random, well-formed but odd sequences of the local
protocol's operations: puts (``PoolClient.put``, chained or not, with hints; the two phases
apart, other steps between ALLOC and COMMIT; inline puts), commits with a wrong checksum,
twice, after an abort, of another connection's lease; reads (``ACQUIRE`` held across steps
and released once, twice or never, ``GET_INLINE``, ``PoolClient.get``); pins, removals
(while another connection reads the blocks), lookups; requests with bad arguments; many
requests of several connections in flight at once, sent in pieces; connections closed with
leases, allocations, pins and requests outstanding, by the client or by the sidecar (a
broken frame, an oversize one, a HELLO as nobody).

Each example starts a sidecar of its own, small (a DRAM tier of 64 pages of 4 KiB, a disk
tier of twice that or none), with an eviction policy, disk layout and write-ahead drawn for
it, so blocks are evicted, demoted and promoted all along; the test runs once where write
leases outlast every example and once where they lapse within one (the key goes to other
writers, the room stays held). The model keeps, per key space and key, every (checksum,
bytes) a commit stored since the key's last removal, the leases each connection holds and
its pins, and checks after every answer:

- every block read (ACQUIRE in place, GET_INLINE, ``PoolClient.get``) is exactly a block a
  commit of that key in that key space stored, and not one removed since (a miss is always
  allowed: eviction, quotas); a verified read never returns a wrong-checksum commit's bytes;
- no page of the tier is lent twice at once (an allocation or a read lease never overlaps
  another allocation, lapsed ones included, nor a read lease but of the same block), and a
  held read lease's bytes do not change until it is released;
- no arena ever shows a page of another key space (every page the machine writes starts
  with a tag naming its key space);
- statuses agree with the model: COMMIT, ABORT and RELEASE settle exactly the leases this
  connection holds; ALLOCATED, PENDING and EXISTS only where they can be; UNPIN finds only
  this session's pins; REMOVE deletes only blocks its own tenant stored, and they miss from
  then on; a pinned block stays; STATS' sessions are the open connections, its pending and
  lapsed writes the model's allocations; a tenant whose connections hold nothing can hold
  its whole share of the tier;
- every request is answered within ``ANSWER_S`` (a bad argument by a clear error, after
  which the connection still serves);
- after all connections close: no session, pending or lapsed write is left, every tenant
  can again hold half the tier (no leaked lease, pin or share), the sidecar still serves a
  fresh put and get, and it stops cleanly (with a client still holding leases).

``KVPOOL_MODEL_EXAMPLES`` and ``KVPOOL_MODEL_STEPS`` raise the search (defaults keep the
run under a minute on two shared cores); ``KVPOOL_MODEL_NO_SHRINK`` reports the first failing
sequence unshrunk (each shrink step starts a sidecar); ``KVPOOL_MODEL_STATS`` prints what the
runs saw (with ``-s``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvpool_client.blockinfo import PutHints
from kvpool_client.client import PoolClient
from kvpool_client.errors import ConnectionLostError, RemoteError
from kvpool_client.integrity import checksum
from kvpool_client.protocol import HEADER, Op, PutStatus, decode, encode
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import TCP_TOKEN, assert_serves, payload, wait_until

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]

PAGE = 4096
DRAM_PAGES = 64
DRAM_BYTES = DRAM_PAGES * PAGE
BLOCK_MAX = 128 << 10
MAX_BATCH = 32
#: Small enough that an inline get of a few large blocks is answered in parts.
MAX_FRAME = 128 << 10
#: Every request must be answered within this many seconds.
ANSWER_S = 10.0
#: Block sizes: under, at and over a page, several pages (multi-extent blocks).
SIZES = [1, 100, 4095, 4096, 4097, 9000, 20000, 40000, 61440]
N_KEYS = 16
SPACES = {"a": "team", "b": "team", "c": "c", "default": "default"}
#: The machine's connections: the tenant of each slot; the last one is over TCP (no arena:
#: data travels inline, ALLOC and ACQUIRE are refused).
SLOTS = ["a", "a", "b", "b", "c", "c", "c"]
TCP_SLOT = 6

EXAMPLES = int(os.environ.get("KVPOOL_MODEL_EXAMPLES", "25"))
STEPS = int(os.environ.get("KVPOOL_MODEL_STEPS", "50"))

#: What the runs saw (printed with ``-s`` where ``KVPOOL_MODEL_STATS`` is set).
SEEN: Counter[str] = Counter()


def seen(what: str) -> None:
    SEEN[what] += 1


STORED = int(PutStatus.STORED)
ALLOCATED = int(PutStatus.ALLOCATED)
UNKNOWN_LEASE_ITEM = -3  # COMMIT's answer for a lease this session does not hold


#: What a sidecar may run with besides: its eviction policy, its disk tier (none, or a layout
#: and compression) and whether it writes blocks down ahead of need.
VARIANTS = st.fixed_dictionaries({
    "policy": st.sampled_from(["prefix", "lru", "prefix-arc", "prefix-recency", "prefix-learned", "prefix-nolearn"]),
    "disk": st.sampled_from([None, ("segments", "none"), ("segments", "zstd"), ("files", "none")]),
    "clean_share": st.sampled_from([0.1, 0.0]),
})


def sidecar_config(disk: Path, lease_s: float, token_file: Path, variant: dict[str, Any]) -> dict[str, Any]:
    layout = variant["disk"]
    return {
        "node_name": "model",
        "max_block_bytes": BLOCK_MAX,
        # puts wait for disk writes where no room is clean (not FULL at once): the teardown's
        # proof that nothing is left held allocates the whole tier, all of it to be evicted
        "dram": {"size_bytes": DRAM_BYTES, "page_bytes": PAGE, "clean_share": variant["clean_share"],
                 "put_waits_for_disk": True},
        "disk": {} if layout is None else {"path": str(disk), "size_bytes": 2 * DRAM_BYTES, "layout": layout[0],
                                           "compression": layout[1]},
        "policy": {"name": variant["policy"]},
        "api": {"max_session_share": 0.5, "max_batch": MAX_BATCH, "max_frame_bytes": MAX_FRAME,
                "lease_timeout_s": lease_s, "tcp_port": 0},
        "tenants": [{"name": "default"}, {"name": "a", "key_space": "team"}, {"name": "b", "key_space": "team"},
                    {"name": "c", "quota_share": "50%", "uids": [os.getuid()], "token_file": str(token_file)}],
    }


def tag(space: str) -> bytes:
    """The first 16 bytes of every page the machine writes for ``space``."""
    return f"<<{space}>>".encode().ljust(16, b"~")


TAGS = {s: tag(s) for s in set(SPACES.values())}


def block_bytes(space: str, key: bytes, size: int, variant: int = 0) -> bytes:
    """Deterministic bytes of ``key`` in ``space`` (``variant`` > 0: another writer's), each
    page starting with the space's tag."""
    data = bytearray(payload(key if not variant else key[::-1] + bytes([variant]), size))
    t = TAGS[space]
    for p in range(0, size, PAGE):
        n = min(len(t), size - p)
        data[p : p + n] = t[:n]
    return bytes(data)


def raw_key(i: int) -> bytes:
    return hashlib.blake2b(f"model-key-{i}".encode(), digest_size=48).digest()


def pages_of(extents: list[tuple[int, int]]) -> frozenset[int]:
    out: set[int] = set()
    for off, n in extents:
        out.update(range(off // PAGE, (off + n - 1) // PAGE + 1))
    return frozenset(out)


@dataclass
class Alloc:
    lease: int
    space: str
    key: bytes
    size: int
    extents: list[tuple[int, int]]
    pages: frozenset[int]
    #: When its ALLOC was sent (monotonic): it may lapse ``lease_s`` after.
    sent: float
    #: Known to have lapsed (its key went to another writer): a commit is refused.
    lapsed: bool = False


@dataclass
class Read:
    lease: int
    space: str
    key: bytes
    csum: int
    extents: list[tuple[int, int]]
    pages: frozenset[int]
    data: bytes

    @property
    def ident(self) -> tuple[Any, ...]:
        return (self.space, self.key, self.csum, tuple(self.extents))


class Conn:
    """One of the machine's connections and what the model says it holds."""

    def __init__(self, sp: SidecarProcess, slot: int, tenant: str) -> None:
        self.slot = slot
        self.tenant = tenant
        self.space = SPACES[tenant]
        if slot == TCP_SLOT:
            self.client = PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], tenant=tenant, token=TCP_TOKEN,
                                     timeout=ANSWER_S)
            assert not self.client.shm
        else:
            self.client = PoolClient(sp.socket_path, tenant=tenant, timeout=ANSWER_S, prefault=False)
            assert self.client.shm, "a Unix-socket client of a known tenant maps its arena"
        #: Whether it maps its key space's arena (the Unix socket) or moves data inline (TCP).
        self.shm = self.client.shm
        self.allocs: dict[int, Alloc] = {}
        self.reads: dict[int, Read] = {}
        self.pins: Counter[bytes] = Counter()
        #: Lease ids this connection settled (committed, aborted, released): settling them
        #: again must do nothing.
        self.settled: list[int] = []

    def view(self) -> memoryview:
        v = self.client._view  # noqa: SLF001 - the mapped arena, read and written in place
        assert v is not None
        return v

    def read(self, extents: list[tuple[int, int]]) -> bytes:
        v = self.view()
        return b"".join(bytes(v[o : o + n]) for o, n in extents)

    def write(self, extents: list[tuple[int, int]], data: bytes) -> None:
        v = self.view()
        pos = 0
        for o, n in extents:
            v[o : o + n] = data[pos : pos + n]
            pos += n

    def call(self, op: Op, *args: Any) -> tuple[bool, Any]:
        """(True, result) or (False, error code name); a request without an answer fails."""
        try:
            return True, self.client._call(op, *args)  # noqa: SLF001 - raw requests
        except RemoteError as e:
            return False, e.code
        except ConnectionLostError as e:
            raise AssertionError(f"{getattr(op, 'name', op)} on slot {self.slot} ({self.tenant}) got no answer: {e}") from e

    def recv_frame(self) -> list[Any]:
        """The next answer on this connection, whatever request it answers."""
        c = self.client
        deadline = time.monotonic() + ANSWER_S
        try:
            c._fill(HEADER.size, deadline)  # noqa: SLF001
            (n,) = HEADER.unpack_from(c._rbuf)  # noqa: SLF001
            c._fill(HEADER.size + n, deadline)  # noqa: SLF001
        except ConnectionLostError as e:
            raise AssertionError(f"slot {self.slot} ({self.tenant}): no answer: {e}") from e
        body = decode(bytes(c._rbuf[HEADER.size : HEADER.size + n]))  # noqa: SLF001
        del c._rbuf[: HEADER.size + n]  # noqa: SLF001
        assert len(body) == 3, body
        return body

    def close(self) -> None:
        self.client.close()


class ProtocolModel(RuleBasedStateMachine):
    factory: Factory
    tmp: Path
    #: The sidecar's ``api.lease_timeout_s``: write leases held longer may lapse.
    lease_s: float

    def __init__(self) -> None:
        super().__init__()
        self.sp: SidecarProcess | None = None
        self._observer: PoolClient | None = None
        self.conns: list[Conn] = []
        self.keys = [raw_key(i) for i in range(N_KEYS)]
        #: Per (space, key): every (checksum, bytes) a commit stored since the key's last
        #: removal (an older block of the key must not come back).
        self.pairs: dict[tuple[str, bytes], set[tuple[int, bytes]]] = {}
        #: Per (space, key): the tenants whose commit stored it.
        self.stored_by: dict[tuple[str, bytes], set[str]] = {}
        #: (space, key) whose block may go without this model's word: removed, or
        #: committed under a wrong checksum (dropped once found corrupt).
        self.volatile: set[tuple[str, bytes]] = set()
        #: (space, key) whose block a REMOVE deleted and nobody stored since: it must miss.
        self.absent: set[tuple[str, bytes]] = set()
        self.lease_ids: set[int] = set()
        self.log: list[str] = []
        self.waited = False

    # ------------------------------------------------------------------ model helpers
    def running(self) -> SidecarProcess:
        assert self.sp is not None, "the sidecar was not started"
        return self.sp

    @property
    def observer(self) -> PoolClient:
        """A connection of its own (tenant ``default``) that asks for STATS."""
        assert self._observer is not None, "the sidecar was not started"
        return self._observer

    def note(self, msg: str) -> None:
        self.log.append(msg)
        seen("step " + msg.split()[0])

    def good(self, space: str, key: bytes) -> set[bytes]:
        return {b for c, b in self.pairs.get((space, key), ()) if checksum(memoryview(b)) == c}

    def writers(self, space: str, key: bytes) -> list[Alloc]:
        return [a for c in self.conns for a in c.allocs.values() if a.space == space and a.key == key]

    def may_lapse(self, a: Alloc) -> bool:
        """Whether ``a`` may have lapsed by now (the sidecar's expiry runs every second)."""
        return a.lapsed or time.monotonic() >= a.sent + self.lease_s

    def allocs(self) -> list[Alloc]:
        return [a for c in self.conns for a in c.allocs.values()]

    def stored(self, conn: Conn, key: bytes, csum: int, data: bytes) -> None:
        k = (conn.space, key)
        self.pairs.setdefault(k, set()).add((csum, data))
        self.stored_by.setdefault(k, set()).add(conn.tenant)
        self.absent.discard(k)
        if checksum(memoryview(data)) != csum:
            self.volatile.add(k)

    def claim(self, pages: frozenset[int], what: str, ident: tuple[Any, ...] | None = None) -> None:
        """No page is lent twice at once: ``pages`` overlap no allocation held, and no read
        lease but of the same block."""
        for c in self.conns:
            for a in c.allocs.values():
                assert not pages & a.pages, (
                    f"{what} overlaps pages {sorted(pages & a.pages)} of slot {c.slot}'s allocation {a.lease} "
                    f"({a.space}, key {self.keys.index(a.key)})")
            for r in c.reads.values():
                if pages & r.pages:
                    assert ident is not None and ident == r.ident, (
                        f"{what} overlaps pages {sorted(pages & r.pages)} of slot {c.slot}'s read lease {r.lease} "
                        f"({r.space}, key {self.keys.index(r.key)})")

    def new_lease(self, lease: object) -> int:
        assert type(lease) is int and lease > 0, f"a lease id must be a positive integer, not {lease!r}"
        assert lease not in self.lease_ids, f"lease id {lease} handed out twice"
        self.lease_ids.add(lease)
        return lease

    def extents_of(self, conn: Conn, raw: object, size: int, what: str) -> list[tuple[int, int]]:
        assert isinstance(raw, list) and raw, f"{what}: extents {raw!r}"
        ext = [(int(o), int(n)) for o, n in raw]
        arena = conn.view().nbytes
        assert sum(n for _, n in ext) == size, f"{what}: extents {ext} do not hold {size} bytes"
        for o, n in ext:
            assert o >= 0 and n > 0 and o + n <= arena, f"{what}: extent {(o, n)} outside the arena"
            assert o % PAGE == 0, f"{what}: extent {(o, n)} does not start on a page"
        return ext

    def check_alloc_status(self, conn: Conn, key: bytes, status: int, what: str) -> None:
        k = (conn.space, key)
        seen(f"put status {PutStatus(status).name if 0 <= status <= 7 else status}")
        assert status != int(PutStatus.REJECTED), f"{what}: REJECTED (admission always admits)"
        assert status != int(PutStatus.TOO_LARGE), f"{what}: TOO_LARGE for a block the tier takes"
        if status in (ALLOCATED, STORED):
            for a in self.writers(*k):
                assert self.may_lapse(a), (
                    f"{what}: {PutStatus(status).name} while lease {a.lease} holds key {self.keys.index(key)}")
                a.lapsed = True  # the key went to another writer: its lease lapsed
                seen("key given to another writer after a lapse")
        elif status == int(PutStatus.EXISTS):
            assert self.pairs.get(k), f"{what}: EXISTS for a key never stored in space {conn.space}"
            assert k not in self.absent, f"{what}: EXISTS for key {self.keys.index(key)}, removed since stored"
        elif status == int(PutStatus.PENDING):
            assert any(not a.lapsed for a in self.writers(*k)), f"{what}: PENDING while no writer holds the key"
        else:
            assert status in (int(PutStatus.FULL), int(PutStatus.QUOTA)), f"{what}: status {status}"

    def take_alloc_answer(self, conn: Conn, items: list[tuple[bytes, int]], answer: object, what: str,
                          sent: float) -> None:
        assert isinstance(answer, list) and len(answer) == len(items), f"{what}: answer {answer!r}"
        for (key, size), got in zip(items, answer):
            assert isinstance(got, list) and len(got) == 3, f"{what}: item {got!r}"
            status, lease, ext = got
            self.check_alloc_status(conn, key, status, what)
            if status != ALLOCATED:
                assert lease == 0 and ext is None, f"{what}: {got!r}"
                continue
            lease = self.new_lease(lease)
            extents = self.extents_of(conn, ext, size, what)
            pages = pages_of(extents)
            self.claim(pages, f"{what}: allocation {lease}")
            room = conn.read(extents)
            for space, t in TAGS.items():
                if space != conn.space:
                    assert t not in room, f"{what}: room allocated to {conn.space} holds a page of space {space}"
            conn.allocs[lease] = Alloc(lease, conn.space, key, size, extents, pages, sent)

    def check_hit(self, conn: Conn, key: bytes, item: object, what: str) -> Read:
        assert isinstance(item, list) and len(item) == 4, f"{what}: item {item!r}"
        lease, size, csum, raw = item
        lease = self.new_lease(lease)
        extents = self.extents_of(conn, raw, size, what)
        data = conn.read(extents)
        known = self.pairs.get((conn.space, key), set())
        assert (conn.space, key) not in self.absent, (
            f"{what}: slot {conn.slot} read key {self.keys.index(key)}, removed since it was stored")
        assert (csum, data) in known, (
            f"{what}: slot {conn.slot} ({conn.tenant}) read key {self.keys.index(key)} as {size} bytes "
            f"(checksum {csum:#x}, {'matching' if checksum(memoryview(data)) == csum else 'NOT matching'} them, "
            f"head {data[:16]!r}) that no commit in space {conn.space} stored "
            f"(stored: {sorted((len(b), c) for c, b in known)})")
        r = Read(lease, conn.space, key, csum, extents, pages_of(extents), data)
        self.claim(r.pages, f"{what}: read lease {lease}", r.ident)
        return r

    def check_verified(self, conn: Conn, key: bytes, data: bytes | None, what: str) -> None:
        if data is None:
            return
        assert (conn.space, key) not in self.absent, (
            f"{what}: slot {conn.slot} read key {self.keys.index(key)}, removed since it was stored")
        assert data in self.good(conn.space, key), (
            f"{what}: slot {conn.slot} ({conn.tenant}) got {len(data)} bytes (head {data[:16]!r}) for key "
            f"{self.keys.index(key)} that no correct commit in space {conn.space} stored")

    def wait_settled(self) -> None:
        """Wait until the sidecar has closed the sessions of closed connections."""
        want = len(self.conns) + 1

        def settled() -> bool:
            s = self.observer.stats()
            least, most = self.pending()
            return bool(s["sessions"] == want and least <= s["pending_writes"] <= most)

        wait_until(settled, f"{want} sessions and pending writes within {self.pending()}", timeout=ANSWER_S)

    def pending(self) -> tuple[int, int]:
        """How many keys the sidecar holds pending at least and at most: the model's
        allocations, but those that may have lapsed."""
        allocs = self.allocs()
        return (len({(a.space, a.key) for a in allocs if not self.may_lapse(a)}),
                len({(a.space, a.key) for a in allocs if not a.lapsed}))

    def _sessions_pending(self) -> tuple[int, int]:
        s = self.observer.stats()
        return s["sessions"], s["pending_writes"]

    def reopen(self, conn: Conn) -> Conn:
        conn.close()
        fresh = Conn(self.running(), conn.slot, conn.tenant)
        self.conns[conn.slot] = fresh
        self.wait_settled()
        return fresh

    def busy_slot(self, slot: int, what: str) -> Conn:
        """The connection in ``slot``, or the next one that holds allocations (``allocs``) or
        read leases (``reads``), if any does."""
        for n in range(len(self.conns)):
            c = self.conns[(slot + n) % len(self.conns)]
            if getattr(c, what):
                return c
        return self.conns[slot]

    def pick(self, conn: Conn, sel: int, mode: str, mine: dict[int, Any]) -> int:
        """A lease id: one of ``mine`` (mode ``own``), one this connection settled, one of
        another connection's, or one nobody holds."""
        if mode == "own" and mine:
            return sorted(mine)[sel % len(mine)]
        if mode == "settled" and conn.settled:
            return conn.settled[sel % len(conn.settled)]
        if mode == "other":
            theirs = sorted(lid for c in self.conns if c is not conn for lid in (*c.allocs, *c.reads))
            if theirs:
                return theirs[sel % len(theirs)]
        return 10**9 + sel

    # ------------------------------------------------------------------ rules: writes
    @initialize(variant=VARIANTS, puts=st.lists(st.tuples(st.integers(0, len(SLOTS) - 1), st.integers(0, N_KEYS - 1),
                                                         st.sampled_from(SIZES)), min_size=8, max_size=24))
    def start(self, variant: dict[str, Any], puts: list[tuple[int, int, int]]) -> None:
        """A sidecar of ``variant``, the machine's connections, and blocks to start from."""
        disk = self.tmp / f"disk{os.urandom(4).hex()}"
        token = self.tmp / "tenant-token"
        token.write_bytes(TCP_TOKEN)
        self.note(f"start {variant}")
        self.sp = self.factory(sidecar_config(disk, self.lease_s, token, variant))
        self._observer = PoolClient(self.sp.socket_path, tenant="default", timeout=ANSWER_S, prefault=False)
        self.conns = [Conn(self.sp, i, t) for i, t in enumerate(SLOTS)]
        for slot, key, size in puts:
            self.put(slot, [key], size, 0)

    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3),
          size=st.sampled_from(SIZES), variant=st.integers(0, 1), chain=st.booleans(),
          hints=st.none() | st.builds(PutHints, prompt_blocks=st.none() | st.integers(0, 64),
                                      session=st.none() | st.sampled_from(["s1", "s2"]),
                                      label=st.none() | st.sampled_from(["system", "turn"])))
    def put(self, slot: int, keys: list[int], size: int, variant: int, chain: bool = False,
            hints: PutHints | None = None) -> None:
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        datas = [block_bytes(conn.space, k, size, variant) for k in ks]
        self.note(f"put slot={slot} keys={keys} size={size} chain={chain} hints={hints}")
        try:
            got = conn.client.put(ks, datas, chain=chain, depth=keys[0] if chain else 0, hints=hints)
        except ConnectionLostError as e:
            raise AssertionError(f"put on slot {slot} got no answer: {e}") from e
        assert len(got) == len(ks)
        for n, (k, d, status) in enumerate(zip(ks, datas, got)):
            if status == PutStatus.PENDING and k in ks[:n]:
                continue  # behind its own allocation earlier in the batch
            self.check_alloc_status(conn, k, int(status), f"put slot {slot}")
            if status == PutStatus.STORED:
                self.stored(conn, k, checksum(memoryview(d)), d)

    @rule(slot=st.integers(0, len(SLOTS) - 1),
          items=st.lists(st.tuples(st.integers(0, N_KEYS - 1), st.sampled_from(SIZES)), min_size=1, max_size=3))
    def alloc(self, slot: int, items: list[tuple[int, int]]) -> None:
        conn = self.conns[slot]
        wire = [[self.keys[i], n, -1, None] for i, n in items]
        self.note(f"alloc slot={slot} items={items}")
        sent = time.monotonic()
        ok, answer = conn.call(Op.ALLOC, wire)
        if not conn.shm:
            assert not ok and answer == "bad_request", f"ALLOC over TCP answered {answer}"
            return
        assert ok, f"ALLOC answered {answer}"
        self.take_alloc_answer(conn, [(self.keys[i], n) for i, n in items], answer, f"ALLOC slot {slot}", sent)

    @rule(slot=st.integers(0, len(SLOTS) - 1), sel=st.integers(0, 100), variant=st.integers(0, 1))
    def write(self, slot: int, sel: int, variant: int) -> None:
        """Write a block into its room well before its commit (other steps in between)."""
        conn = self.busy_slot(slot, "allocs")
        if not conn.allocs:
            return
        a = conn.allocs[sorted(conn.allocs)[sel % len(conn.allocs)]]
        self.note(f"write slot={slot} lease={a.lease}")
        conn.write(a.extents, block_bytes(a.space, a.key, a.size, variant))

    @rule(slot=st.integers(0, len(SLOTS) - 1), sels=st.lists(st.integers(0, 100), min_size=1, max_size=3),
          mode=st.sampled_from(["own", "own", "own", "settled", "other", "unknown"]),
          how=st.sampled_from(["payload", "payload", "wrong", "as_is", "partial"]),
          reader=st.sampled_from(["inline", "get", None]))
    def commit(self, slot: int, sels: list[int], mode: str, how: str, reader: str | None = None) -> None:
        conn = self.busy_slot(slot, "allocs") if mode == "own" else self.conns[slot]
        if mode == "own" and not conn.allocs and conn.shm:
            self.alloc(conn.slot, [(sels[0] % N_KEYS, SIZES[sels[0] % len(SIZES)])])  # something to commit
        leases = [self.pick(conn, s, mode, conn.allocs) for s in sels]
        items: list[list[int]] = []
        written: dict[int, tuple[int, bytes]] = {}
        for lid in leases:
            a = conn.allocs.get(lid)
            if a is None:
                items.append([lid, 12345])
                continue
            if lid not in written:
                if how in ("payload", "wrong"):
                    conn.write(a.extents, block_bytes(a.space, a.key, a.size))
                elif how == "partial":
                    half = block_bytes(a.space, a.key, a.size, 1)[: a.size // 2]
                    conn.write([(a.extents[0][0], min(len(half), a.extents[0][1]))], half)
                data = conn.read(a.extents)
                csum = checksum(memoryview(data))
                if how == "wrong":
                    csum ^= 0x5A5A
                written[lid] = (csum, data)
            items.append([lid, written[lid][0]])
        self.note(f"commit slot={slot} leases={leases} how={how}")
        ok, answer = conn.call(Op.COMMIT, items)
        assert ok, f"COMMIT answered {answer}"
        assert isinstance(answer, list) and len(answer) == len(items), answer
        for (lid, _), got in zip(items, answer):
            a = conn.allocs.pop(lid, None)
            seen(f"commit {mode} {how} -> {got}" + (" (may have lapsed)" if a is not None and self.may_lapse(a) else ""))
            if a is None:
                assert got == UNKNOWN_LEASE_ITEM, f"COMMIT of lease {lid} this session does not hold answered {got}"
                continue
            if got == UNKNOWN_LEASE_ITEM:
                assert self.may_lapse(a), f"COMMIT of held lease {lid} refused before it could lapse"
                continue  # lapsed: refused, and its room given back
            assert got == STORED and not a.lapsed, f"COMMIT of lease {lid} (lapsed: {a.lapsed}) answered {got}"
            conn.settled.append(lid)
            self.stored(conn, a.key, *written[lid])
            csum, data = written[lid]
            if reader is not None and checksum(memoryview(data)) != csum:
                self.bad_block_is_a_miss(conn, a.key, reader)

    def bad_block_is_a_miss(self, writer: Conn, key: bytes, reader: str) -> None:
        """Just committed under a wrong checksum, ``key``'s block is what the store holds:
        a verified read (inline, checked by the sidecar; or the client's) must miss."""
        peers = [c for c in self.conns if c.space == writer.space]
        conn = peers[self.keys.index(key) % len(peers)]
        if reader == "inline":
            ok, got = conn.call(Op.GET_INLINE, [key])
            assert ok and got == [None], (
                f"GET_INLINE on slot {conn.slot} served key {self.keys.index(key)}, just committed under a wrong "
                f"checksum: {got if not ok else [None if b is None else (len(b), b[:16]) for b in got]}")
        else:
            [v] = conn.client.get([key])
            assert v is None, f"get on slot {conn.slot} served key {self.keys.index(key)}, committed under a wrong checksum"

    @rule(slot=st.integers(0, len(SLOTS) - 1), sels=st.lists(st.integers(0, 100), min_size=0, max_size=3),
          mode=st.sampled_from(["own", "own", "settled", "other", "unknown"]))
    def abort(self, slot: int, sels: list[int], mode: str) -> None:
        conn = self.busy_slot(slot, "allocs") if mode == "own" else self.conns[slot]
        leases = [self.pick(conn, s, mode, conn.allocs) for s in sels]
        self.note(f"abort slot={slot} leases={leases}")
        ok, answer = conn.call(Op.ABORT, leases)
        assert ok, f"ABORT answered {answer}"
        least = most = 0
        for lid in leases:
            a = conn.allocs.pop(lid, None)
            if a is not None:
                least += not self.may_lapse(a)
                most += not a.lapsed
                conn.settled.append(lid)
        assert least <= answer <= most, (
            f"ABORT of {leases} answered {answer}, the session held {least} to {most} of them unlapsed")

    @rule(slot=st.integers(0, len(SLOTS) - 1),
          items=st.lists(st.tuples(st.integers(0, N_KEYS - 1), st.sampled_from(SIZES), st.integers(0, 1)),
                         min_size=1, max_size=3))
    def put_inline(self, slot: int, items: list[tuple[int, int, int]]) -> None:
        conn = self.conns[slot]
        while sum(n for _, n, _ in items) > MAX_FRAME - 4096:
            items = items[:-1]  # one frame (a longer one closes the connection)
        datas = [block_bytes(conn.space, self.keys[i], n, v) for i, n, v in items]
        wire = [[self.keys[i], d, -1, None] for (i, _, _), d in zip(items, datas)]
        self.note(f"put_inline slot={slot} items={items}")
        ok, answer = conn.call(Op.PUT_INLINE, wire)
        assert ok, f"PUT_INLINE answered {answer}"
        self.take_inline_answer(conn, [self.keys[i] for i, _, _ in items], datas, answer, f"PUT_INLINE slot {slot}")

    def take_inline_answer(self, conn: Conn, keys: list[bytes], datas: list[bytes], answer: object, what: str) -> None:
        assert isinstance(answer, list) and len(answer) == len(keys), f"{what}: {answer!r}"
        for k, d, status in zip(keys, datas, answer):
            assert status != ALLOCATED, f"{what}: ALLOCATED from an inline put"
            self.check_alloc_status(conn, k, status, what)
            if status == STORED:
                self.stored(conn, k, checksum(memoryview(d)), d)

    # ------------------------------------------------------------------ rules: reads
    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=3),
          hold=st.booleans())
    def acquire(self, slot: int, keys: list[int], hold: bool) -> None:
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        self.note(f"acquire slot={slot} keys={keys} hold={hold}")
        ok, answer = conn.call(Op.ACQUIRE, ks)
        if not conn.shm:
            assert not ok and answer == "bad_request", f"ACQUIRE over TCP answered {answer}"
            return
        assert ok, f"ACQUIRE answered {answer}"
        self.take_acquire_answer(conn, ks, answer, hold, f"ACQUIRE slot {slot}")

    def take_acquire_answer(self, conn: Conn, ks: list[bytes], answer: object, hold: bool, what: str) -> None:
        assert isinstance(answer, list) and len(answer) == len(ks), f"{what}: {answer!r}"
        got: list[Read] = []
        for k, item in zip(ks, answer):
            seen("acquire " + ("miss" if item is None else "hit") + (
                "" if self.pairs.get((conn.space, k)) else " (never stored)"))
            if item is not None:
                r = self.check_hit(conn, k, item, what)
                conn.reads[r.lease] = r
                got.append(r)
        if not hold and got:
            rel = [[r.lease, checksum(memoryview(r.data)) != r.csum] for r in got]
            self.release_checked(conn, rel, f"{what} (release at once)")

    def release_checked(self, conn: Conn, items: list[list[Any]], what: str) -> None:
        expected = 0
        for lid, corrupt in items:
            r = conn.reads.get(lid)
            if r is not None:
                now = conn.read(r.extents)
                assert now == r.data, (f"{what}: the bytes of read lease {lid} (key {self.keys.index(r.key)}) "
                                       "changed while it was held")
        ok, answer = conn.call(Op.RELEASE, items)
        assert ok, f"RELEASE answered {answer}"
        for lid, corrupt in items:
            r = conn.reads.pop(lid, None)
            if r is not None:
                expected += 1
                conn.settled.append(lid)
                if corrupt:
                    self.volatile.add((r.space, r.key))
        assert answer == expected, f"{what}: RELEASE of {items} answered {answer}, the session held {expected}"

    @rule(slot=st.integers(0, len(SLOTS) - 1), sels=st.lists(st.integers(0, 100), min_size=0, max_size=3),
          mode=st.sampled_from(["own", "own", "own", "settled", "other", "unknown"]), corrupt=st.booleans(),
          twice=st.booleans())
    def release(self, slot: int, sels: list[int], mode: str, corrupt: bool, twice: bool) -> None:
        conn = self.busy_slot(slot, "reads") if mode == "own" else self.conns[slot]
        leases = [self.pick(conn, s, mode, conn.reads) for s in sels]
        if twice:
            leases += leases
        self.note(f"release slot={slot} leases={leases} corrupt={corrupt}")
        self.release_checked(conn, [[lid, corrupt] for lid in leases], f"release slot {slot}")

    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=6))
    def get(self, slot: int, keys: list[int]) -> None:
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        self.note(f"get slot={slot} keys={keys}")
        try:
            got = conn.client.get(ks)
        except ConnectionLostError as e:
            raise AssertionError(f"get on slot {slot} got no answer: {e}") from e
        for k, v in zip(ks, got):
            if v is not None:
                self.check_verified(conn, k, bytes(v), f"get slot {slot}")
            elif self.pairs.get((conn.space, k)) and not self.good(conn.space, k):
                self.volatile.add((conn.space, k))  # the client reported it corrupt

    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=6))
    def get_inline(self, slot: int, keys: list[int]) -> None:
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        self.note(f"get_inline slot={slot} keys={keys}")
        ok, answer = conn.call(Op.GET_INLINE, ks)
        assert ok, f"GET_INLINE answered {answer}"
        self.take_inline_get(conn, ks, answer, f"GET_INLINE slot {slot}")

    def take_inline_get(self, conn: Conn, ks: list[bytes], answer: object, what: str) -> None:
        assert isinstance(answer, list) and len(answer) == len(ks), f"{what}: {answer!r}"
        cut = answer.index(False) if False in answer else len(answer)
        assert all(b is False for b in answer[cut:]), f"{what}: blocks not sent must end the answer: {answer!r}"
        sent = sum(len(b) for b in answer[:cut] if isinstance(b, bytes))
        if cut < len(answer):
            seen("get_inline cut short")
            assert sent > MAX_FRAME - 1024 - 16 * len(ks) - max(SIZES) or (cut == 1 and answer[0] is None), (
                f"{what}: answer cut short after {sent} bytes")
        for k, b in zip(ks[:cut], answer[:cut]):
            seen("get_inline " + ("miss" if b is None else "hit"))
            assert b is None or isinstance(b, bytes), f"{what}: item {b!r}"
            self.check_verified(conn, k, b, what)

    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=0, max_size=4))
    def lookup(self, slot: int, keys: list[int]) -> None:
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        self.note(f"lookup slot={slot} keys={keys}")
        ok, answer = conn.call(Op.LOOKUP, ks)
        assert ok, f"LOOKUP answered {answer}"
        self.check_lookup(conn, keys, answer, f"LOOKUP slot {slot}")

    def check_lookup(self, conn: Conn, keys: list[int], answer: object, what: str) -> None:
        assert isinstance(answer, list) and len(answer) == 2, f"{what}: {answer!r}"
        n, runs = answer
        assert 0 <= n <= len(keys) and sum(r[1] for r in runs) == n, f"{what}: {answer!r}"
        assert all(r[0] in ("dram", "disk") for r in runs), f"{what}: {answer!r}"
        for r in runs:
            seen(f"lookup found in {r[0]}")
        for i in keys[:n]:
            assert self.pairs.get((conn.space, self.keys[i])), (
                f"{what}: slot {conn.slot} ({conn.tenant}) finds key {i}, never stored in space {conn.space}")
            assert (conn.space, self.keys[i]) not in self.absent, (
                f"{what}: slot {conn.slot} ({conn.tenant}) finds key {i}, removed since it was stored")

    # ------------------------------------------------------------------ rules: pins, removal
    @rule(slot=st.integers(0, len(SLOTS) - 1), key=st.integers(0, N_KEYS - 1))
    def pin(self, slot: int, key: int) -> None:
        conn = self.conns[slot]
        k = self.keys[key]
        self.note(f"pin slot={slot} key={key}")
        ok, answer = conn.call(Op.PIN, [k])
        assert ok and answer in (0, 1), f"PIN answered {answer}"
        if answer:
            assert self.pairs.get((conn.space, k)), f"PIN took key {key}, never stored in space {conn.space}"
            assert (conn.space, k) not in self.absent, f"PIN took key {key}, removed since it was stored"
            conn.pins[k] += 1

    @rule(slot=st.integers(0, len(SLOTS) - 1), key=st.integers(0, N_KEYS - 1))
    def unpin(self, slot: int, key: int) -> None:
        conn = self.conns[slot]
        k = self.keys[key]
        self.note(f"unpin slot={slot} key={key}")
        ok, answer = conn.call(Op.UNPIN, [k])
        assert ok and answer in (0, 1), f"UNPIN answered {answer}"
        held = conn.pins[k]
        if not held:
            assert answer == 0, f"UNPIN of key {key} on slot {slot}, which holds no pin on it, answered {answer}"
        elif (conn.space, k) in self.volatile:
            conn.pins[k] = held - 1 if answer else 0
        else:
            assert answer == 1, f"UNPIN of key {key} on slot {slot}, which pins it {held} times, answered 0"
            conn.pins[k] = held - 1
        if not conn.pins[k]:
            del conn.pins[k]

    @rule(slot=st.integers(0, len(SLOTS) - 1), keys=st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=2),
          reader=st.none() | st.integers(0, len(SLOTS) - 1), reput=st.none() | st.sampled_from(SIZES))
    def remove(self, slot: int, keys: list[int], reader: int | None = None, reput: int | None = None) -> None:
        """REMOVE, maybe while another connection of the space holds the blocks (its bytes
        must stay), and maybe storing the keys again at once (likely in the room just freed)."""
        conn = self.conns[slot]
        ks = [self.keys[i] for i in keys]
        if reader is not None and self.conns[reader].shm and self.conns[reader].space == conn.space:
            self.acquire(reader, keys, hold=True)
        self.note(f"remove slot={slot} keys={keys}")
        ok, answer = conn.call(Op.REMOVE, ks)
        assert ok, f"REMOVE answered {answer}"
        self.check_remove(conn, keys, answer, f"REMOVE slot {slot}")
        if answer == len(set(keys)):
            # gone at once for new readers, and for good (until stored again)
            ok, found = conn.call(Op.LOOKUP, ks[:1])
            assert ok and found == [0, []], f"key {keys[0]} still found after its removal: {found}"
            for k in ks:
                self.absent.add((conn.space, k))
                self.pairs[(conn.space, k)] = set()
        if answer and reader is not None and any(r.key in ks for r in self.conns[reader].reads.values()):
            seen("removed while read")
        if reput is not None:
            self.put(slot, keys, reput, 1)

    def check_remove(self, conn: Conn, keys: list[int], answer: object, what: str) -> None:
        mine = {i for i in keys if conn.tenant in self.stored_by.get((conn.space, self.keys[i]), ())}
        assert isinstance(answer, int) and 0 <= answer <= len(mine), (
            f"{what}: slot {conn.slot} ({conn.tenant}) removed {answer} of keys {keys}; its tenant stored only "
            f"{sorted(mine)} of them in space {conn.space}")
        seen(f"remove answered {answer}")
        if answer:
            for i in keys:
                self.volatile.add((conn.space, self.keys[i]))

    @rule(slot=st.integers(0, len(SLOTS) - 1))
    def share_is_whole(self, slot: int) -> None:
        """A tenant whose connections give back all they hold (read leases, allocations,
        pins) may hold half the tier again: nothing it gave back stayed counted in its share."""
        conn = self.conns[slot]
        if not conn.shm:
            return
        self.note(f"share_is_whole slot={slot}")
        for c in self.conns:
            if c.tenant != conn.tenant:
                continue
            if c.reads:
                self.release_checked(c, [[lid, False] for lid in sorted(c.reads)], "share_is_whole")
            if c.allocs:
                self.abort(c.slot, list(range(len(c.allocs))), "own")
            for i, k in enumerate(self.keys):
                while c.pins[k]:
                    self.unpin(c.slot, i)
                c.pins.pop(k, None)
        per = 16
        size = DRAM_BYTES // 2 // per
        outcomes: list[list[int]] = []

        def whole() -> bool:
            ks = [os.urandom(48) for _ in range(per)]
            ok, got = conn.call(Op.ALLOC, [[k, size, -1, None] for k in ks])
            assert ok and len(got) == per, got
            leases = []
            for status, lid, ext in got:
                if status == ALLOCATED:
                    self.claim(pages_of(self.extents_of(conn, ext, size, "share_is_whole")), "share_is_whole")
                    leases.append(self.new_lease(lid))
            ok, n = conn.call(Op.ABORT, leases)
            assert ok and n == len(leases), n
            outcomes.append([s for s, _, _ in got])
            return int(PutStatus.QUOTA) not in outcomes[-1]

        try:
            wait_until(whole, f"slot {slot} ({conn.tenant}) to hold its whole share", timeout=3.0)
        except AssertionError as e:
            raise AssertionError(f"{e}; the last ALLOC answered {[PutStatus(x).name for x in outcomes[-1]]}") from e
        seen(f"share_is_whole {'all allocated' if set(outcomes[-1]) == {ALLOCATED} else 'some FULL'}")

    @rule(slot=st.integers(0, len(SLOTS) - 1))
    def pinned_blocks_stay(self, slot: int) -> None:
        conn = self.conns[slot]
        for k, n in list(conn.pins.items()):
            if n and (conn.space, k) not in self.volatile:
                ok, found = conn.call(Op.LOOKUP, [k])
                assert ok and found[0] == 1, (
                    f"key {self.keys.index(k)}, pinned by slot {slot} ({conn.tenant}), is gone: {found}")

    # ------------------------------------------------------------------ rules: connections
    @rule(slot=st.integers(0, len(SLOTS) - 1),
          inflight=st.lists(st.tuples(st.sampled_from(["alloc", "acquire", "put_inline"]), st.integers(0, N_KEYS - 1),
                                      st.sampled_from(SIZES)), max_size=3),
          how=st.sampled_from(["close", "close", "bad_frame", "huge_list", "oversize_frame", "bad_hello"]))
    def close_and_reopen(self, slot: int, inflight: list[tuple[str, int, int]], how: str) -> None:
        """Close a connection with what it holds (leases, allocations, pins) and, maybe,
        requests still in flight, or have the sidecar close it (a broken frame, a list past
        what the decoder builds, a HELLO as a tenant nobody is); open another in its slot."""
        conn = self.conns[slot]
        self.note(f"close slot={slot} how={how} (allocs={sorted(conn.allocs)} reads={sorted(conn.reads)} "
                  f"pins={len(conn.pins)}) inflight={inflight}")
        if how != "close":
            self.closed_by_sidecar(conn, how)
            inflight = []
        for kind, i, size in inflight:
            k = self.keys[i]
            if kind == "alloc":
                conn.client._send(Op.ALLOC, [[k, size, -1, None]])  # noqa: SLF001
            elif kind == "acquire":
                conn.client._send(Op.ACQUIRE, [k, k])  # noqa: SLF001
            else:
                conn.client._send(Op.PUT_INLINE, [[k, block_bytes(conn.space, k, size), -1, None]])  # noqa: SLF001
        if inflight:
            # an inline put may have been stored before the close: allow its bytes
            for kind, i, size in inflight:
                if kind == "put_inline":
                    d = block_bytes(conn.space, self.keys[i], size)
                    self.stored(conn, self.keys[i], checksum(memoryview(d)), d)
        self.reopen(conn)

    def closed_by_sidecar(self, conn: Conn, how: str) -> None:
        client = conn.client
        if how == "bad_frame":
            client._sock.sendall(b"\x04\x00\x00\x00\xc1\xc1\xc1\xc1")  # noqa: SLF001
            rid = -1
        elif how == "huge_list":
            rid = client._send(Op.LOOKUP, [1] * (2 * 4096 + 1))  # noqa: SLF001 - past what the decoder builds
        elif how == "oversize_frame":
            client._sock.sendall(HEADER.pack(MAX_FRAME + 1) + b"\x00" * 16)  # noqa: SLF001
            rid = -1
        else:
            rid = client._send(Op.HELLO, 3, "nobody", None)  # noqa: SLF001
        try:
            client._recv(rid)  # noqa: SLF001
        except RemoteError as e:
            assert e.code == "bad_request", f"{how}: answered {e}"
        except ConnectionLostError as e:
            raise AssertionError(f"{how}: the sidecar closed the connection without an answer: {e}") from e
        else:
            raise AssertionError(f"{how}: answered without an error")
        sock = client._sock  # noqa: SLF001
        sock.settimeout(ANSWER_S)
        try:
            while sock.recv(65536):
                pass
        except TimeoutError as e:
            raise AssertionError(f"{how}: the sidecar kept the connection open") from e
        except ConnectionResetError:
            pass

    @rule(ops=st.lists(st.tuples(st.integers(0, len(SLOTS) - 1),
                                 st.sampled_from(["alloc", "put_inline", "acquire", "get_inline", "remove", "lookup",
                                                  "stats"]),
                                 st.lists(st.integers(0, N_KEYS - 1), min_size=1, max_size=2),
                                 st.sampled_from(SIZES)),
                       min_size=2, max_size=12),
          chunk=st.sampled_from([0, 0, 13, 4096]))
    def burst(self, ops: list[tuple[int, str, list[int], int]], chunk: int) -> None:
        """Requests in flight at once, several on one connection too (past its
        ``max_inflight`` of 8), sent by a thread per connection while their answers are
        read: the sidecar runs them in any order. ``chunk``: frames are sent in pieces of that
        many bytes (0: whole), so they arrive split anywhere."""
        writers: set[tuple[str, bytes]] = set()
        plan = []
        for slot, kind, keys, size in ops:
            conn = self.conns[slot]
            if not conn.shm:
                kind = {"alloc": "put_inline", "acquire": "get_inline"}.get(kind, kind)
            if kind in ("alloc", "put_inline"):
                ws = {(conn.space, self.keys[i]) for i in keys}
                if ws & writers or len(ws) != len(keys):
                    continue  # one writer per key in a burst: the model can then say what each may answer
                writers |= ws
            plan.append((conn, kind, keys, size))
        self.note(f"burst chunk={chunk} {[(c.slot, kind, keys, size) for c, kind, keys, size in plan]}")
        frames: dict[int, list[bytes]] = {}
        sent = []
        t0 = time.monotonic()
        for conn, kind, keys, size in plan:
            ks = [self.keys[i] for i in keys]
            if kind == "alloc":
                args: tuple[Any, ...] = (Op.ALLOC, [[k, size, -1, None] for k in ks])
            elif kind == "put_inline":
                args = (Op.PUT_INLINE, [[k, block_bytes(conn.space, k, size), -1, None] for k in ks])
            elif kind == "stats":
                args = (Op.STATS,)
            else:
                args = ({"acquire": Op.ACQUIRE, "get_inline": Op.GET_INLINE, "remove": Op.REMOVE,
                         "lookup": Op.LOOKUP}[kind], ks)
            rid = next(conn.client._ids)  # noqa: SLF001 - this connection's next request id
            frames.setdefault(conn.slot, []).append(encode([int(args[0]), rid, *args[1:]]))
            sent.append((conn, kind, keys, size, rid))
        failures: list[BaseException] = []

        def send(conn: Conn, data: list[bytes]) -> None:
            try:
                stream = b"".join(data)
                step = chunk or len(stream)
                for pos in range(0, len(stream), step):
                    conn.client._sock.sendall(stream[pos : pos + step])  # noqa: SLF001
            except OSError as e:
                failures.append(e)

        for slot in frames:
            self.conns[slot].client._sock.settimeout(ANSWER_S)  # noqa: SLF001
        threads = [threading.Thread(target=send, args=(self.conns[slot], data), daemon=True)
                   for slot, data in frames.items()]
        for t in threads:
            t.start()
        got: dict[tuple[int, int], list[Any]] = {}
        try:
            for conn, kind, keys, size, rid in sent:
                while (conn.slot, rid) not in got:
                    body = conn.recv_frame()
                    got[(conn.slot, body[0])] = body
        finally:
            for t in threads:
                t.join(ANSWER_S)
        assert not failures, f"burst: sending failed: {failures}"
        answers = []
        for conn, kind, keys, size, rid in sent:
            _, status, result = got[(conn.slot, rid)]
            assert status == 0, f"burst: {kind} on slot {conn.slot} answered {result}"
            answers.append((conn, kind, keys, size, result))
        # writes first: a read or removal in the burst may have come after them
        for conn, kind, keys, size, answer in answers:
            ks = [self.keys[i] for i in keys]
            if kind == "alloc":
                self.take_alloc_answer(conn, [(k, size) for k in ks], answer, f"burst ALLOC slot {conn.slot}", t0)
            elif kind == "put_inline":
                self.take_inline_answer(conn, ks, [block_bytes(conn.space, k, size) for k in ks], answer,
                                        f"burst PUT_INLINE slot {conn.slot}")
        for conn, kind, keys, size, answer in answers:
            ks = [self.keys[i] for i in keys]
            what = f"burst {kind} slot {conn.slot}"
            if kind == "stats":
                assert isinstance(answer, dict) and answer["sessions"] == len(self.conns) + 1, answer
            elif kind == "acquire":
                self.take_acquire_answer(conn, ks, answer, hold=False, what=what)
            elif kind == "get_inline":
                self.take_inline_get(conn, ks, answer, what)
            elif kind == "remove":
                self.check_remove(conn, keys, answer, what)
            elif kind == "lookup":
                self.check_lookup(conn, keys, answer, what)

    @rule()
    def leases_lapse(self) -> None:
        """Let every allocation held lapse (once an example: it takes up to a second)."""
        allocs = self.allocs()
        if self.lease_s >= 5 or self.waited or all(a.lapsed for a in allocs):
            return
        self.waited = True
        self.note(f"leases_lapse {[a.lease for a in allocs]}")
        wait_until(lambda: self.observer.stats()["lapsed_writes"] == len(allocs),
                   f"the {len(allocs)} allocations held to lapse", timeout=ANSWER_S)
        for a in allocs:
            a.lapsed = True

    # ------------------------------------------------------------------ rules: bad requests
    @rule(slot=st.integers(0, len(SLOTS) - 1), case=st.sampled_from(sorted([
        "lookup_not_list", "lookup_over_batch", "acquire_short_key", "acquire_str_key", "acquire_over_batch",
        "alloc_negative_size", "alloc_zero_size", "alloc_huge_size", "alloc_str_size", "alloc_float_size",
        "alloc_bool_size", "alloc_bad_after_good", "alloc_short_item", "alloc_bad_parent", "alloc_hints_not_map",
        "alloc_engine_garbage", "commit_str_checksum", "commit_negative_checksum", "commit_good_then_bad",
        "commit_wrong_width", "commit_not_list", "release_str_id", "release_float_id", "release_bool_id",
        "release_wrong_width", "abort_str", "abort_not_list", "pin_bad_key", "unpin_not_list", "remove_bad_key",
        "put_inline_not_bytes", "put_inline_empty", "put_inline_size_as_data", "unknown_op", "stats_extra_arg",
        "lookup_no_arg", "hello_other_tenant", "hello_same_tenant", "hello_old_version", "acquire_device",
        "acquire_duplicates_over_batch", "alloc_duplicate_keys", "alloc_tokens_exceed_size", "alloc_negative_token",
        "hello_other_version",
    ])), key=st.integers(0, N_KEYS - 1), sel=st.integers(0, 100))
    def bad_request(self, slot: int, case: str, key: int, sel: int) -> None:
        conn = self.conns[slot]
        k = self.keys[key]
        k2 = self.keys[(key + 1) % N_KEYS]
        own = sorted(conn.allocs)
        lease = own[sel % len(own)] if own else 10**9
        other = next((t for t in ("a", "c") if t != conn.tenant), "a")
        cases: dict[str, tuple[tuple[Any, ...], Any]] = {
            "lookup_not_list": ((Op.LOOKUP, k), "bad_request"),
            "lookup_over_batch": ((Op.LOOKUP, [k] * (MAX_BATCH + 1)), "bad_request"),
            "acquire_short_key": ((Op.ACQUIRE, [k[:47]]), "bad_request"),
            "acquire_str_key": ((Op.ACQUIRE, ["x" * 48]), "bad_request"),
            "acquire_over_batch": ((Op.ACQUIRE, [k] * (MAX_BATCH + 1)), "bad_request"),
            "acquire_duplicates_over_batch": ((Op.ACQUIRE, [k, k2] * (MAX_BATCH // 2 + 1)), "bad_request"),
            "alloc_negative_size": ((Op.ALLOC, [[k, -5, -1, None]]), [[int(PutStatus.TOO_LARGE), 0, None]]),
            "alloc_zero_size": ((Op.ALLOC, [[k, 0, -1, None]]), [[int(PutStatus.TOO_LARGE), 0, None]]),
            "alloc_huge_size": ((Op.ALLOC, [[k, BLOCK_MAX + 1, -1, None]]), [[int(PutStatus.TOO_LARGE), 0, None]]),
            "alloc_str_size": ((Op.ALLOC, [[k, "100", -1, None]]), "bad_request"),
            "alloc_float_size": ((Op.ALLOC, [[k, 100.0, -1, None]]), "bad_request"),
            "alloc_bool_size": ((Op.ALLOC, [[k, True, -1, None]]), "bad_request"),
            "alloc_bad_after_good": ((Op.ALLOC, [[k, 100, -1, None], [k2, "x", -1, None]]), "bad_request"),
            "alloc_short_item": ((Op.ALLOC, [[k, 100]]), "bad_request"),
            "alloc_bad_parent": ((Op.ALLOC, [[k, 100, 0, b"short"]]), "bad_request"),
            "alloc_hints_not_map": ((Op.ALLOC, [[k, 100, -1, None]], [1, 2]), "bad_request"),
            "alloc_engine_garbage": ((Op.ALLOC, [[k, 100, -1, None, {"hash": 1}]]), "bad_request"),
            "alloc_duplicate_keys": ((Op.ALLOC, [[k, 100, -1, None], [k, 200, -1, None]]), None),
            "alloc_tokens_exceed_size": ((Op.ALLOC, [[k, 100, -1, None, {"hash": 1, "tokens": [1] * 26,
                                                                        "block_size": 16}]]), "bad_request"),
            "alloc_negative_token": ((Op.ALLOC, [[k, 100, -1, None, {"hash": 1, "tokens": [-1],
                                                                    "block_size": 16}]]), "bad_request"),
            "hello_other_version": ((Op.HELLO, 2, conn.tenant, None), "bad_request"),
            "commit_str_checksum": ((Op.COMMIT, [[lease, "x"]]), "bad_request"),
            "commit_negative_checksum": ((Op.COMMIT, [[lease, -1]]), "bad_request"),
            "commit_good_then_bad": ((Op.COMMIT, [[lease, 1], [lease, 2.5]]), "bad_request"),
            "commit_wrong_width": ((Op.COMMIT, [[lease]]), "bad_request"),
            "commit_not_list": ((Op.COMMIT, lease), "bad_request"),
            "release_str_id": ((Op.RELEASE, [["x", False]]), "bad_request"),
            "release_float_id": ((Op.RELEASE, [[1.0, False]]), "bad_request"),
            "release_bool_id": ((Op.RELEASE, [[True, False]]), "bad_request"),
            "release_wrong_width": ((Op.RELEASE, [[1]]), "bad_request"),
            "abort_str": ((Op.ABORT, ["x"]), "bad_request"),
            "abort_not_list": ((Op.ABORT, lease), "bad_request"),
            "pin_bad_key": ((Op.PIN, [k, b"x"]), "bad_request"),
            "unpin_not_list": ((Op.UNPIN, k), "bad_request"),
            "remove_bad_key": ((Op.REMOVE, [k, 5]), "bad_request"),
            "put_inline_not_bytes": ((Op.PUT_INLINE, [[k, "text", -1, None]]), "bad_request"),
            "put_inline_empty": ((Op.PUT_INLINE, [[k, b"", -1, None]]), [int(PutStatus.TOO_LARGE)]),
            "put_inline_size_as_data": ((Op.PUT_INLINE, [[k, 100, -1, None]]), "bad_request"),
            "unknown_op": ((99,), "bad_request"),
            "stats_extra_arg": ((Op.STATS, 1), "bad_request"),
            "lookup_no_arg": ((Op.LOOKUP,), "bad_request"),
            "hello_other_tenant": ((Op.HELLO, 3, other, None), "bad_request"),
            "hello_same_tenant": ((Op.HELLO, 3, conn.tenant, None), None),
            "hello_old_version": ((Op.HELLO, 1, conn.tenant, None), "bad_request"),
            "acquire_device": ((Op.ACQUIRE_DEVICE, [k]), [None]),
        }
        if not conn.shm:
            if case.startswith("hello"):
                cases[case] = ((Op.HELLO, 3, conn.tenant, TCP_TOKEN), None)
            elif cases[case][0][0] in (Op.ALLOC, Op.ACQUIRE):
                cases[case] = (cases[case][0], "bad_request")
        (op, *args), expected = cases[case]
        self.note(f"bad_request slot={slot} case={case} key={key} lease={lease}")
        sent = time.monotonic()
        ok, answer = conn.call(op, *args)
        if case == "alloc_duplicate_keys" and conn.shm:
            assert ok, answer
            self.take_alloc_answer(conn, [(k, 100), (k, 200)], answer, f"{case} slot {slot}", sent)
            assert answer[1][0] != ALLOCATED, f"{case}: the same key allocated twice in one batch: {answer}"
            return
        if case.startswith("hello") and expected is None:
            assert ok and isinstance(answer, dict) and answer["shm"] == conn.shm, answer
            return
        if isinstance(expected, str):
            assert not ok and answer == expected, f"{case} on slot {slot}: answered {answer!r}, not {expected}"
        else:
            assert ok and answer == expected, f"{case} on slot {slot}: answered {answer!r}, not {expected!r}"
        # the connection still serves
        ok, stats = conn.call(Op.STATS)
        assert ok and isinstance(stats, dict), stats

    # ------------------------------------------------------------------ invariants
    @invariant()
    def sidecar_agrees(self) -> None:
        if not self.conns:
            return
        least, most = self.pending()
        allocs = self.allocs()
        lapsed = (sum(a.lapsed for a in allocs), sum(self.may_lapse(a) for a in allocs))
        s = self.observer.stats()
        assert s["sessions"] == len(self.conns) + 1, f"sessions {s['sessions']}, {len(self.conns) + 1} open"
        assert least <= s["pending_writes"] <= most, (
            f"pending writes {s['pending_writes']}, the model's allocations hold {least} to {most} keys")
        assert lapsed[0] <= s["lapsed_writes"] <= lapsed[1], (
            f"lapsed writes {s['lapsed_writes']}, the model says {lapsed[0]} to {lapsed[1]}")
        dram = s["tiers"]["dram"]
        assert 0 <= dram["used_bytes"] <= dram["capacity_bytes"], dram

    @invariant()
    def no_arena_shows_another_space(self) -> None:
        done: set[str] = set()
        for c in self.conns:
            if c.space in done or not c.shm:
                continue
            done.add(c.space)
            v = c.view()
            foreign = {t: s for s, t in TAGS.items() if s != c.space}
            for p in range(DRAM_PAGES):
                head = bytes(v[p * PAGE : p * PAGE + 16])
                assert head not in foreign, f"the arena of space {c.space} shows page {p} of space {foreign[head]}"

    @invariant()
    def held_reads_stay_put(self) -> None:
        for c in self.conns:
            for r in c.reads.values():
                assert c.read(r.extents) == r.data, (
                    f"the bytes of slot {c.slot}'s read lease {r.lease} (key {self.keys.index(r.key)}) changed")

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        try:
            if self.sp is None or self._observer is None:
                return
            for c in self.conns:  # abruptly, with whatever they hold
                c.close()
            self.conns = []
            evicted = any(k.startswith("evicted") and v for k, v in self.observer.stats()["counters"].items())
            seen(f"example {'with' if evicted else 'without'} evictions")
            wait_until(lambda: self._sessions_pending() == (1, 0), "the closed connections' sessions to go",
                       timeout=ANSWER_S)
            assert self.observer.stats()["lapsed_writes"] == 0
            wait_until(self.whole_share_free, "every tenant to hold half the tier again (no lease, pin or share "
                       "left behind)", timeout=ANSWER_S)
            assert_serves(self.sp)
            self.observer.close()
            # it stops cleanly though a client still holds a read lease, a pin and an
            # allocation, and has a request in flight
            with PoolClient(self.sp.socket_path, tenant="a", timeout=ANSWER_S, prefault=False) as last:
                [k, k2] = [os.urandom(48) for _ in range(2)]
                assert last.put([k], [block_bytes("team", k, 5000)]) == [PutStatus.STORED]
                assert last._call(Op.ACQUIRE, [k])[0] is not None  # noqa: SLF001
                assert last.pin([k]) == 1
                assert last._call(Op.ALLOC, [[k2, 5000, -1, None]])[0][0] == ALLOCATED  # noqa: SLF001
                last._send(Op.ACQUIRE, [k, k2])  # noqa: SLF001
                assert self.sp.stop() == 0, self.sp.log_tail()
        finally:
            if self.sp is not None:
                self.sp.stop()

    def whole_share_free(self) -> bool:
        """Half the tier held by a session of ``default`` while a session of each machine
        tenant in turn allocates the other half: only if nothing else holds a page."""
        per = 16
        size = DRAM_BYTES // 2 // per
        base = os.urandom(8)
        ks = [hashlib.blake2b(base + bytes([i]), digest_size=48).digest() for i in range(5 * per)]
        with PoolClient(self.running().socket_path, tenant="default", timeout=ANSWER_S, prefault=False) as d:
            first = d._call(Op.ALLOC, [[k, size, -1, None] for k in ks[:per]])  # noqa: SLF001
            try:
                if any(s != ALLOCATED for s, _, _ in first):
                    self.note(f"teardown: default allocated {[s for s, _, _ in first]}")
                    return False
                for n, tenant in enumerate(("a", "b", "c"), 1):
                    with PoolClient(self.running().socket_path, tenant=tenant, timeout=ANSWER_S, prefault=False) as t:
                        got = t._call(Op.ALLOC, [[k, size, -1, None] for k in ks[n * per : (n + 1) * per]])  # noqa: SLF001
                        t._call(Op.ABORT, [lid for s, lid, _ in got if s == ALLOCATED])  # noqa: SLF001
                        if any(s != ALLOCATED for s, _, _ in got):
                            self.note(f"teardown: {tenant} allocated {[s for s, _, _ in got]}")
                            return False
            finally:
                d._call(Op.ABORT, [lid for s, lid, _ in first if s == ALLOCATED])  # noqa: SLF001
        return True


@pytest.mark.parametrize("lease_s", [30.0, 0.05], ids=["leases-last", "leases-lapse"])
def test_the_local_protocol_follows_its_model(sidecar_factory: Factory, tmp_path: Path, lease_s: float) -> None:
    """The machine on a sidecar whose write leases outlast every example, and on one whose
    leases lapse within one (the key goes to other writers, the room stays held)."""
    ProtocolModel.factory = staticmethod(sidecar_factory)
    ProtocolModel.tmp = tmp_path
    ProtocolModel.lease_s = lease_s
    run_state_machine_as_test(
        ProtocolModel,
        settings=settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck),
                          phases=[Phase.generate] if os.environ.get("KVPOOL_MODEL_NO_SHRINK") else list(Phase)),
    )
    if os.environ.get("KVPOOL_MODEL_STATS"):
        for what, n in sorted(SEEN.items()):
            print(f"{n:8d}  {what}")
