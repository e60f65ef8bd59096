"""Shared fixtures: real sidecar processes in temporary directories; the real API server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
