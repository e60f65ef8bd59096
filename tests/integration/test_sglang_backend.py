"""The SGLang HiCache backend, loaded by SGLang's own ``dynamic`` backend factory from the
extra-config JSON users pass, over host pools built by SGLang's own classes on the CPU,
against real sidecar processes; no model runs."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvpool_client import client as client_module
from kvpool_client.client import PoolClient
from kvpool_sidecar.process import SidecarProcess
from tests.integration.poolfixtures import pool, redis  # noqa: F401 - fixtures
from tests.integration.support import DEADLINE_S, wait_until

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed (make sglang installs it without its CUDA packages)")
torch = pytest.importorskip("torch")

from sglang.srt.managers.cache_controller import storage_model_name  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from kvpool_client.engines.hostpages import HostPagesError  # noqa: E402
from kvpool_client.engines.sglang import KVPoolHiCacheStorage  # noqa: E402
from kvpool_client.engines.sglang_keys import SGLangConfigError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.sglang]

PAGE = 4
PAGES = 5
#: The extra config of the README's launch command (less the socket, which each test sets).
EXTRA = {"backend_name": "kvpool", "module_path": "kvpool_client.engines.sglang",
         "class_name": "KVPoolHiCacheStorage", "interface_v1": 1}

_salt = count(1)


def host_pool(layout: str = "page_first", *, mla: bool = False, dtype: Any = None, page: int = PAGE,
              layers: int = 3, draft: bool = False) -> Any:
    """A HiCache host pool as SGLang builds it for a device pool on the CPU, filled with noise
    (``draft``: an MHA pool that packs a one-layer speculative draft's KV into its pages)."""
    dtype = dtype or torch.bfloat16
    if draft:
        dev = MHATokenToKVPool(64, page, dtype, 2, 8, layers, "cpu", False, start_layer=0, end_layer=layers)
        drafts = [MHATokenToKVPool(64, page, dtype, 2, 8, 1, "cpu", False, start_layer=0,
                                   end_layer=1).get_device_pool_infos()[0].buffer_info]
        pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers, draft_buffer_infos=drafts,
                                    write_back_staging=dev.hicache_write_back_staging)
    elif mla:
        dev = MLATokenToKVPool(64, page, dtype, 16, 8, layers, "cpu", False, start_layer=0, end_layer=layers)
        pool = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers, target_layer_num=layers)
    else:
        dev = MHATokenToKVPool(64, page, dtype, 2, 8, layers, "cpu", False, start_layer=0, end_layer=layers)
        pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    write_back_staging=dev.hicache_write_back_staging)
    g = torch.Generator().manual_seed(next(_salt))
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=g))
    return pool


def page_hashes(n: int = PAGES, page: int = PAGE) -> list[str]:
    """SGLang's own chained page hashes of a prompt no other call used."""
    salt = next(_salt)
    hashes: list[str] = get_hash_str([(salt * 7919 + i * 31) % 30000 for i in range(n * page)], None,
                                     page_size=page)
    return hashes


def page_bytes(pool: Any, host_indices: Any) -> list[Any]:
    """Each page's bytes, read by SGLang's own ``get_data_page`` (uint8, for bitwise checks)."""
    starts = host_indices[:: pool.page_size].tolist()
    return [pool.get_data_page(i, flat=True).contiguous().view(torch.uint8).clone() for i in starts]


def storage_config(pool: Any, extra_json: str, *, model: str = "itest/sglang", tp_rank: int = 0, tp_size: int = 1,
                   mla: bool = False) -> HiCacheStorageConfig:
    """What SGLang's cache controller builds from the launch flags for one rank."""
    extra_config, *_ = HybridCacheController.parse_storage_backend_extra_config(extra_json)
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=pool.layout == "page_first",
                                model_name=storage_model_name(model, pool), extra_config=extra_config)


def attach(pool: Any, config: HiCacheStorageConfig) -> KVPoolHiCacheStorage:
    """The controller's attach: the factory, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    assert isinstance(backend, KVPoolHiCacheStorage)
    return backend


Make = Callable[..., KVPoolHiCacheStorage]


def model_dir(path: Path, fill: bytes) -> str:
    """A model directory (as a pod mounts it) whose weights are ``fill``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(fill * 4096)
    return str(path)


def hub_snapshot(cache: Path, repo: str, commit: str, fill: bytes) -> str:
    """``cache`` (a hub cache, or SGLang's --download-dir), where SGLang downloaded ``repo`` at ``commit``."""
    root = cache / ("models--" + repo.replace("/", "--"))
    model_dir(root / "snapshots" / commit, fill)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return str(cache)


