"""What a writer says of a block's engine identity (protocol 3): the token ids' checks."""

from __future__ import annotations

import enum
from array import array
from typing import Any

import pytest

from kvpool_sidecar.api import blockinfo
from kvpool_sidecar.api.blockinfo import MAX_BLOCK_TOKENS, parse_engine
from kvpool_sidecar.errors import RequestError

_TOP = (1 << 32) - 1


class _Id(enum.IntEnum):
    SEVEN = 7


class _Index:
    """Not an int, though it converts to one (``operator.index``)."""

    def __index__(self) -> int:
        return 3


def _engine(tokens: object) -> dict[str, Any]:
    return {"hash": 1, "tokens": tokens, "block_size": MAX_BLOCK_TOKENS}


@pytest.mark.parametrize("tokens", [
    [True], [1, False], [1.0], [0, 2.5], [-1], [5, -(1 << 40)], [_TOP + 1], [1 << 64], [1 << 100],
    ["1"], [b"\x01"], [None], [[1]], [{1: 2}], [_Index()],
    (1, 2), "12", b"\x01\x02", {1: 2}, None, 5, [0] * (MAX_BLOCK_TOKENS + 1),
])
def test_bad_token_ids_refuse_the_block(tokens: object) -> None:
    with pytest.raises(RequestError, match="token"):
        parse_engine(_engine(tokens))


@pytest.mark.parametrize("tokens", [[], [0], [_TOP], [0, 1, 2, _TOP - 1], [_Id.SEVEN, 8],
                                    list(range(MAX_BLOCK_TOKENS))])
def test_good_token_ids_are_kept_as_four_byte_ids(tokens: list[int]) -> None:
    ref = parse_engine(_engine(tokens))
    assert ref is not None
    assert ref.token_ids == array("I", tokens) and ref.token_ids.itemsize == 4
    assert type(ref.token_ids) is array and ref.token_ids.typecode == "I"


def test_the_other_fields_are_still_checked_after_good_token_ids() -> None:
    for bad in ({"hash": True}, {"block_size": 0}, {"lora_id": -1}, {"extra_keys": [1.5]}, {"parent": b""}):
        with pytest.raises(RequestError):
            parse_engine({**_engine([1, 2]), **bad})


def test_a_full_put_of_token_ids_is_checked_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put of 256 blocks of 4,096 token ids each (within the decoder's bounds) had its ids
    checked one Python-level call each: 98 ms on the event loop, for a request that could
    then be refused and cost nothing. The ids are checked in bulk now: a few calls a block."""
    calls = 0
    real = blockinfo._uint

    def counted(value: object, top: int, what: str) -> int:
        nonlocal calls
        calls += 1
        return real(value, top, what)

    monkeypatch.setattr(blockinfo, "_uint", counted)
    tokens = list(range(70_000, 70_000 + MAX_BLOCK_TOKENS))
    refs = [parse_engine({"hash": n + 1, "tokens": tokens, "block_size": MAX_BLOCK_TOKENS}) for n in range(256)]
    assert all(ref is not None and ref.token_ids == array("I", tokens) for ref in refs)
    assert calls <= 2 * 256, calls  # (the block size's check: one a block)


def test_an_extra_key_is_an_integer_msgpack_can_announce() -> None:
    """KV events carry the extra keys as msgpack: one below its least integer (-2**63) could
    not be encoded, and would break every batch (and resync) that held its block."""
    for ok in (-(1 << 63), (1 << 64) - 1, 0, "text", b"bytes"):
        ref = parse_engine({**_engine([1]), "extra_keys": [ok]})
        assert ref is not None and ref.extra_keys == (ok,)
    for bad in (-(1 << 63) - 1, -((1 << 64) - 1), 1 << 64):
        with pytest.raises(RequestError, match="extra key"):
            parse_engine({**_engine([1]), "extra_keys": [bad]})
