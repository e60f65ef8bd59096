"""The scheduler's record of held saves: a step's saves, and those of every step after it,
wait for the outcome of its loads; a failed step drops them and the planner plans them again."""

from __future__ import annotations

from typing import Any

from kvpool_client.engines.heldsteps import HeldSteps
from kvpool_client.engines.prefix import LoadSpec, SaveSpec


class Planner:
    """The planner's part HeldSteps uses: what it is told is not in the pool after all."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[bytes]]] = []

    def unsaved(self, req_id: str, start: int, hashes: Any = ()) -> None:
        self.calls.append((req_id, start, list(hashes)))


def held() -> tuple[HeldSteps, Planner]:
    p = Planner()
    return HeldSteps(p, patience=4), p  # type: ignore[arg-type]


LOAD = [LoadSpec("r", 0, [b"h0"], [7])]
SAVE = [SaveSpec("r", 1, [b"h1", b"h2"], [8, 9], b"h0")]


def test_a_step_without_loads_is_not_held_when_nothing_is() -> None:
    steps, _ = held()
    assert steps.decide() == {}
    assert steps.begin([], SAVE) == (0, False)


def test_saves_wait_for_the_outcome_of_the_loads_of_their_step_and_of_every_step_before() -> None:
    steps, p = held()
    assert steps.begin(LOAD, SAVE) == (0, True)
    assert steps.decide() == {}  # not reported yet (asynchronous scheduling: the next step is planned first)
    assert steps.begin([], SAVE) == (1, True)  # held behind step 0
    steps.reported([0], [])
    assert steps.decide() == {0: True, 1: True}
    assert steps.begin([], SAVE) == (2, False) and not p.calls


def test_a_failed_step_drops_itself_and_every_held_step_after_it_and_is_planned_again() -> None:
    steps, p = held()
    steps.begin(LOAD, SAVE)
    steps.begin([], [SaveSpec("q", 4, [b"q4"], [3], b"q3")])  # (computed over step 0's slots, maybe)
    steps.reported([0], [0])  # some worker's load failed
    assert steps.decide() == {0: False, 1: False}
    assert p.calls == [("r", 1, [b"h1", b"h2"]), ("r", 0, []), ("q", 4, [b"q4"])]
    assert steps.begin([], SAVE) == (2, False)  # the record starts afresh
    steps.begin(LOAD, SAVE)
    steps.reported([3], [])
    assert steps.decide() == {3: True}


def test_an_outcome_that_never_comes_counts_as_a_failure() -> None:
    steps, p = held()
    steps.begin(LOAD, SAVE)
    for _ in range(4):
        assert steps.decide() == {}
        steps.begin([], [])
    assert steps.decide() == {0: False, 1: False, 2: False, 3: False, 4: False}
    assert p.calls[0] == ("r", 1, [b"h1", b"h2"])


def test_the_tables_of_the_held_steps_are_kept_until_they_are_decided() -> None:
    """(A request of a held step may have finished before its step's outcome came back: its
    table is what says which of its blocks a failed load spoiled.)"""
    steps, _ = held()
    steps.begin([], SAVE, [[1, 2]])  # nothing held: not kept
    steps.begin(LOAD, SAVE, [[7, 8, 9]])
    steps.begin([], SAVE, [[3, 4], [7, 8]])
    assert list(steps.tables()) == [[7, 8, 9], [3, 4], [7, 8]]
    steps.reported([1], [])
    steps.decide()
    assert list(steps.tables()) == []
