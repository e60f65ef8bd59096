"""What the Mooncake-compatible API answers for kvpool's outcomes, and the pure helpers of its
object store (the API itself runs on real sidecars: tests/integration/test_mooncake_faults.py)."""

from __future__ import annotations

import pytest

from kvpool_client.errors import ConnectionLostError, DeadlineError, RemoteError
from kvpool_client.mooncake.codes import ErrorCode, code_of, put_code
from kvpool_client.mooncake.objects import _capacities, _groups
from kvpool_client.protocol import PutStatus


def test_a_block_another_client_is_writing_is_not_a_success() -> None:
    assert put_code(PutStatus.STORED) == put_code(PutStatus.EXISTS) == ErrorCode.OK
    assert put_code(PutStatus.PENDING) == ErrorCode.REPLICA_IS_NOT_READY  # retryable, as in Mooncake
    assert int(ErrorCode.REPLICA_IS_NOT_READY) == -703
    for status in (PutStatus.FULL, PutStatus.QUOTA, PutStatus.TOO_LARGE, PutStatus.REJECTED):
        assert put_code(status) == ErrorCode.NO_AVAILABLE_HANDLE


def test_a_call_past_its_deadline_answers_as_one_that_timed_out() -> None:
    assert code_of(DeadlineError("past")) == code_of(ConnectionLostError("late")) == ErrorCode.RPC_FAIL
    assert code_of(RemoteError("quota", "no")) == ErrorCode.NO_AVAILABLE_HANDLE
    assert int(ErrorCode.ILLEGAL_CLIENT) == -601


@pytest.mark.parametrize(("stats", "expected"), [
    ({"tiers": {"dram": {"capacity_bytes": 100}, "disk": {"capacity_bytes": 900}}}, (100, 1000)),
    ({"tiers": {"dram": {"capacity_bytes": "100"}, "disk": {"capacity_bytes": 900}}}, (None, 900)),
    ({"tiers": []}, (None, None)),
    ([], (None, None)),
])
def test_what_the_node_can_hold_is_read_from_its_stats(stats: object, expected: tuple[int | None, int | None]) -> None:
    assert _capacities(stats) == expected


def test_groups_are_bounded_by_items_and_bytes() -> None:
    assert [list(r) for r in _groups([8, 8, 8, 8, 8], 10, 16)] == [[0, 1], [2, 3], [4]]
    assert [list(r) for r in _groups([40, 1, 1, 1], 2, 16)] == [[0], [1, 2], [3]]  # one past the bytes, alone
    assert list(_groups([], 4, 16)) == []