@pytest.fixture(autouse=True)
def scheduler_process(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SGLang's runtime context holds the server arguments of a launch with the tests' model,
    as in the scheduler process where SGLang builds its storage backend (a test may set
    others: :func:`serving`), and the node's hub cache the snapshot SGLang downloaded of it."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hub")
    for n, model in enumerate(("itest/sglang", "itest/other-model"), 1):
        hub_snapshot(cache, model, str(n) * 40, model.encode())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    serving(monkeypatch, "--model-path", "itest/sglang")


@pytest.fixture
def backends(request: pytest.FixtureRequest) -> Iterator[Make]:
    """``make(host_pool, sock=..., extra=..., **shard)``: a backend on ``sock`` (by default
    the test's ``sidecar``), closed at the end of the test."""
    made: list[KVPoolHiCacheStorage] = []

    def make(pool: Any, *, sock: str | None = None, extra: dict[str, Any] | None = None,
             **shard: Any) -> KVPoolHiCacheStorage:
        sock = sock or request.getfixturevalue("sidecar").socket_path
        cfg = {**EXTRA, "socket_path": sock, **(extra or {})}
        b = attach(pool, storage_config(pool, json.dumps(cfg), **shard))
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


LAYOUTS = [("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "page_head"),
           ("mla", "layer_first"), ("mla", "page_first"), ("mla", "page_first_direct")]


@pytest.mark.parametrize(("kind", "layout"), LAYOUTS, ids=[f"{k}-{lay}" for k, lay in LAYOUTS])
def test_pages_stored_from_host_slots_load_bitwise_into_others(backends: Make, kind: str, layout: str) -> None:
    pool = host_pool(layout, mla=kind == "mla")
    b = backends(pool, mla=kind == "mla")
    keys = page_hashes()
    src = pool.alloc(PAGES * PAGE)
    want = page_bytes(pool, src)
    assert b.batch_exists(keys) == 0
    assert b.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * PAGES
    assert b.batch_exists(keys) == PAGES
    pool.kv_buffer.zero_()  # clear every host page
    dst = pool.alloc(PAGES * PAGE)  # a prefetch lands in other slots
    assert b.batch_get_v1(keys, dst) == [True] * PAGES
    got = page_bytes(pool, dst)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(not p.any() for p in page_bytes(pool, src))  # nothing but the loaded slots was written


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_move_inline_when_no_arena_is_mapped(sidecar_factory: Callable[..., SidecarProcess], backends: Make,
                                                   kind: str) -> None:
    sp = sidecar_factory({"api": {"shared_arena": "never"}})
    pool = host_pool("page_first", mla=kind == "mla")
    b = backends(pool, sock=sp.socket_path, mla=kind == "mla")
    keys = page_hashes()
    src, dst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    want = page_bytes(pool, src)
    assert b.batch_set_v1(keys, src) == [True] * PAGES
    assert b.batch_get_v1(keys, dst) == [True] * PAGES
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(pool, dst), want))


def test_mha_pages_gathered_in_several_puts_keep_their_chain(backends: Make) -> None:
    pool = host_pool("layer_first")
    b = backends(pool, extra={"max_staging_bytes": 1000})  # one 768-byte page per put
    keys = page_hashes()
    src, dst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    want = page_bytes(pool, src)
    assert b.batch_set_v1(keys[:2], src[: 2 * PAGE], HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 2
    assert b.batch_set_v1(keys[2:], src[2 * PAGE :], HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [True] * 3
    assert b.batch_exists(keys) == PAGES
    assert b.batch_get_v1(keys, dst) == [True] * PAGES
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(pool, dst), want))


def test_batch_exists_counts_the_leading_pages_held(backends: Make) -> None:
    pool = host_pool()
    b = backends(pool)
    keys = page_hashes()
    src = pool.alloc(PAGES * PAGE)
    held = [0, 1, 3]
    for i in held:
        assert b.batch_set_v1([keys[i]], src[i * PAGE : (i + 1) * PAGE]) == [True]
    assert b.batch_exists(keys) == 2
    assert b.batch_exists(keys[1:]) == 1
    assert b.batch_exists(keys[2:]) == 0
    assert b.batch_exists(keys[3:]) == 1
    assert b.batch_exists([]) == 0
    assert b.exists(keys[3]) and not b.exists(keys[4])
    dst = pool.alloc(PAGES * PAGE)
    assert b.batch_get_v1(keys, dst) == [i in held for i in range(PAGES)]


