"""``kvpool status --pool``: the pool a user names, resolved against the pools of the index."""

from __future__ import annotations

import re

import pytest

from kvpool_sidecar.cli import PoolNameError, resolve_pool

KNOWN = ["default", "prod", "team-a.cache", "team-a.solo", "team-b.cache"]


@pytest.mark.parametrize(("typed", "pool"), [
    ("team-a.cache", "team-a.cache"),  # the index's own name
    ("team-a/cache", "team-a.cache"),  # kubectl's namespace/name
    ("solo", "team-a.solo"),  # a name only one namespace has
    ("default", "default"),  # a standalone sidecar's pool
    ("prod", "prod"),
])
def test_names_users_type_find_the_pool(typed: str, pool: str) -> None:
    assert resolve_pool(typed, KNOWN) == pool


@pytest.mark.parametrize(("typed", "says"), [
    ("cache", "in several namespaces: team-a.cache, team-b.cache"),
    ("team-c/cache", "no pool 'team-c/cache' in this index (pools there: default, prod, team-a.cache"),
    ("cache.team-a", "no pool 'cache.team-a'"),  # name and namespace the wrong way round
    ("a/b/c", "no pool 'a/b/c'"),
])
def test_a_name_of_no_pool_or_of_several_is_an_error_listing_them(typed: str, says: str) -> None:
    with pytest.raises(PoolNameError, match=re.escape(says)):
        resolve_pool(typed, KNOWN)
    with pytest.raises(PoolNameError, match=r"pools there: none\)"):
        resolve_pool("x", [])
