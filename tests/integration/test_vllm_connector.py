"""The vLLM connector driven by real vLLM objects (scheduler, KV cache config, per-layer views
built by vLLM on the CPU) against real sidecar processes; no model runs (tier 2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from kvpool_client.client import PoolClient
from kvpool_client.engines import prefix
from kvpool_client.protocol import Op
from kvpool_sidecar.process import SidecarProcess
from tests.integration.kv_subscriber import KvSubscriber, kv_config
from tests.integration.support import DEADLINE_S, fresh_keys

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.config import VllmConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvpool_client.engines.vllm import ConnectorConfigError, ConnectorSettings, KVPoolConnector  # noqa: E402
from kvpool_client.errors import KVPoolError  # noqa: E402
from tests.integration.vllm_harness import BLOCK, Engine, kv_cache_config, make_request, vllm_config  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.vllm]

LAYOUTS = ["BLNHC", "BLHNC", "BHLNC", "LBNHC", "LBHNC", "LHBNC"]


def prompt(n_tokens: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 997 + 1 for i in range(n_tokens)]


@pytest.fixture
def engines(sidecar: SidecarProcess) -> Callable[..., Engine]:
    made: list[Engine] = []

    def make(sock: str | None = None, layout: str = "BLNHC", **kw: object) -> Engine:
        e = Engine.start(sock or sidecar.socket_path, layout, **kw)
        made.append(e)
        return e

    yield make  # type: ignore[misc]
    for e in made:
        e.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prefix_computed_by_one_engine_is_loaded_by_another(engines: Callable[..., Engine], layout: str) -> None:
    tokens = prompt(3 * BLOCK + 5, salt=LAYOUTS.index(layout))
    a = engines(layout=layout)
    ra = make_request(tokens)
    a.run(ra)
    assert a.computed[ra.request_id] == len(tokens) + 1  # a miss: the whole prompt, and one decode step
    assert a.worker.flush_saves(DEADLINE_S)
    assert a.worker._saver is not None and a.worker._saver.stats.stored == 3

    b = engines(layout=layout)
    longer = tokens + [5, 6, 7]
    rb = make_request(longer)
    b.scheduler.add_request(rb)
    out = b.step()
    assert b.load_errors == set()
    assert out.num_scheduled_tokens[rb.request_id] == len(longer) - 3 * BLOCK  # only the suffix computed
    blocks = b.scheduler.kv_cache_manager.get_block_ids(rb.request_id)[0]
    for i in range(3):
        got, want = b.block_kv(blocks[i]), b.expected_block_kv(longer, i)
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want)), i


def test_the_hit_leaves_the_last_prompt_token_to_compute(engines: Callable[..., Engine]) -> None:
    tokens = prompt(4 * BLOCK, salt=11)  # a prompt of whole blocks
    a = engines()
    a.run(make_request(tokens))
    assert a.worker.flush_saves(DEADLINE_S)
    b = engines()
    rb = make_request(tokens)
    b.scheduler.add_request(rb)
    out = b.step()
    assert out.num_scheduled_tokens[rb.request_id] == BLOCK  # the last block is recomputed for its logits


def test_a_second_request_on_the_same_engine_saves_nothing_twice(engines: Callable[..., Engine]) -> None:
    tokens = prompt(2 * BLOCK + 3, salt=12)
    a = engines()
    a.run(make_request(tokens))
    a.run(make_request(tokens + [1, 2, 3]))
    assert a.worker.flush_saves(DEADLINE_S)
    stats = a.worker._saver.stats  # type: ignore[union-attr]
    assert stats.stored == 2 and stats.existed == 0 and stats.failed == 0


@pytest.mark.parametrize("salt", [None, "tenant-salt"])
def test_saved_blocks_are_announced_in_vllms_own_terms(engines: Callable[..., Engine],
                                                       sidecar_factory: Callable[..., SidecarProcess],
                                                       salt: str | None) -> None:
    """The connector gives each saved block vLLM's identity: the sidecar's KV events, decoded with
    vLLM's own classes, name the blocks as vLLM's own events would (hash, parent, tokens)."""
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    sp = sidecar_factory({"kv_events": kv_config()})
    ends = sp.ready["kv_events"]
    sub = KvSubscriber(ends["endpoint"], ends["replay_endpoint"], msgspec.msgpack.Decoder(type=KVEventBatch).decode)
    try:
        tokens = prompt(3 * BLOCK + 5, salt=31)
        a = engines(sp.socket_path)
        req = make_request(tokens, cache_salt=salt)
        saves = [s for out in a.run(req) for s in out.kv_connector_metadata.saves]
        assert a.worker.flush_saves(DEADLINE_S)
        # the request's hints go with each save: its prompt is 4 blocks long (the last one partial)
        assert saves and all(s.hints is not None and s.hints.prompt_blocks == 4 for s in saves)
        want = [maybe_convert_block_hash(h) for h in req.block_hashes[:3]]
        sub.until(lambda s: s.state() == {(h, "CPU") for h in want}, "the three saved blocks")
        stored = [ev for _, ev in sub.events() if type(ev).__name__ == "BlockStored"]
        assert [h for ev in stored for h in ev.block_hashes] == want
        assert stored[0].parent_block_hash is None
        assert [t for ev in stored for t in ev.token_ids] == tokens[: 3 * BLOCK]
        assert {(ev.block_size, ev.medium, ev.lora_id, ev.lora_name) for ev in stored} == {(BLOCK, "CPU", None, None)}
        # the salt is an extra key of the first block, as in vLLM's own events
        extra = [k for ev in stored for k in (ev.extra_keys or [None] * len(ev.block_hashes))]
        assert extra == ([None] * 3 if salt is None else [(salt,), None, None])
    finally:
        sub.close()


def test_a_failed_load_is_recomputed_never_served(engines: Callable[..., Engine], sidecar: SidecarProcess) -> None:
    tokens = prompt(3 * BLOCK + 2, salt=13)
    a = engines()
    a.run(make_request(tokens))
    assert a.worker.flush_saves(DEADLINE_S)
    b = engines()
    b.before_load = lambda out: sidecar.stop()  # the sidecar dies between the lookup and the load
    rb = make_request(tokens, max_tokens=8)
    b.scheduler.add_request(rb)
    first = b.step()
    assert first.num_scheduled_tokens[rb.request_id] == 2  # vLLM planned on the pool's 3 blocks
    assert len(b.load_errors) == 3
    b.before_load = None
    for _ in range(4):
        b.step()
    assert b.computed[rb.request_id] >= len(tokens)  # vLLM recomputed the prefix it could not load
    blocks = b.scheduler.kv_cache_manager.get_block_ids(rb.request_id)[0]
    for i in range(3):
        got, want = b.block_kv(blocks[i]), b.expected_block_kv(tokens, i)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), i


def test_a_preempted_request_resumes_from_what_it_saved(engines: Callable[..., Engine]) -> None:
    """Two requests outgrow a small KV cache: vLLM preempts one (freeing its blocks); when it
    comes back, the blocks it had saved load from the pool, and every block holds the right KV.
    vLLM's own prefix cache is off, so nothing but the pool can spare the recompute."""
    e = engines(num_blocks=9, max_batched_tokens=64, prefix_caching=False)
    reqs = [make_request(prompt(3 * BLOCK + 1, salt=s), max_tokens=40) for s in (21, 22)]
    for r in reqs:
        e.scheduler.add_request(r)
    checked = 0
    for _ in range(200):
        if not e.scheduler.requests:
            break
        before = dict(e.loaded)
        e.step()
        for r in reqs:  # right after a resumed request loaded: its blocks hold the right KV
            if e.loaded.get(r.request_id, 0) > before.get(r.request_id, 0) and r.request_id in e.scheduler.requests:
                tokens = list(r.all_token_ids)
                blocks = e.scheduler.kv_cache_manager.get_block_ids(r.request_id)[0]
                for i, blk in enumerate(blocks[: (len(tokens) - 1) // BLOCK]):
                    got, want = e.block_kv(blk), e.expected_block_kv(tokens, i)
                    assert all(torch.equal(g, w) for g, w in zip(got, want)), (r.request_id, i)
                    checked += 1
    assert not e.scheduler.requests and e.preempted and e.load_errors == set()
    victim = next(iter(e.preempted))
    assert e.loaded.get(victim, 0) > 0 and checked > 0  # it resumed from the pool, not from scratch
    assert e.worker._saver is not None and e.worker._saver.stats.failed == 0


def test_a_stopped_sidecar_is_a_miss_within_the_lookup_deadline(sidecar: SidecarProcess) -> None:
    cfg = vllm_config(sidecar.socket_path, extra={"lookup_timeout_s": 0.5})
    conn = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    req = make_request(prompt(3 * BLOCK + 1, salt=14))
    os.kill(sidecar.pid, signal.SIGSTOP)
    try:
        result: list[tuple[int | None, bool]] = []
        t = threading.Thread(target=lambda: result.append(conn.get_num_new_matched_tokens(req, 0)))
        t.start()
        t.join(DEADLINE_S)
        assert not t.is_alive() and result == [(0, False)]
        # while it backs off, later questions do not touch the socket at all
        assert conn.get_num_new_matched_tokens(make_request(prompt(40, 15)), 0) == (0, False)
    finally:
        os.kill(sidecar.pid, signal.SIGCONT)
        conn.shutdown()


def test_a_steps_lookups_take_lookup_timeout_s_in_all_however_many_requests_wait(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks once per waiting request within one schedule(): with a sidecar that answers
    each lookup in 0.4 s (of the connector's clock), a step of eight new requests asks it
    three times (1.2 s: the budget of lookup_timeout_s, 1 s, used up) and the five others
    miss without asking; the lookups then back off as after a failure, in the next step too.
    (Each had waited up to its own lookup_timeout_s: the step stalled eight times as long.)"""
    clock = SimpleNamespace(now=1000.0)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(prefix, "time", clock)  # the budget's and the back-off's clock
    asked: list[int] = []
    real_lookup = PoolClient.lookup

    def slow(self: PoolClient, keys: Any) -> Any:
        asked.append(len(keys))
        clock.now += 0.4
        return real_lookup(self, keys)

    monkeypatch.setattr(PoolClient, "lookup", slow)
    e = Engine.start(sidecar.socket_path, extra={"lookup_timeout_s": 1.0, "save": False})
    try:
        reqs = [make_request(prompt(2 * BLOCK + 1, salt=60 + i)) for i in range(8)]
        for r in reqs:
            e.scheduler.add_request(r)
        out = e.step()
        assert len(asked) == 3 and len(out.scheduled_new_reqs) == 8  # the step ran them all, five unasked
        e.run(make_request(prompt(2 * BLOCK + 1, salt=70)))  # the next steps: backing off, nothing asked
        assert len(asked) == 3
        clock.now += 60
        e.run(make_request(prompt(2 * BLOCK + 1, salt=71)))  # after the back-off: asked again
        assert len(asked) == 4
    finally:
        e.close()


def test_a_lookup_longer_than_the_sidecars_max_batch_hits_and_costs_the_next_request_nothing(
        sidecar_factory: Callable[..., SidecarProcess], engines: Callable[..., Engine]) -> None:
    """A long prompt names more keys than one request to the sidecar may (its api.max_batch):
    the lookup goes in several and finds the whole prefix, and a lookup the sidecar refuses
    (an error it answers) is a miss for that request alone, never a back-off that makes
    every other request miss."""
    sp = sidecar_factory({"api": {"max_batch": 8}})
    long, short = prompt(12 * BLOCK + 1, salt=41), prompt(3 * BLOCK + 1, salt=42)
    a = engines(sp.socket_path)
    for tokens in (long, short):
        a.run(make_request(tokens))
    assert a.worker.flush_saves(DEADLINE_S)
    cfg = vllm_config(sp.socket_path)
    b = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    try:
        assert b.get_num_new_matched_tokens(make_request(long), 0) == (12 * BLOCK, False)  # 12 keys: 8, then 4
        refused = b._lookups.call(lambda c: c)  # noqa: SLF001 - one whole request of 12 keys, as before:
        with pytest.raises(KVPoolError, match="at most 8"):
            b._lookups.call(lambda c: c._call(Op.LOOKUP, [k.raw for k in fresh_keys(12)]))  # noqa: SLF001
        assert b._lookups.call(lambda c: c) is refused  # noqa: SLF001 - its connection kept
        assert b.get_num_new_matched_tokens(make_request(short), 0) == (3 * BLOCK, False)  # and no back-off
    finally:
        b.shutdown()


def test_two_processes_derive_the_same_keys(sidecar: SidecarProcess) -> None:
    """sha256 block hashes are seeded alike in every process (unless PYTHONHASHSEED differs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    outs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "tests.integration.vllm_harness", "keys", sidecar.socket_path],
                           capture_output=True, text=True, timeout=120, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert outs[0] == outs[1] and len(outs[0]) == 3 and len(set(outs[0])) == 3


def test_a_per_process_hash_seed_is_refused(sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cfg = vllm_config(sidecar.socket_path, hash_algo="xxhash")
    with pytest.raises(ConnectorConfigError, match="PYTHONHASHSEED"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg)).shutdown()


def rank0_keys(cfg: VllmConfig) -> list[bytes]:
    """Rank 0's keys of one prompt, from a scheduler-side connector built for ``cfg``."""
    conn = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    try:
        return conn._rank_keys(0, conn._hashes(make_request(prompt(2 * BLOCK, 16))))
    finally:
        conn.shutdown()


def test_fingerprints_differ_by_layout_dtype_and_namespace(sidecar: SidecarProcess) -> None:
    def keys(layout: str = "BLNHC", **extra: object) -> list[bytes]:
        return rank0_keys(vllm_config(sidecar.socket_path, layout, extra=dict(extra)))

    base = keys()
    assert base == keys()
    assert set(base).isdisjoint(keys("LBNHC"))
    assert set(base).isdisjoint(keys(namespace="tenant-b"))
    assert set(base).isdisjoint(keys(model_id="other/model"))


def test_fingerprints_differ_by_weight_quantization_and_config_overrides(sidecar: SidecarProcess) -> None:
    """The same model name computes other KV with quantized weights or an overridden rope:
    vLLM's block hashes cover neither, so the fingerprint must (they had shared every key)."""
    def keys(quantization: str | None = None, **overrides: object) -> list[bytes]:
        cfg = vllm_config(sidecar.socket_path, hf_overrides=overrides or None)
        cfg.model_config.quantization = quantization  # (fp8 weights cannot be loaded here: what the key sees)
        return rank0_keys(cfg)

    base = keys()
    assert base == keys()
    # a worker's model code sets fields of the config when it loads (minimax_m2 its
    # max_model_len, sarvam its n_group): its keys must still be the scheduler's
    cfg = vllm_config(sidecar.socket_path)
    cfg.model_config.hf_config.max_model_len = 4096
    cfg.model_config.hf_config.n_group = 1
    assert rank0_keys(cfg) == base
    assert set(base).isdisjoint(keys("fp8"))
    assert set(base).isdisjoint(keys(rope_theta=40000.0))
    assert set(base).isdisjoint(keys(rope_scaling={"rope_type": "linear", "factor": 4.0}))


def test_an_adapter_with_other_weights_under_the_same_name_and_path_never_loads_the_others_blocks(
        engines: Callable[..., Engine], tmp_path: Path) -> None:
    """vLLM's block hash names a LoRA adapter by its name and path, and one path holds other
    weights on another deployment or after an update in place: those requests had shared
    every key (engine C loaded A's 3 blocks, computed with the other adapter)."""
    adapter = tmp_path / "adapters" / "sql"
    adapter.mkdir(parents=True)

    def weights(fill: bytes) -> None:
        (adapter / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
        (adapter / "adapter_model.safetensors").write_bytes(fill * 4096)

    def run(e: Engine, tokens: list[int]) -> int:
        r = make_request(tokens, lora=LoRARequest("sql", 1, str(adapter)))
        e.run(r)
        assert e.worker.flush_saves(DEADLINE_S)
        return e.loaded.get(r.request_id, 0)

    tokens = prompt(3 * BLOCK + 5, salt=41)
    weights(b"A")
    a = engines()
    assert run(a, tokens) == 0
    assert run(engines(), tokens) == 3  # the same adapter's files: its blocks are shared
    weights(b"B")  # rewritten in place (or another deployment's mount of the path)
    assert run(engines(), tokens) == 0
    # engine A keeps the weights it loaded (vLLM reloads an adapter id only when asked): which
    # it runs now nobody outside it knows, so it neither loads nor saves for that adapter
    stored = a.worker._saver.stats.stored if a.worker._saver is not None else 0
    assert run(a, tokens) == 0 and run(a, prompt(3 * BLOCK + 5, salt=42)) == 0
    assert (a.worker._saver.stats.stored if a.worker._saver is not None else 0) == stored
    base = make_request(tokens)  # and the base model never reads an adapter's blocks
    c = engines()
    c.run(base)
    assert c.loaded.get(base.request_id, 0) == 0


def test_once_an_adapters_files_change_no_request_of_it_loads_even_one_planned_before(
        engines: Callable[..., Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request seen before the change (waiting, or preempted and resumed) kept hashes keyed
    with the old identity and loaded those blocks into an engine that may run the new weights;
    a load planned in the step that found the change went out too."""
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"A" * 4096)
    lora = LoRARequest("sql", 1, str(tmp_path))
    tokens = prompt(3 * BLOCK + 5, salt=43)
    a = engines()
    first = make_request(tokens, lora=lora)
    a.run(first)
    assert a.worker.flush_saves(DEADLINE_S)

    b = engines()
    waiting = make_request(tokens, lora=lora)
    assert b.connector.get_num_new_matched_tokens(waiting, 0)[0] == 3 * BLOCK  # seen before the change
    (tmp_path / "adapter_model.safetensors").write_bytes(b"B" * 4096)  # rewritten in place
    assert b.connector.get_num_new_matched_tokens(make_request(tokens, lora=lora), 0)[0] == 0  # found
    assert b.connector.get_num_new_matched_tokens(waiting, 0)[0] == 0

    (tmp_path / "adapter_model.safetensors").write_bytes(b"A" * 4096)
    c = engines()  # in one step: a load planned, then the change found by the next request
    planned, after = make_request(tokens, lora=lora), make_request(tokens, lora=lora)
    matched = c.connector.get_num_new_matched_tokens

    def then_rewritten(request: Any, computed: int) -> Any:
        got = matched(request, computed)
        if request is planned:
            (tmp_path / "adapter_model.safetensors").write_bytes(b"B" * 4096)
        return got

    monkeypatch.setattr(c.connector, "get_num_new_matched_tokens", then_rewritten)
    c.scheduler.add_request(planned)
    c.scheduler.add_request(after)
    c.step()
    ids = c.scheduler.kv_cache_manager.get_block_ids(planned.request_id)[0]
    assert c.loaded == {planned.request_id: 3} and c.load_errors == set(ids[:3])  # refused: vLLM computes them


def test_an_adapters_keys_follow_hashes_vllm_rewrites(engines: Callable[..., Engine], tmp_path: Path) -> None:
    """vLLM rewrites a streamed request's block hashes from the first block its new input
    changes: the adapter-keyed hashes kept for the request follow (a kept one would save new
    KV under the key of other tokens)."""
    (tmp_path / "adapter_config.json").write_text("{}")
    lora = LoRARequest("sql", 1, str(tmp_path))
    c = engines().connector
    first = [bytes([i]) * 32 for i in range(4)]
    keyed = c._lora.hashes("r", lora, first)
    assert len(keyed) == 4 and not set(keyed) & set(first)
    rewritten = first[:1] + [bytes([9]) * 32, bytes([8]) * 32]
    assert c._lora.hashes("r", lora, rewritten) == c._lora.hashes("fresh", lora, rewritten)
    assert c._lora.hashes("r", lora, rewritten)[0] == keyed[0]


def test_weights_that_are_not_the_checkpoints_are_keyed_apart(sidecar: SidecarProcess) -> None:
    """``--load-format dummy`` runs random weights under the model's name and path: its KV had
    been keyed as the real weights' (a load test against the shared pool wrote it there)."""
    def keys(load_format: str) -> list[bytes]:
        cfg = vllm_config(sidecar.socket_path)
        cfg.load_config.load_format = load_format
        return rank0_keys(cfg)

    base = keys("auto")
    assert keys("safetensors") == base  # the checkpoint's own weights, read another way
    assert set(base).isdisjoint(keys("dummy"))
    assert set(base).isdisjoint(keys("bitsandbytes"))


def test_unknown_settings_are_refused(sidecar: SidecarProcess) -> None:
    cfg = vllm_config(sidecar.socket_path, extra={"sockt_path": "/x"})
    with pytest.raises(ConnectorConfigError, match="sockt_path"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    for bad in ({"max_stage_bytes": 0}, {"max_pending_save_bytes": -1}, {"max_stage_bytes": "lots"}):
        cfg = vllm_config(sidecar.socket_path, extra=bad)
        with pytest.raises(ConnectorConfigError, match=next(iter(bad))):
            KVPoolConnector(cfg, KVConnectorRole.WORKER, kv_cache_config(cfg))


def test_timeouts_that_are_no_positive_finite_number_of_seconds_are_refused(sidecar: SidecarProcess) -> None:
    """(A negative or NaN one had passed, then failed every lookup with a ValueError that
    reached vLLM's scheduler.)"""
    for name in ("timeout_s", "lookup_timeout_s"):
        for bad in (-1, 0, "nan", float("inf"), True):
            with pytest.raises(ConnectorConfigError, match=name):
                ConnectorSettings.from_extra({name: bad})
        assert getattr(ConnectorSettings.from_extra({name: "0.25"}), name) == 0.25
    cfg = vllm_config(sidecar.socket_path, extra={"lookup_timeout_s": -1})
    with pytest.raises(ConnectorConfigError, match="lookup_timeout_s"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))


def test_timeouts_past_a_minute_are_refused_at_start(sidecar: SidecarProcess) -> None:
    """1e12 or 1e300 seconds had passed as finite, then failed every call with an OverflowError
    (a socket takes no timeout past about 1e9 s), which is no KVPoolError."""
    for name in ("timeout_s", "lookup_timeout_s"):
        for bad in (60.5, 1e12, 1e300):
            with pytest.raises(ConnectorConfigError, match=name):
                ConnectorSettings.from_extra({name: bad})
        assert getattr(ConnectorSettings.from_extra({name: 60}), name) == 60.0
    cfg = vllm_config(sidecar.socket_path, extra={"timeout_s": 1e12})
    with pytest.raises(ConnectorConfigError, match="timeout_s"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))


def test_a_vllm_that_fails_requests_whose_blocks_did_not_load_is_refused(sidecar: SidecarProcess) -> None:
    """vLLM's default kv_load_failure_policy, "fail", ends a request with an error where a
    block the lookup found is gone by the load (evicted, a sidecar that stopped): the
    connector counts on vLLM recomputing it, and refuses to start otherwise."""
    cfg = vllm_config(sidecar.socket_path)
    cfg.kv_transfer_config.kv_load_failure_policy = "fail"
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConnectorConfigError, match="set kv_load_failure_policy: recompute"):
            KVPoolConnector(cfg, role, kv_cache_config(cfg))
    from kvpool_client.engines.vllm import check_load_failure_policy

    check_load_failure_policy(SimpleNamespace())  # a vLLM without the setting always recomputed


def test_a_hybrid_model_is_refused(sidecar: SidecarProcess) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    cfg = vllm_config(sidecar.socket_path)
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, sliding_window=64)
    kcc = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], swa)])
    with pytest.raises(ConnectorConfigError, match="SlidingWindowSpec"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


def group_config(spec: Any = None, *, eagle: bool = False) -> Any:
    """A KV cache config of one group of ``spec`` (the harness's spec by default)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = spec or FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
    group = KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec,
                             is_eagle_group=eagle)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])


def scheduler_keys(cfg: VllmConfig, kcc: Any) -> list[bytes]:
    conn = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kcc)
    try:
        return conn._rank_keys(0, conn._hashes(make_request(prompt(2 * BLOCK, 16))))
    finally:
        conn.shutdown()


def test_a_non_causal_model_is_refused(sidecar: SidecarProcess) -> None:
    """A Prefix-LM's prefill attends both ways: a prefix's KV depends on what follows it (vLLM
    turns its own prefix caching off for it; the connector had keyed it by the prefix)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = vllm_config(sidecar.socket_path)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16, non_causal=True)
    with pytest.raises(ConnectorConfigError, match="both ways"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, group_config(spec))