ISOLATION: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("model", {}, {"model": "itest/other-model"}),
    ("tp-rank", {"tp_size": 2}, {"tp_size": 2, "tp_rank": 1}),
    ("tp-size", {"tp_size": 2}, {"tp_size": 4}),
    ("namespace", {}, {"extra": {"namespace": "team-b"}}),
    ("model-id", {}, {"extra": {"model_id": "elsewhere"}}),
]


@pytest.mark.parametrize(("what", "a_args", "b_args"), ISOLATION, ids=[w for w, _, _ in ISOLATION])
def test_backends_of_other_shards_do_not_see_each_others_pages(backends: Make, what: str, a_args: dict[str, Any],
                                                               b_args: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pool = host_pool()
    a = backends(pool, **a_args)
    if "model" in b_args:  # another model: its own launch's --model-path
        serving(monkeypatch, "--model-path", b_args["model"])
    b = backends(pool, **b_args)
    keys = page_hashes()
    src, dst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    assert a.batch_set_v1(keys, src) == [True] * PAGES
    assert a.batch_exists(keys) == PAGES
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, dst) == [False] * PAGES


POOLS: list[tuple[str, dict[str, Any]]] = [
    ("dtype", {"dtype": "float16"}),
    ("layout", {"layout": "page_first_direct"}),
    ("page-size", {"page": 2 * PAGE}),
    ("layers", {"layers": 4}),
]


@pytest.mark.parametrize(("what", "other"), POOLS, ids=[w for w, _ in POOLS])
def test_pages_of_other_formats_are_not_seen(backends: Make, what: str, other: dict[str, Any]) -> None:
    pool = host_pool()
    kw = dict(other)
    if "dtype" in kw:
        kw["dtype"] = getattr(torch, kw["dtype"])
    page = kw.get("page", PAGE)
    other_pool = host_pool(kw.pop("layout", "page_first"), **kw)
    a, b = backends(pool), backends(other_pool)
    keys = page_hashes(2 * PAGES, PAGE)
    assert a.batch_set_v1(keys, pool.alloc(2 * PAGES * PAGE)) == [True] * 2 * PAGES
    n = 2 * PAGES * PAGE // page
    assert b.batch_exists(keys[:n]) == 0  # the same page hashes: still another pool's pages
    assert b.batch_get_v1(keys[:n], other_pool.alloc(n * page)) == [False] * n


@pytest.mark.redis
def test_pages_one_node_stored_are_found_and_loaded_on_another(pool: Callable[..., SidecarProcess],
                                                                 backends: Make) -> None:
    a, b = pool("a", "127.0.0.11"), pool("b", "127.0.0.12")
    hp = host_pool()
    on_a, on_b = backends(hp, sock=a.socket_path), backends(hp, sock=b.socket_path)
    keys = page_hashes()
    src, dst = hp.alloc(PAGES * PAGE), hp.alloc(PAGES * PAGE)
    want = page_bytes(hp, src)
    assert on_a.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * PAGES
    wait_until(lambda: on_b.batch_exists(keys) == PAGES, "node b to see node a's pages through the index")
    assert on_b.batch_get_v1(keys, dst) == [True] * PAGES  # fetched from node a
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(hp, dst), want))


def test_mla_ranks_share_their_replicated_pages(backends: Make) -> None:
    pool = host_pool("page_first", mla=True)
    r0 = backends(pool, mla=True, tp_size=2, tp_rank=0)
    r1 = backends(pool, mla=True, tp_size=2, tp_rank=1)
    keys = page_hashes()
    src, dst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    want = page_bytes(pool, src)
    assert r0.batch_set_v1(keys, src) == [True] * PAGES  # SGLang lets one rank write MLA pages
    assert r1.batch_exists(keys) == PAGES
    assert r1.batch_get_v1(keys, dst) == [True] * PAGES
    assert all(torch.equal(g, w) for g, w in zip(page_bytes(pool, dst), want))


def test_the_older_calls_move_flat_pages_keyed_apart_from_v1(backends: Make) -> None:
    pool = host_pool("layer_first")  # flat pages and v1 pieces order bytes differently here
    v1 = backends(pool)
    flat = backends(pool, extra={"interface_v1": 0})
    keys = page_hashes()
    src = pool.alloc(PAGES * PAGE)
    pages = [pool.get_data_page(i, flat=True) for i in src[::PAGE].tolist()]
    assert flat.batch_set(keys, pages)
    assert flat.batch_exists(keys) == PAGES
    assert v1.batch_exists(keys) == 0
    got = flat.batch_get(keys)
    assert all(g is not None and torch.equal(g.view(torch.uint8), p.view(torch.uint8)) for g, p in zip(got, pages))
    one = flat.get(keys[0], pool.get_dummy_flat_data_page())
    assert one is not None and torch.equal(one.view(torch.uint8), pages[0].view(torch.uint8))
    assert flat.set(page_hashes(1)[0], pages[0]) and flat.exists(keys[0])


