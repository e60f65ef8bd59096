"""A transformers model end to end on a pool of two real sidecars: zero precision loss.

Instance A (its own process, ``tests/integration/hf_instance.py``) prefills a prompt against
sidecar A and stores its KV; instance B (this process) against sidecar B restores that
prefix, fetched from A through the Redis index, and computes only the suffix.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvpool_bench.engine import build_model  # noqa: E402
from kvpool_client.client import PoolClient  # noqa: E402
from kvpool_client.engines.hf import HFEngineError, HFPoolAdapter, fingerprint_for  # noqa: E402
from kvpool_client.keys import ModelFingerprint  # noqa: E402
from kvpool_client.protocol import PutStatus  # noqa: E402
from kvpool_sidecar.process import SidecarProcess  # noqa: E402
from tests.integration.hf_instance import BLOCK_TOKENS, SPEC  # noqa: E402
from tests.integration.poolfixtures import PoolFactory, pool, redis  # noqa: E402, F401 - fixtures
from tests.integration.support import DEADLINE_S, wait_until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.redis, pytest.mark.torch]

REPO = Path(__file__).resolve().parents[2]
PREFIX_BLOCKS = 5

# Float32 on the CPU: a full prefill and prefix + suffix differ by float reordering only.
ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)  # the same GEMM blocking as instance A's process
    return build_model(SPEC)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SPEC.vocab) for _ in range(n)]


def forward(model: Any, ids: list[int], cache: Any) -> Any:
    """Logits of every position of ``ids`` after what ``cache`` holds (which grows)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits


def run_instance_a(socket_path: str, out: Path, ids: list[int]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.integration.hf_instance", socket_path, str(out),
                           ",".join(map(str, ids))], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_prefix_from_a_peer_is_bit_identical(pool: PoolFactory, model: Any, tmp_path: Path) -> None:
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    prefix = tokens(PREFIX_BLOCKS * BLOCK_TOKENS, seed=1)
    suffix = tokens(23, seed=2)
    stored = run_instance_a(a.socket_path, tmp_path / "a_kv.pt", prefix)
    assert stored == {"blocks": PREFIX_BLOCKS, "held": 0, "sent": PREFIX_BLOCKS, "stored": PREFIX_BLOCKS}
    a_blocks = torch.load(tmp_path / "a_kv.pt")["blocks"]

    with PoolClient(b.socket_path, timeout=DEADLINE_S) as client:
        adapter = HFPoolAdapter(model, client, fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name))
        keys = adapter.keys(prefix)
        wait_until(lambda: client.lookup(keys).prefix == PREFIX_BLOCKS, "A's blocks in the index")
        loaded = adapter.load(prefix + suffix)
        assert (loaded.blocks, loaded.tokens, loaded.found) == (PREFIX_BLOCKS, len(prefix), PREFIX_BLOCKS)
        assert client.stats()["counters"]["fetch_ok"] == PREFIX_BLOCKS  # fetched from A, not computed here
        restored = adapter.codec.blocks_of(loaded.cache, 0, PREFIX_BLOCKS)

        # (1) the KV B restored is, bit for bit, what A computed and stored
        assert restored.dtype == a_blocks.dtype and restored.shape == a_blocks.shape
        assert torch.equal(restored, a_blocks)

        # (2) B's suffix logits from the restored cache equal those from the same prefix
        # computed here (one forward over the prefix, as A did: the same GEMM shapes)
        local = adapter.codec.new_cache()
        forward(model, prefix, local)
        assert torch.equal(adapter.codec.blocks_of(local, 0, PREFIX_BLOCKS), restored)
        from_pool = forward(model, suffix, loaded.cache)
        from_local = forward(model, suffix, local)
        assert torch.equal(from_pool, from_local)

        # (3) against one full prefill of the whole prompt they agree only within float
        # tolerance: the prefix's K/V and the suffix's attention come from GEMMs of other
        # shapes (80 + 23 rows instead of 103), whose kernels block and sum the float
        # products in another order, so the last bits differ.
        full = forward(model, prefix + suffix, adapter.codec.new_cache())[:, len(prefix):]
        assert full.shape == from_pool.shape
        assert torch.allclose(from_pool, full, atol=ATOL, rtol=RTOL), (from_pool - full).abs().max()

        # a prompt that is exactly the cached prefix still computes its last block
        capped = adapter.load(prefix)
        assert (capped.blocks, capped.tokens, capped.found) == (PREFIX_BLOCKS - 1, len(prefix) - BLOCK_TOKENS,
                                                                PREFIX_BLOCKS)


