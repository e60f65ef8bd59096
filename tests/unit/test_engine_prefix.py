"""The scheduler side of the engine connectors, with a lookup that counts what it is asked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvpool_client.engines import prefix
from kvpool_client.engines.prefix import MAX_SAVE_BACKOFF, PrefixPlanner, Reconnecting, StepBudget
from kvpool_client.errors import ConnectionLostError, DeadlineError, KVPoolError, RemoteError

BT = 4


class FakePool:
    """Holds a set of raw keys; lookup is the longest held prefix, as the sidecar's."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.calls = 0
        self.fail = False

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.calls += 1
        if self.fail:
            raise ConnectionLostError("sidecar gone")
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n


def rank_keys(rank: int, hashes: Sequence[bytes]) -> list[bytes]:
    return [b"r%d:" % rank + h for h in hashes]


def hashes(n: int, tag: bytes = b"h") -> list[bytes]:
    return [tag + b"%03d" % i for i in range(n)]


def planner(pool: FakePool, ranks: int = 1, save: bool = True) -> PrefixPlanner:
    return PrefixPlanner(pool.lookup, rank_keys, ranks=ranks, block_tokens=BT, save=save)


def hold(pool: FakePool, hs: Sequence[bytes], ranks: Sequence[int] = (0,)) -> None:
    for r in ranks:
        pool.held.update(rank_keys(r, hs))


def test_hit_length_counts_full_blocks_and_leaves_one_token_to_compute() -> None:
    pool, hs = FakePool(), hashes(5)
    hold(pool, hs)
    p = planner(pool)
    assert p.matched_tokens("a", hs, 0, num_prompt_tokens=5 * BT) == 4 * BT  # the last block is recomputed
    assert p.matched_tokens("b", hs, 0, num_prompt_tokens=5 * BT + 1) == 5 * BT
    assert p.matched_tokens("c", hs, 2 * BT, num_prompt_tokens=5 * BT + 1) == 3 * BT  # past the local hit
    assert p.matched_tokens("d", hs[:2], 2 * BT, num_prompt_tokens=9 * BT) == 0


def test_every_rank_must_hold_a_block() -> None:
    pool, hs = FakePool(), hashes(4)
    hold(pool, hs, ranks=[0, 1])
    hold(pool, hs[:3], ranks=[2])
    hold(pool, hs[:1], ranks=[3])
    assert planner(pool, ranks=3).matched_tokens("a", hs, 0, 100) == 3 * BT
    assert planner(pool, ranks=4).matched_tokens("a", hs, 0, 100) == 1 * BT
    assert pool.calls == 2  # one round trip each, whatever the number of ranks


def test_repeated_questions_cost_no_round_trip_until_the_state_changes() -> None:
    pool, hs = FakePool(), hashes(3)
    hold(pool, hs)
    p = planner(pool)
    for _ in range(3):
        assert p.matched_tokens("a", hs, 0, 100) == 3 * BT
    assert pool.calls == 1
    p.allocated("a", [10, 11, 12, 13], 3 * BT)
    p.preempted("a")
    pool.held.clear()
    assert p.matched_tokens("a", hs, 0, 100) == 0  # asked again after the preemption
    assert pool.calls == 2


def test_a_failed_lookup_is_a_miss() -> None:
    pool, hs = FakePool(), hashes(3)
    hold(pool, hs)
    pool.fail = True
    assert planner(pool).matched_tokens("a", hs, 0, 100) == 0


def test_load_then_saves_each_block_once_when_computed() -> None:
    pool, hs = FakePool(), hashes(6)
    hold(pool, hs[:2])
    p = planner(pool)
    assert p.matched_tokens("a", hs, 0, 6 * BT + 2) == 2 * BT
    ids = [40, 41, 42, 43, 44, 45, 46]
    p.allocated("a", ids, 2 * BT)
    load, save = p.scheduled("a", hs, ids, computed_after_step=2 * BT + 9, replace=True)  # chunked prefill
    assert load is not None and (load.start, load.block_ids, load.hashes) == (0, [40, 41], hs[:2])
    assert save is not None and (save.start, save.block_ids, save.hashes, save.parent) == (2, [42, 43], hs[2:4], hs[1])
    load, save = p.scheduled("a", hs, [], computed_after_step=6 * BT + 2)
    assert load is None and save is not None and (save.start, save.block_ids, save.parent) == (4, [44, 45], hs[3])
    load, save = p.scheduled("a", hs, None, computed_after_step=6 * BT + 3)
    assert load is None and save is None
    p.finished("a")
    assert len(p) == 0


