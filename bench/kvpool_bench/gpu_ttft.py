"""TTFT of a Llama-3-8B-shaped model: full prefill against a prefix restored from the pool.

``python -m kvpool_bench.gpu_ttft [--device cuda] [--out FILE]`` (the GPU check's last step)
builds a random model of Llama-3-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads,
intermediate 14336, bfloat16; the vocabulary reduced to keep memory small), starts a sidecar
whose DRAM arena holds the largest prefix, and for each prefix length (4k, 16k, 32k tokens)
with a 256-token suffix measures:

- ``full_prefill_ms``: one forward over prefix + suffix (the baseline);
- ``pool_restore_ms``: ``HFPoolAdapter.load(in_place=False)`` (lookup, verified copy into
  pinned staging, copy to the device) plus the suffix's forward; ``pool_load_ms`` is the load
  alone;
- ``arena_restore_ms``: the arena registered as pinned memory, ``HFPoolAdapter.load`` reading
  in place (blocks verified in the arena and copied straight from it to the device), plus the
  suffix's forward; ``arena_load_ms`` is that load alone. Both loads run in rounds, the host's
  work on one overlapping the DMA of the one before;
- ``bit_identical``: restored KV equal to what was stored, and suffix logits from it equal to
  those from the locally computed prefix (same shapes), bitwise.

It prints one JSON line (and writes it to ``--out``). ``--device cpu --tiny`` runs the same
logic on a tiny model on the CPU, to check the script where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any


def _model(tiny: bool, device: str) -> Any:
    import importlib

    import torch

    tf: Any = importlib.import_module("transformers")
    if tiny:
        cfg = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 16)
    else:
        cfg = tf.LlamaConfig(vocab_size=4096, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1 << 17,
                             rope_theta=500000.0)
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _timed(fn: Callable[[], Any], sync: Callable[[], None], reps: int) -> tuple[float, Any]:
    """Median milliseconds of ``reps`` runs of ``fn`` (after one warm-up) and its last result."""
    out = fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times), out


def run(device: str, tiny: bool, lengths: Sequence[int], suffix: int, block_tokens: int, reps: int) -> dict[str, Any]:
    import torch

    from kvpool_client.client import PoolClient
    from kvpool_client.engines.hf import BlockCodec, HFPoolAdapter, fingerprint_for
    from kvpool_client.tensors import register_arena_pinned, unregister_arena_pinned
    from kvpool_sidecar.process import SidecarProcess

    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def forward(toks: list[int], cache: Any) -> Any:
        """One forward over ``toks`` after ``cache``: the last token's logits."""
        out = model(input_ids=torch.tensor([toks], device=device), past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        return out.logits[0, -1]

    t_build = time.perf_counter()
    model = _model(tiny, device)
    build_s = time.perf_counter() - t_build
    fp = fingerprint_for(model, block_tokens, model_name="kvpool-gpu-check/random-llama-3-8b-shape"
                         + ("-tiny" if tiny else ""))
    gen = torch.Generator().manual_seed(1)
    vocab = int(model.config.vocab_size)
    results: list[dict[str, Any]] = []
    block_bytes = BlockCodec(model, block_tokens).block_bytes
    page = min(1 << 20, max(4096, 1 << (block_bytes.bit_length() - 1)))
    arena = (max(lengths) // block_tokens + 4) * -(-block_bytes // page) * page
    # one client restores the whole prefix in one call: the arena is sized for it alone
    sp = SidecarProcess({"node_name": "gpu-ttft", "dram": {"size_bytes": arena, "page_bytes": page},
                         "max_block_bytes": max(block_bytes, 1 << 20), "api": {"max_session_share": 1.0}},
                        workdir=tempfile.mkdtemp(prefix="kvpool-gpu-ttft-")).start()
    try:
        with PoolClient(sp.socket_path, timeout=120.0) as client:
            client.wait_prefaulted()  # the arena's pages exist before anything is timed
            adapter = HFPoolAdapter(model, client, fp)
            codec = adapter.codec
            pinned = register_arena_pinned(client) if cuda else False
            with torch.inference_mode():  # warm-up: kernels, allocator
                forward(torch.randint(0, vocab, (min(lengths),), generator=gen).tolist(), codec.new_cache())
            for n in lengths:
                ids = torch.randint(0, vocab, (n + suffix,), generator=gen).tolist()
                prefix_ids, suffix_ids = ids[:n], ids[n:]
                with torch.inference_mode():
                    full_ms, _ = _timed(lambda: forward(ids, codec.new_cache()), sync, reps)
                    local = codec.new_cache()
                    model(input_ids=torch.tensor([prefix_ids], device=device), past_key_values=local, use_cache=True)
                    sync()
                    t = time.perf_counter()
                    stored = adapter.store(local, prefix_ids)
                    store_ms = 1e3 * (time.perf_counter() - t)
                    nb = n // block_tokens
                    truth = codec.blocks_of(local, 0, nb)
                    local_logits = forward(suffix_ids, local)

                    def from_pool() -> tuple[Any, Any]:
                        loaded = adapter.load(ids, in_place=False)
                        return loaded, forward(ids[loaded.tokens:], loaded.cache)

                    def from_arena() -> tuple[Any, Any]:
                        loaded = adapter.load(ids)
                        return codec.blocks_of(loaded.cache, 0, loaded.blocks), forward(ids[loaded.tokens:],
                                                                                          loaded.cache)

                    pool_ms, (loaded, pool_logits) = _timed(from_pool, sync, reps)
                    load_ms, _ = _timed(lambda: adapter.load(ids, in_place=False), sync, 1)
                    arena_load_ms, _ = _timed(lambda: adapter.load(ids), sync, 1)
                    arena_ms, (arena_blocks, arena_logits) = _timed(from_arena, sync, reps)
                    restored = codec.blocks_of(loaded.cache, 0, nb)
                    full_logits = forward(ids, codec.new_cache())
                    # the next length starts from an arena with room for it: without this, its
                    # store (in rounds) would evict blocks of its own chain rather than these,
                    # which were read many times
                    removed = client.remove(adapter.keys(prefix_ids))
                results.append({
                    "prefix_tokens": n, "suffix_tokens": suffix, "kv_bytes": nb * block_bytes,
                    "blocks_stored": stored.stored, "blocks_removed_after": removed, "reused_tokens": loaded.tokens,
                    "full_prefill_ms": full_ms, "pool_restore_ms": pool_ms, "pool_load_ms": load_ms,
                    "arena_restore_ms": arena_ms, "arena_load_ms": arena_load_ms, "store_ms": store_ms,
                    "ttft_pool_vs_full": pool_ms / full_ms, "ttft_arena_vs_full": arena_ms / full_ms,
                    "bit_identical": bool(loaded.tokens == n and torch.equal(restored, truth)
                                          and torch.equal(arena_blocks, truth)
                                          and torch.equal(pool_logits, local_logits)
                                          and torch.equal(arena_logits, local_logits)),
                    "max_abs_diff_vs_full_prefill": float((pool_logits.float() - full_logits.float()).abs().max()),
                })
            if pinned:
                unregister_arena_pinned(client)
    finally:
        sp.stop()
    return {"check": "gpu_ttft", "device": device, "tiny": tiny, "block_tokens": block_tokens,
            "block_bytes": block_bytes, "model_build_s": build_s, "arena_pinned": pinned,
            "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short prompts (checks the logic)")
    p.add_argument("--lengths", help="prefix lengths, comma-separated (default 4096,16384,32768; tiny 64,128)")
    p.add_argument("--suffix", type=int, help="suffix tokens (default 256; tiny 16)")
    p.add_argument("--block-tokens", type=int, help="tokens per pool block (default 64; tiny 16)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", help="also write the JSON line here")
    a = p.parse_args(argv)
    lengths = [int(x) for x in (a.lengths or ("64,128" if a.tiny else "4096,16384,32768")).split(",")]
    result = run(a.device, a.tiny, lengths, a.suffix or (16 if a.tiny else 256),
                 a.block_tokens or (16 if a.tiny else 64), a.reps)
    line = json.dumps(result)
    print(line)
    if a.out:
        with open(a.out, "w") as f:
            f.write(line + "\n")
    return 0 if all(r["bit_identical"] for r in result["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
