"""The daemon's garbage collection on a real sidecar: its collector reclaims on schedule,
and the blocks it holds are served intact across reclaims (frozen or thawed)."""

from __future__ import annotations

from collections.abc import Callable

from kvpool_client.client import PoolClient
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S, assert_serves, fresh_keys, payload, put_all, wait_until

RECLAIMED = "garbage collection: "


def reclaims(sp: SidecarProcess) -> int:
    return sp.log_path.read_text(errors="replace").count(RECLAIMED)


def test_the_daemon_reclaims_on_schedule_and_its_blocks_stay_whole(
        sidecar_factory: Callable[..., SidecarProcess]) -> None:
    sp = sidecar_factory({"gc_reclaim_interval_s": 1, "log_level": "INFO"})
    keys = fresh_keys(64)
    datas = [payload(k, 20_000) for k in keys]
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as c:
        assert put_all(c, keys, datas) == [PutStatus.STORED] * len(keys)
        seen = wait_until(lambda: reclaims(sp), "a reclaim in the log")
        wait_until(lambda: reclaims(sp) > seen, "a second reclaim, after the blocks were frozen")
        got = c.get(keys)
        assert [bytes(g) if g is not None else None for g in got] == datas
    assert_serves(sp)


def test_without_freezing_the_daemon_never_reclaims(sidecar_factory: Callable[..., SidecarProcess]) -> None:
    sp = sidecar_factory({"gc_freeze": False, "gc_reclaim_interval_s": 1, "log_level": "INFO"})
    with_collector = sidecar_factory({"gc_reclaim_interval_s": 1, "log_level": "INFO"})
    # the one beside it, started after, has reclaimed twice: this one would have by now
    wait_until(lambda: reclaims(with_collector) >= 2, "two reclaims of the sidecar with a collector")
    assert reclaims(sp) == 0
    assert_serves(sp)
