"""One model path may hold any fine-tune (a ``/model`` mount): where no ``model_id`` vouches
for the weights, a local model directory keys by its files, so two fine-tunes served from one
path never read each other's KV."""

from __future__ import annotations

import os
from pathlib import Path

from kvpool_client.engines.sglang_keys import StorageSettings
from kvpool_client.engines.weights import SMALL_FILE, local_weights_identity
from tests.unit.test_sglang_keys import StorageConfig, key


def weights(path: Path, data: bytes, mtime_ns: int = 1_700_000_000_000_000_000, config: bytes = b"{}") -> Path:
    """A model directory whose weight file (large: counted by size and time) holds ``data``."""
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
    weights(d, b"medical fine-tune")  # another fine-tune in its place: another size
    assert local_weights_identity(str(d)) != first
    weights(d, b"legal fine-tune", mtime_ns=1_800_000_000_000_000_000)  # same size, written at another time
    assert local_weights_identity(str(d)) != first
    weights(d, b"legal fine-tune")
    assert local_weights_identity(str(d)) == first
    weights(d, b"legal fine-tune", config=b'{"rope_theta": 1e6}')  # a small file counts by its bytes
    assert local_weights_identity(str(d)) != first
    weights(d, b"legal fine-tune")  # written again, byte for byte: the same weights
    assert local_weights_identity(str(d)) == first


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
