"""The per-tenant index budget: a token bucket per tenant, refilled by the clock."""

from __future__ import annotations

import pytest

from kvpool_sidecar.api.budget import IndexBudget, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_its_rate_and_holds_at_most_its_burst() -> None:
    clock = Clock()
    b = TokenBucket(10, 20, clock)
    assert b.take(15) and b.take(5)
    assert not b.take(1)
    clock.now += 0.5  # five tokens back
    assert b.take(5) and not b.take(1)
    clock.now += 3600  # an hour idle refills no more than the burst
    assert b.take(20) and not b.take(1)


def test_a_request_larger_than_the_burst_passes_only_from_a_full_bucket() -> None:
    clock = Clock()
    b = TokenBucket(10, 20, clock)
    assert b.take(64)  # from full: allowed, and it empties the bucket
    assert not b.take(64)
    clock.now += 1.0
    assert not b.take(64)  # half full is not enough
    clock.now += 1.0
    assert b.take(64)


def test_each_tenant_has_its_own_budget_and_refusals_are_counted() -> None:
    clock = Clock()
    budget = IndexBudget(4, 100, clock)
    assert budget.allows("a", 100)
    assert not budget.allows("a", 1) and not budget.allows("a", 50)
    assert budget.allows("b", 100)
    assert budget.throttled == 2
    assert budget.turn("a") is budget.turn("a") and budget.turn("a") is not budget.turn("b")


def test_a_bucket_needs_a_positive_rate() -> None:
    with pytest.raises(ValueError):
        TokenBucket(0, 1)
    with pytest.raises(ValueError):
        TokenBucket(1, 0)
