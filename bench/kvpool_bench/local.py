"""``kvpool bench local``: the local data path against memcpy and Mooncake Store.

The sidecar runs in its own process; this process is the client. For each block size it
puts batches of ``batch`` fresh blocks (from the client's buffers into the shared arena,
checksummed on the way) and gets them back into the client's buffers (verified), after one
untimed warm-up round, exactly as the Mooncake baseline does. Interleaved with those, round
by round, it measures single-thread memcpy of the same blocks (ratios are medians of
per-round ratios, so a noisy neighbour slows both sides alike), and blocks per second of
put, get and acquire/release (in place, verified: what an engine's load does). Then the batched lookup
latency of a 64-key chain and, when ``mooncake-transfer-engine-non-cuda`` is installed,
Mooncake Store's ``batch_put_from``/``batch_get_into`` on the same block sizes (its own
process layout and rounds; its figures are totals over rounds, ours medians of rounds).
The client's buffers (and memcpy's) are page-aligned anonymous memory, as Mooncake's
registered buffers and an engine's pinned tensors are; the client shares a batch of 4 MiB or
more over up to four copying threads (:mod:`kvpool_client.integrity`), so a ratio to the
single-thread memcpy can pass 1.

Beside the rates, the sidecar's own CPU per block for each operation (all its threads, from
``/proc``; each window closes after one empty lookup, so work the sidecar does just after
answering counts too), summed over :data:`CPU_ROUNDS` more rounds of put, get, acquire and
remove, and what that makes one sidecar's capacity: the blocks per second of acquire/release
it could serve were its clients never the bottleneck. On a machine with few cores the
measured rates are the client's and the sidecar's time together.

Output contract: one JSON object with ``ratios`` holding at least ``put_vs_memcpy_4MiB``,
``get_vs_memcpy_4MiB`` (and ``put_vs_mooncake_4MiB``, ``get_vs_mooncake_4MiB`` when
Mooncake is installed) and a number ``lookup64_p50_us``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

from kvpool_bench.mooncake import mooncake_available, run_mooncake_local, size_label
from kvpool_bench.services import page_aligned, process_cpu_s
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/local", dtype="bfloat16", block_tokens=16, kv_layout="bytes")

#: Rounds (each removes its blocks afterwards) over which the sidecar's CPU per block is summed:
#: enough blocks that a timer or a collection in the daemon is a small share of the figure.
CPU_ROUNDS = 64


def _fresh_keys(start: int, n: int) -> list[Any]:
    return block_keys(FP, list(range(start * 16, (start + n) * 16)))


def memcpy_round(src: list[memoryview], dst: list[memoryview]) -> float:
    """Seconds of single-thread memcpy of the batch (the physical limit of a local put/get)."""
    t = time.perf_counter()
    for s, d in zip(src, dst):
        d[:] = s
    return time.perf_counter() - t


class Phase:
    """Times one operation: wall seconds, and the sidecar's CPU seconds until it is idle."""

    def __init__(self, client: PoolClient, pid: int) -> None:
        self.client = client
        self.pid = pid
        self.wall = 0.0
        self.cpu = 0.0

    def __enter__(self) -> Phase:
        self._cpu0 = process_cpu_s(self.pid)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.client.lookup([])  # served after whatever the sidecar does once it answered
        self.cpu = process_cpu_s(self.pid) - self._cpu0


def pool_round(client: PoolClient, pid: int, src: list[memoryview], dst: list[memoryview], first_key: int,
               check: bool) -> tuple[Phase, Phase, Phase]:
    """Put the batch under fresh keys, get it back into ``dst``, and acquire and release it
    in place (verified, no copy: the engine's path); each one's times."""
    keys = _fresh_keys(first_key, len(src))
    with Phase(client, pid) as put:
        statuses = client.put(keys, src)
    if any(s != PutStatus.STORED for s in statuses):
        raise RuntimeError(f"put failed: {statuses}")
    with Phase(client, pid) as get:
        got = client.get(keys, into=dst)
    if any(g is None for g in got) or (check and any(bytes(d) != bytes(s) for s, d in zip(src, dst))):
        raise RuntimeError("get returned a miss or different bytes")
    with Phase(client, pid) as acq, client.acquire(keys) as held:
        if any(v is None for v in held.views):
            raise RuntimeError("acquire returned a miss")
    return put, get, acq