def test_a_corrupt_or_missing_block_shortens_the_prefix(sidecar_factory: Any, model: Any) -> None:
    sp: SidecarProcess = sidecar_factory()
    prompt = tokens(PREFIX_BLOCKS * BLOCK_TOKENS + 7, seed=3)
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as client, \
            PoolClient(sp.socket_path, timeout=DEADLINE_S) as corrupter:
        adapter = HFPoolAdapter(model, client, fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name))
        cache = adapter.codec.new_cache()
        forward(model, prompt, cache)
        assert adapter.store(cache, prompt).stored == PREFIX_BLOCKS
        truth = adapter.codec.blocks_of(cache, 0, PREFIX_BLOCKS)
        keys = adapter.keys(prompt)

        # flip one byte of block 2 in the shared arena, behind the sidecar's back
        with corrupter.acquire(keys[2:3]) as held:
            extents = held.extents[0]
        assert extents
        view = corrupter._view  # noqa: SLF001 - a second mapping of the same arena
        assert view is not None
        off, length = extents[0]
        view[off + length // 2] ^= 0x40

        loaded = adapter.load(prompt)
        assert loaded.found == PREFIX_BLOCKS  # the lookup still saw five blocks ...
        assert (loaded.blocks, loaded.tokens) == (2, 2 * BLOCK_TOKENS)  # ... the read stopped at the bad one
        assert torch.equal(adapter.codec.blocks_of(loaded.cache, 0, 2), truth[:2])

        # the bad block was dropped: now it is missing, and the prefix ends before it again
        missing = adapter.load(prompt)
        assert (missing.found, missing.blocks) == (2, 2)
        logits = forward(model, prompt[2 * BLOCK_TOKENS:], missing.cache)[:, -1]
        full = forward(model, prompt, adapter.codec.new_cache())[:, -1]
        assert torch.allclose(logits, full, atol=ATOL, rtol=RTOL)

        # storing again fills the hole (blocks 0-1 are held and not sent again)
        again = adapter.store(cache, prompt)
        assert (again.held, again.sent, again.stored) == (2, 3, 3)
        assert adapter.load(prompt).blocks == PREFIX_BLOCKS

        # a block of another size under a prefix key (a writer whose layout the fingerprint
        # does not name): a miss, not an error, whether it is larger or smaller
        for i, size in ((3, 1000), (1, adapter.codec.block_bytes * 2)):
            assert client.remove(keys[i:i + 1]) == 1
            assert corrupter.put(keys[i:i + 1], [b"\x01" * size]) == [PutStatus.STORED]
            wrong = adapter.load(prompt)
            assert (wrong.found, wrong.blocks, wrong.tokens, wrong.cache.get_seq_length()) == (PREFIX_BLOCKS, 0, 0, 0)
            for in_place in (False, True):
                assert adapter.load(prompt, in_place=in_place).blocks == 0
            assert client.remove(keys[i:i + 1]) == 1
            assert adapter.store(cache, prompt).stored == PREFIX_BLOCKS - i  # (EXISTS counts as stored)
        assert adapter.load(prompt).blocks == PREFIX_BLOCKS

        # a sidecar that is gone is a miss (the model computes the whole prompt), not an error
        sp.stop()
        gone = adapter.load(prompt)
        assert (gone.blocks, gone.tokens, gone.cache.get_seq_length()) == (0, 0, 0)
        assert adapter.store(cache, prompt).stored == 0


def test_the_fingerprint_must_match_the_model(model: Any, sidecar_factory: Any) -> None:
    fp = fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name)
    assert fp.extra["num_layers"] == str(SPEC.layers) and fp.dtype == "float32"
    assert fp != fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name + "-other-weights")
    # quantized weights, or adapters loaded, compute other KV under the same name
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    try:
        assert fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest() != fp.digest()
    finally:
        del model.config.quantization_config
    model.peft_config = {"default": "a LoRA adapter"}
    try:
        with pytest.raises(HFEngineError, match="adapter"):
            fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name)
        lora = fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name, adapter="org/lora-a@r1")
        assert lora.digest() != fp.digest()
    finally:
        del model.peft_config
    assert fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest() == fp.digest()
    with PoolClient(sidecar_factory().socket_path, timeout=DEADLINE_S) as client:
        for bad in (ModelFingerprint(SPEC.name, "float32", BLOCK_TOKENS, "vllm-flash", extra=fp.extra),
                    ModelFingerprint(SPEC.name, "bfloat16", BLOCK_TOKENS, fp.kv_layout, extra=fp.extra),
                    ModelFingerprint(SPEC.name, "float32", BLOCK_TOKENS, fp.kv_layout,
                                     extra={**fp.extra, "num_layers": "3"})):
            with pytest.raises(HFEngineError):
                HFPoolAdapter(model, client, bad)


