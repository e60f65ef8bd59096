"""The SGLang backend's keys and settings (no SGLang needed): what a page's key depends on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_client.engines.hostpages import HostPagesError, copy_runs
from kvpool_client.engines.sglang_keys import (
    PageFormat,
    SGLangConfigError,
    ShardIdentity,
    StorageSettings,
    adapters_identity,
    kv_values,
    page_fingerprint,
    page_keys,
    start_adapters,
)
from kvpool_client.errors import KeyFormatError
from kvpool_client.keys import RAW_KEY_BYTES, key_from_engine_hash

HASH = "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe"  # an SGLang page hash


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` the backend reads."""

    model_name: str | None = "org/model"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    should_split_heads: bool = False
    dcp_size: int = 1


class MHATokenToKVPoolHost:
    """The attributes of an SGLang host pool that describe its pages."""

    def __init__(self, **kw: Any) -> None:
        self.layout, self.dtype, self.page_size = "page_first", "torch.bfloat16", 64
        self.layer_num, self.start_layer, self.end_layer, self.head_num, self.head_dim, self.v_head_dim = 32, 0, 32, 8, 128, 128
        self.__dict__.update(kw)


SETTINGS = StorageSettings()
PIECES = (4 << 20, 4 << 20)


def fingerprint(cfg: StorageConfig | None = None, pool: Any = None, s: StorageSettings = SETTINGS,
                interface: str = "v1", pieces: tuple[int, ...] = PIECES, version: str = "0.5.23",
                weights: str = "", kv: str = "", adapters: str = "") -> Any:
    shard = ShardIdentity.from_storage_config(cfg or StorageConfig(), s)
    return page_fingerprint(shard, PageFormat.of_pool(pool or MHATokenToKVPoolHost(), interface, pieces), s, version,
                            weights, kv, adapters)


def key(**kw: Any) -> bytes:
    raw: bytes = page_keys(fingerprint(**kw), [HASH])[0].raw
    return raw


BASE = key()

#: One change to what SGLang says about the shard, the page format or the settings each.
CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("model", {"cfg": StorageConfig(model_name="org/other")}),
    ("tp-rank", {"cfg": StorageConfig(tp_rank=1, tp_size=2)}),
    ("tp-size", {"cfg": StorageConfig(tp_size=2)}),
    ("pp-rank", {"cfg": StorageConfig(pp_rank=1, pp_size=2)}),
    ("cp-rank", {"cfg": StorageConfig(attn_cp_rank=1, attn_cp_size=2)}),
    ("mla", {"cfg": StorageConfig(is_mla_model=True)}),
    ("dtype", {"pool": MHATokenToKVPoolHost(dtype="torch.float16")}),
    ("layout", {"pool": MHATokenToKVPoolHost(layout="page_first_direct")}),
    ("page-size", {"pool": MHATokenToKVPoolHost(page_size=32)}),
    ("heads", {"pool": MHATokenToKVPoolHost(head_num=4)}),
    ("layers", {"pool": MHATokenToKVPoolHost(start_layer=32, end_layer=64)}),
    ("pool-class", {"pool": type("MHATokenToKVPoolHostMXFP8", (MHATokenToKVPoolHost,), {})()}),
    ("pieces", {"pieces": (8 << 20,)}),
    ("interface", {"interface": "flat"}),
    ("namespace", {"s": StorageSettings(namespace="team-b")}),
    ("model-id", {"s": StorageSettings(model_id="org/model-mirror")}),
    ("revision", {"s": StorageSettings(revision="r2")}),
    ("sglang-version", {"version": "0.5.24"}),
    ("quantized-weights", {"weights": "quantization='fp8';json_model_override_args='{}';revision=None"}),
    ("kv-values", {"kv": "kv_cache_dtype=fp8_e4m3;fp8=torch.float8_e4m3fn"}),
    ("lora-adapters", {"adapters": "0123456789abcdef0123456789abcdef"}),
]


@pytest.mark.parametrize(("what", "change"), CHANGES, ids=[w for w, _ in CHANGES])
def test_every_part_of_a_pages_identity_changes_its_key(what: str, change: dict[str, Any]) -> None:
    assert key(**change) != BASE


