"""Attacks on the pool through Redis, against real sidecars and a real redis-server: a node
record written without the pool secret is never contacted; a holder that stalls costs the
fetch deadline once, then is skipped for a while instead of on every read."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_py

from kvpool_bench.services import RedisServer
from kvpool_client.client import PoolClient
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.transfer import auth
from tests.integration.poolfixtures import TOKEN, PoolFactory, node_config, pool, redis  # noqa: F401 - fixtures
from tests.integration.support import DEADLINE_S, fresh_keys, wait_until
from tests.unit.store_support import store_key

pytestmark = [pytest.mark.integration, pytest.mark.redis]


class Listener:
    """A TCP port that counts connections; each is held open and never answered."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lis = Listener()
    yield lis
    lis.close()


def plant(r: redis_py.Redis, node: str, address: str, keys: list[bytes], *, sig: str | None, stamp: str) -> None:
    """A node record and holder entries written straight into Redis, as an attacker would:
    under the store keys of ``keys`` (the default tenant's, which anyone can compute)."""
    fields = {"address": address, "heartbeat": stamp, "tiers": json.dumps({}), "hits": "0", "misses": "0",
              "gpus": "[]", "version": "x"}
    if sig is not None:
        fields["sig"] = sig
    r.hset(f"kvp:itest:node:{node}", mapping=fields)
    r.pexpire(f"kvp:itest:node:{node}", 60_000)
    r.sadd("kvp:itest:nodes", node)
    for k in map(store_key, keys):  # the block set and the holders hash field that lookups read
        r.sadd(f"kvp:itest:blk:{k.hex()}", f"{node}@dram")
        r.hset("kvp:itest:held", k, f"{node}@dram")


@pytest.mark.parametrize("forgery", ["unsigned", "wrong-secret", "stale"])
def test_a_node_record_without_the_pool_secret_is_never_contacted(
        pool: PoolFactory, redis: RedisServer, listener: Listener, forgery: str) -> None:
    b = pool("b", "127.0.0.12")
    keys = [k.raw for k in fresh_keys(3)]
    r = redis_py.Redis.from_url(redis.url)
    now = repr(time.time())
    sig = {"unsigned": None,
           "wrong-secret": auth.sign_node(b"not-the-pool-secret-at-all", "itest", "evil", listener.address, now),
           "stale": auth.sign_node(TOKEN.encode(), "itest", "evil", listener.address, repr(time.time() - 3600))}[forgery]
    stamp = repr(time.time() - 3600) if forgery == "stale" else now
    plant(r, "evil", listener.address, keys, sig=sig, stamp=stamp)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as c:
        # the index says it is held elsewhere, but by no node a fetch would contact: no hit
        # promised, and none comes
        assert c.lookup(keys).prefix == 0
        assert c.get(keys) == [None, None, None]
    assert listener.accepted == 0


def test_a_stalling_holder_costs_the_deadline_once_then_is_skipped(
        pool: PoolFactory, redis: RedisServer, listener: Listener) -> None:
    b = pool("b", "127.0.0.12")
    keys = [k.raw for k in fresh_keys(2)]
    r = redis_py.Redis.from_url(redis.url)
    stamp = repr(time.time())
    # a record signed with the secret (a pool member that hangs), at an address that never answers
    plant(r, "hung", listener.address, keys, sig=auth.sign_node(TOKEN.encode(), "itest", "hung", listener.address,
                                                                 stamp), stamp=stamp)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as c:
        assert c.get(keys) == [None, None]
        assert listener.accepted == 1
        for _ in range(3):
            assert c.get(keys) == [None, None]
    assert listener.accepted == 1  # skipped while it backs off: no new connection, no new wait


def test_one_lookup_asks_the_index_about_a_bounded_number_of_keys(pool: PoolFactory) -> None:
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12", api={"max_index_keys": 8})
    keys = fresh_keys(20)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, [b"k" * 1000] * len(keys), chain=True)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        # the index holds all 20 (a's heartbeat publishes them); b asks it about 8 at most
        assert wait_until(lambda: cb.lookup(keys).prefix, "the index to hold a's blocks") == 8
        assert cb.lookup(keys[8:]).prefix == 8  # the rest of the prefix, in the next lookup


def test_a_tenant_past_its_index_rate_misses_and_the_others_do_not(pool: PoolFactory) -> None:
    tenants = [{"name": "default"}, {"name": "greedy", "key_space": "default"}]
    a = pool("a", "127.0.0.11", tenants=tenants)
    # 0.1 key a second: a full bucket lets one lookup through, the next one only 10 s later
    b = pool("b", "127.0.0.12", tenants=tenants, api={"index_keys_per_s": 0.1})
    keys = fresh_keys(6)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, [b"k" * 1000] * len(keys), chain=True)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as polite, \
            PoolClient(b.socket_path, tenant="greedy", timeout=DEADLINE_S) as greedy:
        assert greedy.lookup(keys).prefix == 6  # its bucket starts full (the index holds them)
        flood = [greedy.lookup(keys).prefix for _ in range(20)]
        assert flood == [0] * 20  # past its rate: a miss at once, no index call
        assert greedy.stats()["index_throttled"] == 20
        assert greedy.get(keys) == [None] * 6  # fetches draw on the same budget
        assert polite.get(keys) == [b"k" * 1000] * 6  # another tenant's budget is its own


@pytest.mark.parametrize("fields", [{"tiers": "[]"}, {"tiers": '{"dram": 5}'}, {"tiers": '{"dram": {"used_bytes": "lots"}}'},
                                    {"gpus": "[" * 100_000 + "]" * 100_000}, {"sig": "é" * 64},
                                    {"sig": "f" * 1_000_000, "address": "1:1" * 100_000}])