def measure_size(client: PoolClient, pid: int, size: int, batch: int, rounds: int, key_base: int
                 ) -> dict[str, Any]:
    """put, get and memcpy interleaved round by round; ratios are medians of per-round ratios."""
    src = [page_aligned(size, os.urandom(size)) for _ in range(batch)]
    dst = [page_aligned(size) for _ in range(batch)]
    copy_dst = [page_aligned(size) for _ in range(batch)]
    t_copy: list[float] = []
    t_put: list[float] = []
    t_get: list[float] = []
    t_acq: list[float] = []
    for rnd in range(rounds + 1):  # round 0 warms up (and checks the bytes)
        c = memcpy_round(src, copy_dst)
        p, g, a = pool_round(client, pid, src, dst, key_base + rnd * batch, check=rnd == 0)
        if rnd:
            t_copy.append(c)
            t_put.append(p.wall)
            t_get.append(g.wall)
            t_acq.append(a.wall)
    cpu = {"put": 0.0, "get": 0.0, "acquire_release": 0.0}
    for rnd in range(CPU_ROUNDS):
        first = key_base + (rounds + 1 + rnd) * batch
        for op, phase in zip(cpu, pool_round(client, pid, src, dst, first, check=False)):
            cpu[op] += phase.cpu
        client.remove(_fresh_keys(first, batch))
    moved = batch * size / 1e9
    per_block = {op: s / (CPU_ROUNDS * batch) * 1e6 for op, s in cpu.items()}
    return {
        "put_gbps": moved / statistics.median(t_put),
        "get_gbps": moved / statistics.median(t_get),
        "memcpy_gbps": moved / statistics.median(t_copy),
        "put_blocks_per_s": batch / statistics.median(t_put),
        "get_blocks_per_s": batch / statistics.median(t_get),
        "acquire_release_blocks_per_s": batch / statistics.median(t_acq),
        **{f"{op}_sidecar_cpu_us_per_block": us for op, us in per_block.items()},
        "acquire_release_capacity_blocks_per_s": 1e6 / per_block["acquire_release"],
        "put_vs_memcpy": statistics.median(c / p for c, p in zip(t_copy, t_put)),
        "get_vs_memcpy": statistics.median(c / g for c, g in zip(t_copy, t_get)),
    }


def measure_lookup(client: PoolClient, n_keys: int, iterations: int) -> dict[str, float]:
    keys = _fresh_keys(10_000_000, n_keys)
    client.put(keys, [b"x" * 4096] * n_keys, chain=True)
    lat = []
    for i in range(iterations + 50):
        t = time.perf_counter()
        res = client.lookup(keys)
        dt = time.perf_counter() - t
        if res.prefix != n_keys:
            raise RuntimeError("lookup lost blocks")
        if i >= 50:
            lat.append(dt * 1e6)
    lat.sort()
    return {"p50_us": statistics.median(lat), "p99_us": lat[int(len(lat) * 0.99) - 1]}


def run_local_bench(block_sizes: list[int], batch: int = 16, rounds: int = 8, lookups: int = 2000,
                    mooncake: bool = True) -> dict[str, Any]:
    arena = sum(batch * s * (rounds + 1) for s in block_sizes) + (256 << 20)
    result: dict[str, Any] = {"batch": batch, "rounds": rounds, "blocks": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as work:
        config = {"node_name": "bench", "dram": {"size_bytes": arena, "populate": True}, "max_block_bytes": max(block_sizes)}
        with SidecarProcess(config, workdir=work) as sidecar, PoolClient(sidecar.socket_path) as client:
            client.wait_prefaulted()
            base = 0
            for size in block_sizes:
                label = size_label(size)
                row = measure_size(client, sidecar.pid, size, batch, rounds, base)
                base += batch * (rounds + 1 + CPU_ROUNDS)
                result["ratios"][f"put_vs_memcpy_{label}"] = row.pop("put_vs_memcpy")
                result["ratios"][f"get_vs_memcpy_{label}"] = row.pop("get_vs_memcpy")
                result["blocks"][label] = row
            lk = measure_lookup(client, 64, lookups)
    result["lookup64_p50_us"] = lk["p50_us"]
    result["lookup64_p99_us"] = lk["p99_us"]
    result["mooncake"] = None
    if mooncake and mooncake_available():
        mc = run_mooncake_local(block_sizes, batch, rounds)
        mc_tcp = run_mooncake_local(block_sizes, batch, rounds, force_tcp=True)
        result["mooncake"] = {"default": mc, "force_tcp": mc_tcp}
        for label, row in result["blocks"].items():
            for op in ("put", "get"):
                result["ratios"][f"{op}_vs_mooncake_{label}"] = row[f"{op}_gbps"] / mc[label][f"{op}_gbps"]
                result["ratios"][f"{op}_vs_mooncake_tcp_{label}"] = row[f"{op}_gbps"] / mc_tcp[label][f"{op}_gbps"]
    return result
