"""kvpool's Mooncake-compatible API on real sidecars: what Mooncake's own behaviour suite
(tests/contract/test_mooncake_api.py) cannot show. How values are split into blocks, what
a failed or partial value leaves, the connection's lifecycle, TCP, threads, and nodes."""

from __future__ import annotations

import ctypes
import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool_client.client import PoolClient
from kvpool_client.mooncake import ErrorCode, KeyMap, MooncakeDistributedStore
from kvpool_client.mooncake.layout import HEADER, Header
from kvpool_sidecar.process import SidecarProcess
from tests.integration.poolfixtures import pool, redis  # noqa: F401 - fixtures
from tests.integration.support import DEADLINE_S, TCP_TOKEN, tcp_tenants, wait_until

pytestmark = pytest.mark.integration

Factory = Callable[..., SidecarProcess]
BLOCK = 64 << 10
SETUP = ("127.0.0.1", "P2PHANDSHAKE", 1 << 30, 1 << 27, "tcp", "", "127.0.0.1:50051")


def blob(n: int) -> bytes:
    return random.Random(n).randbytes(n)


def connect(sp: SidecarProcess, **kw: object) -> MooncakeDistributedStore:
    s = MooncakeDistributedStore(socket_path=sp.socket_path, timeout=DEADLINE_S, **kw)  # type: ignore[arg-type]
    assert s.setup(*SETUP) == 0
    return s


@pytest.fixture
def small_blocks(sidecar_factory: Factory) -> SidecarProcess:
    return sidecar_factory({"max_block_bytes": BLOCK})


@pytest.fixture
def store(small_blocks: SidecarProcess) -> Iterator[MooncakeDistributedStore]:
    s = connect(small_blocks)
    yield s
    s.close()


def blocks(sp: SidecarProcess) -> int:
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        n: int = c.stats()["blocks"]
        return n


def header(sp: SidecarProcess, key: str, namespace: str = "") -> Header:
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        got = c.get([KeyMap(namespace).head(key)])[0]
        assert got is not None
        return Header.parse(bytes(got[: HEADER.size]), got.nbytes)


def test_a_large_value_is_split_into_blocks_and_reassembled(small_blocks: SidecarProcess,
                                                           store: MooncakeDistributedStore) -> None:
    value = blob(5 * BLOCK + 1000)
    assert store.put("big", value) == 0
    h = header(small_blocks, "big")
    assert h.size == len(value) and h.blocks == 6 == blocks(small_blocks)
    assert store.get("big") == value
    assert store.put("big", blob(300_000)) == 0  # held: no blocks written, none left behind
    assert blocks(small_blocks) == 6
    assert store.upsert("big", b"small") == 0  # the old chunks go with the old value
    assert blocks(small_blocks) == 1 and store.get("big") == b"small"
    assert store.remove("big") == 0 and blocks(small_blocks) == 0


def test_a_value_missing_a_block_reads_as_a_miss(small_blocks: SidecarProcess,
                                                 store: MooncakeDistributedStore) -> None:
    value = blob(3 * BLOCK)
    assert store.put("v", value) == 0
    h = header(small_blocks, "v")
    with PoolClient(small_blocks.socket_path, timeout=DEADLINE_S) as c:
        assert c.remove([KeyMap().chunk("v", h.nonce, 2)]) == 1  # as an eviction would
    buf = (ctypes.c_ubyte * len(value))()
    assert store.register_buffer(ctypes.addressof(buf), len(value)) == 0
    assert store.get("v") == b""
    assert store.get_into("v", ctypes.addressof(buf), len(value)) == ErrorCode.OBJECT_NOT_FOUND
    got = store.get_into_ranges([ctypes.addressof(buf)], [["v"]], [[[0, 100]]], [[[0, 2 * BLOCK]]], [[[10, 10]]])
    assert got == [[[10, ErrorCode.OBJECT_NOT_FOUND]]]  # the head's bytes are still whole
    assert store.remove("v") == 0 and blocks(small_blocks) == 0


def test_a_put_that_fails_midway_leaves_no_blocks(sidecar_factory: Factory) -> None:
    # one connection may hold a quarter of the 1 MiB tier: a value of 10 blocks cannot be put
    sp = sidecar_factory({"max_block_bytes": BLOCK, "dram": {"size_bytes": "1Mi"},
                          "api": {"max_session_share": 0.25}})
    s = connect(sp)
    assert s.put("too big", blob(10 * BLOCK)) == ErrorCode.NO_AVAILABLE_HANDLE
    assert blocks(sp) == 0 and s.is_exist("too big") == 0
    assert s.put("fits", blob(2 * BLOCK)) == 0 and blocks(sp) == 3
    s.close()


def test_what_the_pool_holds_under_a_key_is_checked(small_blocks: SidecarProcess,
                                                    store: MooncakeDistributedStore) -> None:
    with PoolClient(small_blocks.socket_path, timeout=DEADLINE_S) as c:
        c.put([KeyMap().head("foreign")], [b"not an object header" * 10])
    assert store.get("foreign") == b""
    assert store.get_size("foreign") == ErrorCode.INVALID_READ
    assert store.get_tensor("foreign") is None


def test_namespaces_and_tenants_keep_objects_apart(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"tenants": [{"name": "default"}, {"name": "a"}]})
    plain, spaced, tenant_a = connect(sp), connect(sp, namespace="team"), connect(sp, tenant="a")
    assert plain.put("k", b"plain") == 0 and spaced.put("k", b"team") == 0 and tenant_a.put("k", b"a") == 0
    assert [x.get("k") for x in (plain, spaced, tenant_a)] == [b"plain", b"team", b"a"]
    assert spaced.remove("k") == 0 and plain.get("k") == b"plain" and tenant_a.get("k") == b"a"
    for x in (plain, spaced, tenant_a):
        x.close()


