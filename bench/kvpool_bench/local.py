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
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/local", dtype="bfloat16", block_tokens=16, kv_layout="bytes")


def _fresh_keys(start: int, n: int) -> list[Any]:
    return block_keys(FP, list(range(start * 16, (start + n) * 16)))


def memcpy_round(src: list[memoryview], dst: list[memoryview]) -> float:
    """Seconds of single-thread memcpy of the batch (the physical limit of a local put/get)."""
    t = time.perf_counter()
    for s, d in zip(src, dst):
        d[:] = s
    return time.perf_counter() - t


def pool_round(client: PoolClient, src: list[memoryview], dst: list[memoryview], first_key: int,
               check: bool) -> tuple[float, float, float]:
    """Seconds to put the batch under fresh keys, to get it back into ``dst``, and to
    acquire and release it in place (verified, no copy: the engine's path)."""
    keys = _fresh_keys(first_key, len(src))
    t = time.perf_counter()
    statuses = client.put(keys, src)
    t_put = time.perf_counter() - t
    if any(s != PutStatus.STORED for s in statuses):
        raise RuntimeError(f"put failed: {statuses}")
    t = time.perf_counter()
    got = client.get(keys, into=dst)
    t_get = time.perf_counter() - t
    if any(g is None for g in got) or (check and any(bytes(d) != bytes(s) for s, d in zip(src, dst))):
        raise RuntimeError("get returned a miss or different bytes")
    t = time.perf_counter()
    with client.acquire(keys) as held:
        if any(v is None for v in held.views):
            raise RuntimeError("acquire returned a miss")
    t_acq = time.perf_counter() - t
    return t_put, t_get, t_acq


def measure_size(client: PoolClient, size: int, batch: int, rounds: int, key_base: int) -> dict[str, Any]:
    """put, get and memcpy interleaved round by round; ratios are medians of per-round ratios."""
    src = [memoryview(bytearray(os.urandom(size))) for _ in range(batch)]
    dst = [memoryview(bytearray(size)) for _ in range(batch)]
    copy_dst = [memoryview(bytearray(size)) for _ in range(batch)]
    t_copy: list[float] = []
    t_put: list[float] = []
    t_get: list[float] = []
    t_acq: list[float] = []
    for rnd in range(rounds + 1):  # round 0 warms up (and checks the bytes)
        c = memcpy_round(src, copy_dst)
        p, g, a = pool_round(client, src, dst, key_base + rnd * batch, check=rnd == 0)
        if rnd:
            t_copy.append(c)
            t_put.append(p)
            t_get.append(g)
            t_acq.append(a)
    moved = batch * size / 1e9
    return {
        "put_gbps": moved / statistics.median(t_put),
        "get_gbps": moved / statistics.median(t_get),
        "memcpy_gbps": moved / statistics.median(t_copy),
        "put_blocks_per_s": batch / statistics.median(t_put),
        "get_blocks_per_s": batch / statistics.median(t_get),
        "acquire_release_blocks_per_s": batch / statistics.median(t_acq),
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
                row = measure_size(client, size, batch, rounds, base)
                base += batch * (rounds + 1)
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