def test_a_stopped_sidecar_is_a_miss_and_its_successor_is_used(backends: Make, sidecar: SidecarProcess) -> None:
    pool = host_pool()
    b = backends(pool, extra={"lookup_timeout_s": 0.5, "timeout_s": 2.0})
    keys = page_hashes()
    src, dst = pool.alloc(PAGES * PAGE), pool.alloc(PAGES * PAGE)
    assert b.batch_set_v1(keys, src) == [True] * PAGES
    sidecar.stop()
    results: list[Any] = []
    t = threading.Thread(target=lambda: results.extend(
        [b.batch_exists(keys), b.batch_get_v1(keys, dst), b.batch_set_v1(keys, src), b.exists(keys[0])]))
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive() and results == [0, [False] * PAGES, [False] * PAGES, False]
    sidecar.start()  # a new sidecar on the same socket: the old one's DRAM pages are gone
    fresh = page_hashes()
    wait_until(lambda: b.batch_set_v1(fresh, src) == [True] * PAGES, "a put through the new sidecar")
    assert b.batch_exists(fresh) == PAGES
    assert b.batch_exists(keys) == 0


def test_a_stuck_sidecar_is_a_miss_within_the_lookup_deadline(backends: Make, sidecar: SidecarProcess) -> None:
    pool = host_pool()
    b = backends(pool, extra={"lookup_timeout_s": 0.5})
    keys = page_hashes()
    assert b.batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    os.kill(sidecar.pid, signal.SIGSTOP)
    try:
        results: list[int] = []
        t = threading.Thread(target=lambda: results.append(b.batch_exists(keys)))
        t.start()
        t.join(DEADLINE_S)
        assert not t.is_alive() and results == [0]
    finally:
        os.kill(sidecar.pid, signal.SIGCONT)
    wait_until(lambda: b.batch_exists(keys) == PAGES, "lookups after the sidecar resumed")


def test_indices_that_do_not_match_the_keys_are_refused_and_store_nothing(backends: Make) -> None:
    pool = host_pool()
    b = backends(pool)
    keys = page_hashes()
    src = pool.alloc(PAGES * PAGE)
    with pytest.raises(HostPagesError, match="host indices"):
        b.batch_set_v1(keys, src[:-1])
    with pytest.raises(HostPagesError, match="host indices"):
        b.batch_get_v1(keys[:2], src)
    assert b.batch_exists(keys) == 0


def test_the_launch_flags_load_the_backend(sidecar: SidecarProcess) -> None:
    """The README's flags, parsed by SGLang's own argument parser, through the dynamic factory."""
    extra_json = json.dumps({**EXTRA, "hicache_storage_pass_prefix_keys": True, "socket_path": sidecar.socket_path})
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "itest/sglang", "--page-size", str(PAGE), "--enable-hierarchical-cache",
                              "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "dynamic",
                              "--hicache-storage-backend-extra-config", extra_json])
    assert args.hicache_storage_backend == "dynamic"
    pool = host_pool(args.hicache_mem_layout, page=args.page_size)
    config = storage_config(pool, args.hicache_storage_backend_extra_config, model=args.model_path)
    assert config.extra_config.get("interface_v1")  # SGLang's test for the zero-copy calls
    backend = attach(pool, config)
    try:
        keys = page_hashes()
        assert backend.batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
        assert backend.batch_exists(keys) == PAGES
    finally:
        backend.close()


def serving(monkeypatch: pytest.MonkeyPatch, *flags: str) -> None:
    """SGLang's runtime context holds the server arguments of ``flags``, as in a scheduler process."""
    from sglang.srt import runtime_context

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(list(flags)))
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)


def test_fine_tunes_served_under_one_name_are_keyed_apart(backends: Make, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Any) -> None:
    """SGLang names the model to its storage backend by ``--served-model-name``: two
    deployments of different fine-tunes, both served as ``chat``, had shared every key (and
    random ``--load-format dummy`` weights the real ones')."""
    def model(name: str, fill: bytes) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "llama"}')
        (d / "model.safetensors").write_bytes(fill * (2 << 20))
        return str(d)

    a, b = model("ft-a", b"A"), model("ft-b", b"B")
    pool = host_pool()
    keys = page_hashes()
    serving(monkeypatch, "--model-path", a, "--served-model-name", "chat")
    assert backends(pool, model="chat").batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool, model="chat").batch_exists(keys) == PAGES  # the same weights: the same keys
    serving(monkeypatch, "--model-path", b, "--served-model-name", "chat")
    assert backends(pool, model="chat").batch_exists(keys) == 0
    serving(monkeypatch, "--model-path", a, "--served-model-name", "chat", "--load-format", "dummy")
    assert backends(pool, model="chat").batch_exists(keys) == 0
    serving(monkeypatch, "--model-path", a, "--served-model-name", "assistant")  # a name is no weights
    assert backends(pool, model="assistant").batch_exists(keys) == PAGES