def test_lifecycle(small_blocks: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    s = MooncakeDistributedStore(timeout=DEADLINE_S)  # as Mooncake's code makes it
    closed = ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
    assert (s.put("k", b"v"), s.get("k"), s.is_exist("k"), s.health_check()) == (closed, b"", -1, 1)
    config = {"local_hostname": "node-a", "metadata_server": "P2PHANDSHAKE",
              "master_server_addr": "unix:" + small_blocks.socket_path}
    assert s.setup({**config, "tenant_id": "nobody"}) == ErrorCode.INVALID_PARAMS  # no such tenant
    assert s.setup(config) == 0
    assert s.get_hostname() == "node-a" and s.health_check() == 0
    monkeypatch.setenv("KVPOOL_SOCKET_PATH", small_blocks.socket_path)
    assert s.put("k", b"v") == 0 and s.setup(*SETUP) == 0 and s.get("k") == b"v"  # setup again: reconnects
    assert s.close() == 0 and s.close() == 0
    assert s.get("k") == b"" and s.remove("k") == closed and s.register_buffer(1, 1) == closed
    with pytest.raises(TypeError):
        s.setup("only a hostname")
    with pytest.raises(TypeError):
        s.put(5, b"v")  # type: ignore[arg-type]


def test_a_restarted_sidecar_is_reconnected(sidecar_factory: Factory) -> None:
    first = sidecar_factory()
    s = connect(first)
    assert s.put("k", b"v") == 0
    first.stop()
    assert s.get("k") == b"" and s.health_check() == 2
    assert s.put("k", b"v") == ErrorCode.RPC_FAIL
    sidecar_factory({"api": {"socket_path": first.socket_path}})  # its successor, empty
    assert s.health_check() == 0 and s.get("k") == b""
    assert s.put("k", b"again") == 0 and s.get("k") == b"again"
    s.close()


def test_over_tcp(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"max_block_bytes": BLOCK, "api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    s = MooncakeDistributedStore(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S)
    assert s.setup(*SETUP) == 0
    value = blob(4 * BLOCK + 3)
    assert s.put("big", value) == 0 and s.get("big") == value and s.get_size("big") == len(value)
    buf = (ctypes.c_ubyte * 64)()
    assert s.register_buffer(ctypes.addressof(buf), 64) == 0
    assert s.get_into_ranges([ctypes.addressof(buf)], [["big"]], [[[0]]], [[[3 * BLOCK - 5]]], [[[10]]]) == [[[10]]]
    assert bytes(buf[:10]) == value[3 * BLOCK - 5 : 3 * BLOCK + 5]
    assert s.remove("big") == 0 and s.is_exist("big") == 0
    s.close()


def test_memory_outside_registered_buffers_is_never_touched(store: MooncakeDistributedStore) -> None:
    assert store.put("k", b"0123456789") == 0
    buf = (ctypes.c_ubyte * 32)()
    ptr = ctypes.addressof(buf)
    assert store.get_into("k", ptr, 32) == ErrorCode.INVALID_PARAMS  # not registered
    assert store.register_buffer(ptr, 16) == 0
    assert store.get_into("k", ptr + 8, 16) == ErrorCode.INVALID_PARAMS  # runs past its end
    assert store.put_from("k2", ptr + 8, 16) == ErrorCode.INVALID_PARAMS
    assert bytes(buf) == bytes(32) and store.is_exist("k2") == 0
    assert store.get_into("k", ptr, 16) == 10 and bytes(buf[:10]) == b"0123456789"


def test_a_key_twice_in_one_batch(store: MooncakeDistributedStore) -> None:
    values = [blob(100_003), blob(5 * BLOCK)]
    assert store.put_batch(["a", "b"], values) == 0
    assert store.get_batch(["b", "a", "b", "a"]) == [values[1], values[0], values[1], values[0]]


def test_threads_share_one_store(store: MooncakeDistributedStore) -> None:
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(20):
            key, value = f"t{t}-{i}", os.urandom(1000 + 997 * i)
            if store.put(key, value) != 0 or store.get(key) != value or store.get_size(key) != len(value):
                errors.append(key)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE_S)
    assert not any(th.is_alive() for th in threads) and errors == []
    assert store.batch_is_exist([f"t{t}-19" for t in range(4)]) == [1] * 4


@pytest.mark.redis
def test_across_nodes_a_remove_is_local(pool: Factory) -> None:  # noqa: F811 - fixture
    a, b = pool("a", "127.0.0.11", max_block_bytes=BLOCK), pool("b", "127.0.0.12", max_block_bytes=BLOCK)
    on_a, on_b = connect(a), connect(b)
    value = blob(3 * BLOCK + 11)
    assert on_a.put("k", value) == 0
    wait_until(lambda: on_b.is_exist("k") == 1, "the index to publish a's blocks")
    assert on_b.remove("k") == ErrorCode.OBJECT_NOT_FOUND  # b holds none of its own yet
    assert on_b.get("k") == value  # fetched from a: b holds a copy now
    assert on_a.upsert("k", b"new") == 0
    assert on_a.get("k") == b"new"
    assert on_b.get("k") == value  # b's copy survives a's upsert (documented)
    assert on_b.remove("k") == 0
    wait_until(lambda: on_b.get("k") == b"new", "b to read a's new value")
    on_a.close()
    on_b.close()
