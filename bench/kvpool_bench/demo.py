"""``kvpool demo``: a local pool serving a replayed request trace with synthetic KV.

Starts a real sidecar (in-memory index; DRAM arena plus a disk tier in a temporary
directory), then replays a Mooncake-format trace through the client as fast as it can:
for every request, look up the longest cached prefix of its blocks, get those blocks (and
check every byte), and put the blocks that missed. Ends with the prefix hit rate, the
bytes in each tier and the throughput, and where the time went: the demo's own work
(hashing token ids into block keys, making the synthetic KV bytes, checking every byte
served), the client's calls (lookup, get, put: the client library, the socket and the
sidecar together, and the CPU this process spent in them), the sidecar's CPU time, the
bytes it moved to and from disk and the seconds its disk tier spent writing, syncing,
reading and deleting them (summed over the threads that did it, beside the event loop;
reads from the page cache run on the event loop). The throughput line is the demo's loop, not the pool's
ceiling: ``kvpool bench local`` measures that.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvpool_bench.services import check_memory, main_thread_cpu_s, process_cpu_s
from kvpool_bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, distinct_blocks, load_trace
from kvpool_client.client import PoolClient
from kvpool_client.keys import BlockKey, ModelFingerprint, block_keys
from kvpool_client.protocol import PutStatus
from kvpool_sidecar.process import SidecarProcess

FINGERPRINT = ModelFingerprint(model="demo/synthetic-8b", revision="1", dtype="bfloat16",
                               block_tokens=TRACE_BLOCK_TOKENS, kv_layout="synthetic")


def synthetic_tokens(hash_ids: tuple[int, ...]) -> list[int]:
    """Token ids standing in for a request's prompt: block ``b`` is ``b*512 .. b*512+511``."""
    out: list[int] = []
    for b in hash_ids:
        out.extend(range(b * TRACE_BLOCK_TOKENS, (b + 1) * TRACE_BLOCK_TOKENS))
    return out


