"""``kvpool bench soak``: many clients under eviction pressure, every byte checked.

A sidecar with a small DRAM tier and a disk tier (so puts evict and demote all the time)
serves ``clients`` clients, spread over worker processes (threads inside each, one
``PoolClient`` per thread). Each client runs a mixed loop for ``seconds``: puts of chained
blocks of a prompt of its own or of a shared one, gets (copies) and acquires (in place) of
prefixes it or others stored, and lookups. Every block's bytes derive from its key, so a
reader knows what each block must hold: a block that comes back with other bytes counts as
*wrong* (must stay 0; a miss is not wrong). Reported: operations and errors by kind, p50/p99
latency per operation, wrong bytes, and the sidecar's RSS and open descriptors sampled
every second. The baseline of the same run: single-thread memcpy plus checksum of one
block, the least a put or get of it costs, as a ratio to each operation's p50.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpool_client.client import PoolClient
from kvpool_client.errors import KVPoolError
from kvpool_client.integrity import checksum
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_sidecar.process import SidecarProcess

FP = ModelFingerprint(model="bench/soak", dtype="bfloat16", block_tokens=16, kv_layout="bytes")
OPS = ("put", "get", "acquire", "lookup")


@dataclass(frozen=True)
class SoakOptions:
    clients: int = 32
    seconds: float = 300.0
    workers: int = 4
    block_bytes: int = 256 << 10
    dram: str = "256Mi"
    disk: str = "1Gi"
    prompts: int = 512  # shared prompts every client reads and writes: 1 GiB, over the DRAM tier
    blocks_per_prompt: int = 8


def block_bytes(key: BlockKey, size: int) -> bytes:
    """The bytes block ``key`` must hold: a reader knows them without asking anyone."""
    seed = hashlib.blake2b(key.raw, digest_size=8).digest()
    return (seed * (size // 8 + 1))[:size]


def _prompt_keys(prompt: int, blocks: int) -> list[BlockKey]:
    rng = random.Random(prompt)
    return block_keys(FP, [rng.randrange(1 << 30) for _ in range(blocks * FP.block_tokens)])


class _Client:
    def __init__(self, sock: str, opts: SoakOptions, seed: int) -> None:
        self.opts = opts
        self.rng = random.Random(seed)
        self.sock = sock
        self.client: PoolClient | None = None
        self.lat: dict[str, list[float]] = {op: [] for op in OPS}
        self.errors: Counter[str] = Counter()
        self.wrong = 0
        self.misses = 0

    def _pool(self) -> PoolClient:
        if self.client is None:
            self.client = PoolClient(self.sock, timeout=30.0)
        return self.client

    def step(self) -> None:
        o = self.opts
        keys = _prompt_keys(self.rng.randrange(o.prompts), o.blocks_per_prompt)
        op = self.rng.choices(OPS, weights=(3, 3, 2, 2))[0]
        t = time.perf_counter()
        try:
            c = self._pool()
            if op == "put":
                c.put(keys, [block_bytes(k, o.block_bytes) for k in keys], chain=True)
            elif op == "get":
                for k, got in zip(keys, c.get(keys)):
                    self._check(k, None if got is None else bytes(got))
            elif op == "acquire":
                with c.acquire(keys) as held:
                    for k, views in zip(keys, held.views):
                        self._check(k, None if views is None else b"".join(bytes(v) for v in views))
            else:
                c.lookup(keys)
        except KVPoolError as e:
            self.errors[type(e).__name__] += 1
            if self.client is not None:
                self.client.close()
                self.client = None
            return
        self.lat[op].append(time.perf_counter() - t)

    def _check(self, key: BlockKey, got: bytes | None) -> None:
        if got is None:
            self.misses += 1
        elif got != block_bytes(key, self.opts.block_bytes):
            self.wrong += 1


def _worker(sock: str, opts: SoakOptions, first: int, n: int, deadline: float, out: Any) -> None:
    clients = [_Client(sock, opts, first + i) for i in range(n)]

    def run(c: _Client) -> None:
        while time.time() < deadline:
            c.step()

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        if c.client is not None:
            c.client.close()
    out.put({"lat": {op: sum((c.lat[op] for c in clients), []) for op in OPS},
             "errors": dict(sum((c.errors for c in clients), Counter())),
             "wrong": sum(c.wrong for c in clients), "misses": sum(c.misses for c in clients)})


def _sample(pid: int, client: PoolClient) -> tuple[int, int]:
    """The sidecar's resident bytes (from /proc) and open descriptors (its own count in
    ``STATS``: it is undumpable, so its descriptors are root's to list)."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    return rss, int(client.stats().get("open_fds") or 0)


