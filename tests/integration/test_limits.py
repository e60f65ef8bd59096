"""Resources a local client can hold are bounded, against a real sidecar process: strangers
that never say HELLO and half-sent frames are dropped, so idle connections cannot lock
out the node's engines."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import struct
import tempfile
import termios
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.errors import RemoteError
from kvpool_client.protocol import HEADER, ErrorCode, Op, PutStatus, encode
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (DEADLINE_S, RawConn, flood_as_nobody, fresh_keys, http_get, payload,
                                       wait_until)

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes waiting in ``sock`` to be read (FIONREAD)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]


def test_idle_strangers_and_half_sent_frames_are_closed(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"api": {"max_connections": 9, "hello_timeout_s": 0.5, "frame_timeout_s": 0.5}})
    idle = [RawConn(sp.socket_path, tenant=None) for _ in range(8)]  # the slots, and no HELLO
    half = RawConn(sp.socket_path)  # the last slot
    half.send_raw(HEADER.pack(1000) + b"\x93\x01")  # a frame that never completes
    try:
        assert all(c.closed_by_peer() for c in idle)  # each read is bounded by DEADLINE_S
        assert half.closed_by_peer()
        keys = fresh_keys(1)
        with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # the node serves again
            assert c.put(keys, [payload(keys[0], 1000)]) == [PutStatus.STORED]
    finally:
        for c in (*idle, half):
            c.close()


def test_a_half_sent_frame_is_timed_again_after_backpressure(sidecar_factory: Factory) -> None:
    """Reading pauses while a client leaves its answers unread, and the timer of a partial
    frame stops with it; once the client reads them, the frame left half sent is timed again."""
    sp = sidecar_factory({"api": {"frame_timeout_s": 0.5}})
    with RawConn(sp.socket_path) as c:
        # 20,000 answers of about 180 bytes: far more than the socket holds
        c.send_raw(b"".join(encode([int(Op.STATS), 100 + i]) for i in range(20000)) + HEADER.pack(1000) + b"\x93")
        # unread until the socket is full of answers: the sidecar has stopped writing to it,
        # and reading from the client, with the half-sent frame in its buffer (a Unix socket
        # holds a little under 32 KiB of them, fewer the larger each answer: 32,715 bytes of
        # answers of about 200 bytes here)
        wait_until(lambda: _unread_bytes(c.sock) >= 24 * 1024, "answers to fill the socket")
        answers = 0
        while answers < 20000 and c.recv() is not None:
            answers += 1
        assert answers == 20000 and c.closed_by_peer()


def test_a_client_whose_writes_end_part_way_through_frames_keeps_its_connection(sidecar_factory: Factory) -> None:
    """Each write completes a frame and starts the next (a client streaming large requests
    reads and writes in pieces that do not fall on frame boundaries): the part left over is
    timed from the frame completed before it, not from the first partial frame ever
    buffered. Forty frames at 50 ms apart take four frame timeouts."""
    sp = sidecar_factory({"api": {"frame_timeout_s": 0.5}})
    frames = [encode([int(Op.STATS), 100 + i]) for i in range(41)]
    with RawConn(sp.socket_path) as c:
        c.send_raw(frames[0][:5])
        for i in range(1, len(frames)):
            time.sleep(0.05)  # the pace of the client under test, not a wait for the sidecar
            c.send_raw(frames[i - 1][5:] + frames[i][:5])
            answer = c.recv()
            assert answer is not None and answer[:2] == [100 + i - 1, 0], (i, answer)


def test_a_greeted_idle_client_keeps_its_connection(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"api": {"hello_timeout_s": 0.3, "frame_timeout_s": 0.3}})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        keys = fresh_keys(1)
        assert c.put(keys, [payload(keys[0], 100)]) == [PutStatus.STORED]
        with RawConn(sp.socket_path, tenant=None) as stranger:  # its closing proves the timeout passed
            assert stranger.closed_by_peer()
        assert c.lookup(keys).prefix == 1


def test_one_client_holds_at_most_its_share_of_dram(sidecar_factory: Factory) -> None:
    """The default share (half the DRAM tier) against a real sidecar: a client that pins
    and allocates all it can leaves the other half to the other tenants; another connection
    of its own tenant gets nothing more."""
    sp = sidecar_factory({"dram": {"size_bytes": "8Mi", "page_bytes": "64Ki"}, "api": {"max_session_share": 0.5},
                          "tenants": [{"name": "default"}, {"name": "b", "key_space": "default"}]})
    block = 256 * 1024
    keys = fresh_keys(64)  # 8 MiB of blocks of 128 KiB: a put the client sends whole (kvpool_client.pipeline)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as greedy, \
            PoolClient(sp.socket_path, tenant="b", timeout=DEADLINE_S) as other:  # another tenant
        got = greedy.put(keys, [payload(k, block // 2) for k in keys])  # one batch: the whole tier
        assert got.count(PutStatus.STORED) == 32 and got.count(PutStatus.QUOTA) == 32
        stored = [k for k, g in zip(keys, got) if g == PutStatus.STORED]
        assert greedy.pin(stored) == 32  # half the tier, pinned: its share
        mine = fresh_keys(8)
        assert other.put(mine, [payload(k, block) for k in mine]) == [PutStatus.STORED] * 8
        assert greedy.put(fresh_keys(1), [b"x" * block]) == [PutStatus.QUOTA]
        assert other.lookup(mine).prefix == 8
        with PoolClient(sp.socket_path, timeout=DEADLINE_S) as twin:  # greedy's tenant, new connection
            assert twin.put(fresh_keys(1), [b"y" * block]) == [PutStatus.QUOTA]


def test_a_share_is_counted_in_the_pages_blocks_take_not_in_their_bytes(sidecar_factory: Factory) -> None:
    """Blocks of one byte each take a whole page: a client that allocates and pins them can
    hold no more pages than its share, however few bytes they are."""
    sp = sidecar_factory({"dram": {"size_bytes": "8Mi", "page_bytes": "64Ki"}, "api": {"max_session_share": 0.5},
                          "tenants": [{"name": "default"}, {"name": "b", "key_space": "default"}]})
    keys = fresh_keys(100)  # 100 pages of a 128-page tier, 100 bytes
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as greedy, \
            PoolClient(sp.socket_path, tenant="b", timeout=DEADLINE_S) as other:
        got = greedy.put(keys, [b"z"] * len(keys))  # one batch: its leases hold a page each
        assert got.count(PutStatus.STORED) == 64 and got.count(PutStatus.QUOTA) == 36
        assert greedy.pin(keys) == 64  # half the tier's pages, pinned: its share
        mine = fresh_keys(60)
        assert other.put(mine, [payload(k, 64 * 1024) for k in mine]) == [PutStatus.STORED] * 60
        assert other.lookup(mine).prefix == 60 and greedy.lookup(keys[:64]).prefix == 64


def test_strangers_at_the_connection_limit_make_room_for_a_new_client(sidecar_factory: Factory) -> None:
    """Connections that never say HELLO cannot keep clients out: at the limit, each new
    connection closes the oldest of them (a client says HELLO as it connects)."""
    sp = sidecar_factory({"api": {"max_connections": 8, "hello_timeout_s": 30}})
    idle = [RawConn(sp.socket_path, tenant=None) for _ in range(8)]  # every slot, and no HELLO
    try:
        keys = fresh_keys(4)
        clients = [PoolClient(sp.socket_path, timeout=DEADLINE_S) for _ in range(4)]
        try:
            for c, k in zip(clients, keys):
                assert c.put([k], [payload(k, 1000)]) == [PutStatus.STORED]
            assert all(c.closed_by_peer() for c in idle[:4])  # the oldest strangers made the room
        finally:
            for c in clients:
                c.close()
    finally:
        for c in idle:
            c.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to flood the socket as another user")
def test_clients_get_in_while_another_user_floods_the_socket(sidecar_factory: Factory) -> None:
    """A process needing no credentials that connects in a loop, non-blocking, keeps the
    listen backlog full; at the limit each of its connections had ended the oldest stranger
    of any user, an engine's connected a moment before its HELLO came. A client that waits
    in the backlog (a blocking connect) now gets in and through its HELLO, every time: the
    flood ends only its own."""
    shared = tempfile.mkdtemp(prefix="kvpool-flood-")  # (pytest's own are root's alone)
    os.chmod(shared, 0o755)
    flood = None
    try:
        sp = sidecar_factory({"api": {"max_connections": 4, "socket_path": os.path.join(shared, "kvpool.sock"),
                                      "socket_mode": 0o666}})
        with RawConn(sp.socket_path) as first, RawConn(sp.socket_path) as second:  # two slots greeted
            flood = flood_as_nobody(sp.socket_path)  # and the other two its, again and again
            for _ in range(30):
                with RawConn(sp.socket_path, blocking_connect=True) as c:  # says HELLO: its status is 0
                    assert c.call(int(Op.STATS))[1] == 0
            assert first.call(int(Op.STATS))[1] == 0 and second.call(int(Op.STATS))[1] == 0
    finally:
        if flood is not None:
            flood.kill()
        shutil.rmtree(shared, ignore_errors=True)


def _open_fds(sp: SidecarProcess) -> int:
    try:
        return len(os.listdir(f"/proc/{sp.pid}/fd"))
    except PermissionError:  # (the sidecar is undumpable: only root lists its descriptors)
        pytest.skip("counts the sidecar's descriptors from /proc, which only root may")


def _flood_unread(conn: RawConn, frames: bytes) -> None:
    """Send ``frames`` until the socket takes no more; their answers are never read."""
    conn.sock.setblocking(False)
    with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):  # (full; or closed for room)
        for _ in range(64):
            conn.sock.send(frames)


def test_strangers_that_never_read_their_answers_are_gone_once_closed(sidecar_factory: Factory) -> None:
    """Strangers that send requests before HELLO (each answered "say HELLO first") and never
    read the answers: closed at the hello timeout, their connections had waited for the
    answers to be read, for good, each keeping its slot, session and descriptor, so every
    engine after them was refused. They are gone at the timeout, and so is each stranger
    closed to make room for a new client."""
    sp = sidecar_factory({"api": {"max_connections": 8, "hello_timeout_s": 1.0}})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:  # (the sidecar's own descriptors, settled)
        c.lookup(fresh_keys(1))
    before = _open_fds(sp)
    flood = encode([int(Op.LOOKUP), 1, []]) * 2000
    strangers = [RawConn(sp.socket_path, tenant=None) for _ in range(12)]  # 4 make room, closing the oldest
    try:
        for s in strangers:
            _flood_unread(s, flood)
        wait_until(lambda: _open_fds(sp) <= before, "the strangers' connections to be gone")
        keys = fresh_keys(1)
        with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
            assert c.put(keys, [payload(keys[0], 1000)]) == [PutStatus.STORED]
    finally:
        for s in strangers:
            s.close()


def _refused_at_hello(sp: SidecarProcess, tenant: str) -> RemoteError:
    with pytest.raises(RemoteError) as refused:
        PoolClient(sp.socket_path, tenant=tenant, timeout=DEADLINE_S)
    return refused.value


def test_one_tenants_clients_cannot_take_every_connection(sidecar_factory: Factory) -> None:
    """Past its share of the slots a tenant's new client is answered UNAVAILABLE at HELLO and
    closed; the other tenants still connect, and a slot the tenant gives back is its again."""
    sp = sidecar_factory({"api": {"max_connections": 8, "max_connections_per_tenant": 3},
                          "tenants": [{"name": "default"}, {"name": "a"}]})
    greedy = [PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) for _ in range(3)]
    try:
        err = _refused_at_hello(sp, "a")
        assert err.code == "unavailable" and "max_connections_per_tenant" in str(err)
        keys = fresh_keys(2)
        with PoolClient(sp.socket_path, timeout=DEADLINE_S) as other:  # another tenant is served
            assert other.put(keys[:1], [payload(keys[0], 1000)]) == [PutStatus.STORED]
        greedy.pop().close()
        with PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) as again:  # the slot came back
            assert again.put(keys[1:], [payload(keys[1], 1000)]) == [PutStatus.STORED]
    finally:
        for c in greedy:
            c.close()


def test_two_tenants_together_cannot_take_every_slot_from_a_third(sidecar_factory: Factory) -> None:
    """Each tenant keeps a reserve of slots: once a tenant holds its own, it may not take the
    slots the other tenants have not used of theirs, so the third still connects."""
    sp = sidecar_factory({"api": {"max_connections": 9, "reserved_connections_per_tenant": 2},
                          "tenants": [{"name": "default"}, {"name": "a"}, {"name": "b"}]})
    held = [PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) for _ in range(5)]
    try:
        held += [PoolClient(sp.socket_path, tenant="b", timeout=DEADLINE_S) for _ in range(2)]  # b's reserve
        err = _refused_at_hello(sp, "b")
        assert err.code == "unavailable" and "reserved_connections_per_tenant" in str(err)
        assert _refused_at_hello(sp, "a").code == "unavailable"
        keys = fresh_keys(2)
        late = [PoolClient(sp.socket_path, timeout=DEADLINE_S) for _ in range(2)]  # the third's reserve
        held += late
        for client, key in zip(late, keys):
            assert client.put([key], [payload(key, 1000)]) == [PutStatus.STORED]
    finally:
        for c in held:
            c.close()


def test_a_node_with_several_tenants_caps_each_at_three_quarters_of_the_slots(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"api": {"max_connections": 8}, "tenants": [{"name": "default"}, {"name": "a"}]})
    greedy = [PoolClient(sp.socket_path, tenant="a", timeout=DEADLINE_S) for _ in range(6)]
    try:
        assert _refused_at_hello(sp, "a").code == "unavailable"
        others = [PoolClient(sp.socket_path, timeout=DEADLINE_S) for _ in range(2)]  # the last two slots
        for c in others:
            c.close()
    finally:
        for c in greedy:
            c.close()


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (read until EOF, each read bounded)."""
    s.settimeout(DEADLINE_S)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def test_half_sent_http_requests_neither_last_nor_keep_a_probe_out(sidecar_factory: Factory) -> None:
    """HTTP connections that never finish a request are closed after ``api.http_deadline_s``,
    and at ``api.http_max_connections`` a new one closes the oldest: /healthz still answers."""
    sp = sidecar_factory({"api": {"http_max_connections": 8, "http_deadline_s": 2.0}})
    port = sp.ready["http_port"]
    slow = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) for _ in range(8)]
    try:
        for s in slow:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the end of the headers
        status, _ = http_get(port, "/healthz")  # the ninth: the oldest made room for it
        assert status == 200
        assert _closed_by_server(slow[0])
        assert all(_closed_by_server(s) for s in slow[1:])  # past the deadline
    finally:
        for s in slow:
            s.close()