def test_fingerprints_differ_by_every_field_of_the_spec_and_by_the_platforms_fp8(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends that pack heads into other slots, or store fp8 in another format, lay out other
    bytes under the same geometry: they had shared keys."""
    import dataclasses

    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = vllm_config(sidecar.socket_path)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)
    base = scheduler_keys(cfg, group_config(spec))
    assert base == scheduler_keys(vllm_config(sidecar.socket_path), group_config(spec))
    slots = dataclasses.replace(spec, num_head_slots=1, state_content_bytes=64)  # 1 slot of 64 B, not 2 of 32
    assert slots.page_size_bytes == spec.page_size_bytes  # the same geometry as the key had it
    assert set(base).isdisjoint(scheduler_keys(cfg, group_config(slots)))
    monkeypatch.setattr(type(current_platform), "fp8_dtype", classmethod(lambda cls: torch.float8_e4m3fnuz))
    assert set(base).isdisjoint(scheduler_keys(cfg, group_config(spec)))


def test_fingerprints_differ_by_config_path_and_code_revision(sidecar: SidecarProcess, tmp_path: Path) -> None:
    """A config read from another path (a YaRN rope, fewer layers) or the model code's other
    revision computes other KV for the model's name: they had shared every key."""
    base = rank0_keys(vllm_config(sidecar.socket_path))
    keys = []
    for theta in (10000.0, 20000.0):
        d = tmp_path / str(theta)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": theta}))
        cfg = vllm_config(sidecar.socket_path)
        cfg.model_config.hf_config_path = str(d)
        keys.append(rank0_keys(cfg))
    assert set(base).isdisjoint(keys[0]) and set(keys[0]).isdisjoint(keys[1])
    cfg = vllm_config(sidecar.socket_path)
    cfg.model_config.code_revision = "abc123"
    assert set(base).isdisjoint(rank0_keys(cfg))


def test_pipeline_stages_of_unequal_layer_counts_key_alike_on_the_scheduler_and_workers(
        sidecar: SidecarProcess) -> None:
    """The scheduler keys every stage's blocks from the first stage's KV config; a stage of
    more layers (61 over 2 stages) had keyed its own blocks apart: they never hit."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvpool_client.engines.vllm_keys import fingerprints

    cfg = vllm_config(sidecar.socket_path)
    cfg.parallel_config.pipeline_parallel_size = 2
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float16)

    def stage(layers: int) -> Any:
        group = KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)], spec)
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group])

    settings = ConnectorSettings.from_extra({"socket_path": sidecar.socket_path})
    scheduler, second = fingerprints(cfg, stage(31), settings), fingerprints(cfg, stage(30), settings)
    assert len(scheduler) == 2 and scheduler[1] == second[1]


def test_a_model_read_from_a_uri_needs_a_model_id(sidecar: SidecarProcess) -> None:
    """``s3://bucket/model`` names no weights on the node: overwritten in place, it had kept its keys."""
    cfg = vllm_config(sidecar.socket_path)
    cfg.model_config.model = "s3://bucket/llama-ft"
    with pytest.raises(ConnectorConfigError, match="model_id"):
        KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, kv_cache_config(cfg))
    cfg = vllm_config(sidecar.socket_path, extra={"model_id": "llama-ft-2026-12"})
    cfg.model_config.model = "s3://bucket/llama-ft"
    assert rank0_keys(cfg)


