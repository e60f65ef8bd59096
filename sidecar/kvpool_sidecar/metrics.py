"""The sidecar's figures: plain counters for ``stats`` and Prometheus series for /metrics.

:class:`StoreMetrics` always keeps its own counters (so the trace replay and ``stats`` work
without Prometheus); given a registry it also exports them, with per-tier byte gauges
sampled at scrape time and a latency histogram per local operation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram

from kvpool_client.protocol import PutStatus

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0,
)


class StoreMetrics:
    """Counters of what the store did; optionally mirrored into a Prometheus registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.counts: Counter[str] = Counter()
        self._prom = registry is not None
        if registry is None:
            return
        self._blocks = PromCounter(
            "kvpool_blocks", "Blocks handled by operation and result", ["op", "result"], registry=registry
        )
        self._bytes = PromCounter("kvpool_bytes", "Payload bytes moved by operation", ["op"], registry=registry)
        self._evictions = PromCounter("kvpool_evictions", "Blocks evicted from a tier", ["tier"], registry=registry)
        self._corrupt = PromCounter(
            "kvpool_corrupt_blocks", "Blocks dropped after a failed checksum", ["tier"], registry=registry
        )
        self._latency = Histogram(
            "kvpool_request_seconds", "Local API request latency", ["op"], buckets=_LATENCY_BUCKETS, registry=registry
        )
        self._tier_bytes = Gauge("kvpool_tier_bytes", "Bytes per tier", ["tier", "kind"], registry=registry)

    def _inc(self, op: str, result: str, n: int = 1) -> None:
        self.counts[f"{op}_{result}"] += n
        if self._prom and n:
            self._blocks.labels(op, result).inc(n)

    def _add_bytes(self, op: str, size: int) -> None:
        self.counts[f"{op}_bytes"] += size
        if self._prom and size:
            self._bytes.labels(op).inc(size)

    def lookup(self, hits: int, misses: int) -> None:
        self._inc("lookup", "hit", hits)
        self._inc("lookup", "miss", misses)

    def put(self, status: PutStatus, size: int = 0) -> None:
        self._inc("put", status.name.lower())
        self._add_bytes("put", size)

    def get(self, *, hit: bool, size: int = 0) -> None:
        self._inc("get", "hit" if hit else "miss")
        self._add_bytes("get", size)

    def evicted(self, tier: str) -> None:
        self.counts[f"evicted_{tier}"] += 1
        if self._prom:
            self._evictions.labels(tier).inc()

    def corrupt(self, tier: str) -> None:
        self.counts[f"corrupt_{tier}"] += 1
        if self._prom:
            self._corrupt.labels(tier).inc()

    def demoted(self, size: int) -> None:
        self._inc("demote", "ok")
        self._add_bytes("demote", size)

    def demote_failed(self) -> None:
        self._inc("demote", "failed")

    def promoted(self, size: int) -> None:
        self._inc("promote", "ok")
        self._add_bytes("promote", size)

    def promote_failed(self) -> None:
        self._inc("promote", "failed")

    def observe(self, op: str, seconds: float) -> None:
        if self._prom:
            self._latency.labels(op).observe(seconds)

    def track_tiers(self, sample: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Export ``{tier: (capacity, used)}`` from ``sample`` at every scrape."""
        if not self._prom:
            return
        for tier in sample():
            self._tier_bytes.labels(tier, "capacity").set_function(lambda t=tier: sample()[t][0])
            self._tier_bytes.labels(tier, "used").set_function(lambda t=tier: sample()[t][1])

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
