"""``kvpool bench tenants``: one tenant's lookups while another tenant floods the sidecar,
against the same lookups on the same sidecar with no flood.

The sidecar shares its event loop between tenants in turns (``api/turns.py``). Here tenant
``probe`` looks up a 64-key chain of its own every 2 ms, from a process of its own, for
``seconds`` alone (the baseline); then again while tenant ``flood``, on ``connections``
connections from processes of their own, acquires and releases ``batch`` blocks of 4 KiB
again and again, as fast as the sidecar answers (reads whose bookkeeping in the policy costs
about as much of the loop as the reads themselves). What matters: the probe's p50 and p99
under the flood against alone, and the blocks per second the flood gets (it is not starved
either). Latencies are in milliseconds.
"""

from __future__ import annotations

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

FP = ModelFingerprint(model="bench/tenants", dtype="bfloat16", block_tokens=4, kv_layout="bytes")
BLOCK_BYTES = 4096
#: How often the probe looks its chain up.
PROBE_EVERY_S = 0.002
PROBE_KEYS = 64


#: The most keys one request may name (the sidecar's ``api.max_batch``, by default).
MAX_BATCH = 4096


@dataclass(frozen=True)
class TenantsOptions:
    seconds: float = 8.0
    connections: int = 4
    batch: int = 4096
    policy: str = "prefix"

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"the flood's batch must be 1 to {MAX_BATCH} blocks (the sidecar's api.max_batch)")
        if self.connections < 1 or self.seconds <= 0:
            raise ValueError("the flood needs a connection at least, and the probe a time to run")


def _keys(start: int, n: int) -> list[BlockKey]:
    return block_keys(FP, list(range(start * 4, (start + n) * 4)))


def _probe(socket_path: str, seconds: float, start: Any, results: Any) -> None:
    """Tenant ``probe``: its chain put once, then looked up every :data:`PROBE_EVERY_S` for
    ``seconds`` once ``start`` is set; the latencies sent back."""
    lat: list[float] = []
    with PoolClient(socket_path, tenant="probe", timeout=120) as p:
        keys = _keys(0, PROBE_KEYS)
        p.put(keys, [b"p" * BLOCK_BYTES] * PROBE_KEYS, chain=True)
        start.wait(120)
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            t = time.perf_counter()
            if p.lookup(keys).prefix != PROBE_KEYS:
                raise RuntimeError("the probe's chain was lost")
            lat.append(time.perf_counter() - t)
            time.sleep(PROBE_EVERY_S)
    results.send(lat)
    results.close()


def _flood(socket_path: str, first: int, batch: int, ready: Any, stop: Any, done: Any) -> None:
    """Tenant ``flood``: ``batch`` blocks put, then acquired and released until ``stop``; the
    blocks read counted in ``done``."""
    with PoolClient(socket_path, tenant="flood", timeout=120) as c:
        keys = _keys(first, batch)
        for at in range(0, batch, 1024):
            part = keys[at:at + 1024]
            if any(s != PutStatus.STORED for s in c.put(part, [b"f" * BLOCK_BYTES] * len(part), chain=True,
                                                        depth=at, parent=keys[at - 1] if at else None)):
                raise RuntimeError("the flood's blocks did not fit")
        ready.release()
        while not stop.is_set():
            c.acquire(keys).release()
            with done.get_lock():
                done.value += batch


def tenants_run(opts: TenantsOptions) -> dict[str, Any]:
    """One sidecar: the probe alone, then beside the flood."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="kvpool-tenants-") as work:
        cfg = {"node_name": "tenants", "max_block_bytes": BLOCK_BYTES, "policy": {"name": opts.policy},
               "dram": {"size_bytes": (opts.connections + 1) * opts.batch * BLOCK_BYTES + (64 << 20),
                        "page_bytes": BLOCK_BYTES, "populate": True},
               "tenants": [{"name": "default"}, {"name": "probe"}, {"name": "flood"}]}
        with SidecarProcess(cfg, workdir=work) as sp:
            out: dict[str, Any] = {}
            ready, stop, done = ctx.Semaphore(0), ctx.Event(), ctx.Value("q", 0)
            flood = [ctx.Process(target=_flood, args=(sp.socket_path, (i + 1) * opts.batch, opts.batch,
                                                      ready, stop, done), name=f"tenants-flood-{i}")
                     for i in range(opts.connections)]
            probes: list[Any] = []
            try:
                for phase in ("alone", "flood"):
                    start = ctx.Event()
                    results, sending = ctx.Pipe(duplex=False)
                    probe = ctx.Process(target=_probe, args=(sp.socket_path, opts.seconds, start, sending),
                                        name="tenants-probe")
                    probe.start()
                    probes.append(probe)
                    sending.close()
                    if phase == "flood":
                        for f in flood:
                            f.start()
                        for _ in flood:
                            if not ready.acquire(timeout=120):
                                raise RuntimeError("the flood did not start")
                    before, t = done.value, time.perf_counter()
                    start.set()
                    try:
                        lat = results.recv() if results.poll(opts.seconds + 120) else []
                    except EOFError:  # (it died: its error is on stderr)
                        lat = []
                    read = (done.value - before) / (time.perf_counter() - t)
                    probe.join(60)
                    if not lat:
                        raise RuntimeError("the probe measured no lookup")
                    out[phase] = {"lookups": len(lat), "lookup_ms": {
                        "p50": ms_at(lat, 0.5), "p99": ms_at(lat, 0.99), "max": max(lat) * 1e3}}
                    if phase == "flood":
                        out[phase]["flood_blocks_per_s"] = read
            finally:
                stop.set()
                for p in probes + flood:
                    if p.pid is not None:
                        p.join(60)
                        if p.is_alive():
                            p.terminate()
                            p.join(10)
    return out


def run_tenants(opts: TenantsOptions) -> dict[str, Any]:
    r = tenants_run(opts)
    alone, flood = r["alone"]["lookup_ms"], r["flood"]["lookup_ms"]
    return {"seconds": opts.seconds, "connections": opts.connections, "batch": opts.batch, "policy": opts.policy,
            "block_bytes": BLOCK_BYTES, "runs": r,
            "ratios": {"lookup_p50_flood_vs_alone": flood["p50"] / alone["p50"],
                       "lookup_p99_flood_vs_alone": flood["p99"] / alone["p99"]}}
