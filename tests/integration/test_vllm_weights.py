"""What names a vLLM deployment's weights in its blocks' keys, beyond the model's name: the
rope factors a LongRoPE model runs with, weights read from an object store, the rest of the
model config that changes them, and weights updated under a running engine. Real vLLM
config objects and scheduler on the CPU, against a real sidecar (tier 2)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool_sidecar.process import SidecarProcess
from tests.integration.support import DEADLINE_S

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import ModelConfig, VllmConfig  # noqa: E402

from kvpool_client.engines.vllm import ConnectorConfigError, KVPoolConnector  # noqa: E402
from tests.integration.test_vllm_connector import prompt, rank0_keys  # noqa: E402
from tests.integration.vllm_harness import BLOCK, Engine, make_request, vllm_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.vllm]


def long_rope_dir() -> str:
    """A Phi-3-shaped config whose rope has short and long factors (original context 1,024)."""
    d = Path(tempfile.gettempdir()) / "kvpool-vllm-tiny-phi3-longrope"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 64, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 1024, "torch_dtype": "float16",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}}))
    return str(d)


def with_model(socket_path: str, **model: Any) -> VllmConfig:
    cfg = vllm_config(socket_path)
    cfg.model_config = ModelConfig(skip_tokenizer_init=True, dtype="float16", seed=0, **model)
    return cfg


def test_a_long_rope_models_keys_follow_the_factors_its_length_picks(sidecar: SidecarProcess) -> None:
    """vLLM rotates a LongRoPE model's keys by its long factors past the original context
    and by its short ones up to it: the same tokens' KV differs, and the keys had not."""
    def keys(max_model_len: int) -> list[bytes]:
        return rank0_keys(with_model(sidecar.socket_path, model=long_rope_dir(), max_model_len=max_model_len))

    short = keys(1024)
    assert keys(512) == short  # the short factors both
    assert set(short).isdisjoint(keys(4096))
    assert keys(2048) == keys(4096)  # the long factors both
    # fitted to the GPU (-1): vLLM starts it at its original context and fits no further
    cfg = with_model(sidecar.socket_path, model=long_rope_dir(), max_model_len=-1)
    assert cfg.model_config.max_model_len == 1024 and rank0_keys(cfg) == short
    cfg.model_config.max_model_len = 512  # (what the fit left)
    assert rank0_keys(cfg) == short


def test_weights_read_from_an_object_store_need_a_model_id(sidecar: SidecarProcess) -> None:
    """vLLM reads an object store's model into a local directory of its config files and keeps
    the URI as ``model_weights``: that directory names no weights, and any two fine-tunes
    under one config had shared their keys."""
    cfg = vllm_config(sidecar.socket_path)
    cfg.model_config.model_weights = "s3://bucket/finetune-a"
    with pytest.raises(ConnectorConfigError, match="s3://bucket/finetune-a"):
        rank0_keys(cfg)
    cfg = vllm_config(sidecar.socket_path, extra={"model_id": "acme/finetune-a-v3"})
    cfg.model_config.model_weights = "s3://bucket/finetune-a"
    assert rank0_keys(cfg)


def test_the_rest_of_what_changes_the_weights_is_keyed(sidecar: SidecarProcess) -> None:
    """Under one name and one ``--quantization``: which layers an online quantization leaves
    alone, another class for the architecture, the multimodal processor's server defaults
    (vLLM's multimodal hashes cover the request's own arguments only)."""
    def keys(change: Callable[[Any], None] | None = None) -> list[bytes]:
        cfg = vllm_config(sidecar.socket_path)
        cfg.model_config.quantization = "fp8"  # (fp8 weights cannot be loaded here: what the key sees)
        if change is not None:
            change(cfg.model_config)
        return rank0_keys(cfg)

    base = keys()
    assert keys(lambda mc: setattr(mc, "quantization_config", None)) == base
    assert set(base).isdisjoint(keys(lambda mc: setattr(mc, "quantization_config", {"ignore": ["*k_proj*"]})))
    assert set(base).isdisjoint(keys(lambda mc: setattr(mc, "model_class_overrides",
                                                        {"LlamaForCausalLM": "acme.models:Llama"})))

    class Multimodal:
        mm_processor_kwargs = {"max_pixels": 200704}

    assert set(base).isdisjoint(keys(lambda mc: setattr(mc, "multimodal_config", Multimodal())))


@pytest.fixture
def engine(sidecar: SidecarProcess) -> Iterator[Callable[[], Engine]]:
    made: list[Engine] = []

    def make() -> Engine:
        made.append(Engine.start(sidecar.socket_path))
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_an_engine_that_resets_its_cache_with_the_connectors_loads_and_saves_nothing(
        engine: Callable[[], Engine]) -> None:
    """A trainer syncs new weights into a running engine, then resets its prefix cache with
    the connector's (``reset_prefix_cache(reset_connector=True)``): the connector had not
    heard of it (vLLM's default ``reset_cache`` does nothing), so the engine went on loading
    the old weights' KV and storing its new weights' KV under the old weights' keys."""
    tokens = prompt(3 * BLOCK + 5, salt=71)
    a = engine()
    a.run(make_request(tokens))
    assert a.worker.flush_saves(DEADLINE_S)
    b = engine()
    assert b.scheduler.reset_prefix_cache(reset_connector=True)
    rb = make_request(tokens)
    b.scheduler.add_request(rb)
    out = b.step()
    assert out.num_scheduled_tokens[rb.request_id] == len(tokens)  # nothing loaded: all computed
    b.run(make_request(prompt(2 * BLOCK + 3, salt=72)))
    assert b.worker.flush_saves(DEADLINE_S)
    assert b.worker._saver is None or b.worker._saver.stats.stored == 0
    c = engine()  # an engine that did not reset still shares
    rc = make_request(tokens)
    c.scheduler.add_request(rc)
    assert c.step().num_scheduled_tokens[rc.request_id] == len(tokens) - 3 * BLOCK
    assert isinstance(b.connector, KVPoolConnector) and b.connector.reset_cache() is True


def test_an_engine_whose_weights_never_change_keeps_the_pool_through_a_sleep(sidecar: SidecarProcess) -> None:
    """vLLM resets the connector's cache on sleep and on a pause that clears caches too:
    ``weights_fixed: true``, the operator's word, keeps such an engine on the pool."""
    tokens = prompt(3 * BLOCK + 5, salt=73)
    a = Engine.start(sidecar.socket_path)
    b = Engine.start(sidecar.socket_path, extra={"weights_fixed": True})
    try:
        a.run(make_request(tokens))
        assert a.worker.flush_saves(DEADLINE_S)
        assert b.scheduler.reset_prefix_cache(reset_connector=True)
        rb = make_request(tokens)
        b.scheduler.add_request(rb)
        assert b.step().num_scheduled_tokens[rb.request_id] == len(tokens) - 3 * BLOCK
    finally:
        a.close()
        b.close()
    with pytest.raises(ConnectorConfigError, match="weights_fixed"):
        rank0_keys(vllm_config(sidecar.socket_path, extra={"weights_fixed": "yes"}))
    with pytest.raises(ConnectorConfigError, match="save"):  # (it had meant true: bool("false"))
        rank0_keys(vllm_config(sidecar.socket_path, extra={"save": "false"}))
