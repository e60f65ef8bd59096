"""Hostile and broken clients against one real sidecar: it answers clearly and keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool_client.aclient import AsyncPoolClient
from kvpool_client.client import PoolClient
from kvpool_client.errors import RemoteError
from kvpool_client.protocol import HEADER, PROTOCOL_VERSION, ErrorCode, Op, PutStatus, encode
from kvpool_sidecar.api.blockinfo import MAX_BLOCK_TOKENS
from kvpool_sidecar.api.framebounds import MAX_MAP_ITEMS, PRE_HELLO_FRAME_BYTES
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import (
    DEADLINE_S,
    TCP_TOKEN,
    RawConn,
    assert_serves,
    fresh_keys,
    payload,
    tcp_tenants,
    wait_until,
)

pytestmark = pytest.mark.integration

MAX_FRAME = 65_536
MAX_BATCH = 16
BLOCK_MAX = 1 << 20
BAD = int(ErrorCode.BAD_REQUEST)


@pytest.fixture(scope="module")
def sp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    """One sidecar for the whole module: every case must leave it healthy for the next."""
    work = tmp_path_factory.mktemp("bad-input")
    proc = SidecarProcess(
        {
            "node_name": "bad-input",
            "max_block_bytes": BLOCK_MAX,
            "dram": {"size_bytes": "8Mi"},
            "api": {"tcp_port": 0, "max_frame_bytes": MAX_FRAME, "max_batch": MAX_BATCH},
            "tenants": tcp_tenants(work),
        },
        workdir=work,
    ).start()
    yield proc
    assert proc.stop() == 0, proc.log_tail()


@pytest.fixture
def healthy(sp: SidecarProcess) -> Iterator[SidecarProcess]:
    """The module's sidecar, checked to serve correct data after the test."""
    yield sp
    assert_serves(sp)


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


def _frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


# ---------------------------------------------------------------------------- broken streams

_KEY = b"k" * 48

STREAM_CASES = {
    "length_over_limit": HEADER.pack(MAX_FRAME + 1) + b"\x00" * 32,
    "length_4GiB": b"\xff\xff\xff\xff" + b"\x00" * 8,
    "not_msgpack": _frame(b"\xc1\xc1\xc1\xc1"),
    "truncated_msgpack": _frame(b"\x93\x01"),
    "trailing_bytes": _frame(_pack([int(Op.STATS), 1]) + b"\x00"),
    "map_body": _frame(_pack({"op": 1, "rid": 1})),
    "int_body": _frame(_pack(7)),
    "str_body": _frame(_pack("hello")),
    "empty_list": _frame(_pack([])),
    "one_item_list": _frame(_pack([1])),
    "str_op": _frame(_pack(["hello", 1])),
    "float_op": _frame(_pack([1.0, 1])),
    "str_rid": _frame(_pack([int(Op.STATS), "x"])),
    "nil_rid": _frame(_pack([int(Op.STATS), None])),
    "bad_utf8": _frame(b"\x92\x01\xa2\xff\xfe"),
    "int_map_key": _frame(_pack([int(Op.LOOKUP), 1, {1: 2}])),
    "deep_nesting": _frame(b"\x91" * 60_000 + b"\x00"),
    "zero_length_frame": _frame(b""),
}


@pytest.mark.parametrize("transport", ["uds", "tcp"])
@pytest.mark.parametrize("case", sorted(STREAM_CASES))
def test_broken_stream_gets_error_then_close(healthy: SidecarProcess, case: str, transport: str) -> None:
    conn = RawConn(healthy.socket_path) if transport == "uds" else RawConn(port=healthy.ready["tcp_port"], token=TCP_TOKEN)
    with conn:
        conn.send_raw(STREAM_CASES[case])
        answer = conn.recv()
        assert answer is not None, "the sidecar closed the connection without an answer"
        rid, status, result = answer
        assert (rid, status) == (0, BAD), answer
        assert result[0] == "bad_request" and isinstance(result[1], str) and result[1]
        assert conn.closed_by_peer(), "the connection must be closed after a broken frame"