def test_pages_of_quantized_or_overridden_weights_are_keyed_apart(backends: Make,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same model name with fp8 weights, or a rope override, computes other KV for the same
    tokens, and SGLang's page hashes do not tell them apart: the server arguments SGLang runs
    with (its runtime context, as in a scheduler process) go into the pages' keys."""
    def running(*flags: str) -> None:
        serving(monkeypatch, "--model-path", "itest/sglang", *flags)

    pool = host_pool()
    running()
    plain = backends(pool)
    keys = page_hashes()
    assert plain.batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool).batch_exists(keys) == PAGES  # the same weights: the same keys
    running("--json-model-override-args", '{ }')  # (the overrides' JSON is compared, not its spelling)
    assert backends(pool).batch_exists(keys) == PAGES
    running("--model-loader-extra-config", '{ }')
    assert backends(pool).batch_exists(keys) == PAGES
    for flags in (["--quantization", "fp8"], ["--json-model-override-args", '{"rope_theta": 40000.0}'],
                  ["--modelopt-quant", "fp8"], ["--modelopt-checkpoint-restore-path", "/ckpt/calib-b"],
                  ["--custom-weight-loader", "acme.loaders.load"], ["--weight-version", "step-200"],
                  # the dtype it computes in, where the pages' dtype is set apart (bf16 pages either way)
                  ["--dtype", "float16", "--kv-cache-dtype", "bfloat16"],
                  ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
                  ["--model-impl", "transformers"], ["--decrypted-config-file", "/secrets/other-config.json"],
                  ["--model-loader-extra-config", '{"enable_multithread_load": true}']):
        running(*flags)
        assert backends(pool).batch_exists(keys) == 0, flags
    flash_rl = ["--load-format", "flash_rl", "--rl-quant-profile"]  # FlashRL quantizes as its profile says
    running(*flash_rl, "/profiles/a.pt")
    assert backends(pool).batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    running(*flash_rl, "/profiles/b.pt")
    assert backends(pool).batch_exists(keys) == 0


