"""``kvpool bench engine``: a transformers model served on a request trace, with and without the pool.

N engine instances (separate processes, one CPU thread each) of a small random Llama-shaped
model serve a Mooncake-format trace, scaled down: a prefix of the trace, ``tokens_per_block``
tokens per trace block (512 in the trace) and at most ``max_blocks`` blocks a request. Token
ids are derived from the trace's hash ids (equal ids, equal tokens), and one trace block is
one pool block. Requests go round-robin to the instances, each instance serves its queue
as fast as it can (a closed loop: TTFT is service time, without queueing), in three modes
whose instances all live at once and serve the trace segment by segment, taking turns (so a
machine that is slower for a while is slower for every mode; a mode's makespan is the sum
of its slowest instance's busy time per segment):

- ``no_reuse``: every prompt prefilled in full;
- ``private``: each instance an in-process LRU prefix cache over blocks, the total memory
  split evenly across the instances (what an engine's own prefix caching gives);
- ``pool``: one kvpool sidecar process whose DRAM tier holds that same total memory, every
  instance a ``PoolClient`` on it through :class:`kvpool_client.engines.hf.HFPoolAdapter`.

TTFT is load of the reused prefix + prefill of the rest + the first token (the argmax of the
last prompt token's logits); storing the new blocks comes after it but counts in throughput.
Every instance prefills in block-aligned chunks (:func:`kvpool_client.engines.hf.prefill`), so
a block's KV does not depend on which request computed it: first-token logits with reuse
are then bit-identical to those without, which the run checks for every request (against
``no_reuse``) and, for every ``check_every``-th request that reused a prefix, against the
same prefix recomputed locally in that instance.

Hit rate is reused blocks over reusable blocks (those of a prompt's full blocks that leave
a token to compute). "Memory for equal hit rate" replays the same request stream, no model
needed, through per-instance LRU caches of growing total size: the total the private caches
need to reach the pool's measured hit rate (replaying at the private mode's own size
reproduces its measured hit rate exactly); and the converse, what one shared LRU cache
needs to reach the private caches' hit rate.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool_bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace
from kvpool_client.keys import ModelFingerprint

MODES = ("no_reuse", "private", "pool")

#: The product's claims this bench tests.
CLAIMS = {"throughput": "+30%", "ttft": "-25%", "memory_for_equal_hit_rate": "-40%", "precision_loss": "zero"}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-shaped model with seeded random weights (no download)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 512
    seed: int = 0
    dtype: str = "float32"

    @property
    def name(self) -> str:
        return (f"kvpool-bench/random-llama-L{self.layers}-H{self.hidden}-A{self.heads}-KV{self.kv_heads}"
                f"-I{self.intermediate}-V{self.vocab}-seed{self.seed}")


def build_model(spec: ModelSpec, device: str = "cpu") -> Any:
    """The model of ``spec``: the same weights in every process (same seed, same torch)."""
    import importlib

    import torch

    tf: Any = importlib.import_module("transformers")  # typed only in part: used as Any
    cfg = tf.LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, max_position_embeddings=1 << 17)
    torch.manual_seed(spec.seed)
    model = tf.LlamaForCausalLM(cfg).to(dtype=getattr(torch, spec.dtype))
    return model.to(device).eval()


@dataclass(frozen=True)
class EngineBenchOptions:
    trace: str
    #: Serve the first ``limit`` requests (None: the whole trace).
    limit: int | None = None
    instances: int = 2
    tokens_per_block: int = 64
    max_blocks: int = 6
    #: Total KV memory of the private caches and of the pool, as a fraction of the scaled
    #: trace's distinct full blocks.
    capacity_fraction: float = 0.25
    #: Recompute the prefix of every Nth request that reused one (each instance's 1st, N+1th,
    #: ...) and compare bitwise; outside the timings.
    check_every: int = 10
    pool_policy: str = "prefix"
    #: The trace is served in this many segments, the modes taking turns on each.
    segments: int = 8
    spec: ModelSpec = field(default_factory=ModelSpec)


def block_tokens_of(hash_id: int, n: int, vocab: int) -> list[int]:
    """The first ``n`` token ids of trace block ``hash_id`` (a pure function of the id)."""
    rng = random.Random(hashlib.blake2b(b"kvpool-bench-block" + str(hash_id).encode(), digest_size=8).digest())
    return [rng.randrange(vocab) for _ in range(n)]


def scale_trace(trace: Sequence[TraceRequest], tokens_per_block: int, max_blocks: int, vocab: int) -> list[list[int]]:
    """Token ids of each request, ``tokens_per_block`` per trace block, at most ``max_blocks`` blocks."""
    out: list[list[int]] = []
    for req in trace:
        ids = req.hash_ids[:max_blocks]
        if not ids:
            continue
        length = -(-req.input_length * tokens_per_block // TRACE_BLOCK_TOKENS)
        length = max(2, min(length, len(ids) * tokens_per_block))
        toks: list[int] = []
        for h in ids:
            toks += block_tokens_of(h, min(tokens_per_block, length - len(toks)), vocab)
            if len(toks) >= length:
                break
        out.append(toks)
    return out


class LRUBlocks:
    """An LRU cache of blocks (values may be None: a replay without data)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.data: OrderedDict[bytes, Any] = OrderedDict()

    def hit(self, keys: Sequence[bytes], usable: int) -> int:
        """The cached prefix of ``keys`` (at most ``usable``); its blocks become most recent."""
        n = 0
        while n < usable and keys[n] in self.data:
            self.data.move_to_end(keys[n])
            n += 1
        return n

    def insert(self, keys: Sequence[bytes], values: Callable[[int], Any] | None = None) -> None:
        for i, k in enumerate(keys):
            if k in self.data:
                self.data.move_to_end(k)
                continue
            if self.capacity <= 0:
                continue
            self.data[k] = values(i) if values is not None else None
            while len(self.data) > self.capacity:
                self.data.popitem(last=False)