def test_a_model_loaded_from_a_local_directory_keys_by_its_files(model: Any, tmp_path: Path) -> None:
    """``_name_or_path`` a local directory (one mount may hold any fine-tune): its weight
    files are part of the key, unless ``model_name`` vouches for the weights."""

    d = tmp_path / "model"
    d.mkdir()
    weights = d / "model.safetensors"
    with open(weights, "wb") as f:  # large enough to count by pieces of its bytes, as weights do
        f.truncate(2 << 20)
    cfg = model.config.get_text_config(decoder=True)
    before = getattr(cfg, "_name_or_path", "")
    cfg._name_or_path = str(d)
    try:
        legal = fingerprint_for(model, BLOCK_TOKENS)
        assert legal.extra.get("files") and fingerprint_for(model, BLOCK_TOKENS).digest() == legal.digest()
        os.utime(weights, ns=(1, 1))  # the same weights copied again: the same keys
        assert fingerprint_for(model, BLOCK_TOKENS).digest() == legal.digest()
        with open(weights, "r+b") as f:  # another fine-tune copied in
            f.write(b"medical")
        assert fingerprint_for(model, BLOCK_TOKENS).digest() != legal.digest()
        named = fingerprint_for(model, BLOCK_TOKENS, model_name="acme/legal-ft-v2")
        assert "files" not in named.extra
    finally:
        cfg._name_or_path = before


def test_config_overrides_the_hub_commit_and_other_inputs_key_apart(model: Any) -> None:
    """Under one name: a config field overridden at load (``from_pretrained(path,
    rms_norm_eps=0.5)``: other KV from the same files), the hub commit the weights were
    loaded at (``revision`` left out), and a model that reads images, whose placeholder
    tokens' KV depends on the image (refused: its token ids do not say which)."""
    base = fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name)
    eps = model.config.rms_norm_eps
    model.config.rms_norm_eps = 0.5
    try:
        assert fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest() != base.digest()
    finally:
        model.config.rms_norm_eps = eps
    model.config.use_cache = not model.config.use_cache  # how it is called: the same KV
    try:
        assert fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest() == base.digest()
    finally:
        model.config.use_cache = not model.config.use_cache
    commits = []
    for commit in ("a" * 40, "b" * 40):
        model.config._commit_hash = commit
        try:
            commits.append(fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest())
        finally:
            model.config._commit_hash = None
    assert len({*commits, base.digest()}) == 3
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=16, projection_dim=32)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=1000)
    vlm = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=999))
    with pytest.raises(HFEngineError, match="vision_config"):
        fingerprint_for(vlm, BLOCK_TOKENS, model_name="acme/tiny-llava")
    model.config.pad_token_id = 0  # (the tokenizer's idiom: the same KV)
    try:
        assert fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name).digest() == base.digest()
    finally:
        model.config.pad_token_id = None


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}])
def test_a_rope_whose_factors_follow_the_forwards_length_is_refused(rope: dict[str, Any]) -> None:
    """transformers picks a dynamic or LongRoPE model's factors by the length of each
    forward: a prefix's KV computed in a short prompt and in a long one differ, under one key."""
    import types

    from transformers import DbrxConfig, LlamaConfig

    from kvpool_client.engines.hf import KVGeometry

    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        num_hidden_layers=2, vocab_size=1000, max_position_embeddings=256,
                        rope_scaling={**rope, "original_max_position_embeddings": 128})
    with pytest.raises(HFEngineError, match=rope["rope_type"]):
        KVGeometry.of(types.SimpleNamespace(config=llama, dtype=torch.float32))
    # a text model with settings of its own in sub-configs (DBRX's attention) is no multimodal one
    dbrx = DbrxConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=100)
    assert KVGeometry.of(types.SimpleNamespace(config=dbrx, dtype=torch.float32)).layers == 2