def test_an_eagle_group_computes_the_last_block_of_a_hit_and_keys_by_its_drafter(
        sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGLE layers in the group: the drafter's KV at a block's last token depends on the next
    token, which the block's hash does not cover (vLLM's own prefix cache computes that block
    again); and two drafters of one shape had shared keys."""
    from types import SimpleNamespace

    cfg = vllm_config(sidecar.socket_path)
    conn = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, group_config(eagle=True))
    try:
        assert conn._planner is not None and conn._planner.hold_back == 1
    finally:
        conn.shutdown()
    plain = KVPoolConnector(cfg, KVConnectorRole.SCHEDULER, group_config())
    try:
        assert plain._planner is not None and plain._planner.hold_back == 0
    finally:
        plain.shutdown()
    base = scheduler_keys(cfg, group_config(eagle=True))
    monkeypatch.setattr(cfg, "speculative_config", SimpleNamespace(method="eagle", model="org/eagle-a"), raising=False)
    a = scheduler_keys(cfg, group_config(eagle=True))
    monkeypatch.setattr(cfg, "speculative_config", SimpleNamespace(method="eagle", model="org/eagle-b"), raising=False)
    b = scheduler_keys(cfg, group_config(eagle=True))
    assert set(base).isdisjoint(a) and set(a).isdisjoint(b)


def test_one_model_path_holding_other_weights_keys_apart(sidecar: SidecarProcess, tmp_path: Path) -> None:
    """Deployments mount their fine-tunes at one path (``/model``): keyed by the path, they
    had read each other's KV. A local model directory keys by its files (names, sizes and
    bytes) unless ``model_id`` vouches for the weights."""
    def keys(weights: bytes, **extra: object) -> list[bytes]:
        d = tmp_path / "model"
        d.mkdir(exist_ok=True)
        f = d / "model.safetensors"
        with open(f, "wb") as out:  # large enough to count by pieces of its bytes, as weights do
            out.write(weights)
            out.truncate(2 << 20)
        os.utime(f, ns=(1_700_000_000_000_000_000,) * 2)  # one time: only the bytes differ
        cfg = vllm_config(sidecar.socket_path, extra=dict(extra))
        cfg.model_config.model = str(d)
        return rank0_keys(cfg)

    legal = keys(b"legal fine-tune")
    assert keys(b"legal fine-tune") == legal
    assert set(legal).isdisjoint(keys(b"medical fine-tune"))
    assert keys(b"legal fine-tune", model_id="acme/ft-v2") == keys(b"medical fine-tune", model_id="acme/ft-v2")


class AttentionEngine(Engine):
    """The stand-in forward with each layer's KV past the first reading the cache slots of
    the positions before it, as attention does: KV computed over slots that did not load is
    wrong, as it would be in a real model."""

    ATTENTION = 0.001


def clean_blocks(sp: SidecarProcess, engines: list[Engine], tokens: list[int], n: int) -> list[Any]:
    """The KV of the first ``n`` blocks of ``tokens`` as an engine computes it without the pool."""
    clean = AttentionEngine.start(sp.socket_path, extra={"save": False})
    engines.append(clean)
    clean.connector._planner._lookup = lambda keys: 0  # type: ignore[union-attr]  # noqa: SLF001
    req = make_request(tokens, max_tokens=5)
    clean.scheduler.add_request(req)
    while req.num_computed_tokens < n * BLOCK:
        clean.step()
    return [clean.block_kv(x) for x in clean.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0][:n]]


def first_load_fails(engine: Engine) -> Callable[[], None]:
    """The engine's next step that loads has its load time out; returns what undoes it."""
    loads = engine.worker._loads  # noqa: SLF001

    class TimesOut:
        def call(self, fn: Any) -> Any:
            raise KVPoolError("a load timed out (injected)")

        def close(self) -> None:
            pass

    def fail_once(out: Any) -> None:
        meta = out.kv_connector_metadata
        if meta.loads:
            engine.worker._loads = TimesOut()  # noqa: SLF001
            engine.before_load = None

    engine.before_load = fail_once

    def undo() -> None:
        engine.worker._loads = loads  # noqa: SLF001
    return undo