def synthetic_payload(key: BlockKey, size: int) -> bytes:
    """Deterministic KV bytes for ``key`` so that every hit can be checked."""
    seed = key.digest
    return (seed * (size // len(seed) + 1))[:size]


@dataclass
class DemoResult:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    wrong_bytes: int = 0
    put_blocks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    #: Seconds spent in each part of the loop (see the module's docstring), and this
    #: process's CPU seconds in each.
    spent: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    sidecar_cpu_s: float = 0.0
    #: Of it, the sidecar's event loop (its main thread).
    sidecar_loop_cpu_s: float = 0.0

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - t
            self.cpu[part] = self.cpu.get(part, 0.0) + time.process_time() - c

    def summary(self, stats: dict[str, Any], distinct: int) -> dict[str, Any]:
        tiers = {name: {"used_bytes": t["used_bytes"], "capacity_bytes": t["capacity_bytes"], "blocks": t["blocks"]}
                 for name, t in stats["tiers"].items()}
        return {
            "requests": self.requests,
            "blocks_requested": self.blocks,
            "distinct_blocks": distinct,
            "hit_rate": self.hit_blocks / self.blocks if self.blocks else 0.0,
            "hit_blocks": self.hit_blocks,
            "wrong_bytes_served": self.wrong_bytes,
            "tiers": tiers,
            "seconds": self.seconds,
            "requests_per_s": self.requests / self.seconds if self.seconds else 0.0,
            "read_gbps": self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0,
            "write_gbps": self.bytes_written / self.seconds / 1e9 if self.seconds else 0.0,
            "time_s": {part: self.spent.get(part, 0.0) for part in PARTS},
            "client_cpu_in_pool_calls_s": sum(self.cpu.get(part, 0.0) for part in POOL_CALLS),
            "sidecar_cpu_s": self.sidecar_cpu_s,
            "sidecar_loop_cpu_s": self.sidecar_loop_cpu_s,
            "disk_bytes": {"written": stats.get("counters", {}).get("demote_bytes", 0),
                           "read": stats.get("counters", {}).get("promote_bytes", 0)},
            "disk_seconds": stats["tiers"].get("disk", {}).get("io_seconds", {}),
            "counters": stats.get("counters", {}),
        }


#: The parts of the loop the demo times, in the order it reports them.
PARTS = ("hash_keys", "make_kv", "check_bytes", "lookup", "get", "put")
#: The parts that are calls on the pool.
POOL_CALLS = ("lookup", "get", "put")


def replay(client: PoolClient, trace: list[TraceRequest], block_bytes: int, progress: bool = True,
           sidecar_pid: int | None = None) -> DemoResult:
    res = DemoResult()
    cpu0 = process_cpu_s(sidecar_pid) if sidecar_pid else 0.0
    loop0 = main_thread_cpu_s(sidecar_pid) if sidecar_pid else 0.0
    started = time.perf_counter()
    for req in tqdm(trace, desc="replaying", unit="req", disable=not progress, file=sys.stderr):
        with res.timing("hash_keys"):
            keys = block_keys(FINGERPRINT, synthetic_tokens(req.hash_ids))
        if not keys:
            continue
        res.requests += 1
        res.blocks += len(keys)
        with res.timing("lookup"):
            hit = client.lookup(keys).prefix
        served = 0
        if hit:
            with res.timing("get"):
                got = client.get(keys[:hit])
            with res.timing("check_bytes"):
                for k, g in zip(keys, got):
                    if g is None:
                        break  # evicted between lookup and get: a miss, recomputed below
                    if bytes(g) != synthetic_payload(k, block_bytes):
                        res.wrong_bytes += 1
                    served += 1
        res.hit_blocks += served
        res.bytes_read += served * block_bytes
        todo = keys[served:]
        if todo:
            with res.timing("make_kv"):
                payloads = [synthetic_payload(k, block_bytes) for k in todo]
            with res.timing("put"):
                statuses = client.put(todo, payloads, chain=True, depth=served,
                                      parent=keys[served - 1] if served else None)
            stored = sum(1 for st in statuses if st == PutStatus.STORED)
            res.put_blocks += stored
            res.bytes_written += stored * block_bytes
    res.seconds = time.perf_counter() - started
    if sidecar_pid:
        res.sidecar_cpu_s = process_cpu_s(sidecar_pid) - cpu0
        res.sidecar_loop_cpu_s = main_thread_cpu_s(sidecar_pid) - loop0
    return res


def run_demo(trace_path: str, *, limit: int | None, block_bytes: int, dram: str, disk: str,
             policy: str = "prefix", progress: bool = True, as_json: bool = False) -> dict[str, Any]:
    trace = load_trace(trace_path, limit)
    # a request's blocks made, put and read back: a block of 3 GB had been made until the
    # kernel killed the demo
    check_memory(3 * block_bytes * max((len(r.hash_ids) for r in trace), default=0), "kvpool demo", "--block-bytes")
    with tempfile.TemporaryDirectory(prefix="kvpool-demo-") as work:
        config = {
            "node_name": "demo",
            "dram": {"size_bytes": dram},
            "disk": {"path": str(Path(work) / "disk"), "size_bytes": disk},
            "policy": {"name": policy},
        }
        with SidecarProcess(config, workdir=work) as sidecar:
            with PoolClient(sidecar.socket_path) as client:
                res = replay(client, trace, block_bytes, progress, sidecar.pid)
                summary = res.summary(client.stats(), distinct_blocks(trace))
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_summary(summary, block_bytes))
    return summary


def format_summary(s: dict[str, Any], block_bytes: int) -> str:
    lines = [
        f"requests           {s['requests']}  ({s['requests_per_s']:.0f}/s over {s['seconds']:.1f} s)",
        f"blocks requested   {s['blocks_requested']}  ({s['distinct_blocks']} distinct, {block_bytes} bytes each)",
        f"prefix hit rate    {s['hit_rate']:.3f}  ({s['hit_blocks']} blocks served from the pool)",
        f"wrong bytes served {s['wrong_bytes_served']}",
        f"throughput         read {s['read_gbps']:.2f} GB/s, write {s['write_gbps']:.2f} GB/s",
    ]
    for name, t in s["tiers"].items():
        lines.append(f"tier {name:<13} {t['used_bytes'] / 2**20:9.1f} MiB used of {t['capacity_bytes'] / 2**20:.0f} MiB"
                     f", {t['blocks']} blocks")
    ts = s["time_s"]
    lines += [
        f"time, demo's own   hashing keys {ts['hash_keys']:.1f} s, making KV {ts['make_kv']:.1f} s, "
        f"checking bytes {ts['check_bytes']:.1f} s",
        f"time, pool calls   lookup {ts['lookup']:.1f} s, get {ts['get']:.1f} s, put {ts['put']:.1f} s "
        f"(client, socket and sidecar; the client used {s['client_cpu_in_pool_calls_s']:.1f} s of CPU in them, "
        f"the sidecar {s['sidecar_cpu_s']:.1f} s in all, {s['sidecar_loop_cpu_s']:.1f} s of it on its event loop)",
        f"disk               {s['disk_bytes']['written'] / 2**20:.0f} MiB demoted, "
        f"{s['disk_bytes']['read'] / 2**20:.0f} MiB promoted",
    ]
    io = s["disk_seconds"]
    if io:
        lines.append(f"time, disk         writing {io['write']:.1f} s, syncing {io['sync']:.1f} s, reading "
                     f"{io['read']:.1f} s, deleting {io['delete']:.1f} s in threads, {io['read_cached']:.1f} s "
                     "reading from the page cache on the sidecar's event loop")
    lines.append("(the throughput is this loop's; kvpool bench local measures the pool's data path)")
    return "\n".join(lines)