def _tiny(cls: str, cfg: str, **kw: Any) -> Any:
    import transformers

    config = getattr(transformers, cfg)(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=2, vocab_size=SPEC.vocab, **kw)
    torch.manual_seed(0)
    return getattr(transformers, cls)(config).eval()


def test_a_sliding_window_model_is_refused_not_stored_shifted() -> None:
    """A Mistral-style ``sliding_window`` (no ``layer_types``) makes transformers keep the
    last tokens only: a prompt of 19 tokens under a window of 17 left K and V of tokens 3-18,
    which were stored as the blocks of tokens 0-15 (every value wrong, under the right keys)."""
    from kvpool_client.engines.hf import BlockCodec, KVGeometry

    mistral = _tiny("MistralForCausalLM", "MistralConfig", sliding_window=17)
    with pytest.raises(HFEngineError, match="full attention"):
        KVGeometry.of(mistral)
    with pytest.raises(HFEngineError, match="full attention"):
        BlockCodec(mistral, 8)
    with pytest.raises(HFEngineError, match="full attention"):
        fingerprint_for(mistral, 8, model_name="acme/tiny-mistral")


def test_a_cache_of_other_shapes_or_fewer_tokens_is_a_clear_error(model: Any) -> None:
    """A cache layer whose K or V is not ``[1, kv_heads, tokens, head_dim]`` of every token
    (MLA's K and V of two sizes, a layer that dropped its oldest tokens) is an
    :class:`HFEngineError`, never blocks: a layer short of its first tokens had been read as
    if it began at token 0, and other shapes raised torch's RuntimeError from inside."""
    from kvpool_client.engines.hf import BlockCodec

    codec = BlockCodec(model, BLOCK_TOKENS)
    ids = tokens(3 * BLOCK_TOKENS + 5, seed=9)
    whole = codec.blocks_of(_filled(model, codec, ids), 0, 2)

    dropped = _filled(model, codec, ids)  # layer 1 kept its last tokens only (as a sliding window's does)
    layer = dropped.layers[1]
    layer.keys, layer.values = layer.keys[:, :, 5:], layer.values[:, :, 5:]
    with pytest.raises(HFEngineError, match="layer 1"):
        codec.blocks_of(dropped, 0, 2)

    mla = _filled(model, codec, ids)  # V of another head size than K
    mla.layers[0].values = mla.layers[0].values[..., :8].contiguous()
    with pytest.raises(HFEngineError, match="layer 0"):
        codec.blocks_of(mla, 0, 2)

    fewer = _filled(model, codec, ids)  # K of other heads
    fewer.layers[0].keys = fewer.layers[0].keys[:, :1].contiguous()
    with pytest.raises(HFEngineError, match="layer 0"):
        codec.blocks_of(fewer, 0, 2)
    assert torch.equal(codec.blocks_of(_filled(model, codec, ids), 0, 2), whole)


def _filled(model: Any, codec: Any, ids: list[int]) -> Any:
    cache = codec.new_cache()
    forward(model, ids, cache)
    return cache


def test_a_model_whose_local_files_are_gone_is_refused_unnamed(model: Any, tmp_path: Path) -> None:
    """``_name_or_path`` a local path no longer there (a temporary directory, a mount gone):
    its files cannot say which weights it holds, and the path alone had keyed two
    fine-tunes loaded from one mount alike."""
    cfg = model.config.get_text_config(decoder=True)
    before = getattr(cfg, "_name_or_path", "")
    cfg._name_or_path = str(tmp_path / "gone")
    try:
        with pytest.raises(HFEngineError, match="model_name"):
            fingerprint_for(model, BLOCK_TOKENS)
        assert fingerprint_for(model, BLOCK_TOKENS, model_name="acme/legal-ft-v2").model == "acme/legal-ft-v2"
        cfg._name_or_path = "acme/not-downloaded"  # a hub name: its name and revision key it
        assert fingerprint_for(model, BLOCK_TOKENS).model == "acme/not-downloaded"
    finally:
        cfg._name_or_path = before


