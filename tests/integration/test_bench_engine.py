"""``kvpool bench engine`` on tiny settings: its JSON's structure and internal consistency.

No timing is judged; the counts are, and they must agree with each other.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.slow]

REQUESTS = 24


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # five conversations whose turns grow by one block: every later turn reuses the earlier
    # ones, on its own instance and (round-robin) on the other one
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    lines = []
    for i in range(REQUESTS):
        conv, turn = i % 5, i // 5
        ids = [1000 * conv + j for j in range(turn + 2)]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(ids) - 100, "output_length": 4,
                                 "hash_ids": ids}))
    trace.write_text("\n".join(lines) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvpool_sidecar.cli", "bench", "engine", "--json", "--trace", str(trace),
         "--limit", str(REQUESTS), "--instances", "2", "--tokens-per-block", "8", "--max-blocks", "6",
         "--capacity-fraction", "1.0", "--check-every", "1", "--layers", "2", "--hidden", "64", "--heads", "4",
         "--kv-heads", "2", "--intermediate", "128"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed: dict[str, Any] = json.loads(out.stdout)
    return parsed


def test_structure(result: dict[str, Any]) -> None:
    assert result["bench"] == "engine"
    assert set(result["modes"]) == {"no_reuse", "private", "pool"}
    assert set(result["claims"]) == {"throughput_+30%", "ttft_-25%", "memory_for_equal_hit_rate_-40%",
                                     "zero_precision_loss"}
    for mode in result["modes"].values():
        for key in ("ttft_p50_ms", "ttft_p99_ms", "requests_per_s", "prompt_tokens_per_s", "hit_rate"):
            assert isinstance(mode[key], float) and math.isfinite(mode[key]), key
        assert mode["ttft_p99_ms"] >= mode["ttft_p50_ms"] > 0
    for claim in result["claims"].values():
        assert isinstance(claim["holds" if "holds" in claim else "holds_vs_private"], bool)


def test_counts_agree(result: dict[str, Any]) -> None:
    modes = result["modes"]
    a, b, c = modes["no_reuse"], modes["private"], modes["pool"]
    for m in (a, b, c):
        assert m["requests"] == REQUESTS
        assert m["prompt_tokens"] == a["prompt_tokens"]
        assert m["reused_tokens"] + m["computed_tokens"] == m["prompt_tokens"]
        assert m["reused_tokens"] == 8 * m["hit_blocks"]
        assert m["usable_blocks"] == a["usable_blocks"]
        assert m["hit_rate"] == pytest.approx(m["hit_blocks"] / m["usable_blocks"])
    assert a["reused_tokens"] == 0 and a["hit_rate"] == 0.0
    assert 0 < b["reused_tokens"] and 0 < c["reused_tokens"]
    assert c["computed_tokens"] <= a["computed_tokens"] and b["computed_tokens"] < a["computed_tokens"]
    # with room for every block, the pool holds all an instance's own cache would, and more
    assert c["hit_rate"] >= b["hit_rate"]
    assert result["ratios"]["pool_vs_no_reuse_computed_tokens"] == pytest.approx(
        c["computed_tokens"] / a["computed_tokens"])


def test_the_replay_reproduces_the_private_caches(result: dict[str, Any]) -> None:
    mem = result["memory"]
    assert mem["private_replay_hit_rate_at_total"] == pytest.approx(result["modes"]["private"]["hit_rate"])
    assert mem["private_hit_rate_unlimited"] >= mem["private_replay_hit_rate_at_total"]
    need = mem["private_blocks_for_pool_hit_rate"]
    if need is None:  # private caches cannot reach the pool's hit rate at any size
        assert mem["private_hit_rate_unlimited"] < result["modes"]["pool"]["hit_rate"]
    else:
        assert mem["pool_vs_private_memory_for_pool_hit_rate"] == pytest.approx(mem["total_blocks"] / need)


def test_zero_precision_loss(result: dict[str, Any]) -> None:
    modes = result["modes"]
    assert modes["private"]["precision_checks"] > 0 and modes["pool"]["precision_checks"] > 0
    for m in ("private", "pool"):
        assert modes[m]["precision_mismatches"] == 0
        assert modes[m]["logits_differ_from_no_reuse"] == 0
        assert modes[m]["first_token_differs_from_no_reuse"] == 0
    assert result["claims"]["zero_precision_loss"] == {"mismatches": 0, "holds": True}
