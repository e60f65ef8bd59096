"""The scheduler's record of engine blocks that may hold wrong KV: what taints a block, what
makes it clean again (a clean computation that writes it whole), and what a save may reach."""

from __future__ import annotations

from kvpool_client.engines.taint import Computed, Taint, blocks_from

BS = 16


def test_blocks_from_the_first_failed_one_in_every_table() -> None:
    assert blocks_from([[1, 2, 3, 4], [1, 2, 9], [7, 8]], {2}) == {2, 3, 4, 9}
    assert blocks_from([[1, 2]], {5}) == set()


def test_a_block_is_clean_again_once_a_clean_step_has_written_it_whole_and_run() -> None:
    t = Taint(BS)
    t.taint({2, 3})
    assert t.judge([Computed("r", [1, 2, 3], 16, 48)]) == set()  # reads block 1 only: clean
    assert t.clean_run([2, 3]) == 2  # rewritten whole in the step being planned
    t.step_ran()
    assert len(t) == 0


def test_a_block_written_part_way_stays_tainted() -> None:
    """A step that ends half way through a block rewrote half of it: the rest is as the failed
    step left it (it had been counted as computed again, and saved by the next request that
    hit it)."""
    t = Taint(BS)
    t.taint({4})
    assert t.judge([Computed("r", [0, 1, 2, 3, 4, 5], 48, 72)]) == set()  # blocks 3 and half of 4
    t.step_ran()
    assert t.clean_run([3, 4]) == 1
    # the same request goes on from the middle of block 4: it reads its own clean run, not the
    # stale half, and block 4 is clean once it is whole
    assert t.judge([Computed("r", [0, 1, 2, 3, 4, 5], 72, 96)]) == set()
    t.step_ran()
    assert len(t) == 0


def test_a_block_begun_over_tainted_blocks_is_not_cleaned_by_finishing_it_cleanly() -> None:
    t = Taint(BS)
    t.taint({1})
    assert t.judge([Computed("q", [1, 2, 3], 24, 40)]) == {"q"}  # half of block 1... over block 1
    t.step_ran()
    assert t.clean_run([2]) == 0  # what q wrote is tainted
    assert t.judge([Computed("q", [1, 2, 3], 40, 48)]) == {"q"}  # and so is all q computes after
    t.step_ran()
    assert t.clean_run([2, 3]) == 0


def test_a_request_that_goes_back_starts_a_new_run() -> None:
    """vLLM sends the request whose load failed back to its first failed block: that block is
    then read as before the failure, not as its own clean run."""
    t = Taint(BS)
    assert t.judge([Computed("r", [1, 2, 3], 16, 48)]) == set()
    t.step_ran()
    t.taint({1, 2, 3})  # its load of block 0... and what it computed after: reported failed
    assert t.judge([Computed("r", [0, 2, 3], 0, 32)]) == set()  # back to block 0, recomputing
    t.step_ran()
    assert t.clean_run([0, 2, 3]) == 2


def test_a_block_another_request_rewrites_whole_in_the_same_step_is_read_clean() -> None:
    """Q hits R's blocks in vLLM's prefix cache in the very step R recomputes them: vLLM writes
    a layer's KV before attention reads it, so Q's KV is right (it had been taken as wrong, and
    its conversation never saved again)."""
    t = Taint(BS)
    t.taint({1, 2})
    r = Computed("r", [1, 2], 0, 32)
    q = Computed("q", [1, 2, 5], 32, 48)
    assert t.judge([q, r]) == set()  # in either order
    t.step_ran()
    assert len(t) == 0
    t.taint({1, 2})
    half = Computed("r", [1, 2], 0, 24)  # R rewrites block 1 and half of block 2
    assert t.judge([half, Computed("q", [1, 2, 5], 32, 48)]) == {"q"}


def test_a_restarted_request_is_judged_afresh() -> None:
    t = Taint(BS)
    assert t.judge([Computed("r", [1, 2], 0, 24)]) == set()
    t.step_ran()
    t.restart("r")  # preempted: its next step reads what it had written as any other block
    t.taint({1})
    assert t.judge([Computed("r", [1, 2], 24, 32)]) == {"r"}


def test_a_block_given_afresh_loses_its_taint() -> None:
    """vLLM reuses a block id whose old bytes were tainted: the request it goes to loads or
    computes it before anything reads it. The taint had stayed, and every request that then
    loaded into the block was taken as computing over wrong KV and never saved."""
    t = Taint(BS)
    t.taint({4, 5})
    t.fresh([5, 9])
    assert t.clean_run([1, 5, 4]) == 2
    assert t.judge([Computed("y", [5, 6], 16, 32)]) == set()