#: The key of HASH under the base fingerprint, as first released: a change loses every page stored.
GOLDEN = ("fd6941b43f393b6218a70a3f55b567a2cd6ccb6d5c3ea453"
          "00bf3a3dffd15a830a08a39b30a37a021c961efa14ca8759")


def test_keys_are_stable_across_releases() -> None:
    assert len(BASE) == RAW_KEY_BYTES
    assert BASE.hex() == GOLDEN


def test_a_key_is_the_engine_hash_under_the_fingerprint() -> None:
    fp = fingerprint()
    assert page_keys(fp, [HASH])[0] == key_from_engine_hash(fp, "sglang-page", HASH.encode())
    assert page_keys(fp, [HASH])[0].fingerprint == fp.digest()


def test_mla_ranks_share_keys_but_pipeline_stages_do_not() -> None:
    mla = StorageConfig(is_mla_model=True, tp_size=4)
    assert key(cfg=mla) == key(cfg=dataclasses.replace(mla, tp_rank=3)) == key(cfg=dataclasses.replace(mla, tp_size=8))
    assert key(cfg=mla) != key(cfg=dataclasses.replace(mla, pp_size=2, pp_rank=1))


@settings(max_examples=50)
@given(a=st.text(min_size=16, max_size=80), b=st.text(min_size=16, max_size=80))
def test_distinct_page_hashes_get_distinct_keys(a: str, b: str) -> None:
    ka, kb = page_keys(fingerprint(), [a, b])
    assert (ka == kb) == (a == b)


@pytest.mark.parametrize("bad", ["short", b"baed642339816affb3fe8719792d0e4c", 12345])
def test_hashes_that_are_not_long_strings_are_refused(bad: Any) -> None:
    with pytest.raises(KeyFormatError):
        page_keys(fingerprint(), [bad])


def test_settings_come_from_the_extra_config_then_the_environment() -> None:
    env = {"KVPOOL_SOCKET_PATH": "/env.sock", "KVPOOL_TENANT": "t-env", "KVPOOL_NAMESPACE": "ns-env"}
    s = StorageSettings.from_extra(None, env)
    assert (s.socket_path, s.tenant, s.namespace) == ("/env.sock", "t-env", "ns-env")
    s = StorageSettings.from_extra({"socket_path": "/x.sock", "tenant": "t", "namespace": "", "timeout_s": 3,
                                    "backend_name": "kvpool", "module_path": "m", "class_name": "C",
                                    "interface_v1": 1}, env)
    assert (s.socket_path, s.tenant, s.namespace, s.timeout_s) == ("/x.sock", "t", "", 3.0)
    assert StorageSettings.from_extra({}, {}).socket_path == "/run/kvpool/kvpool.sock"


@pytest.mark.parametrize("extra", [{"sockt_path": "/typo"}, {"timeout_s": "fast"}, {"timeout_s": 0},
                                   {"lookup_timeout_s": True}, {"tenant": 7}, {"max_staging_bytes": -1},
                                   {"lora_no_extra_key": "yes"}, {"lora_no_extra_key": 1}])
def test_bad_settings_are_refused_by_name(extra: dict[str, Any]) -> None:
    with pytest.raises(SGLangConfigError):
        StorageSettings.from_extra(extra, {})


@pytest.mark.parametrize("name", ["timeout_s", "lookup_timeout_s"])
@pytest.mark.parametrize("seconds", [float("inf"), 1e12, 1e300, float("nan"), -1, 0, 5.5])
def test_timeouts_that_are_no_seconds_sglang_can_wait_for_are_refused(name: str, seconds: float) -> None:
    """Infinity or 1e300 had failed every call with an OverflowError (no KVPoolError), and 1e9
    hung a prefetch thread on a stuck sidecar; past 5 s a backup of several puts outlasts the
    10 s SGLang's flush waits for it."""
    with pytest.raises(SGLangConfigError, match=name):
        StorageSettings.from_extra({name: seconds}, {})
    given: dict[str, Any] = {name: seconds}
    with pytest.raises(SGLangConfigError, match=name):
        StorageSettings(**given)


