"""A flood of one cause makes one log line a period, which then counts what it skipped."""

from __future__ import annotations

import logging

import pytest

from kvpool_sidecar.ratelog import warn_once


def test_one_line_per_cause_per_period(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("kvpool.test.ratelog")
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(100):
            warn_once(log, "flood-a", "refused %d", i, every_s=3600)
        warn_once(log, "flood-b", "another cause", every_s=3600)
    assert [r.getMessage() for r in caplog.records] == ["refused 0", "another cause"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=log.name):
        warn_once(log, "flood-a", "refused %d", 100, every_s=0)  # the period is over
    assert [r.getMessage() for r in caplog.records] == ["refused 100 (and 99 more like it in the last 0 s)"]