def test_frame_over_limit_names_the_limit(healthy: SidecarProcess) -> None:
    with RawConn(healthy.socket_path) as conn:
        conn.send_raw(HEADER.pack(MAX_FRAME + 1))
        answer = conn.recv()
        assert answer is not None
        assert str(MAX_FRAME) in answer[2][1]
        assert conn.closed_by_peer()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(min_size=1, max_size=64))
def test_random_frame_bodies_always_get_an_answer(sp: SidecarProcess, body: bytes) -> None:
    with RawConn(sp.socket_path) as conn:
        conn.send_raw(_frame(body))
        answer = conn.recv()
        assert answer is not None, f"no answer to body {body.hex()}"
        assert isinstance(answer, list) and len(answer) == 3
    assert sp.proc is not None and sp.proc.poll() is None, sp.log_tail()


def test_random_frame_bodies_left_the_sidecar_healthy(healthy: SidecarProcess) -> None:
    with PoolClient(healthy.socket_path, timeout=DEADLINE_S) as c:
        wait_until(lambda: c.stats()["sessions"] == 1, "the fuzzing connections to close")


# ---------------------------------------------------------------------------- bad requests

_K = [k.raw for k in fresh_keys(MAX_BATCH + 1)]
_UNKNOWN = fresh_keys(1)[0].raw
ERR = "error"
OK = "ok"