@pytest.mark.parametrize("size", [float("inf"), float("nan"), 1.5, -1, 0])
def test_a_staging_size_that_is_no_whole_number_of_bytes_is_refused(size: float) -> None:
    """Infinity had raised a bare OverflowError, and 1.5 was cut to one byte."""
    with pytest.raises(SGLangConfigError, match="max_staging_bytes"):
        StorageSettings.from_extra({"max_staging_bytes": size}, {})


def test_timeouts_and_staging_within_bounds_are_kept() -> None:
    s = StorageSettings.from_extra({"timeout_s": 5, "lookup_timeout_s": 0.25, "max_staging_bytes": 1e9}, {})
    assert (s.timeout_s, s.lookup_timeout_s, s.max_staging_bytes) == (5.0, 0.25, 10**9)
    assert StorageSettings().timeout_s == 4.0  # (within SGLang's wait, however a backup goes)


@pytest.mark.parametrize("cfg", [StorageConfig(model_name=None), StorageConfig(should_split_heads=True),
                                 StorageConfig(dcp_size=2), StorageConfig(tp_rank=2, tp_size=2)],
                         ids=["no-model", "split-heads", "dcp", "rank-out-of-range"])
def test_shards_kvpool_cannot_key_safely_are_refused(cfg: StorageConfig) -> None:
    with pytest.raises(SGLangConfigError):
        ShardIdentity.from_storage_config(cfg, SETTINGS)


def test_a_model_id_stands_in_for_a_missing_model_name() -> None:
    shard = ShardIdentity.from_storage_config(StorageConfig(model_name=None), StorageSettings(model_id="org/m"))
    assert shard.model == "org/m"


def test_a_pool_that_does_not_describe_its_pages_is_refused() -> None:
    with pytest.raises(SGLangConfigError):
        fingerprint(pieces=())
    with pytest.raises(SGLangConfigError):
        fingerprint(pool=MHATokenToKVPoolHost(page_size=0))


@settings(max_examples=100)
@given(data=st.binary(min_size=1, max_size=256), st_cuts=st.data())
def test_copy_runs_moves_the_bytes_between_any_two_splits(data: bytes, st_cuts: st.DataObject) -> None:
    def split(n: int) -> list[tuple[int, int]]:
        cuts = sorted(st_cuts.draw(st.lists(st.integers(0, n), max_size=6)))
        bounds = [0, *cuts, n]
        return [(a, b) for a, b in zip(bounds, bounds[1:])]

    src = [memoryview(data)[a:b] for a, b in split(len(data))]
    out = bytearray(len(data))
    dst = [memoryview(out)[a:b] for a, b in split(len(data))]
    copy_runs(dst, src)
    assert bytes(out) == data


def test_copy_runs_refuses_unequal_sizes() -> None:
    with pytest.raises(HostPagesError):
        copy_runs([memoryview(bytearray(3))], [memoryview(b"ab")])


# ------------------------------------------------------------------ fp8 pages (SGLang stores them as uint8)
FP8_POOL = MHATokenToKVPoolHost(dtype="torch.uint8")


def fp8_key(kv_cache_dtype: str, platform: str = "torch.float8_e4m3fn") -> bytes:
    return key(pool=FP8_POOL, kv=kv_values("torch.uint8", kv_cache_dtype, lambda: platform))


def test_fp8_pages_of_other_formats_or_platforms_are_keyed_apart() -> None:
    """SGLang stores fp8_e4m3 and fp8_e5m2 KV alike as uint8 (byte 0x3c is 1.5 in one, 1.0 in
    the other), and fp8_e4m3 is e4m3fnuz on ROCm MI300: the host pool's dtype said nothing."""
    e4m3 = fp8_key("fp8_e4m3")
    assert e4m3 == fp8_key("fp8_e4m3")
    assert len({e4m3, fp8_key("fp8_e5m2"), fp8_key("fp8_e4m3", "torch.float8_e4m3fnuz"), fp8_key("auto"),
                fp8_key("mxfp8")}) == 5


