"""One model path may hold any fine-tune (a ``/model`` mount): where no ``model_id`` vouches
for the weights, a local model directory keys by its files, so two fine-tunes served from one
path never read each other's KV."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool_client.engines.sglang_keys import SGLangConfigError, ShardIdentity, StorageSettings
from kvpool_client.engines.weights import (
    SMALL_FILE,
    AdapterIdentities,
    load_format_tag,
    local_weights_identity,
    weights_identity,
)
from tests.unit.test_sglang_keys import StorageConfig, key


def weights(path: Path, data: bytes, mtime_ns: int = 1_700_000_000_000_000_000, config: bytes = b"{}") -> Path:
    """A model directory whose weight file (large: counted by pieces of its bytes) begins with ``data``."""
    path.mkdir(exist_ok=True)
    big = path / "model.safetensors"
    with open(big, "wb") as f:
        f.write(data)
        f.truncate(SMALL_FILE + len(data))  # sparse: large without taking the disk
    os.utime(big, ns=(mtime_ns, mtime_ns))
    (path / "config.json").write_bytes(config)
    return path


def test_the_identity_follows_the_weight_files_and_nothing_else(tmp_path: Path) -> None:
    d = weights(tmp_path / "model", b"legal fine-tune")
    first = local_weights_identity(str(d))
    assert first and first == local_weights_identity(str(d))
    (d / "notes.md").write_text("not a weight file")
    assert local_weights_identity(str(d)) == first
    weights(d, b"medical fine-tune")  # another fine-tune in its place: other bytes
    assert local_weights_identity(str(d)) != first
    weights(d, b"legal fine-tune", mtime_ns=1_800_000_000_000_000_000)  # the same, copied at another time
    assert local_weights_identity(str(d)) == first  # (another node's copy, or a pod's at its start)
    copy = weights(tmp_path / "elsewhere", b"legal fine-tune")
    assert local_weights_identity(str(copy)) == first
    weights(d, b"legal fine-tune", config=b'{"rope_theta": 1e6}')  # a small file counts by its bytes
    assert local_weights_identity(str(d)) != first
    weights(d, b"legal fine-tune")  # written again, byte for byte: the same weights
    assert local_weights_identity(str(d)) == first


def test_fine_tunes_alike_but_in_a_few_pieces_of_their_weights_are_told_apart(tmp_path: Path) -> None:
    """Same sizes, same configs, same times (a reproducible image build): only the bytes of
    the weights differ, here in one 64 KiB stretch of a 64 MiB file."""
    base = bytearray(64 << 20)
    a = tmp_path / "a"
    b = tmp_path / "b"
    for d, tweak in ((a, 0), (b, 1)):
        d.mkdir()
        body = bytearray(base)
        body[40 << 20 : (40 << 20) + (64 << 10)] = bytes([tweak]) * (64 << 10)
        (d / "model.safetensors").write_bytes(body)
        os.utime(d / "model.safetensors", ns=(1, 1))
    assert local_weights_identity(str(a)) != local_weights_identity(str(b))
    assert local_weights_identity(str(a / "model.safetensors")) != local_weights_identity(str(b / "model.safetensors"))


def test_a_hub_name_or_a_missing_path_has_no_file_identity(tmp_path: Path) -> None:
    assert local_weights_identity("meta-llama/Llama-3.1-8B") == ""
    assert local_weights_identity(str(tmp_path / "absent")) == ""
    assert local_weights_identity("") == ""


def test_sglang_pages_of_one_path_key_apart_when_its_weights_change_unless_model_id_vouches(tmp_path: Path) -> None:
    d = weights(tmp_path / "model", b"legal fine-tune")
    cfg = StorageConfig(model_name=str(d))
    legal = key(cfg=cfg)
    assert legal == key(cfg=cfg)
    weights(d, b"medical fine-tune")
    assert key(cfg=cfg) != legal
    vouched = StorageSettings(model_id="acme/medical-ft-v2")
    before = key(cfg=cfg, s=vouched)
    weights(d, b"legal fine-tune")
    assert key(cfg=cfg, s=vouched) == before  # the operator named the weights: their files do not count


def test_an_adapters_identity_is_pinned_and_a_change_of_its_files_turns_it_off(tmp_path: Path) -> None:
    """An engine keeps the weights it loaded for an adapter id: files rewritten under it
    afterwards (same name, size and modification time here) leave nobody outside the engine
    knowing which weights it runs, so the adapter gets no identity from then on."""
    d = weights(tmp_path / "adapter", b"sql adapter v1")
    known = AdapterIdentities(most=3)
    first = known.pin(1, str(d))
    assert first and first == local_weights_identity(str(d)) and known.pin(1, str(d)) == first
    weights(d, b"sql adapter v2")  # updated in place
    assert known.pin(1, str(d)) is None and known.pin(1, str(d)) is None and known.changed == {1}
    assert known.pin(2, str(d)) == local_weights_identity(str(d)) != first  # a new id loads the new files
    assert known.pin(3, "org/hub-adapter") is None  # no local files, no snapshot here: nothing names its weights
    full = AdapterIdentities(most=1)
    assert full.pin(1, str(d)) and full.pin(2, str(d)) is None  # past ``most`` adapters: none


def test_load_formats_that_do_not_read_the_checkpoints_weights_as_they_are_are_named() -> None:
    assert [load_format_tag(f) for f in ("auto", "safetensors", "PT", None, "")] == [""] * 5
    assert [load_format_tag(f) for f in ("dummy", "bitsandbytes", "gguf", "made-up")] == \
        ["dummy", "bitsandbytes", "gguf", "made-up"]


def hub_snapshot(cache: Path, repo: str, commit: str, data: bytes) -> None:
    """A model downloaded from the hub at ``commit``, where the hub library keeps it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "snapshots").mkdir(parents=True, exist_ok=True)
    weights(root / "snapshots" / commit, data)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)