def _memcpy_checksum_s(size: int, rounds: int = 50) -> float:
    src = memoryview(os.urandom(size))
    dst = memoryview(bytearray(size))
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst[:] = src
        checksum(dst)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ms_at(xs: list[float], q: float) -> float:
    """The ``q`` quantile of latencies ``xs`` (seconds), in milliseconds (0 for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else 0.0


def run_soak(opts: SoakOptions) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpool-soak-") as work:
        cfg = {"node_name": "soak", "dram": {"size_bytes": opts.dram, "populate": True},
               "disk": {"path": str(Path(work) / "disk"), "size_bytes": opts.disk},
               "api": {"max_connections": max(1024, 2 * opts.clients)}}
        with SidecarProcess(cfg, workdir=Path(work) / "sidecar") as sp:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            deadline = time.time() + opts.seconds
            per = [opts.clients // opts.workers + (i < opts.clients % opts.workers) for i in range(opts.workers)]
            procs = [ctx.Process(target=_worker, args=(sp.socket_path, opts, sum(per[:i]), n, deadline, q))
                     for i, n in enumerate(per) if n]
            for p in procs:
                p.start()
            samples: list[tuple[float, int, int]] = []
            start = time.time()
            with PoolClient(sp.socket_path, timeout=30.0) as watcher:  # (one descriptor more, throughout)
                while any(p.is_alive() for p in procs) and time.time() < deadline + 60:
                    samples.append((round(time.time() - start, 1), *_sample(sp.pid, watcher)))
                    time.sleep(1.0)
            results = [q.get(timeout=60) for _ in procs]
            for p in procs:
                p.join(10)
            alive = sp.proc is not None and sp.proc.poll() is None
    lat: dict[str, list[float]] = {op: sum((r["lat"][op] for r in results), []) for op in OPS}
    errors: Counter[str] = Counter()
    for r in results:
        errors.update(r["errors"])
    base_ms = _memcpy_checksum_s(opts.block_bytes) * 1e3
    per_block = {"put": opts.blocks_per_prompt, "get": opts.blocks_per_prompt,
                 "acquire": opts.blocks_per_prompt, "lookup": 0}
    ops = {op: {"count": len(v), "p50_ms": ms_at(v, 0.5), "p99_ms": ms_at(v, 0.99)} for op, v in lat.items()}
    return {
        "bench": "soak",
        "options": asdict(opts),
        "operations": sum(len(v) for v in lat.values()),
        "wrong_blocks": sum(r["wrong"] for r in results),
        "missed_blocks": sum(r["misses"] for r in results),
        "errors": dict(errors),
        "ops": ops,
        "baseline_memcpy_checksum_ms_per_block": base_ms,
        "ratios": {f"{op}_p50_vs_memcpy_checksum": ops[op]["p50_ms"] / (base_ms * per_block[op])
                   for op in ("put", "get", "acquire") if ops[op]["count"]},
        "sidecar": {"alive_at_end": alive, "rss_bytes": [s[1] for s in samples], "open_fds": [s[2] for s in samples],
                    "rss_max": max((s[1] for s in samples), default=0),
                    "fds_max": max((s[2] for s in samples), default=0)},
    }


__all__ = ["SoakOptions", "block_bytes", "run_soak"]