def test_pages_whose_dtype_says_what_they_hold_keep_their_keys() -> None:
    def unused() -> str:
        raise AssertionError("the platform's fp8 type is read for opaque pages only")

    for dtype in ("torch.bfloat16", "torch.float16", "torch.float32"):
        assert kv_values(dtype, "auto", unused) == kv_values(dtype, None, unused) == ""
    assert key(kv=kv_values("torch.bfloat16", "bf16", unused)) == BASE


@pytest.mark.parametrize("dtype", ["torch.uint8", "torch.float4_e2m1fn_x2", ""])
def test_opaque_pages_without_sglangs_kv_cache_dtype_are_refused(dtype: str) -> None:
    with pytest.raises(SGLangConfigError, match="fp8_e5m2"):
        kv_values(dtype, None, lambda: "torch.float8_e4m3fn")


# ------------------------------------------------------------------ LoRA adapters loaded at start
LORA = StorageSettings(lora_no_extra_key=True)


def adapter(path: Path, data: bytes) -> str:
    path.mkdir(exist_ok=True)
    (path / "adapter_model.safetensors").write_bytes(data)
    (path / "adapter_config.json").write_text('{"r": 8}')
    return str(path)


def test_adapters_at_one_path_with_other_weights_are_keyed_apart(tmp_path: Path) -> None:
    """SGLang's id of a --lora-paths adapter is a hash of its name and path: two deployments
    mounting other adapter bytes under one path made the same page hashes."""
    path = adapter(tmp_path / "support", b"\x01" * 4096)
    first = adapters_identity([("support", path)], LORA)
    assert first == adapters_identity([("support", path)], LORA)
    adapter(tmp_path / "support", b"\x02" * 4096)
    second = adapters_identity([("support", path)], LORA)
    assert second != first
    assert key(adapters=first) != key(adapters=second)
    other = adapter(tmp_path / "billing", b"\x01" * 4096)
    assert adapters_identity([("support", path), ("billing", other)], LORA) not in (first, second)
    assert adapters_identity([("billing", other), ("support", path)], LORA) == \
        adapters_identity([("support", path), ("billing", other)], LORA)  # (in any order)


def test_lora_without_start_adapters_still_keys_apart_from_no_lora() -> None:
    none = adapters_identity([], LORA)
    assert none and key(adapters=none) != BASE


def test_lora_is_refused_unless_no_request_sets_an_extra_key(tmp_path: Path) -> None:
    """A request with no adapter whose extra_key is an adapter's id hashes as that adapter's
    requests do (SGLang joins the strings), and the backend sees no request."""
    with pytest.raises(SGLangConfigError, match="lora_no_extra_key"):
        adapters_identity([("support", adapter(tmp_path / "a", b"x"))], SETTINGS)
    with pytest.raises(SGLangConfigError, match="lora_no_extra_key"):
        adapters_identity([], SETTINGS)
    assert StorageSettings.from_extra({"lora_no_extra_key": True}, {}).lora_no_extra_key


@pytest.mark.parametrize("path", ["/nonexistent/kvpool-adapter", "no-such-org/no-such-adapter-kvpool"])
def test_adapters_whose_files_kvpool_cannot_find_are_refused(path: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # (an empty hub cache)
    with pytest.raises(SGLangConfigError, match="no files"):
        adapters_identity([("a", path)], LORA)


def test_start_adapters_read_every_form_sglang_takes() -> None:
    class LoRARef:
        def __init__(self, lora_name: str, lora_path: str) -> None:
            self.lora_name, self.lora_path, self.lora_id = lora_name, lora_path, "ignored"

    want = [("a", "/p/a"), ("b", "/p/b")]
    assert start_adapters(["b=/p/b", "a=/p/a"]) == want
    assert start_adapters({"a": "/p/a", "b": "/p/b"}) == want
    assert start_adapters([{"lora_name": "a", "lora_path": "/p/a"}, LoRARef("b", "/p/b")]) == want
    assert start_adapters(["/p/x"]) == [("/p/x", "/p/x")]
    assert start_adapters(None) == start_adapters([]) == []
    for bad in ("a=/p/a", [7], [{"lora_name": "a"}], ["a="]):
        with pytest.raises(SGLangConfigError):
            start_adapters(bad)
