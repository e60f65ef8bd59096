"""Shared fixtures: real sidecar processes in temporary directories; the real API server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from kvpool_sidecar.process import SidecarProcess
from tests.cluster.fixtures import apiserver  # noqa: F401 - one control plane for the whole run


@pytest.fixture
def sidecar_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., SidecarProcess]]:
    """Start real sidecar daemons; every one is stopped at the end of the test."""
    started: list[SidecarProcess] = []

    def start(config: dict[str, Any] | None = None, **kw: Any) -> SidecarProcess:
        cfg: dict[str, Any] = {"node_name": f"node{len(started)}", "dram": {"size_bytes": "64Mi"}}
        cfg.update(config or {})
        # these arenas are tiny: one batch may fill them, which the default share refuses
        # (tests of that share set it themselves)
        cfg["api"] = {"max_session_share": 1.0, **(cfg.get("api") or {})}
        sp = SidecarProcess(cfg, workdir=kw.pop("workdir", None) or tmp_path_factory.mktemp("sidecar"), **kw)
        started.append(sp)
        return sp.start()

    yield start
    for sp in started:
        sp.stop()


@pytest.fixture
def sidecar(sidecar_factory: Callable[..., SidecarProcess]) -> SidecarProcess:
    """One real sidecar with a 64 MiB arena and no disk tier."""
    return sidecar_factory()


class LoopTurns:
    """The turns of the running event loop, counted by a task that yields at each one: a
    test reads :attr:`count` at two moments to see whether the loop turned in between."""

    def __init__(self) -> None:
        self.count = 0


@pytest.fixture
async def loop_turns() -> AsyncIterator[LoopTurns]:
    turns = LoopTurns()
    running = True

    async def tick() -> None:
        while running:
            turns.count += 1
            await asyncio.sleep(0)

    task = asyncio.get_running_loop().create_task(tick())
    await asyncio.sleep(0)
    try:
        yield turns
    finally:
        running = False
        await task
