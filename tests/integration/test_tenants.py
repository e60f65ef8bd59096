"""Tenants on a real sidecar: separate key spaces unless shared, quotas as a share of DRAM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.client import Lookup, PoolClient
from kvpool_client.keys import BlockKey
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from kvpool_sidecar.tenancy import KeySpaces
from tests.integration.support import DEADLINE_S, TCP_TOKEN, RawConn, fresh_keys, payload, tcp_tenants, wait_until

pytestmark = pytest.mark.integration

STORED = PutStatus.STORED
Factory = Callable[..., SidecarProcess]
PAGE = 64 << 10


def _client(sp: SidecarProcess, tenant: str) -> PoolClient:
    return PoolClient(sp.socket_path, tenant=tenant, timeout=DEADLINE_S)


def test_tenants_never_see_each_others_blocks(sidecar_factory: Factory, tmp_path: Path) -> None:
    sp = sidecar_factory({"api": {"tcp_port": 0, "shared_arena": "shared"},
                          "tenants": tcp_tenants(tmp_path, "default", "a", "b")})
    keys = fresh_keys(4)
    mine = [payload(k, 70_000) for k in keys]
    theirs = [payload(k, 50_000) for k in keys]
    with _client(sp, "a") as a, _client(sp, "b") as b, _client(sp, "default") as d, \
            PoolClient(host="127.0.0.1", port=sp.ready["tcp_port"], tenant="b", token=TCP_TOKEN,
                       timeout=DEADLINE_S) as b_tcp:
        assert a.put(keys, mine, chain=True) == [STORED] * 4
        assert a.lookup(keys) == Lookup(4, ["dram"] * 4)
        # the same keys are nothing to the other tenants, over the socket and inline over TCP
        for other in (b, d, b_tcp):
            assert other.lookup(keys).prefix == 0
            assert other.get(keys) == [None] * 4
        assert b.pin(keys) == 0
        # b stores its own blocks under the same keys; each tenant reads back its own bytes
        assert b.put(keys, theirs, chain=True) == [STORED] * 4
        assert [bytes(g) for g in a.get(keys) if g is not None] == mine
        assert [bytes(g) for g in b.get(keys) if g is not None] == theirs
        assert [bytes(g) for g in b_tcp.get(keys) if g is not None] == theirs
        assert d.lookup(keys).prefix == 0
        assert d.stats()["blocks"] == 8


def test_tenants_in_one_key_space_share_blocks(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"tenants": [{"name": "default"}, {"name": "a", "key_space": "team"},
                                      {"name": "b", "key_space": "team"}]})
    keys = fresh_keys(3)
    data = [payload(k, 30_000) for k in keys]
    with _client(sp, "a") as a, _client(sp, "b") as b, _client(sp, "default") as d:
        assert a.put(keys, data, chain=True) == [STORED] * 3
        assert b.put(keys[:1], data[:1]) == [PutStatus.EXISTS]
        assert [bytes(g) for g in b.get(keys) if g is not None] == data
        assert d.get(keys) == [None] * 3  # default is a space of its own


def test_a_quota_share_caps_the_tenant_on_a_real_sidecar(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"dram": {"size_bytes": 64 * PAGE, "page_bytes": PAGE},
                          "tenants": [{"name": "default"}, {"name": "a", "quota_share": "25%"}]})
    others = fresh_keys(8)
    with _client(sp, "a") as a, _client(sp, "default") as d:
        assert d.put(others, [payload(k, PAGE) for k in others]) == [STORED] * 8
        keys = fresh_keys(40)
        for k in keys:  # one at a time: every put beyond the quota evicts one of a's own
            assert a.put([k], [payload(k, PAGE)]) == [STORED]
        held = sum(a.lookup([k]).prefix for k in keys)
        assert held == 16  # a quarter of 64 pages
        assert d.lookup(others) == Lookup(8, ["dram"] * 8)  # nobody else's block was evicted
        assert a.put(fresh_keys(1), [b"x" * (17 * PAGE)]) == [PutStatus.QUOTA]  # larger than the share


def test_a_quota_holds_in_the_disk_tier_too(sidecar_factory: Factory, tmp_path: Path) -> None:
    """A tenant under its DRAM quota that kept writing had everything it evicted demoted to
    disk, where no quota held: it flushed every other tenant's disk blocks (a review's
    `disk_flush.py`: all 512 of them, with a quota of 4 MiB). A tenant with a quota has the
    same share of each other tier: its demotions make room from its own blocks there."""
    sp = sidecar_factory({"dram": {"size_bytes": 64 * PAGE, "page_bytes": PAGE},
                          "disk": {"path": str(tmp_path / "disk"), "size_bytes": 128 * PAGE},
                          "tenants": [{"name": "default"}, {"name": "good", "quota_share": "25%"},
                                      {"name": "evil", "quota_share": "25%"}]})
    with _client(sp, "good") as good, _client(sp, "evil") as evil:
        mine = fresh_keys(40)
        for k in mine:  # 16 pages of DRAM, the rest demoted: 24 on disk, within its 32
            assert good.put([k], [payload(k, PAGE)]) == [STORED]
        wait_until(lambda: sum(good.lookup([k]).prefix for k in mine) == 40, "good's blocks in DRAM and on disk")
        theirs = fresh_keys(200)
        for k in theirs:
            assert evil.put([k], [payload(k, PAGE)]) == [STORED]
        assert sum(good.lookup([k]).prefix for k in mine) == 40  # nothing of good's was flushed
        assert 0 < sum(evil.lookup([k]).tiers == ["disk"] for k in theirs) <= 32  # evil's share of the disk


def test_a_connection_cannot_switch_tenant(sidecar_factory: Factory) -> None:
    sp = sidecar_factory({"tenants": [{"name": "default"}, {"name": "a"}]})
    with RawConn(sp.socket_path, tenant=None) as conn:
        _, status, _ = conn.hello("a")
        assert status == 0
        _, status, result = conn.hello("a")  # saying it again is fine
        assert status == 0
        _, status, result = conn.hello("default")
        assert status != 0 and result[0] == "bad_request" and "tenant" in result[1]


def _left_on_disk(sidecar_factory: Factory, tmp_path: Path, tenants: list[dict[str, Any]], writer: str,
                  secret: bytes) -> tuple[BlockKey, list[BlockKey], dict[str, Any]]:
    """A node of ``tenants`` where ``writer`` put ``secret`` and then enough to push it down to
    disk, stopped: the secret's key, the other keys, and the node's tiers to restart on."""
    node = {"dram": {"size_bytes": "4Mi", "page_bytes": PAGE},
            "disk": {"path": str(tmp_path / "disk"), "size_bytes": "64Mi"}}
    first = sidecar_factory({**node, "tenants": tenants})
    [key, *more] = fresh_keys(100)
    with _client(first, writer) as c:
        assert c.put([key], [secret]) == [STORED]
        for k in more:  # 6 MiB through a 4 MiB DRAM tier: the secret goes down to disk
            # (a put the write-ahead has no clean room for yet is answered FULL at once, by
            # design, where a busy machine's disk writes lag: put again until it is stored)
            wait_until(lambda: c.put([k], [payload(k, 60_000)]) == [STORED], "a put to be stored")
        wait_until(lambda: c.lookup([key]).tiers == ["disk"], "the block to be on disk only")
    assert first.stop() == 0
    return key, more, node


def test_a_block_of_a_tenant_no_space_names_never_lands_in_another_spaces_arena(
        sidecar_factory: Factory, tmp_path: Path) -> None:
    """Tenant a (space "team") leaves a block on disk; the node restarts without a. Reading
    it (b shares the space) must not promote it into an arena: arena 0 is the default
    space's, which default's clients map and read."""
    secret = b"TEAM-SECRET-PAYLOAD-" * 3200
    key, more, node = _left_on_disk(sidecar_factory, tmp_path, [
        {"name": "default"}, {"name": "a", "key_space": "team"}, {"name": "b", "key_space": "team"}], "a", secret)
    second = sidecar_factory({**node, "tenants": [{"name": "default"}, {"name": "b", "key_space": "team"}]})
    with _client(second, "b") as b, _client(second, "default") as d:
        assert b.lookup([key]).tiers == ["disk"]  # adopted from disk, under its old writer
        assert b.get([key]) == [None]  # no arena for it: a miss, not a copy in the wrong one
        assert d._view is not None and bytes(d._view).find(secret[:40]) < 0  # noqa: SLF001
        assert b.put(more[:1], [payload(more[0], 60_000)]) in ([STORED], [PutStatus.EXISTS])  # still serving


def test_a_pool_down_to_one_space_never_serves_what_another_space_left_on_disk(
        sidecar_factory: Factory, tmp_path: Path) -> None:
    """Tenant b (a space of its own) leaves a block on disk; the node restarts with tenant a
    alone, one key space. b's store key is anyone's to compute (the space's name keys it), so
    a asks for it as a key: it must name nothing (a pool of one space had kept clients' keys
    as they came, and served b's bytes to a)."""
    key, _, node = _left_on_disk(sidecar_factory, tmp_path, [{"name": "a"}, {"name": "b"}], "b",
                                 b"SPACE-B-SECRET-KV-" * 3600)
    b_store_key = KeySpaces({"a": "a", "b": "b"}).scoped("b", [key.raw])[0]
    second = sidecar_factory({**node, "tenants": [{"name": "a"}]})
    with _client(second, "a") as a:
        assert second.ready and a.stats()["blocks"] > 0  # b's blocks were adopted, and stay b's
        assert a.lookup([b_store_key]).prefix == 0
        assert a.get([b_store_key]) == [None]
        assert a.lookup([key]).prefix == 0


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="runs the sidecar and a client under another uid (root and setpriv)")
def test_a_process_of_the_sidecars_user_cannot_reach_its_memory_through_proc(
        sidecar_factory: Factory) -> None:
    """A client that runs as the sidecar's user (a bare-metal install) had opened
    ``/proc/<sidecar>/fd/<n>``, the arena's memfd, and read every tenant's blocks: the sidecar
    is undumpable, so its ``/proc`` entries are root's."""
    uid = 10001
    as_uid = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    work = Path(tempfile.mkdtemp(prefix="kvpool-uid-"))  # (pytest's own are root's alone)
    os.chown(work, uid, uid)
    try:
        _probe_proc_as(sidecar_factory({"api": {"socket_mode": 0o666}}, workdir=work, prefix=as_uid), as_uid)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _probe_proc_as(sp: SidecarProcess, as_uid: list[str]) -> None:
    uids = next(line for line in Path(f"/proc/{sp.pid}/status").read_text().splitlines() if line.startswith("Uid:"))
    assert uids.split()[1:] == [as_uid[1].split("=")[1]] * 4  # the sidecar runs as that user
    with _client(sp, "default") as c:
        assert c.put(fresh_keys(1), [b"secret" * 1000]) == [STORED]
    probe = ("import os, sys\n"
             "try:\n"
             "    fds = os.listdir(f'/proc/{sys.argv[1]}/fd')\n"
             "except PermissionError:\n"
             "    print('refused')\n"
             "else:\n"
             "    print('listed', len(fds))\n")
    out = subprocess.run([*as_uid, sys.executable, "-c", probe, str(sp.pid)], capture_output=True, text=True,
                         timeout=DEADLINE_S, check=True)
    assert out.stdout.strip() == "refused", out.stdout