def saved_then_failed(sp: SidecarProcess, engines: list[Engine], saved: list[int], tokens: list[int],
                      **kw: Any) -> tuple[Engine, Any]:
    """Engine A saves ``saved``; engine B (``kw``) runs ``tokens``, whose first load times
    out: B and its request, after that step."""
    a = AttentionEngine.start(sp.socket_path)
    engines.append(a)
    a.run(make_request(saved))
    a.worker.flush_saves()
    b = AttentionEngine.start(sp.socket_path, **kw)
    engines.append(b)
    undo = first_load_fails(b)
    req = make_request(tokens, max_tokens=2)
    b.scheduler.add_request(req)
    b.step()
    undo()
    assert b.load_errors
    return b, req


def until_done(engine: Engine, *requests: Any, max_steps: int = 30) -> None:
    """Step ``engine`` until each of ``requests`` has finished (at most ``max_steps``); then
    its saves land."""
    for _ in range(max_steps):
        if all(r.request_id not in engine.scheduler.requests for r in requests):
            break
        engine.step()
    engine.worker.flush_saves()


def third_engine_reads(sp: SidecarProcess, engines: list[Engine], tokens: list[int], want: list[Any]) -> int:
    """Engine C runs ``tokens``: every block of ``want`` must be the clean KV, whether C loaded
    it or computed it; how many blocks C loaded from the pool."""
    c = AttentionEngine.start(sp.socket_path)
    engines.append(c)
    req = make_request(tokens, max_tokens=5)
    c.scheduler.add_request(req)
    c.step()
    assert not c.load_errors
    got = c.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    for i, kv in enumerate(want):
        assert all(torch.equal(g, w) for g, w in zip(c.block_kv(got[i]), kv)), f"block {i} is wrong KV"
    return c.loaded.get(req.request_id, 0)