def test_a_malformed_node_record_is_skipped_and_reads_go_on(pool: PoolFactory, redis: RedisServer, listener: Listener,
                                                            fields: dict[str, str]) -> None:
    """A record written into Redis with fields of the wrong shape (JSON nested past the
    parser's depth, a signature that is not ASCII, fields of megabytes) is skipped: reads from
    the pool's real nodes go on, never an error."""
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12")
    keys = fresh_keys(2)
    data = [b"q" * 5000, b"r" * 6000]
    r = redis_py.Redis.from_url(redis.url)
    plant(r, "evil", listener.address, [], sig=None, stamp=repr(time.time()))
    r.hset("kvp:itest:node:evil", mapping=fields)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(keys, data, chain=True)
    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        wait_until(lambda: cb.lookup(keys).prefix == 2, "the index to hold a's blocks")
        got = cb.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == data
    assert listener.accepted == 0


def test_a_real_nodes_record_with_numbers_past_a_float_never_fails_a_read(pool: PoolFactory,
                                                                          redis: RedisServer) -> None:
    """A writer to Redis rewrites the tiers of a real node's record (not a signed field) with
    ``Infinity``, again and again to win against its heartbeat. Every node's next refresh of
    the records had raised (``int(inf)``), and every lookup and get that went past the local
    prefix, on every node, answered INTERNAL. The record is now malformed, skipped: reads go
    on, the local blocks hit."""
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12")
    remote, local = fresh_keys(2), fresh_keys(2)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        ca.put(remote, [b"q" * 5000, b"r" * 6000], chain=True)
    r = redis_py.Redis.from_url(redis.url)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            r.hset("kvp:itest:node:a", "tiers", '{"dram": {"used_bytes": Infinity, "capacity_bytes": 1}}')
            stop.wait(0.002)

    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        assert cb.put(local, [b"L" * 4096] * 2, chain=True) == [PutStatus.STORED] * 2
        wait_until(lambda: cb.lookup(remote).prefix == 2, "the index to hold a's blocks")
        writer = threading.Thread(target=rewrite, daemon=True)
        writer.start()
        try:
            stop.wait(1.5)  # past the nodes' refresh (1 s)
            for _ in range(3):
                assert cb.lookup(local + remote).prefix >= 2
                got = cb.get(local + remote)
                assert [bytes(g) for g in got[:2] if g is not None] == [b"L" * 4096] * 2
        finally:
            stop.set()
            writer.join()


def test_a_hung_index_leaves_a_lookup_its_local_answer_within_an_engines_timeout(
        redis: RedisServer, tmp_path: Any, sidecar_factory: Any) -> None:  # noqa: F811
    """Redis stops answering (a partition, or a writer's long script): the peers' part of a
    LOOKUP ends at ``peer.lookup_timeout_s`` and the local prefix is the answer, for a client
    with the engine connectors' 1 s lookup timeout. It had run to ``fetch_timeout_s`` (2 s):
    the engine's call timed out, and its connector dropped the connection."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    config = node_config("a", "127.0.0.11", redis.url, token)
    config["peer"]["lookup_timeout_s"] = 0.2
    a = sidecar_factory(config)
    local = fresh_keys(2)
    far = fresh_keys(4)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(local, [b"x" * 4096] * 2, chain=True) == [PutStatus.STORED] * 2
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        with PoolClient(a.socket_path, timeout=1.0, prefault=False) as engine:  # as the connectors do
            for _ in range(2):  # the connection stays usable
                assert engine.lookup(local + far).prefix == 2
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)


def test_fetches_from_a_holder_that_hangs_leave_the_tenants_lookups_their_index_turns(
        pool: PoolFactory, redis: RedisServer, listener: Listener) -> None:
    """Four reads of blocks whose holder (signed, a member) accepts and never answers: each
    fetch had held one of the tenant's four index turns for its whole transfer, so the
    tenant's LOOKUPs (which need a turn within ``peer.lookup_timeout_s``) found no block held
    by a peer, the healthy holder's included. A fetch gives its turn back once the index has
    answered."""
    a = pool("a", "127.0.0.11")
    b = pool("b", "127.0.0.12")
    hung = [k.raw for k in fresh_keys(4)]
    healthy = fresh_keys(3)
    data = [b"h" * 5000, b"i" * 6000, b"j" * 7000]
    r = redis_py.Redis.from_url(redis.url)
    stamp = repr(time.time())
    plant(r, "hung", listener.address, hung, sig=auth.sign_node(TOKEN.encode(), "itest", "hung", listener.address,
                                                                 stamp), stamp=stamp)
    with PoolClient(a.socket_path, timeout=DEADLINE_S) as ca:
        assert ca.put(healthy, data, chain=True) == [PutStatus.STORED] * 3
    got: list[Any] = []

    def read(key: bytes) -> None:
        with PoolClient(b.socket_path, timeout=DEADLINE_S) as c:
            got.append(c.get([key]))

    with PoolClient(b.socket_path, timeout=DEADLINE_S) as cb:
        wait_until(lambda: cb.lookup(healthy).prefix == 3, "the index to hold a's blocks")
        readers = [threading.Thread(target=read, args=(k,)) for k in hung]
        for t in readers:
            t.start()
        try:
            wait_until(lambda: listener.accepted >= 4, "the four fetches to reach the hung holder")
            assert cb.lookup(healthy).prefix == 3  # a turn came: the holder that answers is counted
            assert [bytes(g) if g is not None else None for g in cb.get(healthy)] == data
        finally:
            for t in readers:
                t.join(DEADLINE_S)
    assert got == [[None]] * 4