def test_a_local_hit_is_saved_to_the_pool_and_not_loaded() -> None:
    pool, hs = FakePool(), hashes(3)
    p = planner(pool)
    assert p.matched_tokens("a", hs, 2 * BT, 3 * BT + 1) == 0
    p.allocated("a", [7, 8, 9], 0)
    load, save = p.scheduled("a", hs, [7, 8, 9], 3 * BT + 1, replace=True)
    assert load is None and save is not None and save.block_ids == [7, 8, 9] and save.parent is None


def test_a_resumed_request_takes_its_new_blocks_and_saves_only_the_rest() -> None:
    pool, hs = FakePool(), hashes(4)
    p = planner(pool)
    p.matched_tokens("a", hs, 0, 4 * BT + 1)
    p.allocated("a", [1, 2, 3, 4, 5], 0)
    _, save = p.scheduled("a", hs, [1, 2, 3, 4, 5], 2 * BT, replace=True)
    assert save is not None and save.block_ids == [1, 2]
    p.preempted("a")
    hold(pool, hs[:2])
    assert p.matched_tokens("a", hs, 0, 4 * BT + 1) == 2 * BT
    p.allocated("a", [9, 8, 7, 6, 5], 2 * BT)
    load, save = p.scheduled("a", hs, [9, 8, 7, 6, 5], 4 * BT + 1, replace=True)
    assert load is not None and load.block_ids == [9, 8]
    assert save is not None and save.block_ids == [7, 6] and save.start == 2


def test_saving_can_be_off() -> None:
    pool, hs = FakePool(), hashes(2)
    p = planner(pool, save=False)
    p.matched_tokens("a", hs, 0, 100)
    assert p.scheduled("a", hs, [1, 2], 100, replace=True) == (None, None)


def test_reconnecting_backs_off_after_a_failure() -> None:
    made: list[int] = []

    def connect() -> object:
        made.append(1)
        raise ConnectionLostError("no sidecar")

    r = Reconnecting(connect, backoff_s=60.0)
    for _ in range(3):
        with pytest.raises(KVPoolError):
            r.call(lambda c: c)
    assert len(made) == 1  # later calls fail at once, without trying the socket


def _recording_clients() -> tuple[list[object], list[object], Callable[[], object]]:
    """The clients a :class:`Reconnecting` made, those it closed, and its ``connect``."""
    made: list[object] = []
    closed: list[object] = []

    class Client:
        def close(self) -> None:
            closed.append(self)

    def connect() -> object:
        made.append(Client())
        return made[-1]

    return made, closed, connect


def test_reconnecting_keeps_its_client_when_a_tasks_deadline_passed() -> None:
    """A DeadlineError (nothing was sent: the connection owes nothing) neither drops the
    client nor backs off; any other pool error does both."""
    made, closed, connect = _recording_clients()

    def late(c: object) -> object:
        raise DeadlineError("the task's deadline passed")

    def lost(c: object) -> object:
        raise ConnectionLostError("gone")

    r = Reconnecting(connect, backoff_s=60.0)
    with pytest.raises(DeadlineError):
        r.call(late)
    assert r.call(lambda c: c) is made[0] and not closed
    with pytest.raises(ConnectionLostError):
        r.call(lost)
    assert closed == [made[0]]
    with pytest.raises(KVPoolError, match="backing off"):
        r.call(lambda c: c)


