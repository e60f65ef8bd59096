"""``kvpool bench pressure``: put and get latency with and without eviction pressure.

One sidecar with a small DRAM tier over a disk tier, several client threads. First the
calm phase: puts that fit in free DRAM, and gets of what was put, in :data:`CALM_ROUNDS`
rounds after an untimed one, each round's blocks removed after it so the next finds DRAM as
free (enough puts that calm's p99 is not its slowest few, nor the sidecar's first requests:
with one round of 48 puts it had been start-up outliers of 2-3x the rest). Each thread keeps
one connection for the whole run, as an engine does. Then DRAM is filled
(untimed), and two pressure phases put three times the DRAM tier each, so every put needs
room and evicts: *pressure* (sustained; each thread puts again at once: more than the disk
can take for long) and *bursty* (each thread pauses ``gap_ms`` between puts, as an engine does
between prefills). The figure that matters is put p99 under pressure against put p99 calm.

The same run repeats on two more sidecars, the baselines: the write-ahead on but puts that
find no room free or clean waiting for a disk write (``dram.put_waits_for_disk: true``; by
default they are answered FULL at once), and the write-ahead off (``dram.clean_share: 0``,
evicted blocks are written to disk on demand, while the put waits). Each phase reports the
share of the blocks put that were stored, beside the latencies: a put refused fast is
quick, not stored. Bytes are checked on every get.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool_bench.soak import block_bytes, ms_at
from kvpool_client.client import PoolClient
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/pressure", dtype="bfloat16", block_tokens=16, kv_layout="bytes")


@dataclass(frozen=True)
class PressureOptions:
    threads: int = 4
    block_bytes: int = 256 << 10
    batch: int = 8
    dram_mib: int = 256
    disk_mib: int = 2048
    #: The pressure phase puts this many times the DRAM tier.
    pressure_factor: float = 3.0
    #: The disk tier's ``fsync`` (``always``: each demotion waits for the device, where
    #: waiting for it hurts a put the most).
    fsync: str = "always"
    #: The pause of each thread between puts in the bursty phase.
    gap_ms: float = 50.0


#: Timed rounds of the calm phase (each puts 0.4 of the DRAM tier, then removes it): as
#: many puts in all as a pressure phase (3x the tier), so that both p99s rest on as many.
CALM_ROUNDS = 8


class _Phase:
    def __init__(self) -> None:
        self.put: list[float] = []
        self.get: list[float] = []
        self.wrong = 0
        self.blocks = 0
        self.stored = 0
        self.lock = threading.Lock()

    def summary(self) -> dict[str, float]:
        return {"put_p50_ms": ms_at(self.put, 0.5), "put_p99_ms": ms_at(self.put, 0.99),
                "get_p50_ms": ms_at(self.get, 0.5), "get_p99_ms": ms_at(self.get, 0.99),
                "puts": len(self.put), "gets": len(self.get), "wrong_blocks": self.wrong,
                "stored_share": self.stored / self.blocks if self.blocks else 0.0}


def _client_loop(c: PoolClient, opts: PressureOptions, seed: int, batches: int, phase: _Phase | None,
                 gap_s: float, remove: bool = False) -> None:
    rng = random.Random(seed)
    recent: list[list[BlockKey]] = []
    put: list[BlockKey] = []
    for _ in range(batches):
        keys = block_keys(FP, [rng.randrange(1 << 30) for _ in range(opts.batch * FP.block_tokens)])
        data = [block_bytes(k, opts.block_bytes) for k in keys]
        t0 = time.perf_counter()
        statuses = c.put(keys, data, chain=True)
        t1 = time.perf_counter()
        recent = [*recent[-3:], keys]
        put += keys
        back = rng.choice(recent)
        got = c.get(back)
        t2 = time.perf_counter()
        wrong = sum(g is not None and bytes(g) != block_bytes(k, opts.block_bytes) for k, g in zip(back, got))
        if phase is not None:
            with phase.lock:
                phase.put.append(t1 - t0)
                phase.get.append(t2 - t1)
                phase.wrong += wrong
                phase.blocks += len(keys)
                phase.stored += sum(st == PutStatus.STORED for st in statuses)
        if gap_s:
            time.sleep(gap_s)
    if remove:  # the round's blocks go, so the next round finds DRAM as this one did
        for i in range(0, len(put), 256):
            c.remove(put[i:i + 256])


def _run_threads(clients: list[PoolClient], opts: PressureOptions, batches: int, phase: _Phase | None, seed: int,
                 gap_s: float = 0.0, remove: bool = False) -> None:
    per = max(1, batches // len(clients))
    ts = [threading.Thread(target=_client_loop, args=(c, opts, seed + i, per, phase, gap_s, remove))
          for i, c in enumerate(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _one_sidecar(opts: PressureOptions, clean_share: float, work: Path, *, waits: bool = False) -> dict[str, Any]:
    batch_bytes = opts.batch * opts.block_bytes
    dram = opts.dram_mib << 20
    name = f"{clean_share}-{'waits' if waits else 'refuses'}"
    config = {"node_name": "bench-pressure", "policy": {"name": "lru"},
              "dram": {"size_bytes": dram, "clean_share": clean_share, "put_waits_for_disk": waits},
              "disk": {"path": str(work / f"disk-{name}"), "size_bytes": opts.disk_mib << 20,
                       "fsync": opts.fsync},
              "api": {"max_session_share": 1.0}}
    with SidecarProcess(config, workdir=str(work / f"sc-{name}")) as sp, ExitStack() as stack:
        # One connection per thread for the whole run, as an engine holds its own: a new
        # connection maps the arena and makes it writable (in the background), work that
        # would land in its first puts' times (50-200 ms with four connecting at once).
        clients = [stack.enter_context(PoolClient(sp.socket_path, timeout=60.0)) for _ in range(opts.threads)]
        for c in clients:
            c.wait_prefaulted()
        calm, pressure, bursty = _Phase(), _Phase(), _Phase()
        calm_batches = max(opts.threads, int(0.4 * dram) // batch_bytes)
        for rnd in range(CALM_ROUNDS + 1):  # round 0 warms the sidecar up, untimed
            _run_threads(clients, opts, calm_batches, calm if rnd else None, seed=1000 + 100 * rnd, remove=True)
        calm_evicted = clients[0].stats()["counters"].get("evicted_dram", 0)
        _run_threads(clients, opts, dram // batch_bytes, None, seed=2000)  # fill DRAM, untimed
        pressured = int(opts.pressure_factor * dram) // batch_bytes
        _run_threads(clients, opts, pressured, pressure, seed=3000)
        _run_threads(clients, opts, pressured, bursty, seed=4000, gap_s=opts.gap_ms / 1e3)
        counters = clients[0].stats()["counters"]
    c_sum, p_sum, b_sum = calm.summary(), pressure.summary(), bursty.summary()
    return {"clean_share": clean_share, "put_waits_for_disk": waits, "calm": c_sum, "pressure": p_sum, "bursty": b_sum,
            "put_p99_pressure_over_calm": p_sum["put_p99_ms"] / c_sum["put_p99_ms"],
            "put_p50_pressure_over_calm": p_sum["put_p50_ms"] / c_sum["put_p50_ms"],
            "put_p99_bursty_over_calm": b_sum["put_p99_ms"] / c_sum["put_p99_ms"],
            "put_p50_bursty_over_calm": b_sum["put_p50_ms"] / c_sum["put_p50_ms"],
            "get_p99_pressure_over_calm": p_sum["get_p99_ms"] / c_sum["get_p99_ms"],
            "demoted_blocks": counters.get("demote_ok", 0),
            "puts_refused_without_clean_room": counters.get("put_full_no_clean_room", 0),
            "calm_evicted_blocks": calm_evicted}


def run_pressure(opts: PressureOptions = PressureOptions()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpool-pressure-") as work:
        started = time.perf_counter()
        ahead = _one_sidecar(opts, 0.1, Path(work))
        waiting = _one_sidecar(opts, 0.1, Path(work), waits=True)
        on_demand = _one_sidecar(opts, 0.0, Path(work), waits=True)
        return {
            "options": opts.__dict__,
            "write_ahead": ahead,
            "write_ahead_put_waits_baseline": waiting,
            "on_demand_baseline": on_demand,
            "put_p99_under_pressure_ahead_over_on_demand": (ahead["pressure"]["put_p99_ms"]
                                                            / on_demand["pressure"]["put_p99_ms"]),
            "put_p99_under_pressure_ahead_over_waits": ahead["pressure"]["put_p99_ms"] / waiting["pressure"]["put_p99_ms"],
            "put_p99_bursty_ahead_over_on_demand": ahead["bursty"]["put_p99_ms"] / on_demand["bursty"]["put_p99_ms"],
            "put_p50_bursty_ahead_over_on_demand": ahead["bursty"]["put_p50_ms"] / on_demand["bursty"]["put_p50_ms"],
            "seconds": time.perf_counter() - started,
            "cpus": os.cpu_count(),
        }
