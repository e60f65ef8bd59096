"""``kvpool replay``: drive the sidecar's own store and policies with a request trace.

Each request of a Mooncake-format trace (:mod:`kvpool_bench.trace`) becomes what a serving
engine does against the pool: look up the longest cached prefix of its blocks, read those
blocks (acquire and release, so the policy sees the hits), and put the blocks that missed
(allocate and commit, with their depth and parent in the chain). The tiers keep accounts
only (no payloads), so a replay runs as fast as the store's bookkeeping allows.

Each put carries the hints a real engine would give (:class:`Hints`), derived from the trace
and from nothing later than the request: its prompt length in blocks, and its session and
label where the trace has them (kvpool extensions of the format). ``hints=False`` (``kvpool
replay --no-hints``) puts without them. The report says what the policy cost: its CPU per put
(every call the store made into it) and, for a policy with shadow caches or learning state,
those structures' bytes per resident block (:mod:`kvpool_bench.footprint`).

A hit counts only while the prefix is unbroken: a block cached behind a missing one is of no
use to an engine. Every replay also reports, on the same trace, routing and capacity, the hit
rates of LRU and of Belady's offline optimum (evict the block used furthest in the future;
never admit a block used later than every resident one), so a policy is placed between the
two. Several instances either share one pool or each keep a private cache of an equal share
of the memory, with round-robin, random or prefix-aware routing.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvpool_bench.footprint import TimedPolicy, state_bytes
from kvpool_bench.oracles import belady_hits, live_choice_deciles, oracle_rates
from kvpool_bench.trace import TRACE_BLOCK_TOKENS, TraceError, TraceRequest, load_trace
from kvpool_sidecar.policy import Hints, make_policy
from kvpool_sidecar.store import Session, StoreSettings, TenantLimits, TieredStore
from kvpool_sidecar.tiers.base import TierKind
from kvpool_sidecar.tiers.ledger import LedgerTier

#: KV bytes per token of a Llama-3-8B-shaped model in bf16 (32 layers, 8 KV heads of 128).
DEFAULT_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
ROUTINGS = ("round-robin", "random", "prefix")


class ReplayError(ValueError):
    """The replay's options do not make sense for this trace."""


@dataclass(frozen=True)
class TenantSpec:
    """``name[:priority[:quota]]``; quota in bytes, blocks (``512b``) or a tier share (``25%``)."""

    name: str
    priority: int = 0
    quota: str | None = None

    @classmethod
    def parse(cls, text: str) -> TenantSpec:
        parts = text.split(":")
        if not parts[0] or len(parts) > 3:
            raise ReplayError(f"tenant {text!r}: expected name[:priority[:quota]]")
        try:
            priority = int(parts[1]) if len(parts) > 1 and parts[1] else 0
        except ValueError:
            raise ReplayError(f"tenant {text!r}: priority must be an integer") from None
        quota = parts[2] if len(parts) > 2 and parts[2] else None
        spec = cls(parts[0], priority, quota)
        spec.quota_bytes(1, 1)  # validate now
        return spec

    def quota_bytes(self, tier_bytes: int, block_bytes: int) -> int | None:
        q = self.quota
        if q is None:
            return None
        try:
            if q.endswith("%"):
                share = float(q[:-1]) / 100
                if not 0 < share <= 1:
                    raise ValueError
                return max(block_bytes, int(share * tier_bytes))
            if q.endswith("b"):
                return int(q[:-1]) * block_bytes
            return int(q)
        except ValueError:
            raise ReplayError(f"tenant {self.name!r}: bad quota {q!r} (bytes, NNNb blocks or NN%)") from None


@dataclass(frozen=True)
class ReplayOptions:
    """What to replay against; capacities are totals over all instances, in blocks."""

    policy: str = "prefix"
    capacity_blocks: int = 0
    disk_blocks: int = 0
    instances: int = 1
    routing: str = "round-robin"
    private: bool = False
    tenants: tuple[TenantSpec, ...] = ()
    #: Tenants may hit each other's blocks (otherwise keys are namespaced per tenant).
    share_tenants: bool = False
    bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    seed: int = 0
    progress: bool = False
    #: Also report the admission oracles of :mod:`kvpool_bench.oracles` (what knowing a
    #: block's reuse, or its reuse time, would be worth).
    oracles: bool = False
    #: Put with the hints an engine would give (prompt length; session and label where the
    #: trace has them).
    hints: bool = True

    @property
    def block_bytes(self) -> int:
        return TRACE_BLOCK_TOKENS * self.bytes_per_token