def test_a_hub_name_keys_by_the_files_of_the_snapshot_this_node_downloaded(tmp_path: Path) -> None:
    """Nodes that downloaded ``org/model`` before and after its repository changed hold other
    weights under one name (and no revision): the snapshot in the local cache tells them apart."""
    cache = tmp_path / "hub"
    hub_snapshot(cache, "org/model", "a" * 40, b"weights of March")
    march = weights_identity("org/model", cache_dir=str(cache))
    assert march == "hub:" + "a" * 40
    assert weights_identity("org/model", "a" * 40, cache_dir=str(cache)) == march  # (a pinned revision)
    # files of the commit another process of the engine fetched later (a tokenizer) change nothing
    (cache / "models--org--model" / "snapshots" / ("a" * 40) / "tokenizer.json").write_text("{}")
    assert weights_identity("org/model", cache_dir=str(cache)) == march
    hub_snapshot(cache, "org/model", "b" * 40, b"weights of April")  # another node, downloaded later
    april = weights_identity("org/model", cache_dir=str(cache))
    assert april and april != march
    assert weights_identity("org/other", cache_dir=str(cache)) == ""  # nothing downloaded: nothing to read
    assert weights_identity("not a hub name!", cache_dir=str(cache)) == ""
    assert weights_identity("org/model", "../../etc", cache_dir=str(cache)) == ""
    # the hub library lists the commit's every file, of which vLLM downloaded a few (its
    # snapshot_download without patterns then raised, and the name had keyed alone)
    tree = pytest.importorskip("huggingface_hub._tree_cache")  # (where this hub library keeps its listings)
    listing = {p: tree.TreeCacheEntry(size=1, blob_id="0" * 40) for p in ("config.json", "original/consolidated.pth")}
    tree.write_tree_cache(str(cache / "models--org--model"), "b" * 40, listing)
    assert weights_identity("org/model", cache_dir=str(cache)) == april


def test_sglang_keys_a_hub_model_by_its_snapshot_in_the_download_dir_or_refuses_it(tmp_path: Path) -> None:
    """SGLang downloads a hub name into its ``--download-dir``: looked for in the default hub
    cache alone, the name had been keyed by itself, and nodes at two commits shared keys."""
    hub_snapshot(tmp_path / "node-a", "org/model", "a" * 40, b"weights of March")
    hub_snapshot(tmp_path / "node-b", "org/model", "b" * 40, b"weights of April")

    def files(cache: str, s: StorageSettings = StorageSettings()) -> str:
        return ShardIdentity.from_storage_config(StorageConfig(model_name="chat"), s, model_path="org/model",
                                                 cache_dir=str(tmp_path / cache)).files

    assert (files("node-a"), files("node-b")) == ("hub:" + "a" * 40, "hub:" + "b" * 40)
    with pytest.raises(SGLangConfigError, match="model_id"):  # downloaded from elsewhere: nothing names it
        files("empty")
    assert files("empty", StorageSettings(model_id="org/model@march")) == ""  # the operator names the weights


def test_a_ref_that_is_not_a_plain_file_names_no_commit(tmp_path: Path) -> None:
    """A FIFO where the hub library keeps a ref had hung the engine's start on its open."""
    cache = tmp_path / "hub"
    hub_snapshot(cache, "org/model", "a" * 40, b"weights")
    ref = cache / "models--org--model" / "refs" / "main"
    ref.unlink()
    os.mkfifo(ref)
    assert weights_identity("org/model", cache_dir=str(cache)) == ""


def test_an_adapter_named_on_the_hub_uses_no_pool_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA adapter given as a hub name: the engine downloads the newest commit when it
    first loads it, after the scheduler keyed its first requests, so nodes at two commits
    (or one whose download moved it) had keyed other weights alike by the name."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    hub_snapshot(tmp_path, "org/sql-lora", "1" * 40, b"adapter weights")
    known = AdapterIdentities()
    assert known.pin(1, "org/sql-lora") is None and known.pin(1, "org/sql-lora") is None
    assert known.changed == set()


def test_a_model_directorys_own_code_is_part_of_its_identity(tmp_path: Path) -> None:
    """``trust_remote_code`` runs the directory's ``modeling_*.py``: other code, other KV."""
    d = weights(tmp_path / "model", b"one fine-tune")
    first = local_weights_identity(str(d))
    (d / "modeling_custom.py").write_text("def rope(x): return x\n")
    with_code = local_weights_identity(str(d))
    assert with_code != first
    (d / "modeling_custom.py").write_text("def rope(x): return 2 * x\n")
    assert local_weights_identity(str(d)) not in (first, with_code)
