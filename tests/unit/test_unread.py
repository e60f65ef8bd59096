"""The node-wide bound on answers buffered for clients that do not read them."""

from __future__ import annotations

import pytest

from kvpool_sidecar.api.unread import Unread


def test_past_the_bound_the_connection_holding_the_most_goes_and_is_no_longer_counted() -> None:
    u: Unread[str] = Unread(100)
    assert u.behind("a", 40) is None and u.behind("b", 50) is None and u.total == 90
    assert u.behind("a", 45) is None and u.total == 95  # what "a" buffers now, not added again
    assert u.behind("c", 30) == "b"  # 125 > 100: "b" holds the most
    assert u.total == 75 and u.held("b") == 0 and u.aborted == 1
    assert u.behind("c", 70) == "c"  # the one past the bound may be the newest writer
    assert u.total == 45 and u.aborted == 2


def test_a_connection_that_catches_up_or_closes_holds_nothing() -> None:
    u: Unread[str] = Unread(100)
    u.behind("a", 60)
    u.behind("b", 30)
    u.drained("a")
    u.drained("a")  # (twice is harmless: it closed after it drained)
    u.drained("never-behind")
    assert u.total == 30 and u.held("a") == 0
    assert u.behind("c", 70) is None  # room again


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Unread(0)
