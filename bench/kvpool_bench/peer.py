"""``kvpool bench peer``: fetching blocks from a peer sidecar against raw loopback TCP.

Two sidecars on loopback share a real redis-server (started here). Sidecar A holds
``batch`` fresh blocks per round; a client of sidecar B gets them, which runs B's whole
read path: index lookup, holder choice, one TCP request to A (``sendfile`` from A's arena,
``recv_into`` B's arena), checksum verification, local commit, and the client's verified
copy out of B's arena. In the same run: a plain socket copy of the same bytes between two
processes on loopback (the physical limit), 64-key index lookup latency, and, when
Mooncake is installed, Mooncake Store's remote ``batch_get_into`` on the same block sizes.

Output contract: ``ratios`` holds ``fetch_vs_raw_tcp_4MiB`` (and ``fetch_vs_mooncake_4MiB``
when Mooncake is installed); ``lookup64_p50_us`` is a number.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpool_bench.mooncake import mooncake_available, run_mooncake_remote, size_label
from kvpool_bench.services import RedisServer, free_port
from kvpool_client.client import PoolClient
from kvpool_client.keys import ModelFingerprint, block_keys
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/peer", dtype="bfloat16", block_tokens=16)


def _sender(port: int, size: int, count: int) -> None:
    buf = os.urandom(size)
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(count):
            s.sendall(buf)
        s.recv(1)


def measure_raw_tcp(size: int, batch: int, rounds: int) -> float:
    """GB/s of a plain socket copy of ``batch * rounds`` blocks between two processes."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        proc = mp.get_context("spawn").Process(target=_sender, args=(port, size, batch * (rounds + 1)))
        proc.start()
        conn, _ = srv.accept()
        with conn:
            view = memoryview(bytearray(size))
            total = 0.0
            for rnd in range(rounds + 1):
                t = time.perf_counter()
                for _ in range(batch):
                    got = 0
                    while got < size:
                        n = conn.recv_into(view[got:])
                        if n == 0:
                            raise RuntimeError("raw sender closed early")
                        got += n
                if rnd:
                    total += time.perf_counter() - t
            conn.sendall(b"x")
        proc.join(10)
    return batch * size * rounds / total / 1e9


def _node(name: str, redis_url: str, token: Path, arena: int, block_max: int) -> dict[str, Any]:
    return {
        "node_name": name, "pool": "bench", "block_max_bytes": block_max,
        "dram": {"size_bytes": arena, "populate": True},
        "index": {"backend": "redis", "url": redis_url, "heartbeat_s": 0.5},
        "peer": {"enabled": True, "host": "127.0.0.1", "port": free_port(), "token_file": str(token),
                 "fetch_timeout_s": 30.0},
    }


def measure_fetch(a: PoolClient, b: PoolClient, size: int, batch: int, rounds: int, base: int) -> float:
    src = [os.urandom(size) for _ in range(batch)]
    dst = [memoryview(bytearray(size)) for _ in range(batch)]
    total = 0.0
    for rnd in range(rounds + 1):
        keys = block_keys(FP, list(range((base + rnd * batch) * 16, (base + (rnd + 1) * batch) * 16)))
        a.put(keys, src)
        deadline = time.monotonic() + 10
        while b.lookup(keys).prefix < batch:  # wait for A's publish to reach the index
            if time.monotonic() > deadline:
                raise RuntimeError("blocks never appeared in the index")
            time.sleep(0.002)
        t = time.perf_counter()
        got = b.get(keys, into=dst)
        dt = time.perf_counter() - t
        if any(g is None for g in got) or (rnd == 0 and any(bytes(d) != s for s, d in zip(src, dst))):
            raise RuntimeError("peer fetch returned a miss or different bytes")
        if rnd:
            total += dt
    return batch * size * rounds / total / 1e9


def measure_index_lookup(redis_url: str, n_keys: int, iterations: int) -> dict[str, float]:
    from kvpool_sidecar.events import IndexEvent
    from kvpool_sidecar.index.redis import RedisIndex, RedisIndexSettings

    async def run() -> list[float]:
        idx = RedisIndex(redis_url, RedisIndexSettings(pool="bench-lookup"))
        keys = [k.raw for k in block_keys(FP, list(range(n_keys * 16)))]
        await idx.heartbeat("n1", "127.0.0.1:1", {}, 0, 0, [], 30)
        await idx.apply("n1", [IndexEvent(True, "dram", k) for k in keys])
        lat = []
        for i in range(iterations + 20):
            t = time.perf_counter()
            held = await idx.lookup(keys)
            if len(held) != n_keys:
                raise RuntimeError("index lookup lost keys")
            if i >= 20:
                lat.append((time.perf_counter() - t) * 1e6)
        await idx.purge_pool()
        await idx.close()
        return lat

    lat = sorted(asyncio.run(run()))
    return {"p50_us": statistics.median(lat), "p99_us": lat[int(len(lat) * 0.99) - 1]}


def run_peer_bench(block_sizes: list[int], batch: int = 16, rounds: int = 6, mooncake: bool = True) -> dict[str, Any]:
    arena = batch * max(block_sizes) * (rounds + 1) * len(block_sizes) + (128 << 20)
    result: dict[str, Any] = {"batch": batch, "rounds": rounds, "blocks": {}, "ratios": {}}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-peer-") as work, RedisServer() as redis:
        token = Path(work) / "token"
        token.write_text(os.urandom(24).hex())
        sa = SidecarProcess(_node("a", redis.url, token, arena, max(block_sizes)), workdir=Path(work) / "a")
        sb = SidecarProcess(_node("b", redis.url, token, arena, max(block_sizes)), workdir=Path(work) / "b")
        with sa, sb, PoolClient(sa.socket_path) as a, PoolClient(sb.socket_path) as b:
            a.wait_prefaulted()
            b.wait_prefaulted()
            base = 0
            for size in block_sizes:
                label = size_label(size)
                fetch = measure_fetch(a, b, size, batch, rounds, base)
                base += batch * (rounds + 1)
                raw = measure_raw_tcp(size, batch, rounds)
                result["blocks"][label] = {"fetch_gbps": fetch, "raw_tcp_gbps": raw}
                result["ratios"][f"fetch_vs_raw_tcp_{label}"] = fetch / raw
        lk = measure_index_lookup(redis.url, 64, 1000)
    result["lookup64_p50_us"] = lk["p50_us"]
    result["lookup64_p99_us"] = lk["p99_us"]
    result["mooncake"] = None
    if mooncake and mooncake_available():
        mc = run_mooncake_remote(block_sizes, batch, rounds)
        result["mooncake"] = mc
        for label, row in result["blocks"].items():
            row["mooncake_get_gbps"] = mc[label]["get_gbps"]
            result["ratios"][f"fetch_vs_mooncake_{label}"] = row["fetch_gbps"] / mc[label]["get_gbps"]
    return result