def q_then_c(sp: SidecarProcess, engines: list[Engine], b: Engine, tokens: list[int], want: list[Any],
             *running: Any) -> int:
    """Request Q (``tokens``) runs on engine ``b`` to its end, as do ``running``; how many
    blocks engine C then loads of ``tokens`` (each one must be the clean KV, ``want``)."""
    q = make_request(tokens, max_tokens=1)
    b.scheduler.add_request(q)
    until_done(b, q, *running)
    return third_engine_reads(sp, engines, tokens + [1], want)


def test_what_a_step_computed_over_a_failed_load_is_never_saved(sidecar: SidecarProcess) -> None:
    """Engine B loads three blocks and computes three more in one step; the load fails. The
    forward still ran over the slots that did not load, so those three computed blocks are
    wrong: saved, they had put wrong KV under right keys (engine C then read it, checksums
    right). They are dropped, and saved once vLLM has recomputed them: C reads every block
    as a clean computation makes it."""
    full = prompt(6 * BLOCK + 2, 5)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, full, 6)
        b, rb = saved_then_failed(sidecar, engines, full[: 3 * BLOCK + 2], full)
        until_done(b, rb, max_steps=6)

        assert third_engine_reads(sidecar, engines, full, want) == 6  # the recomputed blocks were saved
    finally:
        for e in engines:
            e.close()