@dataclass
class PolicyResult:
    """What one replay through the store measured."""

    blocks: int = 0
    hits: int = 0
    tier_hits: Counter[str] = field(default_factory=Counter)
    tenant_blocks: Counter[str] = field(default_factory=Counter)
    tenant_hits: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    routed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    #: Blocks allocated (puts that took room), the policy's CPU over all its calls, and its
    #: shadows' and learning state's bytes at the end (summed over caches; None: it has none).
    puts: int = 0
    policy_seconds: float = 0.0
    state_bytes: dict[str, int] | None = None
    resident_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


# ------------------------------------------------------------------ requests and keys
@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A trace request as the replay drives it: its tenant, blocks and their byte sizes."""

    tenant: str
    ids: tuple[int, ...]  # dense block ids: equal ids are the same block in the same namespace
    keys: tuple[bytes, ...]
    sizes: tuple[int, ...]
    hints: Hints | None = None


def block_key(namespace: str, hash_id: int) -> bytes:
    """The 48-byte store key of a trace block (hash ids already encode their prefix)."""
    return hashlib.blake2b(f"{namespace}/{hash_id}".encode(), digest_size=48).digest()


def build_requests(trace: Sequence[TraceRequest], opts: ReplayOptions,
                   tenants: Sequence[str | None] | None = None) -> list[ReplayRequest]:
    """Keys, dense ids and byte sizes for every request; the last block may be partial."""
    names = [t.name for t in opts.tenants] or ["default"]
    ids: dict[tuple[str, int], int] = {}
    keys: dict[int, bytes] = {}
    bb = opts.block_bytes
    out: list[ReplayRequest] = []
    for i, req in enumerate(trace):
        given = tenants[i] if tenants is not None and i < len(tenants) else None
        if given is not None and given not in names:
            raise ReplayError(f"request {i + 1} names tenant {given!r}, which is not declared")
        # Without a tenant in the trace, a conversation stays with one tenant: its first block.
        tenant = given or (names[req.hash_ids[0] % len(names)] if req.hash_ids else names[0])
        ns = "shared" if opts.share_tenants else tenant
        dense: list[int] = []
        for h in req.hash_ids:
            d = ids.get((ns, h))
            if d is None:
                d = ids[(ns, h)] = len(ids)
                keys[d] = block_key(ns, h)
            dense.append(d)
        n = len(dense)
        sizes = [bb] * n
        if n:
            tail = req.input_length - TRACE_BLOCK_TOKENS * (n - 1)
            if 0 < tail < TRACE_BLOCK_TOKENS:
                sizes[-1] = tail * opts.bytes_per_token
        hints = Hints(n, req.session, req.label) if opts.hints else None
        out.append(ReplayRequest(tenant, tuple(dense), tuple(keys[d] for d in dense), tuple(sizes), hints))
    return out


# ------------------------------------------------------------------ routing
class Router:
    """Which instance serves a request."""

    def __init__(self, kind: str, instances: int, seed: int) -> None:
        if kind not in ROUTINGS:
            raise ReplayError(f"routing must be one of {', '.join(ROUTINGS)}")
        self.kind = kind
        self.n = instances
        self._rng = random.Random(seed)
        self._next = 0
        self.load = [0] * instances

    def route(self, keys: Sequence[bytes], stores: Sequence[TieredStore]) -> int:
        if self.n == 1:
            i = 0
        elif self.kind == "round-robin":
            i = self._next
            self._next = (self._next + 1) % self.n
        elif self.kind == "random":
            i = self._rng.randrange(self.n)
        else:  # the longest cached prefix wins; ties go to the least loaded instance
            best = (-1, 0)
            i = 0
            for j, st in enumerate(stores):
                score = (_cached_prefix(st, keys), -self.load[j])
                if score > best:
                    best, i = score, j
        self.load[i] += 1
        return i


def _cached_prefix(store: TieredStore, keys: Sequence[bytes]) -> int:
    n = 0
    for k in keys:
        if not store.contains(k):
            break
        n += 1
    return n


# ------------------------------------------------------------------ replay through the store
def _make_stores(opts: ReplayOptions, policy: str) -> tuple[list[TieredStore], list[TimedPolicy]]:
    caches = opts.instances if opts.private else 1
    bb = opts.block_bytes
    dram_blocks = opts.capacity_blocks // caches
    disk_blocks = opts.disk_blocks // caches
    if dram_blocks < 1:
        raise ReplayError(f"capacity of {opts.capacity_blocks} blocks is less than one block per cache")
    specs = opts.tenants or (TenantSpec("default"),)
    limits = {t.name: TenantLimits(t.priority, t.quota_bytes(dram_blocks * bb, bb)) for t in specs}
    settings = StoreSettings(tenants=limits, block_max_bytes=bb)
    stores = []
    timed = []
    for _ in range(caches):
        p = TimedPolicy(make_policy(policy))
        timed.append(p)
        tiers = [LedgerTier(TierKind.DRAM, dram_blocks * bb, bb)]
        if disk_blocks:
            tiers.append(LedgerTier(TierKind.DISK, disk_blocks * bb))
        stores.append(TieredStore(tiers, p, settings, index_events=False))
    return stores, timed


async def _replay_async(requests: Sequence[ReplayRequest], opts: ReplayOptions, policy: str,
                        routed: Sequence[int] | None, label: str) -> PolicyResult:
    stores, timed = _make_stores(opts, policy)
    router = Router(opts.routing, len(stores), opts.seed)
    sessions: list[dict[str, Session]] = [{} for _ in stores]
    res = PolicyResult()
    started = time.perf_counter()
    for r_index, req in enumerate(tqdm(requests, desc=label, unit="req", disable=not opts.progress,
                                       file=sys.stderr, leave=False)):
        keys = req.keys
        if not keys:
            continue
        i = routed[r_index] if routed is not None else router.route(keys, stores)
        res.routed.append(i)
        store = stores[i]
        session = sessions[i].get(req.tenant)
        if session is None:
            session = sessions[i][req.tenant] = store.open_session(req.tenant)
        n, runs = store.lookup(keys)
        served = 0
        for k in keys[:n]:
            lease = await store.acquire(session, k)
            if lease is None:
                break  # its promotion from disk failed: a miss from here on
            store.release(session, lease.id)
            served += 1
        left = served
        for tier, count in runs:
            take = min(count, left)
            res.tier_hits[tier] += take
            left -= take
        res.blocks += len(keys)
        res.hits += served
        res.tenant_blocks[req.tenant] += len(keys)
        res.tenant_hits[req.tenant] += served
        lineage = store.lineage()
        for j in range(served, len(keys)):
            # A block cached behind a missing one is kept, but no hit for this request; its
            # put is answered EXISTS, as the sidecar answers an engine that writes it again.
            _, write = await store.allocate(session, keys[j], req.sizes[j], tenant=req.tenant, depth=j,
                                            parent=keys[j - 1] if j else None, hints=req.hints, lineage=lineage)
            if write is not None:
                res.puts += 1
                store.commit(session, write.id, 0)
    res.seconds = time.perf_counter() - started
    for st, p in zip(stores, timed):
        res.counters.update(st.metrics.snapshot())
        res.policy_seconds += p.seconds
        res.resident_blocks += sum(n for _, _, n in st.report.tier_usage().values())
        held = state_bytes(p.policy)
        if held is not None:
            res.state_bytes = {k: v + (res.state_bytes or {}).get(k, 0) for k, v in held.items()}
    return res


def replay_policy(requests: Sequence[ReplayRequest], opts: ReplayOptions, policy: str | None = None,
                  routed: Sequence[int] | None = None) -> PolicyResult:
    """Replay ``requests`` through fresh stores running ``policy`` (default: the options')."""
    name = policy or opts.policy
    return asyncio.run(_replay_async(requests, opts, name, routed, name))


# ------------------------------------------------------------------ Belady
def _streams(requests: Sequence[ReplayRequest], opts: ReplayOptions,
             routed: Sequence[int]) -> tuple[list[list[ReplayRequest]], int, int]:
    """Each cache's own request stream (as routed), that cache's capacity, and all accesses."""
    caches = opts.instances if opts.private else 1
    streams: list[list[ReplayRequest]] = [[] for _ in range(caches)]
    live = [r for r in requests if r.keys]
    for r, i in zip(live, routed):
        streams[i if opts.private else 0].append(r)
    return streams, (opts.capacity_blocks + opts.disk_blocks) // caches, sum(len(r.ids) for r in live)


def belady_hit_rate(requests: Sequence[ReplayRequest], opts: ReplayOptions, routed: Sequence[int]) -> float:
    """Belady on each cache's own request stream (as routed), at that cache's capacity."""
    streams, capacity, total = _streams(requests, opts, routed)
    hits = sum(belady_hits(s, capacity) for s in streams)
    return hits / total if total else 0.0


def oracle_hit_rates(requests: Sequence[ReplayRequest], opts: ReplayOptions, routed: Sequence[int]) -> dict[str, float]:
    """The admission oracles on each cache's own stream, as for Belady."""
    streams, capacity, total = _streams(requests, opts, routed)
    out: dict[str, float] = {}
    for stream in streams:
        weight = sum(len(r.ids) for r in stream) / total if total else 0.0
        for name, rate in oracle_rates(stream, capacity).items():
            out[name] = out.get(name, 0.0) + rate * weight
    return out


# ------------------------------------------------------------------ the report
def run(requests: Sequence[ReplayRequest], opts: ReplayOptions, distinct: int, *,
        baselines: bool = True) -> dict[str, Any]:
    """One replay of ``opts.policy`` plus, unless told otherwise, LRU and Belady."""
    started = time.perf_counter()
    main = replay_policy(requests, opts)
    out: dict[str, Any] = {
        "policy": opts.policy,
        "capacity_blocks": opts.capacity_blocks,
        "capacity_fraction": opts.capacity_blocks / distinct if distinct else 0.0,
        "disk_blocks": opts.disk_blocks,
        "instances": opts.instances,
        "pool": "private" if opts.private else "shared",
        "routing": opts.routing,
        "requests": sum(1 for r in requests if r.keys),
        "blocks_requested": main.blocks,
        "distinct_blocks": distinct,
        "hit_rate": main.hit_rate,
        "hit_blocks": main.hits,
        "hits_per_tier": dict(main.tier_hits),
        "bytes_moved": {
            "read_from_pool": main.counters["get_bytes"],
            "written_to_pool": main.counters["put_bytes"],
            "demoted_to_disk": main.counters["demote_bytes"],
            "promoted_from_disk": main.counters["promote_bytes"],
        },
        "evicted_blocks": {k[len("evicted_"):]: v for k, v in main.counters.items() if k.startswith("evicted_")},
        "put_rejected": main.counters["put_rejected"],
        # refused for want of room (the store would not evict a put's own chain for it: a
        # policy that ordered a request's blocks before their parents showed here only)
        "put_full": main.counters["put_full"],
        "hints": opts.hints,
        "replay_seconds": main.seconds,
        "policy_cost": _cost(main),
    }
    if opts.instances > 1:
        load = Counter(main.routed)
        out["load_imbalance"] = max(load.values()) * opts.instances / len(main.routed) if main.routed else 0.0
    if opts.tenants:
        out["tenants"] = {t: {"hit_rate": main.tenant_hits[t] / n if n else 0.0, "blocks": n}
                          for t, n in sorted(main.tenant_blocks.items())}
    if baselines:
        lru = main if opts.policy == "lru" else replay_policy(requests, opts, "lru")
        belady = belady_hit_rate(requests, opts, main.routed)
        out["policy_cost"]["lru_us_per_put"] = _cost(lru)["us_per_put"]
        out["lru_hit_rate"] = lru.hit_rate
        out["belady_hit_rate"] = belady
        gap = belady - lru.hit_rate
        out["gap_closed"] = (main.hit_rate - lru.hit_rate) / gap if gap > 0 else None
    if opts.oracles:
        out["oracles"] = oracle_hit_rates(requests, opts, main.routed)
        out["live_choice_deciles"] = live_choice_deciles(requests)
    out["seconds"] = time.perf_counter() - started
    return out


def _cost(r: PolicyResult) -> dict[str, Any]:
    """What the policy cost: CPU per put, and its state's bytes per resident block."""
    out: dict[str, Any] = {"us_per_put": 1e6 * r.policy_seconds / r.puts if r.puts else 0.0,
                           "resident_blocks": r.resident_blocks}
    if r.state_bytes is not None:
        out["state_bytes"] = r.state_bytes
        total = sum(r.state_bytes.values())
        out["state_bytes_per_resident_block"] = total / r.resident_blocks if r.resident_blocks else 0.0
    return out


def parse_fractions(text: str) -> list[float]:
    """``"0.02,0.05"`` -> ``[0.02, 0.05]``; raises ReplayError."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ReplayError(f"bad capacity fractions {text!r}: expected numbers separated by commas") from None
    if any(f <= 0 for f in out):
        raise ReplayError("capacity fractions must be positive")
    return out


def capacity_from(fraction: float | None, blocks: int | None, distinct: int) -> int:
    if blocks is not None:
        if blocks < 0:
            raise ReplayError("capacities cannot be negative")
        return blocks
    if fraction is None:
        return 0
    if fraction < 0:
        raise ReplayError("capacity fractions cannot be negative")
    return int(fraction * distinct)


def sweep(requests: Sequence[ReplayRequest], opts: ReplayOptions, distinct: int, fractions: Sequence[float],
          policies: Sequence[str]) -> dict[str, list[float]]:
    """Hit rate against capacity for ``policies`` and Belady: ``{name: [rate per fraction]}``."""
    curves: dict[str, list[float]] = {p: [] for p in policies}
    curves["belady"] = []
    for f in fractions:
        o = replace(opts, capacity_blocks=max(1, int(f * distinct)))
        routed: list[int] | None = None
        for p in policies:
            r = replay_policy(requests, o, p)
            curves[p].append(r.hit_rate)
            routed = routed or r.routed
        curves["belady"].append(belady_hit_rate(requests, o, routed or [0] * len(requests)))
    return curves


def write_plot(path: str, fractions: Sequence[float], curves: dict[str, list[float]], title: str) -> None:
    """A PNG of hit rate against capacity; needs the ``plot`` extra (matplotlib)."""
    try:  # imported by name: an optional dependency that mypy need not see
        importlib.import_module("matplotlib").use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise ReplayError("--plot needs matplotlib: pip install 'kvpool[plot]'") from None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for name, ys in curves.items():
        ax.plot(fractions, ys, marker="o", linestyle="--" if name == "belady" else "-", label=name)
    ax.set_xlabel("capacity (fraction of distinct blocks)")
    ax.set_ylabel("prefix hit rate")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def load(path: str, opts: ReplayOptions, limit: int | None = None) -> tuple[list[ReplayRequest], int]:
    """The trace's requests as the replay needs them, and its distinct blocks."""
    trace = load_trace(path, limit)
    tenants = [r.tenant for r in trace] if opts.tenants else None
    requests = build_requests(trace, opts, tenants)
    distinct = len({d for r in requests for d in r.ids})
    return requests, distinct


def main_replay(path: str, opts: ReplayOptions, *, fraction: float | None, blocks: int | None,
                disk_fraction: float | None = None, disk_blocks: int | None = None, limit: int | None = None,
                plot: str | None = None, sweep_fractions: Sequence[float] = (),
                sweep_policies: Sequence[str] = ()) -> dict[str, Any]:
    """What ``kvpool replay`` runs; raises ReplayError or TraceError on bad input."""
    if opts.instances < 1:
        raise ReplayError("--instances must be at least 1")
    if opts.routing not in ROUTINGS:
        raise ReplayError(f"--routing must be one of {', '.join(ROUTINGS)}")
    make_policy(opts.policy)  # an unknown name fails before the trace is read
    requests, distinct = load(path, opts, limit)
    if not requests:
        raise TraceError(f"{path}: no requests")
    opts = replace(opts, capacity_blocks=capacity_from(fraction, blocks, distinct),
                   disk_blocks=capacity_from(disk_fraction, disk_blocks, distinct))
    out = run(requests, opts, distinct)
    out["trace"] = path
    if plot:
        curves = sweep(requests, opts, distinct, sweep_fractions, sweep_policies)
        write_plot(plot, sweep_fractions, curves, Path(path).name)
        out["plot"] = {"path": plot, "fractions": list(sweep_fractions), "hit_rates": curves}
    return out
