"""The admission oracles of ``kvpool replay --oracles``: hand-made traces, exact hit counts."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool_bench import oracles as O
from kvpool_sidecar.cli import main as cli_main


@dataclass
class Req:
    ids: tuple[int, ...]


def reqs(*ids: list[int]) -> list[Req]:
    return [Req(tuple(i)) for i in ids]


def test_next_uses() -> None:
    assert O.next_uses(reqs([1, 2], [1], [3, 2])) == [2, 4, 5, 5, 5]


def test_ever_skips_one_shot_blocks_and_within_also_skips_late_ones() -> None:
    # one slot; accesses: 1 (again at 2), 2 (again at 5), 1, 3 (again at 4), 3, 2
    trace = reqs([1], [2], [1], [3], [3], [2])
    # ever: 2 (used again) takes 1's slot, so 1 misses; 3 then takes the slot and hits once
    assert O.oracle_lru_hits(trace, 1) == 1
    # within 3 accesses: 2 returns 4 accesses later, so it is not admitted; 1 and 3 both hit
    assert O.oracle_lru_hits(trace, 1, 3) == 2
    # a horizon of one access admits only 3
    assert O.oracle_lru_hits(trace, 1, 1) == 1
    assert O.oracle_lru_hits(trace, 0) == 0


def test_hits_count_only_the_unbroken_prefix() -> None:
    assert O.oracle_lru_hits(reqs([1, 2], [1, 2]), 2) == 2
    # one slot: 2 evicts 1, so the second request misses at once and 2 is no hit
    assert O.oracle_lru_hits(reqs([1, 2], [1, 2]), 1) == 0


def test_rate_keeps_the_faster_block_and_drops_a_block_at_its_last_use() -> None:
    # accesses 1 2 1 2 2 1: block 1 has rate 2/5, block 2 has 2/3
    trace = reqs([1], [2], [1], [2], [2], [1])
    # one slot: 2 replaces 1; 1 (slower) is then not admitted; 2 hits twice, the second
    # time at its last use (so it leaves); 1's last use is not admitted
    assert O.oracle_rate_hits(trace, 1) == 2
    assert O.oracle_lru_hits(trace, 1) == 1 and O.oracle_rate_hits(trace, 0) == 0  # ever: 1 and 2 take turns
    # equal rates: the deeper block is refused, so the shallower one hits
    assert O.oracle_rate_hits(reqs([1, 2], [1, 2]), 1) == 1
    assert O.oracle_rate_hits(reqs([1, 2], [1, 2]), 2) == 2


def test_rates_and_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = reqs([1], [2], [1], [3], [3], [2])
    assert O.oracle_rates(trace, 1) == {"oracle_ever_reused": 1 / 6, "oracle_ever_reused_new_blocks_only": 1 / 6,
                                        "oracle_rate_and_last_use": 2 / 6, "oracle_class": 1 / 6,
                                        "oracle_reused_within_3x_capacity": 2 / 6}
    assert O.oracle_rates([], 1) == {}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": r.ids})
                            + "\n" for i, r in enumerate(trace)))
    assert cli_main(["replay", str(path), "--capacity", "1", "--oracles", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["oracles"] == O.oracle_rates(trace, 1)
    assert out["lru_hit_rate"] <= out["oracles"]["oracle_ever_reused"] <= out["belady_hit_rate"]


def test_live_choice_ranks_the_reused_prefix_among_the_live_ones() -> None:
    # Ten prefixes asked for in turn, five rounds: each reuse picks the live prefix used
    # longest ago (decile 9 of age), which has no more uses than any rival (never above
    # the middle decile: ties count at their middle). In the last round fewer rivals are live,
    # so the oldest ranks lower: deciles 9 (10 to 5 live), 8, 8, 7 and 5 (alone).
    trace = reqs(*([p, 100 + i] for i in range(5) for p in range(10)))
    out = O.live_choice_deciles(trace)
    assert out["age"][9] == pytest.approx(36 / 40) and out["age"][8] == pytest.approx(2 / 40)
    assert out["age"][7] == out["age"][5] == pytest.approx(1 / 40)
    assert sum(out["uses"][:6]) == pytest.approx(1.0) and out["uses"][0] > 0
    # Twenty prefixes asked for twice in a row (the second time, the newest of p + 1 live:
    # decile int(10 * 0.5 / (p + 1))), then once more in turn (the oldest of 20 - p live).
    stack = reqs(*([p] for p in range(20) for _ in range(2)), *([p] for p in range(20)))
    expect = [15, 3, 1, 0, 0, 2, 0, 1, 2, 16]
    assert O.live_choice_deciles(stack)["age"] == pytest.approx([n / 40 for n in expect])
    assert O.live_choice_deciles([]) == {"age": [0.0] * 10, "uses": [0.0] * 10}


def test_live_choice_is_flat_for_fair_draws() -> None:
    rnd = random.Random(5)
    left = {p: 30 for p in range(40)}
    trace = []
    while left:
        p = rnd.choice(sorted(left))
        trace.append(Req((p,)))
        left[p] -= 1
        if not left[p]:
            del left[p]
    out = O.live_choice_deciles(trace)
    assert all(0.06 < share < 0.14 for share in out["age"]), out


def test_ever_for_new_blocks_only_leaves_blocks_seen_before_to_lru() -> None:
    # one slot: 1 (again at 2), 2 (never again), 1, 1
    trace = reqs([1], [2], [1], [1])
    assert O.oracle_lru_hits(trace, 1) == 2  # 2 is not admitted: both later reads of 1 hit
    assert O.oracle_lru_hits(trace, 1, new_only=True) == 2  # 2 is new: the oracle still turns it away
    # 3 is new and read again, 1 seen before and kept as LRU keeps it though never read again
    trace = reqs([1], [1], [3], [1], [3])
    assert O.oracle_lru_hits(trace, 1) == 2
    assert O.oracle_lru_hits(trace, 1, new_only=True) == 1


def test_belady_marks_the_accesses_whose_block_it_kept_to_their_next_use() -> None:
    # one slot: 1 stays to its next use (2 comes and is used again after 1's); 2 is bypassed
    # at its first access and kept from its second to its third
    trace = reqs([1], [2], [1], [2], [2])
    kept = [False] * 5
    assert O.belady_hits(trace, 1, kept) == 2
    assert kept == [True, False, False, True, False]


def test_class_admits_only_the_classes_belady_keeps() -> None:
    # a four-block prompt read again after one-block prompts used once each: LRU of four
    # blocks loses it to them, the class oracle keeps one-block prompts out (Belady never
    # kept one) and the long prompt's blocks in
    trace = reqs([1, 2, 3, 4], [100], [101], [102], [103], [1, 2, 3, 4], [104], [105], [1, 2, 3, 4])
    assert O.oracle_lru_hits(trace, 4, 10**9) == 8  # ever: both reads again hit
    assert O.oracle_class_hits(trace, 4) == 8
    lru = O.lru_admitting(trace, 4, [True] * sum(len(r.ids) for r in trace))
    assert lru == 0
    # a class that says nothing (every prompt one block long, read again or not) gains nothing
    flat = reqs([1], [2], [3], [1], [4], [2])
    assert O.oracle_class_hits(flat, 1) == O.lru_admitting(flat, 1, [True] * 6)


def test_classes_are_made_of_what_a_policy_knows_at_the_access() -> None:
    classes = O.access_classes(reqs([7, 8, 9], [7, 8], [7]))
    # prompt length bucket, depth bucket, own uses, root's uses, last block
    assert classes[:3] == [(2, 0, 0, 0, False), (2, 1, 0, 0, False), (2, 2, 0, 0, True)]
    assert classes[3:5] == [(2, 0, 1, 1, False), (2, 1, 1, 1, True)]
    assert classes[5] == (1, 0, 2, 2, True)