def test_reconnecting_keeps_its_client_when_the_sidecar_answers_a_call_with_an_error() -> None:
    """An error the sidecar answered (a batch it refused, say) is that call's miss: the
    connection serves the next call at once, with no back-off. One that says the sidecar is
    shutting down drops the client and backs off, as a lost connection does."""
    made, closed, connect = _recording_clients()

    def refused(c: object) -> object:
        raise RemoteError("bad_request", "expected a list of at most 4096 keys")

    def going(c: object) -> object:
        raise RemoteError("unavailable", "the sidecar is shutting down")

    r = Reconnecting(connect, backoff_s=60.0)
    for _ in range(3):
        with pytest.raises(RemoteError, match="at most 4096"):
            r.call(refused)
    assert r.call(lambda c: c) is made[0] and len(made) == 1 and not closed
    with pytest.raises(RemoteError, match="shutting down"):
        r.call(going)
    assert closed == [made[0]]
    with pytest.raises(KVPoolError, match="backing off"):
        r.call(lambda c: c)
    assert len(made) == 1


class FakeClock:
    """``time`` for :mod:`kvpool_client.engines.prefix`: it moves only when a test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_steps_lookups_stop_once_they_took_its_budget_and_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks once per waiting request within one step: each lookup gets what the step's
    budget has left as its deadline, and once they took it all the step's other lookups
    miss without asking, and the lookups back off (the client kept); a new step has the
    whole budget again."""
    clock = FakeClock()
    monkeypatch.setattr(prefix, "time", clock)
    made: list[object] = []
    asked: list[float] = []

    class Client:
        def close(self) -> None:
            raise AssertionError("a slow sidecar that answers keeps its connection")

    def connect() -> Client:
        made.append(Client())
        return made[-1]  # type: ignore[return-value]

    conn = Reconnecting(connect, backoff_s=2.0)
    budget = StepBudget(1.0, lambda took: conn.back_off())

    def lookup(left: float) -> int:  # an answer 0.4 s after it was asked, within its deadline
        def answered(c: object) -> int:
            asked.append(left)
            clock.now += 0.4
            return 3
        return conn.call(answered)

    p = PrefixPlanner(lambda keys: budget.run(lookup), rank_keys, ranks=1, block_tokens=BT)
    hits = [p.matched_tokens(f"r{i}", hashes(4, b"%d" % i), 0, 5 * BT) for i in range(8)]
    assert hits == [3 * BT] * 3 + [0] * 5  # the third took the step past its budget: the rest miss unasked
    assert asked == pytest.approx([1.0, 0.6, 0.2]) and len(made) == 1
    budget.new_step()  # the next step: its budget is whole, but the lookups back off for 2 s
    assert p.matched_tokens("late", hashes(4, b"l"), 0, 5 * BT) == 0 and len(asked) == 3
    clock.now += 2.0
    budget.new_step()
    assert p.matched_tokens("later", hashes(4, b"m"), 0, 5 * BT) == 3 * BT and asked[-1] == 1.0
    with pytest.raises(KVPoolError):
        StepBudget(float("nan"))


def test_a_failed_lookup_is_a_miss_for_that_step_only() -> None:
    """A lookup that failed (the sidecar gone, the step's budget spent, a back-off) counts as
    a miss, and a request still waiting asks again at its next step (its miss had been kept
    until its state changed); a lookup that answered is kept."""
    pool, hs = FakePool(), hashes(5)
    hold(pool, hs)
    p = planner(pool)
    pool.fail = True
    assert p.matched_tokens("a", hs, 0, 5 * BT + 1) == 0
    pool.fail = False
    assert p.matched_tokens("a", hs, 0, 5 * BT + 1) == 5 * BT and pool.calls == 2
    assert p.matched_tokens("a", hs, 0, 5 * BT + 1) == 5 * BT and pool.calls == 2
    p.allocated("a", list(range(6)), 0)  # (the engine chose to compute it: no load)
    assert p._reqs["a"].pending_load is None  # noqa: SLF001


