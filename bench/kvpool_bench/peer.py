"""``kvpool bench peer``: fetching blocks from a peer sidecar against raw loopback TCP.

Two sidecars on loopback share a real redis-server (started here). Sidecar A holds
``batch`` fresh blocks per round; a client of sidecar B gets them, which runs B's whole
read path: index lookup, holder choice, one TCP request to A (``send`` from A's arena,
``recv_into`` B's arena), checksum verification, local commit, and the client's verified
copy out of B's arena; a second pass reads through ``acquire`` instead (verified in place,
no copy out), as a GPU engine with a pinned arena would. Round by round, interleaved with
those, a plain socket copy of the same bytes between two processes on loopback (the physical
limit). Its main form reuses one cache-hot buffer on each side, the stricter baseline;
``raw_tcp_distinct`` sends and receives distinct buffers, the fetch's memory footprint. Every
buffer a receiver fills, the baseline's and the client's, is page-aligned anonymous memory, as
the arena's extents, Mooncake's registered buffers and an engine's pinned tensors are: the
kernel's copy into a bytearray (16 bytes into a page) ran at 1.4 GB/s against 2.4-3.5
page-aligned on the development machines, which made the baseline half as fast as the wire.
``raw_tcp_hashed`` is the same copy of distinct buffers through the peer transport's own bulk
send and receive, with the hashing no verified transfer can skip (the sender MACs each piece,
the receiver checksums and MACs each as it lands, pipelined where the sidecars' are) and none of
the rest of a fetch (request, header, room, commit): where both CPUs are busy with the raw
copy already, that hashing adds to it, and ``fetch_in_place_vs_raw_tcp_hashed`` says how close
the engine's path comes to that ceiling.
Ratios are medians of per-round ratios. ``transfer`` is the wire part alone as B's sidecar
times it (request sent to last block verified), to show where the rest of the time goes.
Also the index's 64-key lookup latency against a bare Redis round trip (``PING`` on the
index's own connection, interleaved with the lookups; both one ``HMGET`` of the holders hash):
the same chain again and again, its fields hot in the server's caches, and, as
``lookup64_cold``, chains looked up once each; and, when Mooncake is installed, Mooncake
Store's remote ``batch_get_into`` on the same sizes.

Output contract: ``ratios`` holds ``fetch_vs_raw_tcp_4MiB``, ``fetch_in_place_vs_raw_tcp_hashed_4MiB``,
``raw_tcp_hashed_vs_raw_tcp_4MiB``, ``lookup64_vs_redis_rtt``,
``lookup64_cold_vs_redis_rtt`` (and ``fetch_vs_mooncake_4MiB`` when Mooncake is installed);
``lookup64_p50_us`` is a number.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvpool_bench.mooncake import mooncake_available, run_mooncake_remote, size_label
from kvpool_bench.services import RedisServer, check_memory, free_port, page_aligned
from kvpool_client.client import PoolClient
from kvpool_client.keys import RAW_KEY_BYTES, ModelFingerprint, block_keys
from kvpool_sidecar.process import SidecarProcess
from kvpool_sidecar.transfer import auth
from kvpool_sidecar.transfer import tcpio
from kvpool_sidecar.transfer.tcpio import pipelined_default

FP = ModelFingerprint(model="bench/peer", dtype="bfloat16", block_tokens=16, kv_layout="bytes")


def _sender(port: int, size: int, batch: int, key: bytes) -> None:
    """The raw baseline's sending process: ``batch`` blocks of ``size`` per request byte.

    ``x`` sends one cache-hot buffer ``batch`` times; ``d`` sends ``batch`` distinct buffers
    (two rounds' worth, rotating), the memory footprint of a fetch from a sidecar's arena;
    ``h`` sends them as ``d`` does through the peer transport's own bulk send (each block's
    MAC nonce, its bytes MACed piece by piece, its tag), under ``key``.
    """
    buf = os.urandom(size)
    many = [os.urandom(size) for _ in range(2 * batch)]
    sealer = auth.Sealer(key)
    turn = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        tcpio.tune(s, receiver=False)  # (as a sidecar answering a fetch)
        while (mode := s.recv(1)) in (b"x", b"d", b"h"):
            blocks = [buf if mode == b"x" else many[(turn * batch + i) % len(many)] for i in range(batch)]
            if mode == b"h":
                out = [tcpio.Outgoing([(0, size)], [memoryview(b)], sealer.mac(1, i, _KEY, size, 0, "default"))
                       for i, b in enumerate(blocks)]
                tcpio.blocking_send(s, out, 60.0)
                s.setblocking(True)  # (the bulk send leaves its socket to an event loop)
            else:
                for b in blocks:
                    s.sendall(b)
            turn += 1


#: The block key the hashed baseline's MACs cover (any: both ends use it).
_KEY = b"k" * RAW_KEY_BYTES


class RawTcp:
    """A plain loopback socket copy between two processes, one round on demand."""

    def __init__(self, size: int, batch: int, pipelined: bool = False) -> None:
        self.size, self.batch = size, batch
        self._key = os.urandom(32)
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(1)
        self._proc = mp.get_context("spawn").Process(target=_sender,
                                                     args=(self._srv.getsockname()[1], size, batch, self._key))
        self._proc.start()
        self._srv.settimeout(60)
        self._conn, _ = self._srv.accept()
        tcpio.tune(self._conn, receiver=True)  # (as a sidecar fetching)
        self._view = page_aligned(size)
        self._views = [page_aligned(size) for _ in range(2 * batch)]
        self._turn = 0
        # as a sidecar's receives: checked on the receiving thread, or pipelined on another
        self._hashers = ThreadPoolExecutor(1, thread_name_prefix="bench-hash") if pipelined else None

    def round(self, distinct: bool = False, hashed: bool = False) -> float:
        """Seconds to receive one batch: one hot buffer reused, or distinct buffers each side;
        ``hashed``: distinct buffers sent and received by the peer transport's own bulk
        send and receive (``tcpio.blocking_send``, ``tcpio.blocking_recv``: MACed as they go,
        checksummed and MAC-checked as they land, pipelined as the sidecars' are), with none
        of the rest of a fetch: the ceiling of a verified transfer on this machine."""
        t = time.perf_counter()
        self._conn.sendall(b"h" if hashed else b"d" if distinct else b"x")
        views = [self._views[(self._turn * self.batch + i) % len(self._views)] if distinct or hashed else self._view
                 for i in range(self.batch)]
        if hashed:
            blocks: list[tuple[list[memoryview] | None, int, Any]] = [
                ([v], self.size, functools.partial(auth.block_mac, self._key, 1, i, _KEY, self.size, 0, "default"))
                for i, v in enumerate(views)]
            sums: list[int | None] = []
            tcpio.blocking_recv(self._conn, blocks, 60.0, sums, self._hashers)
            self._conn.setblocking(True)
            if len(sums) != self.batch or None in sums:
                raise RuntimeError("the hashed baseline's blocks failed their MACs")
        else:
            for view in views:
                got = 0
                while got < self.size:
                    n = self._conn.recv_into(view[got:])
                    if n == 0:
                        raise RuntimeError("raw sender closed early")
                    got += n
        self._turn += distinct or hashed
        return time.perf_counter() - t

    def close(self) -> None:
        if self._hashers is not None:
            self._hashers.shutdown()
        self._conn.sendall(b"q")
        self._conn.close()
        self._srv.close()
        self._proc.join(10)


def _node(name: str, redis_url: str, token: Path, arena: int, block_max: int,
          pipelined: bool | None) -> dict[str, Any]:
    return {
        "node_name": name, "pool": "bench", "max_block_bytes": block_max,
        "dram": {"size_bytes": arena, "populate": True},
        "index": {"backend": "redis", "url": redis_url, "heartbeat_s": 0.5},
        "peer": {"enabled": True, "host": "127.0.0.1", "port": free_port(), "token_file": str(token),
                 "fetch_timeout_s": 30.0, "pipelined_receive": pipelined},
    }


def _fetch_seconds(b: PoolClient) -> float:
    """B's running total of time spent in peer transfers (request sent to last block verified)."""
    counters = b.stats()["counters"]
    return float(counters.get("fetch_us", 0)) / 1e6 if isinstance(counters, dict) else 0.0


def fetch_round(a: PoolClient, b: PoolClient, src: list[bytes], dst: list[memoryview], first_key: int,
                *, in_place: bool, check: bool) -> tuple[float, float]:
    """Seconds for B to read ``len(src)`` blocks that only A holds (fresh keys each round),
    and of those the seconds B's sidecar spent in the peer transfer itself."""
    batch = len(src)
    keys = block_keys(FP, list(range(first_key * 16, (first_key + batch) * 16)))
    a.put(keys, src)
    deadline = time.monotonic() + 10
    while b.lookup(keys).prefix < batch:  # wait for A's publish to reach the index
        if time.monotonic() > deadline:
            raise RuntimeError("blocks never appeared in the index")
        time.sleep(0.002)
    wire = _fetch_seconds(b)
    t = time.perf_counter()
    if in_place:
        with b.acquire(keys) as held:
            dt = time.perf_counter() - t
            views = held.views
            if any(v is None for v in views) or (
                    check and any(b"".join(map(bytes, v or [])) != s for s, v in zip(src, views))):
                raise RuntimeError("peer fetch returned a miss or different bytes")
        return dt, _fetch_seconds(b) - wire
    got = b.get(keys, into=dst)
    dt = time.perf_counter() - t
    if any(g is None for g in got) or (check and any(bytes(d) != s for s, d in zip(src, dst))):
        raise RuntimeError("peer fetch returned a miss or different bytes")
    return dt, _fetch_seconds(b) - wire


def measure_index_lookup(redis_url: str, n_keys: int, iterations: int, cold: int = 200) -> dict[str, float]:
    from kvpool_sidecar.events import IndexEvent
    from kvpool_sidecar.index.redis import RedisIndex, RedisIndexSettings

    async def run() -> tuple[list[float], list[float], list[float], list[float]]:
        idx = RedisIndex(redis_url, RedisIndexSettings(pool="bench-lookup"))
        keys = [k.raw for k in block_keys(FP, list(range(n_keys * 16)))]
        # ``cold`` more chains of n_keys, each looked up once: nothing of them is cached
        more = [k.raw for k in block_keys(FP, list(range(n_keys * 16, n_keys * 16 * (cold + 1))))]
        await idx.heartbeat("n1", "127.0.0.1:1", {}, 0, 0, [], 30)
        await idx.apply("n1", [IndexEvent(True, "dram", k) for k in keys + more])
        lat, rtt, lat_cold, rtt_cold = [], [], [], []
        for i in range(iterations + 20):
            t = time.perf_counter()
            held = await idx.lookup(keys)
            t1 = time.perf_counter()
            # the baseline, interleaved: a bare round trip on the index's own connection
            await idx.ping()
            t2 = time.perf_counter()
            if len(held) != n_keys:
                raise RuntimeError("index lookup lost keys")
            if i >= 20:
                lat.append((t1 - t) * 1e6)
                rtt.append((t2 - t1) * 1e6)
        for i in range(cold):
            t = time.perf_counter()
            held = await idx.lookup(more[i * n_keys:(i + 1) * n_keys])
            t1 = time.perf_counter()
            await idx.ping()
            t2 = time.perf_counter()
            if len(held) != n_keys:
                raise RuntimeError("index lookup lost keys")
            lat_cold.append((t1 - t) * 1e6)
            rtt_cold.append((t2 - t1) * 1e6)
        await idx.purge_pool()
        await idx.close()
        return lat, rtt, lat_cold, rtt_cold

    lat, rtt, lat_cold, rtt_cold = (sorted(x) for x in asyncio.run(run()))
    return {"p50_us": statistics.median(lat), "p99_us": lat[int(len(lat) * 0.99) - 1],
            "rtt_p50_us": statistics.median(rtt), "cold_p50_us": statistics.median(lat_cold),
            "cold_rtt_p50_us": statistics.median(rtt_cold)}


def mac_round(blocks: list[bytes]) -> float:
    """Seconds to MAC ``blocks`` as a peer does (AES-256-GMAC under a connection key)."""
    sealer = auth.Sealer(os.urandom(32))
    t0 = time.perf_counter()
    for i, b in enumerate(blocks):
        h = sealer.mac(1, i, b"k" * 48, len(b), 0, "default")
        h.update(b)
        h.digest()
    return time.perf_counter() - t0


def run_peer_bench(block_sizes: list[int], batch: int = 16, rounds: int = 6, mooncake: bool = True,
                   pipelined: bool | None = None) -> dict[str, Any]:
    """``pipelined``: the sidecars' ``peer.pipelined_receive`` (None: their default, by CPUs)."""
    arena = 2 * batch * max(block_sizes) * (rounds + 1) * len(block_sizes) + (128 << 20)
    check_memory(2 * arena + 4 * batch * max(block_sizes), "kvpool bench peer", "--sizes-mib, --batch or --rounds")  # (two sidecars, both ends' buffers)
    result: dict[str, Any] = {"batch": batch, "rounds": rounds, "blocks": {}, "ratios": {},
                              "pipelined_receive": pipelined_default() if pipelined is None else pipelined}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-peer-") as work, RedisServer() as redis:
        token = Path(work) / "token"
        token.write_text(os.urandom(24).hex())
        sa = SidecarProcess(_node("a", redis.url, token, arena, max(block_sizes), pipelined), workdir=Path(work) / "a")
        sb = SidecarProcess(_node("b", redis.url, token, arena, max(block_sizes), pipelined), workdir=Path(work) / "b")
        with sa, sb, PoolClient(sa.socket_path) as a, PoolClient(sb.socket_path) as b:
            a.wait_prefaulted()
            b.wait_prefaulted()
            key = 0
            for size in block_sizes:
                label = size_label(size)
                src = [os.urandom(size) for _ in range(batch)]
                dst = [page_aligned(size) for _ in range(batch)]  # as Mooncake's get lands
                raw = RawTcp(size, batch, result["pipelined_receive"])
                times: dict[str, list[float]] = {"raw": [], "raw_distinct": [], "raw_hashed": [], "fetch": [],
                                                 "in_place": [], "transfer": [], "mac": []}
                try:
                    # baseline and measurements interleave round by round, so a noisy
                    # neighbour slows both alike; round 0 warms up and is not counted
                    for rnd in range(rounds + 1):
                        t_raw = raw.round()
                        t_raw_distinct = raw.round(distinct=True)
                        t_raw_hashed = raw.round(hashed=True)
                        t_fetch, wire_1 = fetch_round(a, b, src, dst, key, in_place=False, check=rnd == 0)
                        t_in_place, wire_2 = fetch_round(a, b, src, dst, key + batch, in_place=True,
                                                         check=rnd == 0)
                        key += 2 * batch
                        t_mac = mac_round(src)
                        if rnd:
                            times["mac"].append(t_mac)
                            times["raw"].append(t_raw)
                            times["raw_distinct"].append(t_raw_distinct)
                            times["raw_hashed"].append(t_raw_hashed)
                            times["fetch"].append(t_fetch)
                            times["in_place"].append(t_in_place)
                            times["transfer"].append((wire_1 + wire_2) / 2)
                finally:
                    raw.close()
                moved = batch * size / 1e9
                row = {f"{k}_gbps".replace("raw", "raw_tcp"): moved / statistics.median(v) for k, v in times.items()}
                row["fetch_in_place_gbps"] = row.pop("in_place_gbps")
                result["blocks"][label] = row
                result["ratios"][f"fetch_vs_raw_tcp_{label}"] = statistics.median(
                    r / f for r, f in zip(times["raw"], times["fetch"]))
                result["ratios"][f"fetch_in_place_vs_raw_tcp_{label}"] = statistics.median(
                    r / f for r, f in zip(times["raw"], times["in_place"]))
                # the wire part alone (B's sidecar: request sent to last block verified)
                # the same ratio against a baseline with the fetch's memory footprint
                result["ratios"][f"fetch_vs_raw_tcp_distinct_{label}"] = statistics.median(
                    r / f for r, f in zip(times["raw_distinct"], times["fetch"]))
                # what authenticating every block costs: the sender and the receiver each MAC
                # it once (AES-256-GMAC, one core), as a share of the whole fetch's time
                result["ratios"][f"mac_share_of_fetch_{label}"] = statistics.median(
                    2 * m / f for m, f in zip(times["mac"], times["fetch"]))
                # against the raw copy with the hashing verification needs (the ceiling here)
                result["ratios"][f"fetch_in_place_vs_raw_tcp_hashed_{label}"] = statistics.median(
                    r / f for r, f in zip(times["raw_hashed"], times["in_place"]))
                result["ratios"][f"raw_tcp_hashed_vs_raw_tcp_{label}"] = statistics.median(
                    r / h for r, h in zip(times["raw"], times["raw_hashed"]))
                wire = [r / f for r, f in zip(times["raw"], times["transfer"]) if f > 0]
                if wire:
                    result["ratios"][f"transfer_vs_raw_tcp_{label}"] = statistics.median(wire)
        lk = measure_index_lookup(redis.url, 64, 1000)
    result["lookup64_p50_us"] = lk["p50_us"]
    result["lookup64_p99_us"] = lk["p99_us"]
    result["redis_rtt_p50_us"] = lk["rtt_p50_us"]
    result["ratios"]["lookup64_vs_redis_rtt"] = lk["p50_us"] / lk["rtt_p50_us"]
    result["lookup64_cold_p50_us"] = lk["cold_p50_us"]
    result["ratios"]["lookup64_cold_vs_redis_rtt"] = lk["cold_p50_us"] / lk["cold_rtt_p50_us"]
    result["mooncake"] = None
    if mooncake and mooncake_available():
        mc = run_mooncake_remote(block_sizes, batch, rounds)
        result["mooncake"] = mc
        for label, row in result["blocks"].items():
            row["mooncake_get_gbps"] = mc[label]["get_gbps"]
            result["ratios"][f"fetch_vs_mooncake_{label}"] = row["fetch_gbps"] / mc[label]["get_gbps"]
    return result