def replay_lru(keys: Sequence[Sequence[bytes]], usable: Sequence[int], routed: Sequence[int], instances: int,
               total_blocks: int, private: bool) -> float:
    """Hit rate of per-instance (``private``) or one shared LRU cache(s) of ``total_blocks``."""
    caches = [LRUBlocks(total_blocks // instances if private else total_blocks)
              for _ in range(instances if private else 1)]
    hits = blocks = 0
    for ks, u, inst in zip(keys, usable, routed):
        c = caches[inst if private else 0]
        h = c.hit(ks, u)
        hits, blocks = hits + h, blocks + u
        c.insert(ks[h:])
    return hits / blocks if blocks else 0.0


def memory_for_hit_rate(target: float, hit_rate: Callable[[int], float], step: int, most: int) -> int | None:
    """The least total capacity (a multiple of ``step``, up to ``most``) reaching ``target``."""
    if hit_rate(most) < target:
        return None
    lo, hi = 0, -(-most // step)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit_rate(mid * step) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo * step


def _instance(mode: str, inst: int, opts: EngineBenchOptions, capacity: int, socket_path: str | None,
              inbox: Any, outbox: Any) -> None:
    """One engine instance: serve each list of requests from ``inbox`` in order (None: stop) and
    answer ``(inst, seconds, records)``; its cache lives from one list to the next."""
    import torch

    from kvpool_client.client import PoolClient
    from kvpool_client.engines.hf import BlockCodec, HFPoolAdapter, fingerprint_for, prefill

    torch.set_num_threads(1)
    model = build_model(opts.spec)
    bt = opts.tokens_per_block
    codec = BlockCodec(model, bt)
    fp = fingerprint_for(model, bt, model_name=opts.spec.name)
    lru = LRUBlocks(capacity)
    client = PoolClient(socket_path) if socket_path else None
    adapter = HFPoolAdapter(model, client, fp) if client is not None else None
    prefill(model, block_tokens_of(-1, 2 * bt, opts.spec.vocab), codec.new_cache(), bt)  # warm-up
    reusing = 0
    outbox.put((inst, 0.0, []))  # ready
    while (work := inbox.get()) is not None:
        out, elapsed = [], 0.0
        for idx, toks in work:
            rec, seconds, reusing = _serve(idx, toks, mode, opts, model, codec, fp, lru, adapter, reusing)
            out.append(rec)
            elapsed += seconds
        outbox.put((inst, elapsed, out))
    if client is not None:
        client.close()


def _serve(idx: int, toks: list[int], mode: str, opts: EngineBenchOptions, model: Any, codec: Any,
           fp: ModelFingerprint, lru: LRUBlocks, adapter: Any, reusing: int) -> tuple[dict[str, Any], float, int]:
    """One request: its record, the seconds it took (without the check), the reusing count."""
    import torch

    from kvpool_client.engines.hf import prefill
    from kvpool_client.keys import block_keys

    bt = opts.tokens_per_block
    keys = [k.raw for k in block_keys(fp, toks)]
    usable = (len(toks) - 1) // bt
    t0 = time.perf_counter()
    found = 0
    if adapter is not None:
        loaded = adapter.load(toks)
        cache, reused, found = loaded.cache, loaded.tokens, loaded.found
    elif mode == "private":
        n = lru.hit(keys, usable)
        found = n
        cache = codec.cache_from_blocks(torch.stack([lru.data[k] for k in keys[:n]])) if n else codec.new_cache()
        reused = n * bt
    else:
        cache, reused = codec.new_cache(), 0
    t1 = time.perf_counter()
    logits = prefill(model, toks[reused:], cache, bt)
    first = int(torch.argmax(logits))
    t2 = time.perf_counter()
    full = len(toks) // bt
    if adapter is not None:
        adapter.store(cache, toks, held=found)
    elif mode == "private" and full > reused // bt:
        fresh = codec.blocks_of(cache, reused // bt, full)
        lru.insert(keys[reused // bt:full], lambda i: fresh[i].clone())
    t3 = time.perf_counter()
    rec: dict[str, Any] = {
        "idx": idx, "prompt_tokens": len(toks), "reused_tokens": reused,
        "computed_tokens": len(toks) - reused, "usable_blocks": usable, "hit_blocks": reused // bt,
        "found_blocks": found, "load_s": t1 - t0, "prefill_s": t2 - t1, "ttft_s": t2 - t0, "store_s": t3 - t2,
        "first_token": first,
        "logits_digest": hashlib.blake2b(logits.float().numpy().tobytes(), digest_size=16).hexdigest(),
    }
    reusing += 1 if reused else 0
    if reused and opts.check_every > 0 and reusing % opts.check_every == 1 % opts.check_every:
        local = codec.new_cache()  # the same prefix, computed here (outside the timings)
        prefill(model, toks[:reused], local, bt)
        restored = codec.blocks_of(cache, 0, reused // bt)
        rec["check_kv_equal"] = bool(torch.equal(restored, codec.blocks_of(local, 0, reused // bt)))
        rec["check_logits_equal"] = bool(torch.equal(logits, prefill(model, toks[reused:], local, bt)))
    return rec, t3 - t0, reusing


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else 0.0


def _summary(recs: list[dict[str, Any]], makespan: float) -> dict[str, Any]:
    recs.sort(key=lambda r: r["idx"])
    ttft = [r["ttft_s"] for r in recs]
    usable = sum(r["usable_blocks"] for r in recs)
    checked = [r for r in recs if "check_logits_equal" in r]
    return {
        "requests": len(recs),
        "prompt_tokens": sum(r["prompt_tokens"] for r in recs),
        "reused_tokens": sum(r["reused_tokens"] for r in recs),
        "computed_tokens": sum(r["computed_tokens"] for r in recs),
        "hit_blocks": sum(r["hit_blocks"] for r in recs),
        "usable_blocks": usable,
        "hit_rate": sum(r["hit_blocks"] for r in recs) / usable if usable else 0.0,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "load_ms_total": 1e3 * sum(r["load_s"] for r in recs),
        "store_ms_total": 1e3 * sum(r["store_s"] for r in recs),
        "makespan_s": makespan,
        "requests_per_s": len(recs) / makespan,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in recs) / makespan,
        "computed_tokens_per_s": sum(r["computed_tokens"] for r in recs) / makespan,
        "precision_checks": len(checked),
        "precision_mismatches": sum(1 for r in checked if not (r["check_logits_equal"] and r["check_kv_equal"])),
        "_records": recs,
    }


def _run_modes(opts: EngineBenchOptions, requests: Sequence[list[int]], capacity_total: int, socket_path: str,
               say: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Every mode's instances alive at once, serving the trace segment by segment, the modes
    taking turns (in a rotating order): a machine that slows down for a while slows every mode.

    A mode's makespan is the sum over segments of its slowest instance's busy time.
    """
    ctx = mp.get_context("spawn")
    n = opts.instances
    outbox = ctx.Queue()
    inboxes = {m: [ctx.Queue() for _ in range(n)] for m in MODES}
    procs = [ctx.Process(target=_instance, args=(m, k, opts, capacity_total // n,
                                                 socket_path if m == "pool" else None, inboxes[m][k], outbox))
             for m in MODES for k in range(n)]
    for p in procs:
        p.start()
    recs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    makespan = dict.fromkeys(MODES, 0.0)
    try:
        for _ in procs:
            outbox.get(timeout=300)  # ready
        segs = max(1, min(opts.segments, len(requests)))
        bounds = [len(requests) * i // segs for i in range(segs + 1)]
        for s in range(segs):
            say(f"segment {s + 1}/{segs}: requests {bounds[s]}-{bounds[s + 1] - 1}")
            for j in range(len(MODES)):
                m = MODES[(s + j) % len(MODES)]
                for k in range(n):
                    inboxes[m][k].put([(i, requests[i]) for i in range(bounds[s], bounds[s + 1]) if i % n == k])
                slowest = 0.0
                for _ in range(n):
                    _, seconds, got = outbox.get(timeout=900)
                    recs[m] += got
                    slowest = max(slowest, seconds)
                makespan[m] += slowest
        for m in MODES:
            for q in inboxes[m]:
                q.put(None)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {m: _summary(recs[m], makespan[m]) for m in MODES}


def run_engine_bench(opts: EngineBenchOptions, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the three modes on the same requests; one JSON-ready dict."""
    from kvpool_client.client import PoolClient
    from kvpool_client.keys import block_keys
    from kvpool_sidecar.process import SidecarProcess

    say = progress or (lambda _msg: None)
    if opts.instances < 1 or opts.tokens_per_block < 1 or opts.max_blocks < 1 or (opts.limit or 1) < 1:
        raise ValueError("instances, tokens_per_block, max_blocks and limit must be positive")
    t_start = time.perf_counter()
    spec, bt = opts.spec, opts.tokens_per_block
    requests = scale_trace(load_trace(opts.trace, limit=opts.limit), bt, opts.max_blocks, spec.vocab)
    # block identity for the replays: any fingerprint gives the instances' prefix structure
    fp = ModelFingerprint(model=spec.name, dtype=spec.dtype, block_tokens=bt, kv_layout="replay")
    keys = [[k.raw for k in block_keys(fp, toks)] for toks in requests]
    usable = [(len(t) - 1) // bt for t in requests]
    distinct = len({k for ks in keys for k in ks})
    n = opts.instances
    capacity = max(n, int(opts.capacity_fraction * distinct) // n * n)
    head_dim = spec.hidden // spec.heads
    block_bytes = spec.layers * 2 * spec.kv_heads * bt * head_dim * (2 if spec.dtype in ("bfloat16", "float16") else 4)
    say(f"{len(requests)} requests, {n} instances per mode, modes {', '.join(MODES)}")
    # the arena holds ``capacity`` blocks (a block smaller than a page takes a whole one)
    page = max(4096, 1 << (block_bytes.bit_length() - 1))
    size = capacity * (-(-block_bytes // page) * page)
    sp = SidecarProcess({"node_name": "bench-engine", "dram": {"size_bytes": size, "page_bytes": page},
                         "policy": {"name": opts.pool_policy, "demote": False}},
                        workdir=tempfile.mkdtemp(prefix="kvpool-bench-engine-")).start()
    try:
        modes = _run_modes(opts, requests, capacity, sp.socket_path, say)
        with PoolClient(sp.socket_path) as c:
            st = c.stats()
        modes["pool"]["pool_stats"] = {k: st[k] for k in ("blocks", "tiers") if k in st}
    finally:
        sp.stop()
    recs = {m: modes[m].pop("_records") for m in MODES}
    base = {r["idx"]: r["logits_digest"] for r in recs["no_reuse"]}
    for m in ("private", "pool"):
        modes[m]["logits_differ_from_no_reuse"] = sum(1 for r in recs[m] if r["logits_digest"] != base[r["idx"]])
        modes[m]["first_token_differs_from_no_reuse"] = sum(
            1 for r, r0 in zip(recs[m], recs["no_reuse"]) if r["first_token"] != r0["first_token"])

    routed = [i % n for i in range(len(requests))]
    def private_hr(cap: int) -> float:
        return replay_lru(keys, usable, routed, n, cap, private=True)

    def shared_hr(cap: int) -> float:
        return replay_lru(keys, usable, routed, n, cap, private=False)

    most = n * distinct
    pool_hr, priv_hr = modes["pool"]["hit_rate"], modes["private"]["hit_rate"]
    priv_need = memory_for_hit_rate(pool_hr, private_hr, n, most)
    shared_need = memory_for_hit_rate(priv_hr, shared_hr, 1, distinct)
    memory = {
        "total_blocks": capacity, "block_bytes": block_bytes, "total_bytes": capacity * block_bytes,
        "distinct_blocks": distinct,
        "private_replay_hit_rate_at_total": private_hr(capacity),
        "private_hit_rate_unlimited": private_hr(most),
        "shared_lru_replay_hit_rate_at_total": shared_hr(capacity),
        "private_blocks_for_pool_hit_rate": priv_need,
        # < 1: the pool reaches its hit rate with this fraction of the memory private caches need
        "pool_vs_private_memory_for_pool_hit_rate": capacity / priv_need if priv_need else None,
        "shared_lru_blocks_for_private_hit_rate": shared_need,
        "shared_vs_private_memory_for_private_hit_rate": shared_need / capacity if shared_need is not None else None,
    }

    def ratio(a: str, b: str, key: str) -> float:
        den = float(modes[b][key])
        return float(modes[a][key]) / den if den else float("nan")

    ratios = {f"{m}_vs_{b}_{key}": ratio(m, b, key)
              for m, b in (("pool", "no_reuse"), ("pool", "private"), ("private", "no_reuse"))
              for key in ("requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "computed_tokens")}
    mem_ratio = memory["pool_vs_private_memory_for_pool_hit_rate"]
    mismatches = sum(modes[m]["precision_mismatches"] + modes[m]["logits_differ_from_no_reuse"]
                     for m in ("private", "pool"))
    claims = {
        "throughput_+30%": {"pool_vs_private": ratios["pool_vs_private_requests_per_s"],
                            "pool_vs_no_reuse": ratios["pool_vs_no_reuse_requests_per_s"],
                            "holds_vs_private": ratios["pool_vs_private_requests_per_s"] >= 1.30},
        "ttft_-25%": {"pool_vs_private_p50": ratios["pool_vs_private_ttft_p50_ms"],
                      "pool_vs_no_reuse_p50": ratios["pool_vs_no_reuse_ttft_p50_ms"],
                      "holds_vs_private": ratios["pool_vs_private_ttft_p50_ms"] <= 0.75},
        "memory_for_equal_hit_rate_-40%": {
            "pool_vs_private": mem_ratio,
            "private_unreachable": priv_need is None,
            "holds": priv_need is None or (mem_ratio is not None and mem_ratio <= 0.60)},
        "zero_precision_loss": {"mismatches": mismatches, "holds": mismatches == 0},
    }
    return {
        "bench": "engine",
        "settings": {**{k: v for k, v in asdict(opts).items() if k != "spec"}, "model": asdict(spec),
                     "model_name": spec.name, "requests": len(requests), "block_tokens": bt,
                     "routing": "round-robin", "threads_per_instance": 1},
        "modes": modes,
        "ratios": ratios,
        "memory": memory,
        "claims": claims,
        "wall_s": time.perf_counter() - t_start,
    }
