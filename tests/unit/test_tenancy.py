"""Key spaces: one tenant's key never addresses another tenant's block unless they share."""

from __future__ import annotations

import os

from kvpool_sidecar.config import settings_from_mapping
from kvpool_sidecar.tenancy import KeySpaces


def test_one_space_maps_its_keys_too_and_as_it_did_beside_others() -> None:
    """A pool down to one space still maps every key: had it kept them as they came, a client
    could name the store key another space's blocks lie under (anyone can compute it) and
    read what that space left on a disk or a peer. The space's own blocks keep their keys."""
    keys = [os.urandom(48) for _ in range(3)]
    one = KeySpaces({"default": "default", "b": "default"})
    assert not one.isolated
    mine = one.scoped("default", keys)
    assert one.scoped("b", keys) == mine
    assert not set(mine) & set(keys)
    several = KeySpaces({"default": "default", "b": "b"})
    assert several.scoped("default", keys) == mine  # its blocks outlive the other space's going
    # another space's store keys, sent as keys, name nothing of that space
    theirs = several.scoped("b", keys)
    assert not set(one.scoped("default", theirs)) & set(theirs)


def test_separate_spaces_give_separate_keys() -> None:
    keys = [os.urandom(48) for _ in range(50)]
    spaces = KeySpaces({"default": "default", "a": "a", "a2": "a", "b": "b"})
    assert spaces.isolated
    a, a2, b, d = (spaces.scoped(t, keys) for t in ("a", "a2", "b", "default"))
    assert a == a2  # a2 shares a's space
    assert len({*a, *b, *d, *keys}) == 4 * len(keys)  # no key collides with any other space's or a raw key
    assert all(len(k) == 48 for k in a + b + d)
    # deterministic across instances (every node of a pool, and a restart, agree)
    assert KeySpaces({"a": "a", "b": "b"}).scoped("a", keys) == a


def test_what_is_not_a_key_passes_through() -> None:
    spaces = KeySpaces({"a": "a", "b": "b"})
    junk: list[object] = [b"short", 7, None]
    assert spaces.scoped("a", junk) == junk  # type: ignore[arg-type]


def test_config_names_the_space() -> None:
    s = settings_from_mapping({"tenants": [{"name": "default"}, {"name": "a", "key_space": "shared"},
                                           {"name": "b", "key_space": "shared"}]})
    assert [t.space for t in s.tenants] == ["default", "shared", "shared"]
