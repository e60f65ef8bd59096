"""What a writer says about its blocks (protocol 3) reaches the store, and version-2
clients are served as before."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvpool_client.blockinfo import EngineBlock, PutHints
from kvpool_client.client import PoolClient
from kvpool_client.errors import KVPoolError
from kvpool_client.protocol import Op, PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, TCP_TOKEN, RawConn, fresh_keys, payload, tcp_tenants

HINTS = PutHints(prompt_blocks=12, session="chat-7", label="turn")


def _engine(keys: Sequence[object]) -> list[EngineBlock | None]:
    out: list[EngineBlock | None] = [EngineBlock(hash=1000 + i, parent=999 + i if i else None,
                                                 token_ids=list(range(i * 16, i * 16 + 16)), block_size=16)
                                     for i in range(len(keys))]
    out[-1] = None  # a block without an engine identity is fine
    return out


@pytest.mark.parametrize("inline", [False, True], ids=["arena", "inline"])
def test_a_put_with_hints_and_engine_blocks_is_stored_and_read(sidecar_factory: Callable[..., SidecarProcess],
                                                               tmp_path: Path, inline: bool) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0}, "tenants": tcp_tenants(tmp_path)})
    keys = fresh_keys(4)
    datas = [payload(k, 5000 + i) for i, k in enumerate(keys)]
    client = PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], token=TCP_TOKEN, timeout=DEADLINE_S) \
        if inline else PoolClient(sp.socket_path, timeout=DEADLINE_S)
    with client as c:
        assert c.shm is not inline
        assert c.put(keys, datas, chain=True, hints=HINTS, engine=_engine(keys)) == [PutStatus.STORED] * 4
        assert [bytes(v) if v is not None else None for v in c.get(keys)] == datas
        # the same blocks put again with other hints are the same blocks
        again = c.put(keys, datas, chain=True, hints=PutHints(label="document"))
        assert again == [PutStatus.EXISTS] * 4


def test_the_client_checks_hints_and_engine_blocks_before_sending(sidecar: SidecarProcess) -> None:
    keys = fresh_keys(2)
    with PoolClient(sidecar.socket_path, timeout=DEADLINE_S) as c:
        with pytest.raises(KVPoolError, match="one engine block"):
            c.put(keys, [b"x" * 10] * 2, engine=[None])
        with pytest.raises(KVPoolError, match="label"):
            c.put(keys, [b"x" * 10] * 2, hints=PutHints(label="x" * 200))
        with pytest.raises(KVPoolError, match="token_ids"):
            c.put(keys[:1], [b"x" * 10], engine=[EngineBlock(hash=1, token_ids=[-1], block_size=1)])
        assert c.lookup(keys).prefix == 0, "a refused put stores nothing"


def test_a_version_2_client_is_served_without_the_new_fields(sidecar: SidecarProcess) -> None:
    k = fresh_keys(3)
    with RawConn(sidecar.socket_path, tenant=None) as conn:
        _, status, hello = conn.hello("default", version=2)
        assert status == 0 and hello["version"] == 2
        # what a version-2 client sends is served
        _, status, result = conn.call(int(Op.ALLOC), [[k[0].raw, 10, -1, None]])
        assert status == 0 and result[0][0] == int(PutStatus.ALLOCATED), result
        _, status, _ = conn.call(int(Op.ABORT), [result[0][1]])
        assert status == 0
        # the fields of version 3 are refused on a version-2 connection, and nothing is reserved
        _, status, result = conn.call(int(Op.ALLOC), [[k[1].raw, 10, -1, None, {"hash": 1, "tokens": [],
                                                                               "block_size": 1}]])
        assert status != 0 and result[0] == "bad_request", result
        _, status, result = conn.call(int(Op.ALLOC), [[k[2].raw, 10, -1, None]], {"label": "x"})
        assert status != 0 and "version 3" in result[1], result
        # and the connection keeps its version
        _, status, result = conn.hello("default", version=3)
        assert status != 0 and "version" in result[1], result
        _, status, stats = conn.call(int(Op.STATS))
        assert status == 0 and stats["pending_writes"] == 0