#: (op, args, expected): ("error", code name) or ("ok", result).
REQUEST_CASES: dict[str, tuple[int, tuple[Any, ...], tuple[str, Any]]] = {
    "unknown_op": (99, (), (ERR, "bad_request")),
    "op_zero": (0, ([_KEY],), (ERR, "bad_request")),
    "negative_op": (-3, (), (ERR, "bad_request")),
    "lookup_no_args": (Op.LOOKUP, (), (ERR, "bad_request")),
    "lookup_extra_arg": (Op.LOOKUP, ([_K[0]], 1), (ERR, "bad_request")),
    "lookup_not_list": (Op.LOOKUP, ("keys",), (ERR, "bad_request")),
    "lookup_over_batch": (Op.LOOKUP, (_K[: MAX_BATCH + 1],), (ERR, "bad_request")),
    "pin_short_key": (Op.PIN, ([b"x" * 47],), (ERR, "bad_request")),
    "pin_long_key": (Op.PIN, ([b"x" * 49],), (ERR, "bad_request")),
    "pin_int_key": (Op.PIN, ([5],), (ERR, "bad_request")),
    "pin_str_key": (Op.PIN, (["x" * 48],), (ERR, "bad_request")),
    "pin_over_batch": (Op.PIN, (_K[: MAX_BATCH + 1],), (ERR, "bad_request")),
    "pin_unknown": (Op.PIN, ([_UNKNOWN],), (OK, 0)),
    "unpin_not_list": (Op.UNPIN, (b"x" * 48,), (ERR, "bad_request")),
    "unpin_unknown": (Op.UNPIN, ([_UNKNOWN],), (OK, 0)),
    "acquire_short_key": (Op.ACQUIRE, ([b"x" * 47],), (ERR, "bad_request")),
    "acquire_over_batch": (Op.ACQUIRE, (_K[: MAX_BATCH + 1],), (ERR, "bad_request")),
    "acquire_unknown": (Op.ACQUIRE, ([_UNKNOWN, _UNKNOWN],), (OK, [None, None])),
    "get_inline_unknown": (Op.GET_INLINE, ([_UNKNOWN],), (OK, [None])),
    "get_inline_bad_key": (Op.GET_INLINE, ([b"x"],), (ERR, "bad_request")),
    "alloc_zero_size": (Op.ALLOC, ([[_K[0], 0, -1, None]],), (OK, [[int(PutStatus.TOO_LARGE), 0, None]])),
    "alloc_negative_size": (Op.ALLOC, ([[_K[0], -5, -1, None]],), (OK, [[int(PutStatus.TOO_LARGE), 0, None]])),
    "alloc_over_block_max": (Op.ALLOC, ([[_K[0], BLOCK_MAX + 1, -1, None]],),
                             (OK, [[int(PutStatus.TOO_LARGE), 0, None]])),
    "alloc_huge_size": (Op.ALLOC, ([[_K[0], 2**62, -1, None]],), (OK, [[int(PutStatus.TOO_LARGE), 0, None]])),
    "alloc_str_size": (Op.ALLOC, ([[_K[0], "10", -1, None]],), (ERR, "bad_request")),
    "alloc_float_size": (Op.ALLOC, ([[_K[0], 10.5, -1, None]],), (ERR, "bad_request")),
    "alloc_bool_size": (Op.ALLOC, ([[_K[0], True, -1, None]],), (ERR, "bad_request")),
    "alloc_nil_size": (Op.ALLOC, ([[_K[0], None, -1, None]],), (ERR, "bad_request")),
    "alloc_short_item": (Op.ALLOC, ([[_K[0], 10, -1]],), (ERR, "bad_request")),
    "alloc_not_list": (Op.ALLOC, ({"k": 1},), (ERR, "bad_request")),
    "alloc_short_key": (Op.ALLOC, ([[b"x" * 47, 10, -1, None]],), (ERR, "bad_request")),
    "alloc_short_parent": (Op.ALLOC, ([[_K[0], 10, 0, b"p"]],), (ERR, "bad_request")),
    "alloc_str_depth": (Op.ALLOC, ([[_K[0], 10, "0", None]],), (ERR, "bad_request")),
    "alloc_over_batch": (Op.ALLOC, ([[k, 10, -1, None] for k in _K],), (ERR, "bad_request")),
    "alloc_no_args": (Op.ALLOC, (), (ERR, "bad_request")),
    "commit_unknown_lease": (Op.COMMIT, ([[123_456_789, 0]],), (OK, [-int(ErrorCode.UNKNOWN_LEASE)])),
    "commit_str_lease": (Op.COMMIT, ([["x", 0]],), (ERR, "bad_request")),
    "commit_short_item": (Op.COMMIT, ([[1]],), (ERR, "bad_request")),
    "commit_not_list": (Op.COMMIT, ("x",), (ERR, "bad_request")),
    "abort_unknown_lease": (Op.ABORT, ([123_456_789],), (OK, 0)),
    "abort_str_lease": (Op.ABORT, (["x"],), (ERR, "bad_request")),
    "release_unknown_lease": (Op.RELEASE, ([[123_456_789, False]],), (OK, 0)),
    "release_short_item": (Op.RELEASE, ([[1]],), (ERR, "bad_request")),
    "release_str_lease": (Op.RELEASE, ([["x", True]],), (ERR, "bad_request")),
    "hello_wrong_version": (Op.HELLO, (PROTOCOL_VERSION + 1, "default"), (ERR, "bad_request")),
    "hello_unknown_tenant": (Op.HELLO, (PROTOCOL_VERSION, "no-such-tenant"), (ERR, "bad_request")),
    "hello_int_tenant": (Op.HELLO, (PROTOCOL_VERSION, 5), (ERR, "bad_request")),
    "hello_no_args": (Op.HELLO, (), (ERR, "bad_request")),
    "put_inline_str_data": (Op.PUT_INLINE, ([[_K[0], "data", -1, None]],), (ERR, "bad_request")),
    "put_inline_empty_data": (Op.PUT_INLINE, ([[_K[0], b"", -1, None]],), (OK, [int(PutStatus.TOO_LARGE)])),
    "put_inline_short_key": (Op.PUT_INLINE, ([[b"x", b"data", -1, None]],), (ERR, "bad_request")),
    "stats_extra_arg": (Op.STATS, (1,), (ERR, "bad_request")),
    # what a writer says about its blocks (protocol 3): malformed refuses the whole put
    "alloc_hints_not_map": (Op.ALLOC, ([[_K[0], 10, -1, None]], [1]), (ERR, "bad_request")),
    "alloc_hints_unknown_field": (Op.ALLOC, ([[_K[0], 10, -1, None]], {"priority": 9}), (ERR, "bad_request")),
    "alloc_hints_long_label": (Op.ALLOC, ([[_K[0], 10, -1, None]], {"label": "x" * 129}), (ERR, "bad_request")),
    "alloc_hints_negative_prompt": (Op.ALLOC, ([[_K[0], 10, -1, None]], {"prompt_blocks": -2}),
                                    (ERR, "bad_request")),
    "alloc_hints_bool_prompt": (Op.ALLOC, ([[_K[0], 10, -1, None]], {"prompt_blocks": True}),
                                (ERR, "bad_request")),
    "alloc_engine_not_map": (Op.ALLOC, ([[_K[0], 10, -1, None, 5]],), (ERR, "bad_request")),
    "alloc_engine_no_hash": (Op.ALLOC, ([[_K[0], 10, -1, None, {"tokens": [1], "block_size": 1}]],),
                             (ERR, "bad_request")),
    "alloc_engine_long_hash": (Op.ALLOC, ([[_K[0], 10, -1, None, {"hash": b"h" * 65, "tokens": [1],
                                                                   "block_size": 1}]],), (ERR, "bad_request")),
    "alloc_engine_big_token": (Op.ALLOC, ([[_K[0], 10, -1, None, {"hash": 1, "tokens": [2**32],
                                                                   "block_size": 1}]],), (ERR, "bad_request")),
    "alloc_engine_many_tokens": (Op.ALLOC, ([[_K[0], 10, -1, None, {"hash": 1, "tokens": [1] * 4097,
                                                                     "block_size": 1}]],), (ERR, "bad_request")),
    "alloc_engine_zero_block_size": (Op.ALLOC, ([[_K[0], 10, -1, None, {"hash": 1, "tokens": [],
                                                                         "block_size": 0}]],), (ERR, "bad_request")),
    "alloc_engine_tokens_over_block": (Op.ALLOC, ([[_K[0], 100, -1, None, {"hash": 1, "tokens": [1] * 26,
                                                                           "block_size": 26}]],), (ERR, "bad_request")),
    "alloc_six_fields": (Op.ALLOC, ([[_K[0], 10, -1, None, None, None]],), (ERR, "bad_request")),
    "put_inline_engine_bad": (Op.PUT_INLINE, ([[_K[0], b"data", -1, None, {"hash": "x"}]],),
                              (ERR, "bad_request")),
    "put_inline_hints_bad": (Op.PUT_INLINE, ([[_K[0], b"data", -1, None]], {"session": 5}), (ERR, "bad_request")),
}

