"""Tenant identity a client cannot claim, against a real sidecar process: nothing is served
and no descriptor is sent before HELLO; a tenant is proved by the kernel (the client's uid
or gid) or by its token, never by its name; TCP needs a token; a client maps only its own
key space's arena (so no client sees another space's bytes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.errors import RemoteError
from kvpool_client.protocol import HEADER, Op, PutStatus, decode
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, TCP_TOKEN, REPO_ROOT, RawConn, fresh_keys, payload, tcp_tenants

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
ALICE_TOKEN = b"alice-token-0123456789abcdef"


def test_nothing_is_served_before_hello(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(1)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        assert c.put(keys, [payload(keys[0], 5000)]) == [PutStatus.STORED]
    with RawConn(sidecar.socket_path, tenant=None) as conn:  # asserts no descriptor came at accept
        for op, args in ((Op.LOOKUP, [[keys[0].raw]]), (Op.GET_INLINE, [[keys[0].raw]]), (Op.STATS, [])):
            _, status, result = conn.call(int(op), *args)
            assert status != 0 and "HELLO" in result[1], result
        assert conn.hello("default")[1] == 0 and conn.got_fd  # the arena comes with the answer
        _, status, result = conn.call(int(Op.LOOKUP), [keys[0].raw])
        assert status == 0 and result[0] == 1


def test_tcp_needs_a_token_even_for_an_open_tenant(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0},
                          "tenants": [{"name": "default"}, *tcp_tenants(tmp_path, "tok")]})
    port = sp.ready["tcp_port"]
    for tenant, token in (("default", None), ("default", TCP_TOKEN), ("tok", None), ("tok", b"x" * 20)):
        with pytest.raises(RemoteError, match="tenant refused"):
            PoolClient(host="127.0.0.1", port=port, tenant=tenant, token=token, timeout=DEADLINE_S)
    with PoolClient(host="127.0.0.1", port=port, tenant="tok", token=TCP_TOKEN, timeout=DEADLINE_S) as c:
        assert c.stats()["blocks"] == 0


_CHILD = r"""
import json, os, sys
from kvpool_client.client import PoolClient
from kvpool_client.errors import KVPoolError
sock, tenant, token = sys.argv[1], sys.argv[2], sys.argv[3] or None
# the interpreter lives where only root may read: load it, then become another user for good
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
try:
    with PoolClient(sock, tenant=tenant, token=token, timeout=10) as c:
        print(json.dumps({"ok": True, "shm": c.shm, "blocks": c.stats()["blocks"]}))
except KVPoolError as e:
    print(json.dumps({"ok": False, "error": str(e)}))
"""


def as_nobody(sock: str, tenant: str, token: bytes | None = None) -> dict[str, object]:
    """A client in a process of another user (uid 65534), on the same node."""
    p = subprocess.run([sys.executable, "-c", _CHILD, sock, tenant, (token or b"").decode()], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    out: dict[str, object] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_another_user_cannot_claim_a_tenant(sidecar_factory: Factory, tmp_path: Path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="kvpool-ident-"))
    shared.chmod(0o755)  # the other user reaches the socket; the socket's mode lets it connect
    token_file = tmp_path / "alice"
    token_file.write_bytes(ALICE_TOKEN)
    sp = sidecar_factory({"api": {"socket_path": str(shared / "kvpool.sock"), "socket_mode": 0o666},
                          "tenants": [{"name": "default", "uids": [os.getuid()]},
                                      {"name": "bob", "uids": [os.getuid()]},
                                      {"name": "alice", "token_file": str(token_file)},
                                      {"name": "public"}]})
    keys = fresh_keys(2)
    with PoolClient(sp.socket_path, tenant="bob", timeout=DEADLINE_S) as bob:
        assert bob.put(keys, [payload(k, 4000) for k in keys]) == [PutStatus.STORED] * 2
    # claiming bob (a uid rule) or alice (a token) by name alone is refused, in the same words
    for tenant in ("bob", "alice", "default", "nobody-such"):
        got = as_nobody(sp.socket_path, tenant)
        assert got["ok"] is False and "tenant refused" in str(got["error"]), got
    assert as_nobody(sp.socket_path, "alice", b"wrong-token-0123456789")["ok"] is False
    # the right token proves alice; an open tenant takes whoever the socket lets in; each
    # gets its own key space's arena mapped
    for tenant, token in (("alice", ALICE_TOKEN), ("public", None)):
        got = as_nobody(sp.socket_path, tenant, token)
        assert got == {"ok": True, "shm": True, "blocks": 2}, got
    with PoolClient(sp.socket_path, tenant="bob", timeout=DEADLINE_S) as bob:
        assert bob.lookup(keys).prefix == 2  # nothing was lost to the attempts


def test_each_key_space_maps_only_its_own_arena(sidecar_factory: Factory) -> None:
    """Two key spaces churn the same pages of one small DRAM tier; each client's mapping
    holds its own space's blocks and zeros, never a byte of the other space's blocks."""
    page = 64 * 1024
    sp = sidecar_factory({"dram": {"size_bytes": 16 * page, "page_bytes": page}, "policy": {"name": "lru"},
                          "tenants": [{"name": "default"}, {"name": "b"}]})
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as a, \
            PoolClient(sp.socket_path, tenant="b", timeout=DEADLINE_S) as b:
        assert a.shm and b.shm and a.info["arena_bytes"] == b.info["arena_bytes"] == 16 * page
        written: dict[str, list[bytes]] = {"a": [], "b": []}
        for rnd, n in enumerate((8, 8, 8, 3)):  # a put of 8 takes every page of the tier
            for name, c in (("a", a), ("b", b)):
                keys = fresh_keys(n)
                datas = [payload(k, page + 100) for k in keys]
                assert c.put(keys, datas) == [PutStatus.STORED] * n, (rnd, name)
                assert [bytes(g) for g in c.get(keys[-2:]) if g is not None] == datas[-2:]  # zero-copy
                # the get's RELEASE is not waited for: a round trip on the same connection says it
                # was applied (else the other client's put could come first, and find those two
                # blocks still held: FULL)
                c.lookup(keys[:1])
                written[name] += datas
        for mine, other, c in (("a", "b", a), ("b", "a", b)):
            assert c._view is not None  # noqa: SLF001
            mapped = bytes(c._view)  # noqa: SLF001
            assert not [d for d in written[other] if d[:4096] in mapped or d[-4096:] in mapped], \
                f"{mine}'s arena holds bytes of {other}'s blocks"
            assert any(d[:4096] in mapped for d in written[mine])  # the test can see a block at all


def test_several_key_spaces_without_arenas_move_data_inline(sidecar_factory: Factory) -> None:
    max_frame = 64 * 1024
    sp = sidecar_factory({"api": {"max_frame_bytes": max_frame, "shared_arena": "never"},
                          "tenants": [{"name": "default"}, {"name": "b"}]})
    keys = fresh_keys(3)
    datas = [payload(k, 24 * 1024) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert not c.shm
        assert c.put(keys, datas) == [PutStatus.STORED] * 3
        assert [bytes(g) for g in c.get(keys) if g is not None] == datas  # over several answers
    with RawConn(sp.socket_path) as conn:
        assert not conn.got_fd
        rid = conn.request(int(Op.GET_INLINE), [k.raw for k in keys])
        head = conn.sock.recv(HEADER.size, socket.MSG_PEEK)
        assert HEADER.unpack(head)[0] <= max_frame  # the answer stays under the frame limit
        body = conn.recv()
        assert body is not None and body[0] == rid and body[1] == 0
        assert body[2][0] == datas[0] and False in body[2]  # the rest: "not sent, ask again"