def test_a_save_that_could_not_be_made_is_planned_again_after_a_back_off_of_the_requests_steps() -> None:
    pool, hs = FakePool(), hashes(8)
    p = planner(pool)
    p.matched_tokens("a", hs, 0, 8 * BT + 1)
    ids = list(range(10, 19))
    p.allocated("a", ids, 0)
    _, save = p.scheduled("a", hs, ids, 3 * BT, replace=True)
    assert save is not None and save.block_ids == [10, 11, 12]
    p.lost("a", 1, hs[1:3])  # the workers kept block 0 only
    _, save = p.scheduled("a", hs, [], 4 * BT)
    assert save is None  # the back-off: one step
    _, save = p.scheduled("a", hs, [], 5 * BT)
    assert save is not None and (save.start, save.block_ids, save.parent) == (1, [11, 12, 13, 14], hs[0])
    p.lost("a", 1, save.hashes)
    assert [p.scheduled("a", hs, [], 5 * BT)[1] for _ in range(2)] == [None, None]  # two steps now
    _, save = p.scheduled("a", hs, [], 6 * BT)
    assert save is not None and save.start == 1 and len(save.block_ids) == 5
    for _ in range(10):
        p.lost("a", 1, save.hashes)
    assert p._reqs["a"].skip_saves == MAX_SAVE_BACKOFF  # noqa: SLF001
    for i in range(2 * MAX_SAVE_BACKOFF + 3):  # a long while without a loss
        p.scheduled("a", hs, [], 6 * BT + i)
    p.lost("a", 1, save.hashes)
    assert p._reqs["a"].skip_saves == 1  # noqa: SLF001 - the back-off starts over
    p.lost("gone", 0, hs)  # a request that finished meanwhile: nothing to plan


def test_a_save_cut_at_a_block_keeps_only_what_comes_before_and_forgets_the_rest() -> None:
    pool, hs = FakePool(), hashes(4)
    p = planner(pool)
    p.matched_tokens("a", hs, 0, 4 * BT + 1)
    p.allocated("a", [1, 2, 3, 4], 0)
    _, save = p.scheduled("a", hs, [1, 2, 3, 4], 4 * BT, replace=True)
    assert save is not None
    cut = p.cut(save, 2)
    assert cut is not None and (cut.start, cut.block_ids, cut.hashes) == (0, [1, 2], hs[:2])
    assert p.cut(save, 0) is None
    # another request that computes the cut blocks again saves them (not taken as saved)
    p.matched_tokens("b", hs, 0, 4 * BT + 1)
    p.allocated("b", [5, 6, 7, 8], 0)
    _, again = p.scheduled("b", hs, [5, 6, 7, 8], 4 * BT, replace=True)
    assert again is not None and again.start == 0 and again.block_ids == [5, 6, 7, 8]


def test_a_held_back_block_of_a_hit_is_computed_again() -> None:
    """With a drafter's layers in the group (EAGLE), a block's KV at its last token depends on
    the next block: the last block of a hit is computed, not loaded."""
    pool = FakePool()
    hs = hashes(5)
    pool.held.update(rank_keys(0, hs[:3]))
    plain = PrefixPlanner(pool.lookup, rank_keys, ranks=1, block_tokens=BT)
    drafted = PrefixPlanner(pool.lookup, rank_keys, ranks=1, block_tokens=BT, hold_back=1)
    assert plain.matched_tokens("r", hs, 0, 5 * BT) == 3 * BT
    assert drafted.matched_tokens("r", hs, 0, 5 * BT) == 2 * BT
    ids = [10, 11, 12, 13, 14]
    drafted.allocated("r", ids, 2 * BT)
    load, save = drafted.scheduled("r", hs, ids, computed_after_step=5 * BT, replace=True)
    assert load is not None and load.block_ids == [10, 11]
    # the block computed again is in the pool already: not saved twice
    assert save is not None and (save.start, save.block_ids) == (3, [13, 14])
    pool.held = set(rank_keys(0, hs[:1]))
    assert PrefixPlanner(pool.lookup, rank_keys, ranks=1, block_tokens=BT, hold_back=1).matched_tokens(
        "q", hs, 0, 5 * BT) == 0
    with pytest.raises(KVPoolError):
        PrefixPlanner(pool.lookup, rank_keys, ranks=1, block_tokens=BT, hold_back=-1)
