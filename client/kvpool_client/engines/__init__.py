"""Engine adapters: the pool in an inference engine's prefill path.

- :mod:`kvpool_client.engines.paged`: where a block's bytes live in a paged KV cache;
- :mod:`kvpool_client.engines.prefix`: the scheduler's hit lengths, loads and saves;
- :mod:`kvpool_client.engines.blockio`: batched loads and background saves;
- :mod:`kvpool_client.engines.vllm`: the vLLM KV connector (imports vLLM), over
  :mod:`~kvpool_client.engines.vllm_settings` (its settings),
  :mod:`~kvpool_client.engines.vllm_keys` (its keys),
  :mod:`~kvpool_client.engines.vllm_adapters` (the hashes of requests with a LoRA adapter),
  :mod:`~kvpool_client.engines.vllm_blocks` (what a save says of vLLM's blocks) and
  :mod:`~kvpool_client.engines.vllm_meta` (the metadata between its scheduler and workers);
- :mod:`kvpool_client.engines.sglang`: the SGLang HiCache storage backend (imports SGLang),
  over :mod:`~kvpool_client.engines.sglang_keys` (its keys),
  :mod:`~kvpool_client.engines.sglang_runtime` (what it reads of the SGLang it runs in) and
  :mod:`~kvpool_client.engines.hostpages` (its host pool's pages as bytes);
- :mod:`kvpool_client.engines.hf`: transformers models (``DynamicCache``), a prefix
  restored from the pool and only the suffix computed;

Each adapter imports its engine only when it is itself imported.
"""
