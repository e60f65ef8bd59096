"""The policies by name (:data:`POLICIES`), and :func:`make_policy` to make one."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvpool_sidecar.errors import ConfigError
from kvpool_sidecar.policy.base import EvictionPolicy
from kvpool_sidecar.policy.lru import LRUPolicy
from kvpool_sidecar.policy.prefix import PrefixAwarePolicy
from kvpool_sidecar.policy.ranks import LEARNED, RECENCY


#: The policies by name. ``prefix`` is the default; ``prefix-arc``, ``prefix-recency`` and
#: ``prefix-learned`` are its orders alone (what its duel chooses between), and
#: ``prefix-nolearn`` is its duel of ARC and recency without learning, for comparisons.
POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "prefix": PrefixAwarePolicy,
    "prefix-arc": lambda: PrefixAwarePolicy(duel=False),
    "prefix-recency": lambda: PrefixAwarePolicy(duel=False, order=RECENCY),
    "prefix-learned": lambda: PrefixAwarePolicy(duel=False, order=LEARNED),
    "prefix-nolearn": lambda: PrefixAwarePolicy(learn=False),
}


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; raises ConfigError for an unknown name."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"policy.name: unknown policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory()