@pytest.mark.parametrize("what", ["load", "store"])
def test_a_slow_then_stalled_sidecar_costs_one_timeout_in_all(sidecar_factory: Any, model: Any, what: str) -> None:
    """A lookup answered late, then a sidecar that stops answering: the load (or store) ends
    within one client timeout, a miss; the lookup had had a timeout of its own, and the read
    (or put) after it another (1.8 s of a 1 s timeout)."""
    import signal
    import time

    sp: SidecarProcess = sidecar_factory()
    prompt = tokens(PREFIX_BLOCKS * BLOCK_TOKENS + 3, seed=11)
    timeout = 1.0
    with PoolClient(sp.socket_path, timeout=timeout) as client:
        adapter = HFPoolAdapter(model, client, fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name + what))
        cache = adapter.codec.new_cache()
        forward(model, prompt, cache)
        if what == "load":
            assert adapter.store(cache, prompt).stored == PREFIX_BLOCKS
        lookup = client.lookup

        def late(keys: Any) -> Any:  # answered at 0.8 of the timeout, and then the sidecar stalls
            found = lookup(keys)
            time.sleep(0.8 * timeout)
            os.kill(sp.pid, signal.SIGSTOP)
            return found

        client.lookup = late  # type: ignore[method-assign]
        try:
            t0 = time.monotonic()
            if what == "load":
                assert adapter.load(prompt).blocks == 0
            else:
                assert adapter.store(cache, prompt).stored == 0
            took = time.monotonic() - t0
        finally:
            os.kill(sp.pid, signal.SIGCONT)
    assert took < 1.3 * timeout, took


def test_a_branch_named_keys_by_the_commit_loaded_not_where_the_branch_is_now(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``revision="main"`` given, the model loaded at commit A, and the node's hub cache's
    ``refs/main`` moved on to B since (another process downloaded the newer main): the key
    names A's weights (the files' identity had read B from the ref, as an engine at B does)."""
    from huggingface_hub import constants

    a, b = "a" * 40, "b" * 40
    repo = tmp_path / "models--acme--tiny"
    for commit in (a, b):
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(b)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = model.config.get_text_config(decoder=True)
    before = getattr(cfg, "_name_or_path", "")
    cfg._name_or_path = "acme/tiny"
    try:
        model.config._commit_hash = a
        at_a = fingerprint_for(model, BLOCK_TOKENS, revision="main")
        model.config._commit_hash = b
        at_b = fingerprint_for(model, BLOCK_TOKENS, revision="main")
    finally:
        model.config._commit_hash = None
        cfg._name_or_path = before
    assert at_a.extra["files"] == "hub:" + a and at_b.extra["files"] == "hub:" + b
    assert at_a.digest() != at_b.digest()


def test_token_ids_of_a_batch_are_a_clear_error_not_a_silent_miss(sidecar_factory: Any, model: Any) -> None:
    """A tokenizer's ``input_ids`` is ``[1, n]``: its length, 1, made no block, and store and
    load did nothing without a word."""
    sp: SidecarProcess = sidecar_factory()
    prompt = tokens(PREFIX_BLOCKS * BLOCK_TOKENS, seed=5)
    batch = torch.tensor([prompt])
    with PoolClient(sp.socket_path, timeout=DEADLINE_S) as client:
        adapter = HFPoolAdapter(model, client, fingerprint_for(model, BLOCK_TOKENS, model_name=SPEC.name))
        cache = adapter.codec.new_cache()
        forward(model, prompt, cache)
        with pytest.raises(HFEngineError, match="one sequence"):
            adapter.store(cache, batch)  # type: ignore[arg-type]
        with pytest.raises(HFEngineError, match="one sequence"):
            adapter.load(batch)  # type: ignore[arg-type]
        assert adapter.store(cache, batch[0]).stored == PREFIX_BLOCKS  # (one row of it is one sequence)
        assert adapter.load(batch[0]).blocks == PREFIX_BLOCKS - 1  # (one token is left to compute)
