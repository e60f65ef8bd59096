"""Engine instance A of the transformers tests, run in its own process.

``python -m tests.integration.hf_instance SOCKET OUT TOKENS`` builds the tests' random model,
prefills TOKENS (comma-separated ids) in one forward, stores the KV in the pool through the
sidecar at SOCKET, saves the stored blocks to OUT (``torch.save``) and prints the store's
result as one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kvpool_bench.engine import ModelSpec

#: The model of the transformers tests: small, Llama-shaped, seeded random weights.
SPEC = ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, seed=7)
BLOCK_TOKENS = 16


def main(argv: list[str]) -> int:
    import torch

    from kvpool_bench.engine import build_model
    from kvpool_client.client import PoolClient
    from kvpool_client.engines.hf import HFPoolAdapter, fingerprint_for

    socket_path, out, tokens = argv[0], argv[1], [int(t) for t in argv[2].split(",")]
    torch.set_num_threads(1)
    model = build_model(SPEC)
    with PoolClient(socket_path) as client:
        adapter = HFPoolAdapter(model, client, fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name))
        cache = adapter.codec.new_cache()
        with torch.inference_mode():
            model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        result = adapter.store(cache, tokens)
        torch.save({"blocks": adapter.codec.blocks_of(cache, 0, result.blocks)}, out)
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
