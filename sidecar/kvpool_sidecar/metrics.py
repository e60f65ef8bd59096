"""The sidecar's figures: plain counters for ``stats`` and Prometheus series for /metrics.

Hot paths only bump a :class:`collections.Counter`; Prometheus reads the counters at
scrape time through a collector, so a lookup pays no label look-ups. Per-tier capacity and
use are sampled at scrape time too. Request latencies go into one histogram per local
operation (children resolved once).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool_client.protocol import PutStatus

_LATENCY_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0,
)
#: counter name prefix -> (Prometheus family, label name)
_BLOCK_OPS = ("lookup", "put", "get", "demote", "promote", "fetch")

TierSample = Callable[[], dict[str, tuple[int, int, int]]]
#: ``{tier: {kind: seconds}}`` of the disk tiers' I/O (see ``StoreReport.io_seconds``).
IoSample = Callable[[], dict[str, dict[str, float]]]

#: Each put status's counter (an enum's ``name`` is a property, looked up on every put).
_PUT_COUNTERS = {status: "put_" + status.name.lower() for status in PutStatus}


class _Exporter(Collector):
    def __init__(self, metrics: StoreMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterator[Metric]:
        counts = self._m.counts
        blocks = CounterMetricFamily("kvpool_blocks", "Blocks handled by operation and result", labels=["op", "result"])
        moved = CounterMetricFamily("kvpool_bytes", "Payload bytes moved by operation", labels=["op"])
        evicted = CounterMetricFamily("kvpool_evictions", "Blocks evicted from a tier", labels=["tier"])
        corrupt = CounterMetricFamily("kvpool_corrupt_blocks", "Blocks dropped after a failed checksum",
                                      labels=["tier"])
        kv_events = CounterMetricFamily("kvpool_kv_events", "KV events for routers: batches, block events "
                                        "published, dropped, resyncs, replays", labels=["result"])
        for name, value in sorted(counts.items()):
            op, _, rest = name.partition("_")
            if rest == "us":
                continue  # time sums are for ``stats``; Prometheus has the latency histogram
            if op in _BLOCK_OPS and rest == "bytes":
                moved.add_metric([op], value)
            elif op in _BLOCK_OPS:
                blocks.add_metric([op, rest], value)
            elif op == "evicted":
                evicted.add_metric([rest], value)
            elif op == "corrupt":
                corrupt.add_metric([rest], value)
            elif op == "kvevents":
                kv_events.add_metric([rest], value)
        yield from (blocks, moved, evicted, corrupt)
        yield CounterMetricFamily("kvpool_hellos_refused", "Local clients' HELLOs refused for their tenant or its "
                                  "proof (each closes its connection)", value=counts.get("hello_refused", 0))
        if kv_events.samples:
            yield kv_events
        sample = self._m.tier_sample
        if sample is not None:
            tier_bytes = GaugeMetricFamily("kvpool_tier_bytes", "Bytes per tier", labels=["tier", "kind"])
            tier_blocks = GaugeMetricFamily("kvpool_tier_blocks", "Blocks resident per tier", labels=["tier"])
            for tier, (capacity, used, n) in sample().items():
                tier_bytes.add_metric([tier, "capacity"], capacity)
                tier_bytes.add_metric([tier, "used"], used)
                tier_blocks.add_metric([tier], n)
            yield tier_bytes
            yield tier_blocks
        io = self._m.io_sample
        if io is not None:
            seconds = CounterMetricFamily("kvpool_disk_io_seconds", "Seconds a disk tier's calls spent writing, "
                                          "syncing, reading in a thread, reading from the page cache and deleting, "
                                          "summed over the threads that ran them", labels=["tier", "kind"])
            for tier, kinds in io().items():
                for kind, spent in kinds.items():
                    seconds.add_metric([tier, kind], spent)
            yield seconds


class StoreMetrics:
    """Counters of what the store did; optionally exported to a Prometheus registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.counts: Counter[str] = Counter()
        self.tier_sample: TierSample | None = None
        self.io_sample: IoSample | None = None
        self._latency: Histogram | None = None
        self._children: dict[str, Histogram] = {}
        if registry is not None:
            registry.register(_Exporter(self))
            self._latency = Histogram("kvpool_request_seconds", "Local API request latency", ["op"],
                                      buckets=_LATENCY_BUCKETS, registry=registry)

    def lookup(self, hits: int, misses: int) -> None:
        c = self.counts
        c["lookup_hit"] += hits
        c["lookup_miss"] += misses

    def put(self, status: PutStatus, size: int = 0) -> None:
        self.counts[_PUT_COUNTERS[status]] += 1
        if size:
            self.counts["put_bytes"] += size

    def get(self, *, hit: bool, size: int = 0) -> None:
        self.counts["get_hit" if hit else "get_miss"] += 1
        if size:
            self.counts["get_bytes"] += size

    def no_clean_room(self) -> None:
        """A put answered FULL rather than wait for a disk write (also counted as FULL)."""
        self.counts["put_full_no_clean_room"] += 1

    def evicted(self, tier: str) -> None:
        self.counts["evicted_" + tier] += 1

    def corrupt(self, tier: str) -> None:
        self.counts["corrupt_" + tier] += 1

    def demoted(self, size: int) -> None:
        self.counts["demote_ok"] += 1
        self.counts["demote_bytes"] += size

    def demote_failed(self) -> None:
        self.counts["demote_failed"] += 1

    def promoted(self, size: int) -> None:
        self.counts["promote_ok"] += 1
        self.counts["promote_bytes"] += size

    def promote_failed(self) -> None:
        self.counts["promote_failed"] += 1

    def fetched(self, ok: int, failed: int, seconds: float) -> None:
        """One peer fetch: blocks that arrived verified, blocks that did not, its wall time."""
        c = self.counts
        c["fetch_ok"] += ok
        c["fetch_failed"] += failed
        c["fetch_us"] += int(seconds * 1e6)
        self.observe("peer_fetch", seconds)

    def index_unanswered(self) -> None:
        """A read's question to the index (a LOOKUP's or a fetch's) got no answer in time or
        an error (:mod:`~kvpool_sidecar.indexwatch`: reads then skip it for a while)."""
        self.counts["index_unanswered"] += 1

    def fetched_bytes(self, size: int) -> None:
        """A fetched block passed its checksum and was stored."""
        self.counts["fetch_bytes"] += size

    def hello_refused(self) -> None:
        """A local client's HELLO named a tenant it may not act as (unknown, or a wrong proof)."""
        self.counts["hello_refused"] += 1

    def observe(self, op: str, seconds: float) -> None:
        if self._latency is None:
            return
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self._latency.labels(op)
        child.observe(seconds)

    def track_tiers(self, sample: TierSample) -> None:
        """Export ``{tier: (capacity, used, blocks)}`` from ``sample`` at every scrape."""
        self.tier_sample = sample

    def track_io(self, sample: IoSample) -> None:
        """Export ``{tier: {kind: seconds}}`` from ``sample`` at every scrape."""
        self.io_sample = sample

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