def test_what_a_request_computed_over_the_slots_of_a_failed_load_is_never_saved(sidecar: SidecarProcess) -> None:
    """Request R's load of 8 blocks fails; vLLM keeps those blocks in its own prefix cache
    (holding whatever was there) and recomputes them a 32-token chunk a step. Meanwhile Q,
    the same 8-block prefix and 3 more, hits them in vLLM's cache and computes its 3 blocks
    over them: wrong KV, which vLLM never computes again (Q is not the request that failed).
    Q's blocks had been saved once the failed step's own saves were dropped; engine C then
    loaded them. They are never saved: C loads the 8 right blocks and computes the rest."""
    base = prompt(8 * BLOCK + 2, 5)
    longer = base[: 8 * BLOCK] + prompt(3 * BLOCK + 2, 9)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, longer, 11)
        b, r = saved_then_failed(sidecar, engines, base, base, long_prefill=32)
        assert q_then_c(sidecar, engines, b, longer, want, r) == 8  # Q's three blocks were not saved
    finally:
        for e in engines:
            e.close()


def test_what_a_request_computed_over_blocks_the_failed_step_computed_is_never_saved(sidecar: SidecarProcess) -> None:
    """Request R loads 3 blocks and computes 2 more in one step; the load fails, and vLLM
    recomputes R from its first block, a block a step (another request, F, runs beside it).
    The 2 blocks the failed step computed stay in vLLM's prefix cache, wrong, until R gets to
    them again; once R has recomputed the 3 whose load failed, Q (R's first 5 blocks and 3
    more) hits all 5 in vLLM's cache and computes over the wrong 5th. Only the blocks whose
    load failed had been tainted: Q's blocks went to the pool, and engine C loaded them. Now
    the blocks the failed step computed after them are tainted too, and what Q computes over
    them is never saved."""
    full = prompt(6 * BLOCK + 2, 5)
    longer = full[: 5 * BLOCK] + prompt(3 * BLOCK + 2, 9)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, longer, 8)
        b, r = saved_then_failed(sidecar, engines, full[: 3 * BLOCK + 2], full, long_prefill=BLOCK)
        b.scheduler.add_request(make_request(prompt(12 * BLOCK, 77), max_tokens=1))  # F: R's recompute is chunked
        while r.num_computed_tokens < 3 * BLOCK:
            b.step()
        assert r.num_computed_tokens == 3 * BLOCK  # blocks 0-2 computed again; blocks 3 and 4 as the failed step left them
        assert q_then_c(sidecar, engines, b, longer, want, r) == 5  # Q's three blocks were not saved
    finally:
        for e in engines:
            e.close()


