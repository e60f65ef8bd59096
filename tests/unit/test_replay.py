"""``kvpool replay``: hand-made traces whose exact hit counts are known, then the README table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpool_bench import replay as R
from kvpool_bench.trace import TRACE_BLOCK_TOKENS, TraceRequest, default_trace_path
from kvpool_sidecar.cli import main as cli_main
from kvpool_sidecar.policy import BlockMeta, Hints, LRUPolicy

Req = list[int] | tuple[str, list[int]]


def write_trace(path: Path, reqs: list[Req], *, partial: bool = False) -> str:
    """One record per request; ``(tenant, ids)`` adds the tenant extension field."""
    with path.open("w") as f:
        for i, r in enumerate(reqs):
            tenant, ids = r if isinstance(r, tuple) else (None, r)
            tokens = len(ids) * TRACE_BLOCK_TOKENS - (100 if partial and ids else 0)
            rec: dict[str, Any] = {"timestamp": i, "input_length": tokens, "output_length": 1, "hash_ids": ids}
            if tenant is not None:
                rec["tenant"] = tenant
            f.write(json.dumps(rec) + "\n")
    return str(path)


def hits(tmp_path: Path, reqs: list[Req], capacity: int, policy: str = "lru", **kw: Any) -> R.PolicyResult:
    opts = R.ReplayOptions(policy=policy, capacity_blocks=capacity, bytes_per_token=1, **kw)
    requests, _ = R.load(write_trace(tmp_path / "t.jsonl", reqs), opts)
    return R.replay_policy(requests, opts)


def report(tmp_path: Path, reqs: list[Req], capacity: int, policy: str = "lru", **kw: Any) -> dict[str, Any]:
    opts = R.ReplayOptions(policy=policy, capacity_blocks=capacity, bytes_per_token=1, **kw)
    requests, distinct = R.load(write_trace(tmp_path / "t.jsonl", reqs), opts)
    return R.run(requests, opts, distinct)


POLICIES = ["lru", "prefix"]


# ------------------------------------------------------------------ counting
@pytest.mark.parametrize("policy", POLICIES)
def test_hits_count_the_unbroken_prefix(tmp_path: Path, policy: str) -> None:
    r = hits(tmp_path, [[1, 2, 3], [1, 2, 3], [1, 2, 4], [5, 2, 3]], capacity=100, policy=policy)
    # 0 + 3 + 2 + 0: blocks 2 and 3 behind the missing 5 do not count.
    assert (r.blocks, r.hits) == (12, 5)
    assert r.tier_hits == {"dram": 5}


def test_a_block_behind_an_evicted_one_is_no_hit(tmp_path: Path) -> None:
    # LRU, 3 blocks: [4] evicts block 1, so the third request misses at once although 2 and 3
    # are still cached; re-inserting 1, 2, 3 cycles the cache and the fourth request hits all three.
    r = hits(tmp_path, [[1, 2, 3], [4], [1, 2, 3], [1, 2, 3]], capacity=3)
    assert (r.blocks, r.hits) == (10, 3)


def test_lru_flushes_and_belady_bypasses(tmp_path: Path) -> None:
    out = report(tmp_path, [[1, 2, 3], [4, 5, 6], [1, 2, 3]], capacity=3)
    assert out["hit_blocks"] == 0 and out["lru_hit_rate"] == 0.0
    assert out["belady_hit_rate"] == pytest.approx(3 / 9)  # 4, 5, 6 are never used again
    assert out["capacity_blocks"] == 3


def test_belady_evicts_the_block_used_furthest_ahead() -> None:
    opts = R.ReplayOptions(bytes_per_token=1)
    trace = [TraceRequest(i, TRACE_BLOCK_TOKENS * len(ids), 1, tuple(ids))
             for i, ids in enumerate([[1], [2], [3], [1], [2], [3], [1]])]
    reqs = R.build_requests(trace, opts)
    # Two slots: 3 is needed after 1 and 2, so it is bypassed; 1, 2, 1 then hit.
    assert R.belady_hits(reqs, 2) == 3
    assert R.belady_hits(reqs, 3) == 4
    assert R.belady_hits(reqs, 0) == 0


def test_partial_tail_is_sized_by_its_tokens(tmp_path: Path) -> None:
    opts = R.ReplayOptions(bytes_per_token=2)
    requests, distinct = R.load(write_trace(tmp_path / "t.jsonl", [[7, 8]], partial=True), opts)
    assert distinct == 2
    assert requests[0].sizes == (2 * TRACE_BLOCK_TOKENS, 2 * (TRACE_BLOCK_TOKENS - 100))


# ------------------------------------------------------------------ instances and routing
SAME = [[1, 2], [1, 2], [1, 2], [1, 2]]


@pytest.mark.parametrize(("private", "routing", "expect"), [
    (False, "round-robin", 6),  # one pool: every request after the first hits both blocks
    (True, "round-robin", 4),   # two private caches: each sees the prefix once cold
    (True, "prefix", 6),        # prefix-aware routing sends all four to the instance that has it
])
def test_instances(tmp_path: Path, private: bool, routing: str, expect: int) -> None:
    r = hits(tmp_path, SAME, capacity=10, instances=2, private=private, routing=routing)
    assert r.hits == expect
    if private and routing == "round-robin":
        assert r.routed == [0, 1, 0, 1]


def test_private_caches_split_the_capacity(tmp_path: Path) -> None:
    # 4 blocks in total: 2 per instance; requests alternate, each instance keeps its own pair.
    reqs: list[Req] = [[1, 2], [3, 4], [1, 2], [3, 4]]
    assert hits(tmp_path, reqs, capacity=4, instances=2, private=True).hits == 4
    # one block each: an instance keeps the head of its chain (the tail would have evicted
    # it and been unreachable), so each second visit hits one block
    assert hits(tmp_path, reqs, capacity=2, instances=2, private=True).hits == 2
    out = report(tmp_path, reqs, capacity=4, instances=2, private=True)
    assert out["belady_hit_rate"] == pytest.approx(0.5) and out["load_imbalance"] == 1.0


def test_random_routing_is_seeded(tmp_path: Path) -> None:
    reqs: list[Req] = [[i % 3] for i in range(30)]
    a = hits(tmp_path, reqs, capacity=4, instances=2, private=True, routing="random", seed=3)
    b = hits(tmp_path, reqs, capacity=4, instances=2, private=True, routing="random", seed=3)
    assert a.routed == b.routed and set(a.routed) == {0, 1}


# ------------------------------------------------------------------ tenants
def test_tenants_do_not_share_unless_allowed(tmp_path: Path) -> None:
    reqs: list[Req] = [("a", [1, 2]), ("b", [1, 2]), ("a", [1, 2])]
    tenants = (R.TenantSpec("a"), R.TenantSpec("b"))
    assert hits(tmp_path, reqs, capacity=10, tenants=tenants).hits == 2
    assert hits(tmp_path, reqs, capacity=10, tenants=tenants, share_tenants=True).hits == 4


@pytest.mark.parametrize("policy", POLICIES)
def test_priority_keeps_the_higher_tenant(tmp_path: Path, policy: str) -> None:
    reqs: list[Req] = [("hi", [1, 2]), ("lo", [3]), ("lo", [4]), ("hi", [1, 2])]
    r = hits(tmp_path, reqs, capacity=3, policy=policy, tenants=(R.TenantSpec("hi", 1), R.TenantSpec("lo", 0)))
    assert r.hits == 2  # [4] evicts the low-priority 3, never 1 or 2
    assert +r.tenant_hits == {"hi": 2}
    same = hits(tmp_path, reqs, capacity=3, policy="lru", tenants=(R.TenantSpec("hi"), R.TenantSpec("lo")))
    assert same.hits == 0  # without priorities LRU evicts block 1 first


@pytest.mark.parametrize("policy", POLICIES)
def test_a_tenant_over_quota_evicts_its_own(tmp_path: Path, policy: str) -> None:
    # Tenant a may hold 2 blocks of the 4: its third block evicts its own, not b's.
    reqs: list[Req] = [("b", [10]), ("a", [1, 2]), ("a", [3]), ("b", [10]), ("a", [3])]
    tenants = (R.TenantSpec("a", quota="2b"), R.TenantSpec("b"))
    r = hits(tmp_path, reqs, capacity=4, policy=policy, tenants=tenants)
    assert +r.tenant_hits == {"b": 1, "a": 1}
    share = hits(tmp_path, reqs, capacity=4, policy=policy,
                 tenants=(R.TenantSpec("a", quota="50%"), R.TenantSpec("b")))
    assert +share.tenant_hits == +r.tenant_hits


def test_tenant_spec_parsing() -> None:
    t = R.TenantSpec.parse("gold:2:25%")
    assert (t.name, t.priority, t.quota_bytes(1000, 10)) == ("gold", 2, 250)
    assert R.TenantSpec.parse("x").quota_bytes(1000, 10) is None
    assert R.TenantSpec.parse("x::3b").quota_bytes(1000, 10) == 30
    assert R.TenantSpec.parse("x:0:4096").quota_bytes(1000, 10) == 4096
    for bad in ["", "a:b", "a:1:0%", "a:1:lots", "a:1:2:3"]:
        with pytest.raises(R.ReplayError):
            R.TenantSpec.parse(bad)


def test_an_undeclared_tenant_in_the_trace_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(R.ReplayError, match="not declared"):
        hits(tmp_path, [("zz", [1])], capacity=2, tenants=(R.TenantSpec("a"),))


# ------------------------------------------------------------------ tiers
@pytest.mark.parametrize("policy", POLICIES)
def test_a_disk_tier_serves_demoted_blocks(tmp_path: Path, policy: str) -> None:
    opts = R.ReplayOptions(policy=policy, capacity_blocks=1, disk_blocks=2, bytes_per_token=1)
    requests, distinct = R.load(write_trace(tmp_path / "t.jsonl", [[1], [2], [1]]), opts)
    out = R.run(requests, opts, distinct)
    assert out["hits_per_tier"] == {"disk": 1}
    block = TRACE_BLOCK_TOKENS
    assert out["bytes_moved"]["demoted_to_disk"] >= block and out["bytes_moved"]["promoted_from_disk"] == block
    assert out["belady_hit_rate"] == pytest.approx(1 / 3)  # Belady gets the two tiers' capacity


# ------------------------------------------------------------------ the command
def test_cli_prints_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 7]])
    assert cli_main(["replay", trace, "--capacity", "4", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("hit_rate", "lru_hit_rate", "belady_hit_rate", "capacity_blocks"):
        assert isinstance(out[k], (int, float)) and not isinstance(out[k], bool), k
    assert out["policy"] == "prefix" and out["capacity_blocks"] == 4
    assert (out["lru_hit_rate"], out["belady_hit_rate"]) == (2 / 12, 5 / 12)
    assert out["lru_hit_rate"] <= out["hit_rate"] <= out["belady_hit_rate"]


def test_cli_capacity_fraction_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [3, 4]])
    assert cli_main(["replay", trace, "--capacity-fraction", "0.5", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_blocks"] == 2
    assert cli_main(["replay", trace, "--policy", "nope", "--no-progress"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    assert cli_main(["replay", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    for no_disk in (["--disk-capacity", "0"], ["--disk-fraction", "0"]):  # (as without either: no disk tier)
        assert cli_main(["replay", trace, "--capacity-fraction", "0.5", *no_disk, "--json", "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)["disk_blocks"] == 0
    assert cli_main(["replay", trace, "--capacity-fraction", "0.0001", "--no-progress"]) == 2
    assert "less than one block" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # (argparse's: a line naming the option)
        cli_main(["replay", trace, "--capacity", "0", "--no-progress"])
    assert refused.value.code == 2 and "--capacity" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    with pytest.raises(R.ReplayError, match="matplotlib"):
        R.write_plot(str(tmp_path / "p.png"), [0.1], {"lru": [0.5]}, "t")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    opts = R.ReplayOptions(bytes_per_token=1)
    requests, distinct = R.load(write_trace(tmp_path / "t.jsonl", SAME + [[3, 4], [1, 2]]), opts)
    curves = R.sweep(requests, opts, distinct, [0.5, 1.0], ["lru", "prefix"])
    assert set(curves) == {"lru", "prefix", "belady"} and all(len(v) == 2 for v in curves.values())
    R.write_plot(str(tmp_path / "p.png"), [0.5, 1.0], curves, "t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the shared trace
README_LRU = {1.0: 0.640, 0.25: 0.443, 0.10: 0.260, 0.05: 0.155, 0.02: 0.076}


@pytest.mark.slow
def test_lru_reproduces_the_trace_readme() -> None:
    path = default_trace_path()
    if not path.exists():
        pytest.skip(f"no trace at {path}")
    opts = R.ReplayOptions(policy="lru")
    requests, distinct = R.load(str(path), opts)
    assert distinct == 43_924
    for fraction, expect in README_LRU.items():
        o = replace(opts, capacity_blocks=int(fraction * distinct))
        assert R.replay_policy(requests, o).hit_rate == pytest.approx(expect, abs=0.003), fraction
    # Unlimited and generous capacities leave Belady nothing to gain.
    assert R.belady_hit_rate(requests, replace(opts, capacity_blocks=distinct), [0] * len(requests)) == \
        pytest.approx(0.640, abs=0.003)
    assert R.belady_hit_rate(requests, replace(opts, capacity_blocks=int(0.25 * distinct)),
                             [0] * len(requests)) == pytest.approx(0.625, abs=0.003)


# ------------------------------------------------------------------ hints and what the policy costs
def test_puts_carry_the_hints_an_engine_would_give(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.jsonl"
    records = [{"timestamp": 0, "input_length": 3 * TRACE_BLOCK_TOKENS - 5, "hash_ids": [1, 2, 3],
                "session": "c1", "label": "turn"},
               {"timestamp": 1, "input_length": TRACE_BLOCK_TOKENS, "hash_ids": [9]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen: list[tuple[bytes, Hints | None]] = []

    class Recording(LRUPolicy):
        def admit(self, tier: str, meta: BlockMeta) -> bool:
            seen.append((meta.key, meta.hints))
            return True

    monkeypatch.setattr(R, "make_policy", lambda name: Recording())
    for hints, expect in ((True, [Hints(3, "c1", "turn")] * 3 + [Hints(1)]), (False, [None] * 4)):
        seen.clear()
        opts = R.ReplayOptions(capacity_blocks=10, bytes_per_token=1, hints=hints)
        requests, _ = R.load(str(path), opts)
        assert [r.hints for r in requests] == [expect[0], expect[3]]
        R.replay_policy(requests, opts)
        assert [h for _, h in seen] == expect  # every put of a request: the request's prompt, never a later one


def test_cli_reports_what_the_policy_costs_and_replays_without_hints(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 7]] * 20)
    for extra, hints in (([], True), (["--no-hints"], False)):
        assert cli_main(["replay", trace, "--capacity", "4", "--json", "--no-progress", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        cost = out["policy_cost"]
        assert out["hints"] is hints and out["policy"] == "prefix"
        assert cost["us_per_put"] > 0 and cost["lru_us_per_put"] > 0 and cost["resident_blocks"] == 4
        assert set(cost["state_bytes"]) == {"learning", "shadows", "witness", "tails"}
        assert cost["state_bytes_per_resident_block"] > 0
    assert cli_main(["replay", trace, "--capacity", "4", "--json", "--no-progress", "--policy", "lru"]) == 0
    assert "state_bytes" not in json.loads(capsys.readouterr().out)["policy_cost"]


def test_the_policy_state_takes_the_same_bytes_whatever_the_hash_seed() -> None:
    """The bound on the policy's state is checked against ``state_bytes``: a figure that
    moved with the process's hash seed (a set's table that grew at a different time, whole
    hashes kept as ints of 32 or 36 bytes) could pass in one run and fail in the next."""
    path = default_trace_path()
    if not path.exists():
        pytest.skip(f"no trace at {path}")
    run = "import sys; from kvpool_sidecar.cli import main; sys.exit(main(sys.argv[1:]))"
    seen = []
    for seed in ("1", "2", "3"):
        out = subprocess.run([sys.executable, "-c", run, "replay", str(path), "--capacity-fraction", "0.05",
                              "--limit", "1000", "--json", "--no-progress"], capture_output=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=300)
        seen.append(json.loads(out.stdout)["policy_cost"]["state_bytes"])
    assert seen[0]["shadows"] > 0 and seen[0] == seen[1] == seen[2]