def test_fp8_pages_of_other_formats_or_platforms_are_keyed_apart(backends: Make,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang stores every fp8 KV cache as uint8 (its host pool says uint8 for e4m3 and e5m2
    alike, and a byte reads 1.5 in one, 1.0 in the other): the resolved --kv-cache-dtype and
    the platform's fp8 type go into the pages' keys."""
    from kvpool_client.engines import sglang_runtime

    def running(*flags: str) -> None:
        serving(monkeypatch, "--model-path", "itest/sglang", *flags)

    pool = host_pool(dtype=torch.float8_e4m3fn)
    assert str(pool.dtype) == "torch.uint8"
    keys = page_hashes()
    running("--kv-cache-dtype", "fp8_e4m3")
    assert backends(pool).batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool).batch_exists(keys) == PAGES
    running("--kv-cache-dtype", "fp8_e5m2")
    assert backends(host_pool(dtype=torch.float8_e5m2)).batch_exists(keys) == 0
    running("--kv-cache-dtype", "fp8_e4m3")
    monkeypatch.setattr(sglang_runtime, "_platform_fp8", lambda: "torch.float8_e4m3fnuz")  # ROCm MI300
    assert backends(pool).batch_exists(keys) == 0
    monkeypatch.setattr(sglang_runtime, "_server_args", lambda: None)  # no runtime context: e4m3 or e5m2?
    with pytest.raises(SGLangConfigError, match="fp8_e5m2"):
        backends(pool)


def test_a_backend_that_cannot_read_the_server_arguments_needs_a_model_id(sidecar: SidecarProcess,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Without SGLang's server arguments, the model is named by its served name alone, which
    two fine-tunes (or one quantized, or another adapter's) often share: it had attached,
    with a warning."""
    from kvpool_client.engines import sglang_runtime

    monkeypatch.setattr(sglang_runtime, "_server_args", lambda: None)
    pool = host_pool()
    with pytest.raises(SGLangConfigError, match="model_id"):
        attach(pool, storage_config(pool, json.dumps({**EXTRA, "socket_path": sidecar.socket_path})))
    vouched = attach(pool, storage_config(pool, json.dumps({**EXTRA, "socket_path": sidecar.socket_path,
                                                            "model_id": "acme/chat-ft-7"})))
    vouched.close()


def test_pages_are_neither_read_nor_written_once_the_weights_version_moves(backends: Make,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An RL trainer's weight sync moves SGLang's weight version under a running engine: its
    pages' keys name the weights it attached with, which other engines may still run. The
    backend had gone on reading their pages and writing the new weights' under those keys."""
    from sglang.srt import runtime_context

    keys, other = page_hashes(), page_hashes()
    version = {"now": "step-100"}
    monkeypatch.setattr(runtime_context, "get_serving", lambda: argparse.Namespace(weight_version=version["now"]))
    pool = host_pool()
    writer, reader = backends(pool), backends(pool)
    assert writer.batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert reader.batch_exists(keys) == PAGES
    version["now"] = "step-200"  # update_weights_from_distributed(..., weight_version="step-200")
    assert reader.batch_exists(keys) == 0
    assert reader.batch_get_v1(keys, pool.alloc(PAGES * PAGE)) == [False] * PAGES
    assert writer.batch_set_v1(other, pool.alloc(PAGES * PAGE)) == [False] * PAGES
    assert writer.batch_set(other[:1], [pool.get_dummy_flat_data_page()]) is False
    fresh = backends(pool)  # an engine started with the new weights keys them apart
    assert fresh.batch_exists(keys) == 0 and fresh.batch_set_v1(other, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    version["now"] = "step-100"  # (a version moved back is not the weights the pages were written with)
    assert reader.batch_exists(keys) == 0


def test_pages_are_neither_read_nor_written_once_sglang_flushes_its_cache(backends: Make) -> None:
    """A weight update flushes SGLang's cache (unless told not to) but moves the weight
    version only where the caller names one, which SGLang's default does not: the backend had
    gone on loading the old weights' pages and storing the new weights' KV under their keys.
    Every flush clears the host pool (alone, or through the group of pools it anchors); and
    SGLang's ``/clear_hicache_storage_backend`` had been logged and answered as done."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry

    keys = page_hashes()
    for flush in ("pool", "group", "clear"):
        pool = host_pool()
        writer, reader = backends(pool), backends(pool)
        assert writer.batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
        assert reader.batch_exists(keys) == PAGES
        if flush == "pool":
            pool.clear()  # UnifiedRadixCache.reset, from Scheduler.flush_cache
        elif flush == "group":
            HostPoolGroup([PoolEntry(PoolName.KV, pool, None, lambda i: i, is_primary_index_anchor=True)]).clear()
        else:
            writer.clear()
            reader.clear()
        assert reader.batch_exists(keys) == 0, flush
        assert reader.batch_get_v1(keys, pool.alloc(PAGES * PAGE)) == [False] * PAGES, flush
        assert writer.batch_set_v1(page_hashes(), pool.alloc(PAGES * PAGE)) == [False] * PAGES, flush
        assert writer.batch_set(keys[:1], [pool.get_dummy_flat_data_page()]) is False
        assert backends(host_pool()).batch_exists(keys) == PAGES  # the pool keeps them: an engine started later


def adapter_dir(path: Any, fill: bytes) -> str:
    """A PEFT LoRA adapter directory (as a pod mounts it) whose weights are ``fill``."""
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(fill * 4096)
    return str(path)


LORA_EXTRA = {"lora_no_extra_key": True}


def test_lora_adapters_at_one_path_with_other_weights_are_keyed_apart(backends: Make, monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Any) -> None:
    """SGLang names a --lora-paths adapter by a hash of its name and path alone, which seeds
    its requests' page hashes: two deployments with other adapter bytes under one path had
    shared those pages' keys. The start adapters' files go into the fingerprint."""
    support = adapter_dir(tmp_path / "support", b"\x01")

    def running(*flags: str) -> None:
        serving(monkeypatch, "--model-path", "itest/sglang", *flags)

    pool = host_pool()
    keys = page_hashes()
    running("--enable-lora", "--lora-paths", f"support={support}")
    assert backends(pool, extra=LORA_EXTRA).batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool, extra=LORA_EXTRA).batch_exists(keys) == PAGES  # the same adapters: the same keys
    adapter_dir(tmp_path / "support", b"\x02")  # another pod: other weights under the same path
    assert backends(pool, extra=LORA_EXTRA).batch_exists(keys) == 0
    adapter_dir(tmp_path / "support", b"\x01")
    running()  # the same model without LoRA, whose requests may set any extra_key (an adapter's id too)
    assert backends(pool).batch_exists(keys) == 0
    plain = page_hashes()
    assert backends(pool).batch_set_v1(plain, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    running("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj")  # adapters loaded later
    assert backends(pool, extra=LORA_EXTRA).batch_exists(plain) == 0


def test_lora_that_cannot_be_keyed_safely_is_refused(sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Any) -> None:
    """With LoRA on, a request whose extra_key ends with an adapter's id hashes as that
    adapter's requests (SGLang joins the strings), and the backend sees no request: LoRA
    needs ``lora_no_extra_key``; and an adapter whose files kvpool cannot find is refused."""
    pool = host_pool()
    support = adapter_dir(tmp_path / "support", b"\x01")
    extra = {**EXTRA, "socket_path": sidecar.socket_path}
    for flags in (["--enable-lora", "--lora-paths", f"support={support}"], ["--lora-paths", support],
                  ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj"]):
        serving(monkeypatch, "--model-path", "itest/sglang", *flags)
        with pytest.raises(SGLangConfigError, match="lora_no_extra_key"):
            attach(pool, storage_config(pool, json.dumps(extra)))
    serving(monkeypatch, "--model-path", "itest/sglang", "--lora-paths", f"support={tmp_path / 'missing'}")
    with pytest.raises(SGLangConfigError, match="no files"):
        attach(pool, storage_config(pool, json.dumps({**extra, **LORA_EXTRA})))


def test_lora_paths_that_sglang_ignores_are_not_refused(sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Any) -> None:
    """``enable_lora`` false (SGLang's Python API, or its dLLM mode) ignores ``--lora-paths``:
    no LoRA, so nothing to refuse (it had asked for ``lora_no_extra_key`` all the same)."""
    from sglang.srt import runtime_context

    pool = host_pool()
    serving(monkeypatch, "--model-path", "itest/sglang", "--lora-paths", adapter_dir(tmp_path / "a", b"\x01"))
    args = runtime_context.get_server_args()
    args.enable_lora = False
    attach(pool, storage_config(pool, json.dumps({**EXTRA, "socket_path": sidecar.socket_path})))


def test_unknown_settings_and_extra_host_pools_are_refused(sidecar: SidecarProcess) -> None:
    pool = host_pool()
    bad = json.dumps({**EXTRA, "socket_path": sidecar.socket_path, "sockt_path": "/typo"})
    with pytest.raises(SGLangConfigError, match="sockt_path"):
        attach(pool, storage_config(pool, bad))
    good = json.dumps({**EXTRA, "socket_path": sidecar.socket_path})
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(pool, good), pool)
    try:
        backend.register_mem_pool_host(pool)
        backend.register_mem_host_pool_v2(pool, "kv")
        backend.register_mem_host_pool_v2(host_pool(), "mamba")
        with pytest.raises(SGLangConfigError, match="mamba"):
            backend.on_host_pools_registered()
    finally:
        backend.close()


def test_a_hub_model_is_keyed_by_the_snapshot_sglang_downloaded(backends: Make, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    """SGLang downloads a hub name into ``--download-dir`` where one is given: the backend had
    looked for its snapshot in the default hub cache only, found none, and keyed the name
    alone, so engines holding two commits of ``acme/chat`` shared every page. A hub name
    whose snapshot is nowhere to be found is refused unless ``model_id`` names its weights."""
    node_a = hub_snapshot(tmp_path / "node-a", "acme/chat", "a" * 40, b"A")
    node_b = hub_snapshot(tmp_path / "node-b", "acme/chat", "b" * 40, b"B")
    pool = host_pool()
    keys = page_hashes()
    serving(monkeypatch, "--model-path", "acme/chat", "--download-dir", node_a)
    assert backends(pool).batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool).batch_exists(keys) == PAGES  # the same commit: the same keys
    serving(monkeypatch, "--model-path", "acme/chat", "--download-dir", node_b)
    assert backends(pool).batch_exists(keys) == 0
    serving(monkeypatch, "--model-path", "acme/chat")  # (nor is it in the node's default hub cache)
    with pytest.raises(SGLangConfigError, match="model_id"):
        backends(pool)
    assert backends(pool, extra={"model_id": "acme/chat@a"}).batch_exists(keys) == 0


def test_pages_of_packed_draft_layers_are_keyed_by_the_draft_model(backends: Make, monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """An EAGLE or MTP draft's KV is packed into the target's host pages (``layer_num`` past
    ``target_layer_num``): two engines of one target with other drafts had shared those pages.
    A draft whose files cannot be found is refused unless ``model_id`` names the weights."""
    pool = host_pool(draft=True)
    assert pool.layer_num > pool.target_layer_num
    keys = page_hashes()

    def drafting(path: str) -> None:
        serving(monkeypatch, "--model-path", "itest/sglang", "--speculative-algorithm", "EAGLE",
                "--speculative-draft-model-path", path)

    drafting(model_dir(tmp_path / "draft-a", b"A"))
    assert backends(pool).batch_set_v1(keys, pool.alloc(PAGES * PAGE)) == [True] * PAGES
    assert backends(pool).batch_exists(keys) == PAGES  # the same draft: the same keys
    drafting(model_dir(tmp_path / "draft-b", b"B"))
    assert backends(pool).batch_exists(keys) == 0
    drafting("acme/eagle-draft")  # a hub name no cache here holds
    with pytest.raises(SGLangConfigError, match="draft"):
        backends(pool)
    assert backends(pool, extra={"model_id": "acme/chat+eagle-7"}).batch_exists(keys) == 0


def test_a_put_ends_by_one_deadline_and_leaves_nothing_allocated(backends: Make, sidecar: SidecarProcess,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A put had waited ``timeout_s`` for its ALLOCs, then a fresh ``timeout_s`` for its COMMITs
    (19.5 s with ``timeout_s`` 10), after a reconnect's handshake of up to ``timeout_s`` more:
    longer than the 10 s SGLang's flush waits for a backup. Here the handshake and the copy
    take a quarter of a second each (on a clock the test holds), and the sidecar stops before
    the COMMIT: every wait of the put ends by the deadline ``timeout_s`` after the put began,
    and the sidecar keeps no room."""
    from kvpool_client.engines import sglang as backend_module

    timeout_s = 1.5
    pool = host_pool()
    b = backends(pool, extra={"timeout_s": timeout_s})
    began = time.monotonic()
    now = [began]
    clock = SimpleNamespace(monotonic=lambda: now[0])
    stalled = threading.Event()
    waits: list[tuple[float | None, float | None]] = []
    connect, write, recv = b._writes._connect, PoolClient._write, PoolClient._recv  # noqa: SLF001

    def slow_handshake() -> PoolClient:
        client = connect()
        waits.clear()  # (the HELLO's: the put's waits come next)
        now[0] += 0.25
        return client

    def copy_then_stall(self: PoolClient, *args: Any) -> Any:
        out = write(self, *args)
        if not stalled.is_set():
            stalled.set()
            now[0] += 0.25
            os.kill(sidecar.pid, signal.SIGSTOP)  # the COMMIT is never answered
        return out

    def timed(self: PoolClient, rid: int, deadline: float | None = None, check: Any = None) -> Any:
        waits.append((deadline, self._cap))  # noqa: SLF001 - the task's deadline
        return recv(self, rid, deadline, check)

    with monkeypatch.context() as m:
        for module in (client_module, backend_module):
            m.setattr(module, "time", clock)
        m.setattr(b._writes, "_connect", slow_handshake)  # noqa: SLF001
        m.setattr(PoolClient, "_write", copy_then_stall)
        m.setattr(PoolClient, "_recv", timed)
        try:
            assert b.batch_set_v1(page_hashes(), pool.alloc(PAGES * PAGE)) == [False] * PAGES
        finally:
            os.kill(sidecar.pid, signal.SIGCONT)
    assert stalled.is_set() and len(waits) >= 2  # the ALLOC's, the COMMIT's
    cap = waits[0][1]
    assert cap == pytest.approx(began + timeout_s, abs=1e-6) and waits == [(cap, cap)] * len(waits)
    with PoolClient(sidecar.socket_path) as c:  # the room went back with the connection, or was committed
        wait_until(lambda: (c.stats()["pending_writes"], c.stats()["lapsed_writes"]) == (0, 0), "no room held")


def test_a_launch_whose_backups_name_no_prefix_is_warned_of(sidecar: SidecarProcess, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Without ``hicache_storage_pass_prefix_keys`` SGLang passes no prefix with a backup, and
    the pool stores every page unchained: said once, at attach."""
    pool = host_pool()
    extra = {**EXTRA, "socket_path": sidecar.socket_path}
    for passed, warned in ((None, True), (False, True), (True, False)):
        launch = {**extra, **({} if passed is None else {"hicache_storage_pass_prefix_keys": passed})}
        serving(monkeypatch, "--model-path", "itest/sglang", "--hicache-storage-backend", "dynamic",
                "--hicache-storage-backend-extra-config", json.dumps(launch))
        caplog.clear()
        attach(pool, storage_config(pool, json.dumps(launch))).close()
        said = [r for r in caplog.records if "hicache_storage_pass_prefix_keys" in r.getMessage()]
        assert len(said) == (1 if warned else 0), passed