#: HELLOs refused for the tenant they name: answered, then the connection is closed.
_CLOSING_HELLOS = frozenset({"hello_unknown_tenant", "hello_int_tenant"})


def _answers_a_good_hello(conn: RawConn) -> bool:
    """Whether a HELLO the sidecar admits, sent now, is answered (False: it was not read)."""
    try:
        conn.request(int(Op.HELLO), PROTOCOL_VERSION, "default", None)
        return conn.recv() is not None
    except (BrokenPipeError, ConnectionResetError):
        return False


@pytest.mark.parametrize("case", sorted(REQUEST_CASES))
def test_bad_request_gets_clear_error_and_connection_stays(healthy: SidecarProcess, case: str) -> None:
    op, args, (kind, expected) = REQUEST_CASES[case]
    with RawConn(healthy.socket_path, tenant=None if op == Op.HELLO else "default") as conn:
        if op == Op.HELLO and len(args) == 2:
            rid, status, result = conn.hello(args[1], version=args[0])
        else:
            rid, status, result = conn.call(int(op), *args)
        if kind == ERR:
            assert status != 0, f"expected an error, got {result!r}"
            assert status == int(ErrorCode[expected.upper()]), result
            assert result[0] == expected and isinstance(result[1], str) and result[1], result
        else:
            assert status == 0, result
            assert result == expected
        if case in _CLOSING_HELLOS:  # refused for its tenant: one guess of a proof per connection
            assert not _answers_a_good_hello(conn), "a HELLO was served after one refused for its tenant"
            return
        # the same connection keeps working (a HELLO refused for its version or arguments may
        # be followed by a good one)
        if op == Op.HELLO:
            assert conn.hello("default")[1] == 0
        rid2, status2, stats = conn.call(int(Op.STATS))
        assert status2 == 0 and isinstance(stats, dict) and "blocks" in stats
        # nothing was left half-written
        assert stats["pending_writes"] == 0


