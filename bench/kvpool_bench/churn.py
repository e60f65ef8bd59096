"""``kvpool bench churn``: latency while a large store's blocks are replaced, against the same
sidecar with Python's own garbage collector.

A sidecar holds a few Python objects per block, and CPython's full collection walks them all
on the event loop (:mod:`kvpool_sidecar.collector`). This fills one sidecar with ``blocks``
small blocks, then for ``seconds`` replaces them a batch at a time (put ``batch`` new ones,
remove the ``batch`` oldest) while a second client, in a process of its own, looks up a
64-key chain every millisecond, as an engine's scheduler asks while another engine saves.
The same run is made on a sidecar with ``gc_freeze: false`` (Python's collector as it is: the baseline), the two alternated
``repeats`` times, so ratios compare runs of the same minutes. What matters: the worst
lookup and put (a full collection stops every request), and blocks replaced per second.
"""

from __future__ import annotations

import os
import statistics
import multiprocessing
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from kvpool_bench.soak import ms_at
from kvpool_client.client import PoolClient
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/churn", dtype="bfloat16", block_tokens=16, kv_layout="bytes")

#: Keys of the chain the prober looks up (far from the churned ones), and how often.
PROBE_BASE = 1 << 24
PROBE_EVERY_S = 0.001


@dataclass(frozen=True)
class ChurnOptions:
    blocks: int = 300_000
    block_bytes: int = 4096
    batch: int = 1024
    seconds: float = 30.0
    repeats: int = 1


def _keys(start: int, n: int) -> list[BlockKey]:
    return block_keys(FP, list(range(start * 16, (start + n) * 16)))


def _probe(socket_path: str, keys: list[BlockKey], ready: Any, done: Any, results: Any) -> None:
    """Look ``keys`` up every :data:`PROBE_EVERY_S` until ``done`` (``ready`` once the first
    lookup is answered); send the latencies."""
    lat: list[float] = []
    with PoolClient(socket_path, timeout=120) as p:
        while not done.is_set():
            t = time.perf_counter()
            p.lookup(keys)
            lat.append(time.perf_counter() - t)
            ready.set()
            done.wait(PROBE_EVERY_S)
    results.send(lat)
    results.close()


def _stop(prober: Any) -> None:
    """Wait a minute for the prober to end (told to by ``done``), then kill it: a prober stuck
    in a lookup that never answers had been left running past the bench."""
    prober.join(60)
    if prober.is_alive():
        prober.kill()
        prober.join()


def churn_run(opts: ChurnOptions, freeze: bool) -> dict[str, Any]:
    """One sidecar, filled and then churned; its latencies and rate."""
    size, batch = opts.block_bytes, opts.batch
    with tempfile.TemporaryDirectory(prefix="kvpool-churn-") as work:
        cfg = {"node_name": "churn", "max_block_bytes": size, "gc_freeze": freeze,
               "dram": {"size_bytes": (opts.blocks + 4 * batch) * size, "page_bytes": 4096, "populate": True}}
        with SidecarProcess(cfg, workdir=work) as sp, PoolClient(sp.socket_path, timeout=120) as c:
            c.wait_prefaulted()
            data = [os.urandom(size)] * batch
            for start in range(0, opts.blocks, batch):
                if any(s != PutStatus.STORED for s in c.put(_keys(start, batch), data)):
                    raise RuntimeError("the fill did not fit: a put was refused")
            probe = _keys(PROBE_BASE, 64)  # a chain of its own, never removed
            c.put(probe, data[:64], chain=True)
            lookups: list[float]
            puts: list[float] = []
            removes: list[float] = []
            ctx = multiprocessing.get_context("spawn")
            results, sending = ctx.Pipe(duplex=False)
            done, ready = ctx.Event(), ctx.Event()
            # an engine's scheduler asking while another engine saves: a process of its own
            asking = ctx.Process(target=_probe, args=(sp.socket_path, probe, ready, done, sending),
                                 name="churn-prober")
            head, tail = opts.blocks, 0
            asking.start()
            sending.close()
            # the churn starts once the prober asks (a process takes a second or so to start: a
            # churn shorter than that had measured no lookup and ended in a traceback)
            if not ready.wait(60):
                done.set()
                _stop(asking)
                raise RuntimeError("the prober did not start")
            started = time.perf_counter()
            try:
                while time.perf_counter() - started < opts.seconds:
                    t = time.perf_counter()
                    c.put(_keys(head, batch), data)
                    puts.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    c.remove(_keys(tail, batch))
                    removes.append(time.perf_counter() - t)
                    head, tail = head + batch, tail + batch
            finally:
                done.set()
                lookups = results.recv() if results.poll(60) else []
                _stop(asking)
            if not lookups:
                raise RuntimeError("the prober measured no lookup")
            elapsed = time.perf_counter() - started
    return {
        "replaced_blocks_per_s": (head - opts.blocks) / elapsed,
        "lookup_ms": {"p50": ms_at(lookups, 0.5), "p99": ms_at(lookups, 0.99), "p999": ms_at(lookups, 0.999),
                      "max": max(lookups) * 1e3},
        "put_ms": {"p50": ms_at(puts, 0.5), "p99": ms_at(puts, 0.99), "max": max(puts) * 1e3},
        "remove_ms": {"p50": ms_at(removes, 0.5), "p99": ms_at(removes, 0.99), "max": max(removes) * 1e3},
    }


def run_churn(opts: ChurnOptions) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"collector": [], "python_gc": []}
    for _ in range(opts.repeats):
        runs["python_gc"].append(churn_run(opts, freeze=False))
        runs["collector"].append(churn_run(opts, freeze=True))

    def med(name: str, *path: str) -> float:
        vals = []
        for r in runs[name]:
            v: Any = r
            for p in path:
                v = v[p]
            vals.append(float(v))
        return statistics.median(vals)

    ratios = {
        "lookup_max_vs_python_gc": med("collector", "lookup_ms", "max") / med("python_gc", "lookup_ms", "max"),
        "lookup_p999_vs_python_gc": med("collector", "lookup_ms", "p999") / med("python_gc", "lookup_ms", "p999"),
        "put_max_vs_python_gc": med("collector", "put_ms", "max") / med("python_gc", "put_ms", "max"),
        "put_p99_vs_python_gc": med("collector", "put_ms", "p99") / med("python_gc", "put_ms", "p99"),
        "replaced_rate_vs_python_gc": med("collector", "replaced_blocks_per_s") / med("python_gc", "replaced_blocks_per_s"),
    }
    return {"blocks": opts.blocks, "block_bytes": opts.block_bytes, "batch": opts.batch, "seconds": opts.seconds,
            "runs": runs, "ratios": ratios}