def test_a_block_recomputed_only_part_way_stays_tainted(sidecar: SidecarProcess) -> None:
    """R's load fails and vLLM recomputes R in chunks of a block and a half; R is aborted when
    it has recomputed the first half of its 5th block, whose second half is as the failed step
    left it. That block had been taken as computed again (the step wrote into it): Q, sharing
    R's first 5 blocks, hit it in vLLM's prefix cache, saved it and what it computed over it,
    and engine C loaded them. A block is clean again only once one clean computation wrote it
    whole."""
    full = prompt(6 * BLOCK + 2, 5)
    longer = full[: 5 * BLOCK] + prompt(3 * BLOCK + 2, 9)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, longer, 8)
        b, r = saved_then_failed(sidecar, engines, full[: 3 * BLOCK + 2], full, long_prefill=BLOCK + BLOCK // 2)
        b.scheduler.add_request(make_request(prompt(12 * BLOCK, 77), max_tokens=1))  # F: R's recompute is chunked
        while r.num_computed_tokens < 4 * BLOCK:
            b.step()
        assert r.num_computed_tokens % BLOCK  # part way through a block
        b.scheduler.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)  # its client went away
        assert q_then_c(sidecar, engines, b, longer, want) <= 4
    finally:
        for e in engines:
            e.close()


