"""``kvpool bench local``: the local data path against memcpy and Mooncake Store.

The sidecar runs in its own process; this process is the client. For each block size it
puts batches of ``batch`` fresh blocks (from the client's buffers into the shared arena,
checksummed on the way) and gets them back into the client's buffers (verified), after one
untimed warm-up round, and removes them (untimed), exactly as the Mooncake baseline does:
both then write into memory just freed, still in the CPU's caches (kinder to both than a
full arena in production, whose room comes from cold blocks). Interleaved with those, round
by round, it measures single-thread memcpy of the same blocks (ratios are medians of
per-round ratios, so a noisy neighbour slows both sides alike), and blocks per second of
put, get and acquire/release (in place, verified: what an engine's load does), and the client's
own checksummed copy of the batch alone (:func:`checksummed_copy_round`: what a verified put
does to the bytes, without the sidecar; a put can beat it, as it hashes while it waits for
room; Mooncake checksums nothing, so its rates are also given against
memcpy). When ``mooncake-transfer-engine-non-cuda`` is
installed, each round also runs Mooncake Store's ``batch_put_from``/``batch_get_into`` of the
same block sizes in a local store client of its own (:class:`~kvpool_bench.mooncake.MooncakeRounds`),
so ``put_vs_mooncake`` and ``get_vs_mooncake`` are medians of per-round ratios too (they had
been two runs taken apart, whose ratio moved by half from one run to the next here). Then the
batched lookup latency of a 64-key chain, and Mooncake through TCP loopback
(``MC_STORE_MEMCPY=0``), a run of its own.
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

``sidecar_tiers`` names the tiers the sidecar ran, hottest first: where CUDA is, a GPU tier
above DRAM, into which blocks read twice are copied (their cost counts in the sidecar's CPU
per block of get and acquire).

Output contract: one JSON object with ``ratios`` holding at least ``put_vs_memcpy_4MiB``,
``get_vs_memcpy_4MiB`` (and ``put_vs_mooncake_4MiB``, ``get_vs_mooncake_4MiB`` when
Mooncake is installed) and a number ``lookup64_p50_us``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from typing import Any

from kvpool_bench.mooncake import MooncakeRounds, mooncake_available, mooncake_rounds, run_mooncake_local, size_label
from kvpool_bench.services import check_memory, page_aligned, process_cpu_s
from kvpool_client.client import PoolClient
from kvpool_client.integrity import copy_many
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


def checksummed_copy_round(src: list[memoryview], dst: list[memoryview]) -> float:
    """Seconds of the client's own copy of the batch, checksummed on the way (what a put does
    to the bytes, threads and all, without the sidecar; a put hashes some blocks ahead while
    it waits for room, so it can beat this)."""
    t = time.perf_counter()
    copy_many([([d], s) for s, d in zip(src, dst)])
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


def measure_size(client: PoolClient, pid: int, size: int, batch: int, rounds: int, key_base: int,
                 mooncake: MooncakeRounds | None = None) -> dict[str, Any]:
    """put, get, memcpy and (given ``mooncake``) Mooncake's put and get interleaved round by
    round; ratios are medians of per-round ratios."""
    src = [page_aligned(size, os.urandom(size)) for _ in range(batch)]
    dst = [page_aligned(size) for _ in range(batch)]
    copy_dst = [page_aligned(size) for _ in range(batch)]
    t_copy: list[float] = []
    t_summed: list[float] = []
    t_put: list[float] = []
    t_get: list[float] = []
    t_acq: list[float] = []
    t_mc: list[tuple[float, float]] = []
    for rnd in range(rounds + 1):  # round 0 warms up (and checks the bytes)
        c = memcpy_round(src, copy_dst)
        summed = checksummed_copy_round(src, copy_dst)
        p, g, a = pool_round(client, pid, src, dst, key_base + rnd * batch, check=rnd == 0)
        # removed untimed, as the Mooncake round removes its keys: both puts then write into
        # memory just freed (without this, ours wrote fresh arena pages each round, out of cache,
        # while Mooncake's small segment stayed in it: 4.5 against 6.3 GB/s at 512 KiB here)
        client.remove(_fresh_keys(key_base + rnd * batch, batch))
        if mooncake is not None:
            mc = mooncake.round(size, check=rnd == 0)
            if rnd:
                t_mc.append(mc)
        if rnd:
            t_copy.append(c)
            t_summed.append(summed)
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
    paired: dict[str, float] = {}
    if t_mc:
        mc_put, mc_get = [m[0] for m in t_mc], [m[1] for m in t_mc]
        paired = {"mooncake_put_gbps": moved / statistics.median(mc_put),
                  "mooncake_get_gbps": moved / statistics.median(mc_get),
                  "put_vs_mooncake": statistics.median(m / p for m, p in zip(mc_put, t_put)),
                  "get_vs_mooncake": statistics.median(m / g for m, g in zip(mc_get, t_get)),
                  "mooncake_put_vs_memcpy": statistics.median(c / m for c, m in zip(t_copy, mc_put)),
                  "mooncake_get_vs_memcpy": statistics.median(c / m for c, m in zip(t_copy, mc_get))}
    return {
        "put_gbps": moved / statistics.median(t_put),
        "get_gbps": moved / statistics.median(t_get),
        "memcpy_gbps": moved / statistics.median(t_copy),
        "checksummed_copy_gbps": moved / statistics.median(t_summed),
        "put_blocks_per_s": batch / statistics.median(t_put),
        "get_blocks_per_s": batch / statistics.median(t_get),
        "acquire_release_blocks_per_s": batch / statistics.median(t_acq),
        **{f"{op}_sidecar_cpu_us_per_block": us for op, us in per_block.items()},
        "acquire_release_capacity_blocks_per_s": 1e6 / per_block["acquire_release"],
        "put_vs_memcpy": statistics.median(c / p for c, p in zip(t_copy, t_put)),
        "get_vs_memcpy": statistics.median(c / g for c, g in zip(t_copy, t_get)),
        "put_vs_checksummed_copy": statistics.median(c / p for c, p in zip(t_summed, t_put)),
        "get_vs_checksummed_copy": statistics.median(c / g for c, g in zip(t_summed, t_get)),
        **paired,
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
    check_memory(arena + 2 * batch * max(block_sizes), "kvpool bench local", "--sizes-mib, --batch or --rounds")  # (the arena, the client's buffers)
    result: dict[str, Any] = {"batch": batch, "rounds": rounds, "blocks": {}, "ratios": {}}
    paired = mooncake and mooncake_available()
    with contextlib.ExitStack() as stack:
        rounds_of_mooncake = stack.enter_context(mooncake_rounds(block_sizes, batch)) if paired else None
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpool-bench-"))
        config = {"node_name": "bench", "dram": {"size_bytes": arena, "populate": True}, "max_block_bytes": max(block_sizes)}
        sidecar = stack.enter_context(SidecarProcess(config, workdir=work))
        client = stack.enter_context(PoolClient(sidecar.socket_path))
        client.wait_prefaulted()
        # a GPU tier (on by default where CUDA is) copies blocks read twice up to the device:
        # its cost is in the sidecar's CPU per block of get and acquire
        result["sidecar_tiers"] = list(client.stats()["tiers"])
        base = 0
        for size in block_sizes:
            label = size_label(size)
            row = measure_size(client, sidecar.pid, size, batch, rounds, base, rounds_of_mooncake)
            base += batch * (rounds + 1 + CPU_ROUNDS)
            for name in ("put_vs_memcpy", "get_vs_memcpy", "put_vs_checksummed_copy", "get_vs_checksummed_copy",
                         "put_vs_mooncake", "get_vs_mooncake", "mooncake_put_vs_memcpy", "mooncake_get_vs_memcpy"):
                if name in row:
                    result["ratios"][f"{name}_{label}"] = row.pop(name)
            result["blocks"][label] = row
        lk = measure_lookup(client, 64, lookups)
    result["lookup64_p50_us"] = lk["p50_us"]
    result["lookup64_p99_us"] = lk["p99_us"]
    result["mooncake"] = None
    if paired:
        # the paired rounds above; through TCP loopback (MC_STORE_MEMCPY=0), a run of its own
        mc = {label: {op: row[f"mooncake_{op}_gbps"] for op in ("put", "get")}
              for label, row in result["blocks"].items()}
        mc_tcp = run_mooncake_local(block_sizes, batch, rounds, force_tcp=True)
        result["mooncake"] = {"default": mc, "force_tcp": mc_tcp}
        for label, row in result["blocks"].items():
            for op in ("put", "get"):
                result["ratios"][f"{op}_vs_mooncake_tcp_{label}"] = row[f"{op}_gbps"] / mc_tcp[label][f"{op}_gbps"]
    return result