def test_lookup_with_malformed_keys_never_matches(healthy: SidecarProcess) -> None:
    """A malformed key in a lookup is an error or simply not found; it never ends a match early wrongly."""
    keys = fresh_keys(2)
    with PoolClient(healthy.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, [payload(k, 1000) for k in keys]) == [PutStatus.STORED] * 2
    with RawConn(healthy.socket_path) as conn:
        for bad in (b"x" * 47, keys[0].raw + b"\x00", keys[0].raw[:47], 5, "x" * 48, None, [1]):
            _, status, result = conn.call(int(Op.LOOKUP), [keys[0].raw, bad, keys[1].raw])
            if status:
                assert result[0] == "bad_request", result
            else:
                assert result[0] == 1, f"lookup through malformed key {bad!r} gave {result!r}"


def test_client_sees_clear_remote_errors(healthy: SidecarProcess) -> None:
    with PoolClient(healthy.socket_path, timeout=DEADLINE_S) as c:
        for call in (lambda: c.pin([b"x" * 47]), lambda: c.get([b"x" * 49]), lambda: c.unpin([b""])):
            with pytest.raises(RemoteError) as ei:
                call()
            assert ei.value.code == "bad_request" and "48" in ei.value.message
        keys = fresh_keys(MAX_BATCH + 1)
        raw = [k.raw for k in keys]
        # a request of more keys than api.max_batch is refused whole (the client sends none:
        # it asks for a longer batch in as many requests as it takes)
        items = [[k, 10, -1, None] for k in raw]
        for op, arg in ((Op.LOOKUP, raw), (Op.ACQUIRE, raw), (Op.PIN, raw), (Op.ALLOC, items)):
            with pytest.raises(RemoteError) as ei:
                c._call(op, arg)  # noqa: SLF001
            assert ei.value.code == "bad_request" and str(MAX_BATCH) in ei.value.message
        assert c.lookup(keys[:MAX_BATCH]).prefix == 0, "a refused put must store nothing"
        assert c.lookup(keys).prefix == 0 and c.get(keys) == [None] * len(keys) and c.pin(keys) == 0
        # sizes the pool cannot take are TOO_LARGE, not errors
        k1, k2 = fresh_keys(2)
        assert c.put([k1, k2], [b"", b"z" * (BLOCK_MAX + 1)]) == [PutStatus.TOO_LARGE] * 2
        assert c.lookup([k1]).prefix == 0 and c.lookup([k2]).prefix == 0
        # unknown keys are misses, never bytes
        assert c.get(fresh_keys(3)) == [None, None, None]
        assert c.stats()["pending_writes"] == 0


