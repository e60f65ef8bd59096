"""The sidecar's counters as ``stats`` and Prometheus see them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool_sidecar.metrics import StoreMetrics


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_peer_fetches_are_counted_and_timed() -> None:
    registry = CollectorRegistry()
    m = StoreMetrics(registry)
    m.fetched(3, 1, 0.002)
    m.fetched(2, 0, 0.004)
    for _ in range(5):
        m.fetched_bytes(4096)
    assert m.snapshot() == {"fetch_ok": 5, "fetch_failed": 1, "fetch_bytes": 5 * 4096, "fetch_us": 6000}
    got = _samples(registry)
    assert got[("kvpool_blocks_total", (("op", "fetch"), ("result", "ok")))] == 5
    assert got[("kvpool_blocks_total", (("op", "fetch"), ("result", "failed")))] == 1
    assert got[("kvpool_bytes_total", (("op", "fetch"),))] == 5 * 4096
    assert got[("kvpool_request_seconds_count", (("op", "peer_fetch"),))] == 2
    # the time sum is for ``stats`` only: it is no block result
    assert not any(labels == (("op", "fetch"), ("result", "us")) for _, labels in got)


def test_refused_hellos_are_counted_for_stats_and_prometheus() -> None:
    registry = CollectorRegistry()
    m = StoreMetrics(registry)
    assert _samples(registry)[("kvpool_hellos_refused_total", ())] == 0  # (exported before the first)
    m.hello_refused()
    m.hello_refused()
    assert m.snapshot() == {"hello_refused": 2}
    assert _samples(registry)[("kvpool_hellos_refused_total", ())] == 2


def test_the_metrics_page_is_rendered_at_most_once_in_its_max_age() -> None:
    """Anyone reaching the HTTP port may ask for ``/metrics`` over and over: the page is
    rendered once in ``max_age_s`` and served again meanwhile, then rendered anew."""
    from prometheus_client import Counter

    from kvpool_sidecar.api.http import RenderedMetrics

    registry = CollectorRegistry()
    hits = Counter("kvpool_test_hits", "hits", registry=registry)
    now = [100.0]
    page = RenderedMetrics(registry, max_age_s=1.0, clock=lambda: now[0])
    first = page.body()
    assert b"kvpool_test_hits_total 0.0" in first
    hits.inc()
    now[0] += 0.5
    assert page.body() is first  # not rendered again
    now[0] += 0.5
    again = page.body()
    assert b"kvpool_test_hits_total 1.0" in again