def test_an_http_request_with_a_body_is_refused_and_closed_at_once(sidecar_factory: Factory) -> None:
    """The HTTP endpoints take no body: a request that announces gigabytes of one is answered
    413 and closed, not read (aiohttp had read and dropped what came until the connection's
    deadline, gigabytes a second of the sidecar's CPU). The next probe is answered."""
    sp = sidecar_factory({"api": {"http_deadline_s": 60.0}})
    port = sp.ready["http_port"]
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n" + b"x" * 65536)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(65536):  # until the server closes (its deadline is 60 s away)
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:80]
    status, _ = http_get(port, "/healthz")
    assert status == 200


def test_clients_that_never_read_their_answers_cannot_make_the_sidecar_hold_more_than_its_bound(
        sidecar_factory: Factory) -> None:
    """Four connections each ask for 40 MiB of inline answers and read none: past
    ``api.max_unread_bytes`` across them, the one holding the most is aborted (its answers
    dropped), and a client that reads is served whole meanwhile."""
    sp = sidecar_factory({"api": {"max_frame_bytes": "4Mi", "max_unread_bytes": "4Mi"}})
    keys = fresh_keys(8)
    datas = [payload(k, 256 << 10) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as good:
        assert good.put(keys, datas) == [PutStatus.STORED] * 8
        slow = [RawConn(sp.socket_path) for _ in range(4)]
        try:
            for c in slow:
                for _ in range(20):
                    c.request(int(Op.GET_INLINE), [k.raw for k in keys])  # 2 MiB each
            aborted = wait_until(lambda: good.stats()["unread_aborted"], "a connection aborted")
            assert [bytes(m) if m is not None else None for m in good.get(keys)] == datas
            closed = sum(c.closed_by_peer() for c in slow)  # a slow one that stays reads all it asked for
            assert closed == good.stats()["unread_aborted"] >= aborted >= 1
        finally:
            for c in slow:
                c.close()


def test_clients_that_leave_frames_unfinished_cannot_make_the_sidecar_hold_more_than_its_bound(
        sidecar_factory: Factory) -> None:
    """Five greeted connections each send all but the last byte of a 3 MiB frame: past
    ``api.max_unread_bytes`` of requests not yet whole, across them, the ones holding the
    most are aborted, and a client that completes its frames is served meanwhile."""
    sp = sidecar_factory({"api": {"max_frame_bytes": "4Mi", "max_unread_bytes": "8Mi"}})
    keys = fresh_keys(2)
    datas = [payload(k, 64 << 10) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as good:
        assert good.put(keys, datas) == [PutStatus.STORED] * 2
        frame = encode([int(Op.STATS), 1, b"\0" * (3 << 20)])
        hoarders = [RawConn(sp.socket_path) for _ in range(5)]
        try:
            for c in hoarders:
                c.send_raw(frame[:-1])
            def aborted_so_far() -> int | None:
                n: int = good.stats()["inbound_aborted"]
                return n if n >= 3 else None

            aborted = wait_until(aborted_so_far, "three connections aborted")
            assert [bytes(m) if m is not None else None for m in good.get(keys)] == datas
            for c in hoarders:
                c.sock.settimeout(1.0)  # an aborted one reads EOF at once; one kept waits this long
            closed = sum(c.closed_by_peer() for c in hoarders)
            assert closed == good.stats()["inbound_aborted"] >= aborted >= 3  # at most 2 x 3 MiB kept
        finally:
            for c in hoarders:
                c.close()


_EMPTY_MAP, _SHORT_STRING = b"\x80", b"\xa2ab"
#: A map of 64 entries (the most a map may have), and a list of 16 short strings: each had
#: counted as one object (31,000 such maps of extension values held the loop 7 s a frame).
_FULL_MAP = b"\xde\x00\x40" + b"".join(b"\xa3k" + f"{i:02}".encode() + b"\x01" for i in range(64))
_SHORT_LIST = b"\x9f" + b"\xa1x" * 15


def _refused_as_built(sp: SidecarProcess, item: bytes, n: int, rows: int, why: str) -> None:
    """A LOOKUP frame of ``rows`` lists of ``n`` copies of ``item`` is refused, naming ``why``,
    and its connection closed."""
    row = b"\xdc" + n.to_bytes(2, "big") + item * n
    with RawConn(sp.socket_path) as bomb:
        bomb.send_body(b"\x93" + bytes([int(Op.LOOKUP), 1]) + b"\xdc" + rows.to_bytes(2, "big") + row * rows)
        answer = bomb.recv()
        assert answer is not None and answer[:2] == [0, int(ErrorCode.BAD_REQUEST)], answer
        assert why in answer[2][1]
        assert bomb.closed_by_peer()


def _full_batch_decodes(sp: SidecarProcess, engine: dict[str, Any]) -> None:
    """An ALLOC of the default api.max_batch (4,096) blocks, each with ``engine`` as its
    identity, is served (and its leases given back)."""
    keys = fresh_keys(4096)
    with RawConn(sp.socket_path) as conn:
        _, status, allocs = conn.call(int(Op.ALLOC), [[k.raw, 4096, -1, None, engine] for k in keys])
        assert status == 0 and len(allocs) == len(keys), allocs
        leases = [a[1] for a in allocs if a[0] == int(PutStatus.ALLOCATED)]
        assert leases and conn.call(int(Op.ABORT), leases)[1:] == [0, len(leases)]


def test_a_frame_of_more_token_ids_than_a_batch_holds_is_refused_as_it_is_built(sidecar_factory: Factory) -> None:
    """Token ids in long lists, five bytes each on the wire and some 36 in memory: 56 MiB of
    them took 503 MiB and held the loop for 0.9 s. The decoder stops past 256 a key of a full
    batch, the connection is closed, and a full batch of 256-token engine blocks still decodes."""
    sp = sidecar_factory({"api": {"max_frame_bytes": "8Mi"}})
    _refused_as_built(sp, b"\xce\x00\x01\x86\xa0", 4096, 300, "more than 1048576 numbers")  # 1,228,800 ids
    _full_batch_decodes(sp, {"hash": bytes(32), "tokens": list(range(1000, 1256)), "block_size": 256})


@pytest.mark.parametrize(("item", "n", "rows"), [(_EMPTY_MAP, 1000, 1000), (_SHORT_STRING, 1000, 1000),
                                                 (_FULL_MAP, 16, 1000), (_SHORT_LIST, 16, 1700)],
                         ids=["empty maps", "short strings", "maps of 64 entries", "lists of 15 strings"])
def test_a_frame_of_more_objects_than_a_batch_holds_is_refused_as_it_is_built(sidecar_factory: Factory,
                                                                              item: bytes, n: int, rows: int) -> None:
    """Empty maps or short strings, one to three bytes each on the wire and some 50 to 64 in
    memory: 56 MiB of empty maps took 4 GiB and seconds of the loop to decode. The decoder
    stops past what a full batch holds, the connection is closed, and a full batch (each with
    an engine identity: counted, and within) still decodes. Rows of 16 maps of 64 entries, or
    of 16 lists of 15 strings, fitted the budget when a map and a list of up to 16 items
    counted as one object each, whatever they held."""
    sp = sidecar_factory({"api": {"max_frame_bytes": "8Mi"}})
    _refused_as_built(sp, item, n, rows, "lists, maps and items")
    # the richest identity a full batch is sized for: every field, and 16 extra keys
    _full_batch_decodes(sp, {"hash": bytes(32), "tokens": list(range(1000, 1016)), "block_size": 16,
                             "parent": bytes(32), "lora_id": 1, "lora_name": "l",
                             "extra_keys": [f"x{i}" for i in range(16)]})


def test_a_frame_of_extension_values_is_refused(sidecar_factory: Factory) -> None:
    """The protocol has no extension types; a value of one was built in Python (2 to 3
    microseconds each): refused at the first, the connection closed."""
    sp = sidecar_factory({"api": {"max_frame_bytes": "8Mi"}})
    _refused_as_built(sp, b"\xd4\x05\x00", 1000, 1000, "extension type 5")