@pytest.mark.parametrize(("tenant", "version"), [("no-such-tenant", PROTOCOL_VERSION), ("default", 99)])
def test_hello_rejections_via_client(healthy: SidecarProcess, tenant: str, version: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import kvpool_client.client as client_mod

    monkeypatch.setattr(client_mod, "PROTOCOL_VERSION", version)
    with pytest.raises(RemoteError) as ei:
        PoolClient(healthy.socket_path, tenant=tenant, timeout=DEADLINE_S)
    assert ei.value.code == "bad_request"
    # a refusal never says whether a tenant exists
    assert ("tenant refused" in ei.value.message) if version == PROTOCOL_VERSION else ("version" in ei.value.message)


def test_a_hello_refused_for_its_tenant_or_token_closes_the_connection_and_is_counted(
        healthy: SidecarProcess) -> None:
    """One guess of a tenant's proof per connection: a HELLO refused for its tenant or token
    is answered, counted in STATS, and its connection closed, so a HELLO pipelined behind it
    (here with the right token) is never served. One TCP connection had answered 112,000
    wrong tokens a second, none counted or logged. An unknown tenant and a wrong token get
    the same answer, and the clients raise the same error for it as before."""
    port = healthy.ready["tcp_port"]
    with RawConn(port=port, token=TCP_TOKEN) as watcher:

        def refused() -> int:
            _, status, stats = watcher.call(int(Op.STATS))
            assert status == 0, stats
            return int(stats["counters"].get("hello_refused", 0))

        before = refused()
        answers = []
        for tenant, token in (("default", b"wrong-token-0123456789"), ("no-such-tenant", TCP_TOKEN)):
            with RawConn(port=port, tenant=None) as conn:
                conn.send_raw(encode([int(Op.HELLO), 1, PROTOCOL_VERSION, tenant, token])
                              + encode([int(Op.HELLO), 2, PROTOCOL_VERSION, "default", TCP_TOKEN]))
                answers.append(conn.recv())
                assert conn.recv() is None, "a second HELLO was served on a connection refused at its first"
        assert answers[0] == answers[1], answers
        rid, status, (code, message) = answers[0]
        assert (rid, status, code) == (1, BAD, "bad_request") and "tenant refused" in message, answers
        assert refused() == before + 2

        wrong = b"wrong-token-0123456789"
        with pytest.raises(RemoteError) as ei:
            PoolClient(host="127.0.0.1", port=port, token=wrong, timeout=DEADLINE_S)
        assert ei.value.code == "bad_request" and "tenant refused" in ei.value.message

        async def connect() -> None:
            client = await AsyncPoolClient.connect(host="127.0.0.1", port=port, token=wrong, timeout=DEADLINE_S)
            await client.close()

        with pytest.raises(RemoteError) as ei:
            asyncio.run(connect())
        assert ei.value.code == "bad_request" and "tenant refused" in ei.value.message
        assert refused() == before + 4
        # the connection that proved its tenant is served on
        assert watcher.call(int(Op.LOOKUP), [fresh_keys(1)[0].raw])[1] == 0


def test_bad_item_in_alloc_batch_leaves_no_pending_key(healthy: SidecarProcess) -> None:
    """A batch refused for a bad item must not keep the good items' keys reserved."""
    good, other = fresh_keys(2)
    with RawConn(healthy.socket_path) as conn:
        _, status, result = conn.call(int(Op.ALLOC), [[good.raw, 1000, -1, None], [other.raw, "bad", -1, None]])
        assert status == BAD, result
        with PoolClient(healthy.socket_path, timeout=DEADLINE_S) as c:
            data = payload(good, 1000)
            assert c.put([good], [data]) == [PutStatus.STORED], "the key stayed reserved by a refused batch"
            assert bytes(c.get([good])[0]) == data  # type: ignore[arg-type]


def test_tcp_puts_are_cut_to_the_frame_limit(healthy: SidecarProcess) -> None:
    keys = fresh_keys(4)
    with PoolClient(host="127.0.0.1", port=healthy.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as tcp:
        # a block that can never fit one frame is refused by the client, the connection lives
        assert tcp.put([keys[0]], [b"q" * (MAX_FRAME + 10)]) == [PutStatus.TOO_LARGE]
        assert tcp.lookup([keys[0]]).prefix == 0
        # blocks that fit one by one but not together travel in several frames
        datas = [payload(k, MAX_FRAME // 2) for k in keys[1:]]
        assert tcp.put(keys[1:], datas) == [PutStatus.STORED] * 3
        got = tcp.get(keys[1:])
        assert [bytes(g) if g is not None else None for g in got] == datas


def test_unknown_keys_are_misses_on_every_path(healthy: SidecarProcess) -> None:
    unknown = fresh_keys(4)
    with PoolClient(healthy.socket_path, timeout=DEADLINE_S) as uds, \
            PoolClient(host="127.0.0.1", port=healthy.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) as tcp:
        bufs = [bytearray(b"\x55" * 100) for _ in unknown]
        assert uds.get(unknown, into=bufs) == [None] * 4
        assert all(b == bytearray(b"\x55" * 100) for b in bufs)
        assert tcp.get(unknown) == [None] * 4
        assert uds.lookup(unknown).prefix == 0


# ---------------------------------------------------------------------------- strangers and bombs

def test_a_stranger_cannot_send_a_large_frame_before_hello(healthy: SidecarProcess) -> None:
    """Before HELLO only a small frame is read: a stranger announcing a large one is closed
    at once, before the sidecar buffers (or decodes) any of it."""
    with RawConn(healthy.socket_path, tenant=None) as conn:
        conn.send_raw(HEADER.pack(PRE_HELLO_FRAME_BYTES + 1) + b"\x00" * 64)
        answer = conn.recv()
        assert answer is not None and answer[:2] == [0, BAD], answer
        assert "before HELLO" in answer[2][1] and str(PRE_HELLO_FRAME_BYTES) in answer[2][1]
        assert conn.closed_by_peer()
    with RawConn(healthy.socket_path) as greeted:  # after HELLO the configured limit holds
        _, status, _ = greeted.call(int(Op.LOOKUP), [b"k" * 48] * MAX_BATCH)
        assert status == 0


def test_a_list_longer_than_any_request_holds_is_refused_before_it_is_built(healthy: SidecarProcess) -> None:
    """A frame of many tiny objects (a decode bomb: a byte on the wire, a Python object in
    the sidecar) is refused by the decoder's own bounds, not built and then checked."""
    with RawConn(healthy.socket_path) as conn:
        conn.send_body(_pack([int(Op.LOOKUP), 1, [None] * (2 * MAX_BLOCK_TOKENS + 1)]))
        answer = conn.recv()
        assert answer is not None and answer[:2] == [0, BAD] and "max_array_len" in answer[2][1], answer
        assert conn.closed_by_peer()
    with RawConn(healthy.socket_path) as conn:
        conn.send_body(_pack([int(Op.PUT_INLINE), 1, [], {str(i): i for i in range(MAX_MAP_ITEMS + 1)}]))
        answer = conn.recv()
        assert answer is not None and answer[:2] == [0, BAD] and "max_map_len" in answer[2][1], answer


@pytest.mark.parametrize("bad", [-1, -(2**63)])  # (msgpack carries nothing past 2**64 - 1)
def test_a_commit_with_a_checksum_outside_64_bits_commits_nothing(healthy: SidecarProcess, bad: int) -> None:
    """A checksum no block can have is refused with the whole batch: the good item in it is
    not committed either, and both leases can still be aborted."""
    good, other = fresh_keys(2)
    with RawConn(healthy.socket_path) as conn:
        _, status, allocs = conn.call(int(Op.ALLOC), [[good.raw, 4096, -1, None], [other.raw, 4096, -1, None]])
        assert status == 0 and [a[0] for a in allocs] == [int(PutStatus.ALLOCATED)] * 2, allocs
        leases = [a[1] for a in allocs]
        _, status, result = conn.call(int(Op.COMMIT), [[leases[0], 12345], [leases[1], bad]])
        assert status == BAD and "checksum" in result[1], result
        _, status, found = conn.call(int(Op.LOOKUP), [good.raw, other.raw])
        assert status == 0 and found[0] == 0, "a refused batch committed a block"
        _, status, aborted = conn.call(int(Op.ABORT), leases)
        assert (status, aborted) == (0, 2)
