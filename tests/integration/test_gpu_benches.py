"""The GPU check's benchmarks run their whole logic on the CPU (no DMA), so a GPU machine's
one short lease is never spent on a script that cannot work: each restores what it stored,
bit for bit, and says so in its JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool_bench import gpu_restore, gpu_ttft  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.torch]


def test_the_restore_bench_checks_every_restore_at_each_thread_count(tmp_path: Path) -> None:
    out = tmp_path / "restore.json"
    assert gpu_restore.main(["--device", "cpu", "--total-mib", "48", "--block-mib", "8", "--threads", "1,3",
                             "--reps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["ok"] and r["total_bytes"] == 48 << 20 and [t["threads"] for t in r["threads"]] == [1, 3]
    assert all(t["in_place_ok"] and t["staged_ok"] and t["in_place_ms"] > 0 for t in r["threads"])
    assert r["h2d_gbps"] > 0 and r["memcpy_gbps"] > 0 and r["one_round"]["staged_ms"] > 0
    store = r["store"]  # stored from the "device" in place and staged, each read back and compared
    assert store["in_place_ok"] and store["staged_ok"] and store["in_place_ms"] > 0 and store["d2h_gbps"] > 0


def test_the_restore_bench_refuses_arguments_it_cannot_run() -> None:
    with pytest.raises(SystemExit):
        gpu_restore.main(["--device", "cpu", "--threads", "0"])


def test_the_ttft_bench_restores_bit_identical_prefixes_and_frees_each(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "ttft.json"
    assert gpu_ttft.main(["--device", "cpu", "--tiny", "--reps", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [x["prefix_tokens"] for x in r["results"]] == [64, 128]
    for x in r["results"]:
        blocks = x["prefix_tokens"] // r["block_tokens"]
        assert x["bit_identical"] and x["reused_tokens"] == x["prefix_tokens"]
        assert x["blocks_stored"] == blocks and x["blocks_removed_after"] == blocks