def test_what_a_request_aborted_before_its_steps_outcome_came_back_computed_stays_tainted(
        sidecar: SidecarProcess) -> None:
    """Under vLLM's asynchronous scheduling a request can be aborted after the step in which a
    load failed and before that step's outcome comes back. Q computed over R's failed load in
    that step and left: the taint, taken from the tables of the requests still known, missed
    Q's blocks, which stay in vLLM's prefix cache; a later request with Q's prompt saved them,
    and engine C loaded them. The tables of the held steps' requests are kept until their
    outcome is known."""
    full = prompt(6 * BLOCK + 2, 5)
    qtok = full[: 5 * BLOCK] + prompt(3 * BLOCK + 2, 9)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, qtok, 8)
        a = AttentionEngine.start(sidecar.socket_path)
        engines.append(a)
        a.run(make_request(full[: 3 * BLOCK + 2]))
        a.worker.flush_saves()
        b = AttentionEngine.start(sidecar.socket_path)
        engines.append(b)
        undo = first_load_fails(b)
        r, q = make_request(full, max_tokens=2), make_request(qtok, max_tokens=2)
        b.scheduler.add_request(r)
        b.scheduler.add_request(q)
        b.before_report = lambda out: b.scheduler.finish_requests(q.request_id, RequestStatus.FINISHED_ABORTED)
        b.step()  # R's load fails; Q computed over R's blocks in that step, and is aborted
        undo()
        b.before_report = None
        assert b.load_errors
        until_done(b, r, max_steps=10)
        assert q_then_c(sidecar, engines, b, qtok, want) <= 6  # (Q's prompt again)
    finally:
        for e in engines:
            e.close()


def test_a_request_that_reads_blocks_recomputed_in_the_same_step_is_saved(sidecar: SidecarProcess) -> None:
    """Q hits R's blocks in vLLM's prefix cache in the very step R recomputes them after its
    failed load: vLLM writes a layer's KV before attention reads it, so Q's KV is right. Q had
    been taken as computing over wrong blocks, and nothing of it (nor of any request that later
    hit its prefix) was ever saved."""
    full = prompt(6 * BLOCK + 2, 5)
    longer = full[: 5 * BLOCK] + prompt(3 * BLOCK + 2, 9)
    engines: list[Engine] = []
    try:
        want = clean_blocks(sidecar, engines, longer, 8)
        b, r = saved_then_failed(sidecar, engines, full[: 3 * BLOCK + 2], full)
        assert q_then_c(sidecar, engines, b, longer, want, r) == 8
    finally:
        for e in engines:
            e.close()


def test_blocks_vllm_gives_again_after_a_failed_load_are_saved_by_their_new_requests(sidecar: SidecarProcess) -> None:
    """R's load fails; its prompt ends part way through a block, which stays tainted. vLLM then
    gives that block (and others) to later requests, each of which loads 3 blocks from the pool
    and computes 3: a request that loaded into a tainted block had been taken as computing over
    wrong KV, and its own blocks were never saved (engine C loaded 3 of each, not 6)."""
    full = prompt(5 * BLOCK + 8, 5)
    engines: list[Engine] = []
    try:
        b, r = saved_then_failed(sidecar, engines, full[: 3 * BLOCK + 2], full, num_blocks=12)
        until_done(b, r)
        a = AttentionEngine.start(sidecar.socket_path)
        engines.append(a)
        prefixes = [prompt(3 * BLOCK, 100 + k) for k in range(6)]
        for p in prefixes:
            a.run(make_request(p + [1, 2]))  # the pool holds each prefix's 3 blocks
        a.worker.flush_saves()
        ys = [p + prompt(3 * BLOCK + 4, 200 + k) for k, p in enumerate(prefixes)]
        for y in ys:
            req = make_request(y, max_tokens=1)
            b.scheduler.add_request(req)
            until_done(b, req)
        c = AttentionEngine.start(sidecar.socket_path)
        engines.append(c)
        got = []
        for y in ys[:-1]:  # (the last one's saves wait for a step of B after it)
            q = make_request(y + [9], max_tokens=1)
            c.scheduler.add_request(q)
            c.step()
            got.append(c.loaded.get(q.request_id, 0))
            until_done(c, q)
        assert got == [6] * 5
    finally:
        for e in engines:
            e.close()


def test_a_save_the_backlog_had_no_room_for_is_made_while_the_request_runs(engines: Callable[..., Engine]) -> None:
    """A save dropped for want of room in the worker's backlog had still been counted as saved
    by the scheduler: those blocks stayed misses for every engine. The worker now says so in
    its per-step metadata, and the scheduler plans the save again while the request runs."""
    tokens = prompt(6 * BLOCK + 2, salt=21)
    a = engines(max_batched_tokens=2 * BLOCK)  # two blocks a step: the request runs on after the loss
    saver = a.worker._saver  # noqa: SLF001
    assert saver is not None
    full = [True]
    has_room = saver.has_room
    saver.has_room = lambda n: not full[0] and has_room(n)  # type: ignore[method-assign]
    req = make_request(tokens)
    a.scheduler.add_request(req)
    a.step()  # blocks 0 and 1 computed; no room to save them
    assert saver.stats.dropped == 2 and saver.stats.submitted == 0
    full[0] = False
    for _ in range(10):
        if req.request_id not in a.scheduler.requests:
            break
        a.step()
    assert a.worker.flush_saves(DEADLINE_S)
    b = engines()
    rb = make_request(tokens)
    b.run(rb)
    assert b.loaded.get(rb.request_id) == 6 and saver.stats.stored == 6
