"""Fixtures for a pool of real sidecars sharing a real redis-server over loopback.

Import the fixtures into a test module (``from tests.integration.poolfixtures import pool,
redis``); ``sidecar_factory`` comes from ``tests/conftest.py``. Each sidecar binds its peer
port to its own loopback address (127.0.0.11, .12, ...), so nodes are told apart by address
as separate hosts would be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_bench.services import RedisServer, free_port
from kvpool_sidecar.process import SidecarProcess

TOKEN = "pool-secret-0123456789abcdef"

PoolFactory = Callable[..., SidecarProcess]


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, stopped at the end of the test."""
    with RedisServer() as r:
        yield r


def node_config(name: str, host: str, redis_url: str, token_file: Path, **extra: Any) -> dict[str, Any]:
    """A pool member's settings: the Redis index (fast heartbeats) and a peer port on ``host``."""
    cfg: dict[str, Any] = {
        "node_name": name,
        "pool": "itest",
        "dram": {"size_bytes": "64Mi"},
        "index": {"backend": "redis", "url": redis_url, "heartbeat_s": 0.2, "sweep_s": 0.5},
        "peer": {"enabled": True, "host": host, "port": free_port(), "token_file": str(token_file),
                 "fetch_timeout_s": 2.0},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture
def pool(redis: RedisServer, tmp_path: Path, sidecar_factory: PoolFactory) -> PoolFactory:
    """``pool(name, host, **settings)`` starts one member of the pool ``itest``."""
    token = tmp_path / "token"
    token.write_text(TOKEN)

    def start(name: str, host: str, token_file: Path = token, **extra: Any) -> SidecarProcess:
        return sidecar_factory(node_config(name, host, redis.url, token_file, **extra))

    return start
